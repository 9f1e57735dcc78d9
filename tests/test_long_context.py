"""RoPE scalings far beyond the trained context: the cos/sin tables of a RoPE trained on 4096 positions, at positions
from 16k to 32k, equal transformers' (float32) for every scaling whose math depends on the position or on the length
HF sees (`dynamic` and `longrope` switch regimes past the original context).

The tables are what attention rotates q and k by; tests/test_models.py runs each scaling through whole models against
transformers, on prompts past tiny original contexts. Here the positions are long-context ones: a 16k-token prompt
through transformers' eager attention would hold gigabytes of scores per layer.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run_reference
from families import TINY

ORIGINAL = 4096
ROPES = {
    "linear": dict(max_position_embeddings=8 * ORIGINAL,
                   rope_parameters={"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0}),
    # dynamic NTK grows the base once a call's positions pass max_position_embeddings (the trained context)
    "dynamic": dict(max_position_embeddings=ORIGINAL,
                    rope_parameters={"rope_type": "dynamic", "factor": 8.0, "rope_theta": 10000.0}),
    "yarn": dict(max_position_embeddings=8 * ORIGINAL,
                 rope_parameters={"rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0,
                                  "original_max_position_embeddings": ORIGINAL}),
    "llama3": dict(max_position_embeddings=8 * ORIGINAL,
                   rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": ORIGINAL}),
    # long factors past the original context, short ones within it
    "longrope": dict(max_position_embeddings=8 * ORIGINAL,
                     rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                      "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0],
                                      "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
                                      "original_max_position_embeddings": ORIGINAL}),
}
LENGTH = 64
# Within the original context, then 4x to 8x past it. Increasing: HF's dynamic NTK keeps its largest base across calls.
STARTS = [0, 3000, 16384, 24000, 8 * ORIGINAL - LENGTH]


def tolerance(last_position: int) -> float:
    """Both sides compute float32 frequencies (at most 1 rad per position) with their own pow and multiply them by the
    position: one ulp (2^-24 relative) of a frequency moves the angle at position p by up to p * 2^-24 rad (2e-3 at
    32k), past the cos/sin rounding (1e-5)."""
    return 1e-5 + last_position * 2.0 ** -24


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """transformers' cos and sin per scaling and start."""
    root = tmp_path_factory.mktemp("long_context")
    run_reference([{"op": "rope_tables", "config": dict(TINY, **config), "starts": STARTS, "length": LENGTH,
                    "out": str(root / f"{name}.npz")} for name, config in ROPES.items()], root)
    return {name: dict(np.load(root / f"{name}.npz")) for name in ROPES}


@pytest.mark.parametrize("name", sorted(ROPES))
def test_far_positions_match_transformers(name, tables):
    from day0jax import models
    from day0jax.layers.rope import Rope

    config = models.config_from_hf(dict(TINY, model_type="llama", **ROPES[name]))
    rope = Rope(config.rope, config.head_size, config.max_position_embeddings)
    want = tables[name]
    for i, start in enumerate(STARTS):
        cos, sin = rope.cos_sin(jnp.arange(start, start + LENGTH, dtype=jnp.int32)[None])
        atol = tolerance(start + LENGTH - 1)
        np.testing.assert_allclose(np.asarray(cos[0]), want[f"cos_{i}"], rtol=0, atol=atol,
                                   err_msg=f"{name} cos from position {start}")
        np.testing.assert_allclose(np.asarray(sin[0]), want[f"sin_{i}"], rtol=0, atol=atol,
                                   err_msg=f"{name} sin from position {start}")


def test_scalings_differ_past_the_original_context(tables):
    """What the comparison above covers: each scaling's tables at 24k differ from plain RoPE's there, and `dynamic`
    and `longrope` change regime (their frequencies at 24k differ from those they use within the original context)."""
    from day0jax import models
    from day0jax.layers.rope import Rope

    plain = models.config_from_hf(dict(TINY, model_type="llama", max_position_embeddings=8 * ORIGINAL))
    cos, _ = Rope(plain.rope, plain.head_size, plain.max_position_embeddings).cos_sin(
        jnp.arange(24000, 24000 + LENGTH, dtype=jnp.int32)[None])
    for name, want in tables.items():
        assert np.abs(want["cos_3"] - np.asarray(cos[0])).max() > 0.1, name
    for name in ("dynamic", "longrope"):
        config = models.config_from_hf(dict(TINY, model_type="llama", **ROPES[name]))
        rope = Rope(config.rope, config.head_size, config.max_position_embeddings)
        # The same positions (3000..3063) seen in a call whose longest position is within, then past, the original.
        within = rope.cos_sin(jnp.arange(3000, 3000 + LENGTH, dtype=jnp.int32)[None])[0]
        past = rope.cos_sin(jnp.arange(3000, 3000 + LENGTH, dtype=jnp.int32)[None], seq_len=jnp.int32(24000))[0]
        assert np.abs(np.asarray(within) - np.asarray(past)).max() > 0.1, name
