"""What each distinctive feature of the state-space hybrids and the per-layer-attention families does to the logits:
the tiny checkpoint of tests/families.py, converted, with one feature taken away (a config value the family reads,
or a parameter set to what the feature's absence means), must no longer match transformers' logits. Each table entry
is a feature the parity test in test_models.py would catch if the implementation dropped it; where removing a
feature changes the parameters' shapes (a latent MoE's projections, per-layer head counts), the converter's shape
checks catch it instead. The operators' own features (the D skip, the grouped gated norm, the convolution's state
across calls) are tested in test_kernels_mamba2_ssd.py. Then what these families do not run is refused, naming the
config key, and the state-space families not implemented are refused by name.
"""

from __future__ import annotations

import gc
import json
import re

import jax
import numpy as np
import pytest

import day0jax
from convert.writer import CheckpointWriter
from day0jax.weights import checkpoint
from families import FAMILIES, PROMPTS

PROMPT = 2  # the longest prompt: past the sliding windows and the scans' chunks
FAR = 1e-3  # a removed feature moves the logits at least this far (relative), a hundred times the parity tolerance


def scaled(path_pattern: str, factor: float):
    """A parameter transform: the parameters whose path ends with `path_pattern` times `factor`."""
    return lambda params: {k: v * factor if k.endswith(path_pattern) else v for k, v in params.items()}


def rope(full: dict, sliding: dict) -> dict:
    return {"full_attention": dict(rope_type="default", **full),
            "sliding_attention": dict(rope_type="default", **sliding)}


# name -> (family entry in tests/families.py, config.json overrides, parameter transform)
MUTATIONS = {
    "nemotron_h ReLU-squared as ReLU": ("nemotron_h", dict(mlp_hidden_act="relu"), None),
    "nemotron_h routing without groups": ("nemotron_h", dict(n_group=1, topk_group=1), None),
    "granitemoehybrid muP multipliers at 1": ("granitemoehybrid", dict(embedding_multiplier=1.0,
                                                                     residual_multiplier=1.0, logits_scaling=1.0),
                                              None),
    "granitemoehybrid attention scale of head_dim": ("granitemoehybrid", dict(attention_multiplier=0.25), None),
    "falcon_h1 Mamba2 muP multipliers at 1": ("falcon_h1", dict(ssm_in_multiplier=1.0, ssm_out_multiplier=1.0,
                                                                ssm_multipliers=None), None),
    "falcon_h1 attention muP multipliers at 1": ("falcon_h1", dict(attention_in_multiplier=1.0, key_multiplier=1.0,
                                                                   attention_out_multiplier=1.0), None),
    "falcon_h1 MLP muP multipliers at 1": ("falcon_h1", dict(mlp_multipliers=None), None),
    "falcon_h1 embedding and head multipliers at 1": ("falcon_h1", dict(embedding_multiplier=1.0,
                                                                        lm_head_multiplier=1.0), None),
    "falcon_h1 gate before the norm": ("falcon_h1", dict(mamba_norm_before_gate=False), None),
    "mimo_v2_flash values unscaled": ("mimo_v2_flash", dict(attention_value_scale=1.0), None),
    "mimo_v2_flash no sinks": ("mimo_v2_flash", {}, scaled("self_attn.sinks", -1e4)),
    "mimo_v2_flash one RoPE theta for both kinds": ("mimo_v2_flash", dict(rope_parameters=rope(
        dict(rope_theta=50000.0), dict(rope_theta=50000.0, partial_rotary_factor=0.5))), None),
    "mimo_v2_flash RoPE over the whole head": ("mimo_v2_flash", dict(rope_parameters=rope(
        dict(rope_theta=50000.0, partial_rotary_factor=1.0), dict(rope_theta=100.0, partial_rotary_factor=1.0))),
        None),
    "step3p7 no clamps": ("step3p7", dict(swiglu_limits=None, swiglu_limits_shared=None), None),
    "step3p7 head_dim scale": ("step3p7", dict(query_pre_attn_scalar=None), None),
    "step3p7 one RoPE for both kinds": ("step3p7", dict(rope_parameters=rope(
        dict(rope_theta=10000.0, partial_rotary_factor=0.5), dict(rope_theta=10000.0, partial_rotary_factor=0.5))),
        None),
    "step3p7 constant head gates": ("step3p7", {}, scaled("self_attn.g_proj.kernel", 0.0)),
}


