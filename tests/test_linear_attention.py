"""The engine's per-sequence state for linear-attention layers (a hybrid Qwen3-Next model, tiny and random): greedy
tokens equal the cache-less forward pass whatever the chunking, batching, preemption or reuse of a slot; the memory
plan counts the state slots the engine allocates; a multimodal checkpoint converts as its language model.
"""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import day0jax
from conftest import run_reference
from convert.convert import convert_checkpoint
from day0jax import models
from day0jax.engine.config import EngineConfig
from day0jax.engine.engine import Engine
from sharding import plan as plan_lib
from sharding.mesh import make_mesh
from test_engine_paged import PROMPTS, cache_less_greedy, greedy, run

CONTEXT = 128
HYBRID = dict(model_type="qwen3_next", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=CONTEXT,
              layer_types=["linear_attention", "full_attention", "linear_attention"], linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16, num_experts=0)


@pytest.fixture(scope="module")
def module():
    cfg = models.config_from_hf(HYBRID)
    with nnx.use_eager_sharding(False):
        return models.family("qwen3_next").model(cfg, rngs=nnx.Rngs(0))


def make_engine(module, **overrides) -> Engine:
    # Chunks of 8 and 32: the 41- and 71-token prompts take several chunks, each carrying the state to the next.
    config = dict(page_size=8, max_num_seqs=4, kv_cache_tokens=512, chunk_buckets=(8, 32), min_width=CONTEXT)
    config.update(overrides)
    return Engine(module, make_mesh(None), jnp.float32, context_length=CONTEXT, config=EngineConfig(**config))


@pytest.fixture(scope="module")
def reference(module):
    """Greedy continuations of the cache-less forward pass (the chunked delta rule from a zero state)."""
    return cache_less_greedy(module)


def test_state_follows_each_sequence_through_chunks_and_batches(module, reference, caplog):
    with caplog.at_level(logging.INFO, logger="day0jax.engine"):
        engine = make_engine(module)
    assert not engine.config.prefix_caching and "prefix caching is off" in caplog.text
    # Staggered: requests join while others decode; slots of finished sequences are handed to later ones, whose
    # first chunk must start from zeros, not from what the slot held.
    out = run(engine, {f"r{i}": (p, greedy()) for i, p in enumerate(PROMPTS)}, stagger=3)
    for i, ref in enumerate(reference):
        assert out[(f"r{i}", 0)] == ref, f"prompt {i}"
    again = run(engine, {"again": (PROMPTS[3], greedy())})
    assert again[("again", 0)] == reference[3]
    assert sorted(engine.scheduler.free_slots) == [1, 2, 3, 4]


def test_preempted_sequences_recompute_their_state(module, reference):
    small = make_engine(module, kv_cache_tokens=96, max_model_len=96)
    out = run(small, {f"r{i}": (p, greedy()) for i, p in enumerate(PROMPTS)})
    assert small.scheduler.num_preemptions > 0
    for i, ref in enumerate(reference):
        assert out[(f"r{i}", 0)] == ref, f"prompt {i}"


def test_plan_counts_the_state_slots_the_engine_allocates(module):
    engine = make_engine(module)
    shape = plan_lib.ModelShape.from_model(module, models.param_infos(module), CONTEXT)
    planned = plan_lib.plan(shape, "tp=1", engine.layout.workload(), dtype="float32")
    # Per sequence: three convolution states [W-1, heads, head dim] and the [Nv, Hk, Hv] recurrent state.
    per_seq = (3 * (2 * 8 + 2 * 8 + 4 * 16) + 4 * 8 * 16) * 4
    assert [layer.bytes_per_sequence for layer in shape.state_layers] == [per_seq, per_seq]
    assert planned.state_slots == engine.layout.state_slots == 5
    assert planned.state_bytes == engine.runner.state_bytes == 2 * 5 * per_seq
    assert planned.kv_cache_bytes == engine.runner.pool_bytes  # one attention layer's pages
    assert "per-sequence state" in planned.summary()


def test_multimodal_checkpoint_converts_with_its_tower(tmp_path):
    """A Qwen3.5 checkpoint with its vision tower converts whole (images: tests/test_multimodal.py), and the hybrid
    language model's logits equal transformers' on text."""
    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=CONTEXT, rms_norm_eps=1e-5,
                layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)
    hf = tmp_path / "hf"
    run_reference([{"op": "tiny_hf", "family": "qwen3_5", "config": dict(text_config=text, vision_config=vision),
                    "seed": 0, "multimodal": True, "out": str(hf)},
                   {"op": "run", "model": str(hf), "prompts": PROMPTS[:2], "generate": 0,
                    "out": str(tmp_path / "ref.npz")}], tmp_path)
    convert_checkpoint(hf, tmp_path / "d0", progress=False)
    model = day0jax.load(tmp_path / "d0", dtype="float32")
    assert model.vision is not None and model.config.layer_kinds == ("linear_attention", "full_attention")
    ref = np.load(tmp_path / "ref.npz")
    for i, prompt in enumerate(PROMPTS[:2]):
        ours, theirs = model.logits([prompt])[0], ref[f"logits_{i}"]
        # float32 both sides: relative to the logit scale, as the family tests.
        assert np.abs(ours - theirs).max() <= 1e-3 * np.abs(theirs).max()