def mutated(src, dst, overrides: dict, transform) -> None:
    """Checkpoint `src` written again to `dst` with config.json's keys (a multimodal one's text_config's)
    overridden and the parameters through `transform`."""
    manifest = checkpoint.read_manifest(src)
    params = checkpoint.read_params(src)
    if transform is not None:
        params = transform(params)
    config = json.loads((src / "config.json").read_text())
    target = config["text_config"] if "text_config" in config else config
    target.update(overrides)
    with CheckpointWriter(dst, force=True) as writer:
        for path, array in params.items():
            writer.add(path, np.asarray(array))
        writer.write_json("config.json", config)
        writer.commit({k: manifest[k] for k in ("model_type", "dtype", "source") if k in manifest})


def rel_err(ours, ref):
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_removing_a_feature_moves_the_logits_away_from_transformers(name, tiny, converted, tmp_path):
    family, overrides, transform = MUTATIONS[name]
    assert family in FAMILIES
    mutated(converted[family], tmp_path / "mutated", overrides, transform)
    model = day0jax.load(tmp_path / "mutated", dtype="float32", kernels="reference")  # no self-test: one program
    err = rel_err(model.logits([PROMPTS[PROMPT]])[0], tiny[family]["ref"][f"logits_{PROMPT}"])
    del model
    jax.clear_caches()
    gc.collect()
    assert err > FAR, f"{name}: relative logits error {err:.1e} without the feature: the parity test cannot see it"


# --- refusals ----------------------------------------------------------------------------------------------------

# (family entry, config.json changes, what the refusal names): values HF's model does not run, or runs otherwise.
REFUSALS = [
    ("nemotron_h", dict(mamba_hidden_act="gelu"), "mamba_hidden_act='gelu'"),
    ("nemotron_h", dict(sliding_window=8), "sliding_window=8"),
    ("nemotron_h", dict(layers_block_type=None, hybrid_override_pattern="M*X"), "hybrid_override_pattern"),
    ("nemotron_h", dict(num_hidden_layers=7), "num_hidden_layers=7"),
    ("granitemoehybrid", dict(position_embedding_type="alibi"), "position_embedding_type='alibi'"),
    ("falcon_h1", dict(mamba_d_head=7), "mamba_d_head=7"),
    ("falcon_h1", dict(ssm_multipliers=[1.0, 2.0]), "ssm_multipliers"),
    ("mimo_v2_flash", dict(rope_theta=10000.0), "rope_theta=10000.0"),
    ("step3p7", dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    ("step3p7", dict(per_layer_config={"1": {"head_dim": 8}}), "per_layer_config"),
]


@pytest.mark.parametrize("family, changes, named", REFUSALS, ids=[f"{f}-{n}" for f, _, n in REFUSALS])
def test_values_the_family_does_not_run_are_refused_by_name(family, changes, named):
    from day0jax import models
    from day0jax.core.errors import UnsupportedArchitecture

    model_type, config, _ = FAMILIES[family]
    hf = dict(config, model_type=model_type)
    if "text_config" in hf:
        hf["text_config"] = dict(hf["text_config"], **changes)
    else:
        hf.update(changes)
    with pytest.raises(UnsupportedArchitecture, match=re.escape(named)):
        models.config_from_hf(hf)


# Mamba 1's selective scan (mamba, falcon_mamba, jamba) is another operator; bamba, zamba2 and plamo2 are not
# implemented yet.
@pytest.mark.parametrize("model_type", ["mamba", "falcon_mamba", "jamba", "bamba", "zamba2", "plamo2"])
def test_other_state_space_families_are_refused_by_name(model_type):
    from day0jax import models
    from day0jax.core.errors import UnsupportedArchitecture

    with pytest.raises(UnsupportedArchitecture, match=f"model_type '{model_type}' is not supported"):
        models.family(model_type)
