"""What the state-space hybrids, the per-layer-attention families, DeepSeek-V4, HY-V3, HY-V4 and MiniMax-M3 do not
run is refused, naming the config key, and the state-space families not implemented are refused by name. Their
features' effect on the logits is checked with every family's, in tests/test_models.py (test_feature_moves_logits,
the table in tests/mutations.py).
"""

from __future__ import annotations

import re

import pytest

from families import FAMILIES

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
    ("deepseek_v4", dict(num_key_value_heads=2), "num_key_value_heads=2"),
    ("deepseek_v4", dict(scoring_func="relu"), "scoring_func='relu'"),
    ("deepseek_v4", dict(layer_types=["full_attention"] * 4), "layer_types"),
    ("hy_v3", dict(mlp_layer_types=["sparse", "moe", "dense"]), "mlp_layer_types='moe'"),
    ("hy_v3", dict(mlp_layer_types=["sparse", "dense"]), "has 2 entries for num_hidden_layers=3"),
    ("hy_v3", dict(num_experts_per_tok=9), "num_experts_per_tok=9"),
    ("hy_v3", dict(num_shared_experts=0), "num_shared_experts=0"),
    ("hy_v3", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor=0.5"),
    # Keys of Tencent's own config.json that HF's model never reads: only the values that agree with it run.
    ("hy_v3", dict(moe_router_use_sigmoid=False), "moe_router_use_sigmoid=False"),
    ("hy_v3", dict(route_norm=False), "route_norm=False"),
    ("hy_v3", dict(first_k_dense_replace=1), "first_k_dense_replace=1 disagrees"),
    ("hy_v3", dict(expert_hidden_dim=64), "expert_hidden_dim=64 differs from moe_intermediate_size=32"),
    ("hy_v4", dict(n_group=2, topk_group=1), "n_group=2"),
    ("hy_v4", dict(topk_group=2), "topk_group=2"),
    ("hy_v4", dict(n_shared_experts=0), "n_shared_experts=0"),
    ("hy_v4", dict(swiglu_limit=0.0), "swiglu_limit=0.0"),
    ("hy_v4", dict(layer_types=["full_attention"] * 5), "layer_types='full_attention'"),
    ("hy_v4", dict(mlp_layer_types=["dense", "sparse", "moe", "dense", "sparse"]), "mlp_layer_types='moe'"),
    ("hy_v4", dict(mlp_layer_types=["dense", "sparse"]), "mlp_layer_types"),
    ("hy_v4", dict(indexer_types=["shared", "full", "shared", "full", "shared"]), "indexer_types='shared'"),
    ("hy_v4", dict(indexer_types=["full", "skip", "shared", "full", "shared"]), "indexer_types='skip'"),
    ("hy_v4", dict(index_head_dim=4), "index_head_dim=4"),
    ("hy_v4", dict(hidden_act="relu6"), "hidden_act='relu6'"),
    ("hy_v4", dict(rope_parameters={"rope_type": "made_up", "rope_theta": 10000.0}), "made_up"),
    ("hy_v4", dict(hc_cross_stream=True), "hc_cross_stream=True"),
    ("minimax_m3", dict(layer_types=["minimax_m3_sparse", "sliding_attention", "full_attention"]),
     "layer_types='sliding_attention'"),
    ("minimax_m3", dict(layer_types=["minimax_m3_sparse"]), "has 1 entries for num_hidden_layers=3"),
    ("minimax_m3", dict(mlp_layer_types=["dense", "moe", "sparse"]), "mlp_layer_types='moe'"),
    ("minimax_m3", dict(index_n_heads=3), "index_n_heads=3"),
    ("minimax_m3", dict(index_head_dim=4), "index_head_dim=4"),
    ("minimax_m3", dict(index_local_blocks=4), "index_local_blocks=4"),
    ("minimax_m3", dict(index_block_size=0), "index_block_size=0"),
    # MiniMax's own nested keys, which HF turns into layer_types and the flat index_* keys: given as HF saves them.
    ("minimax_m3", dict(sparse_attention_config={"sparse_block_size": 64}), "sparse_attention_config"),
    ("minimax_m3", dict(rope_parameters={"rope_type": "made_up", "rope_theta": 10000.0}), "made_up"),
    # Without the tail HF lets a query with no kept block attend over every position, future ones included.
    ("glm5_next", dict(index_kpool_always_select_tail=False), "index_kpool_always_select_tail=False"),
    ("glm5_next", dict(qk_rope_head_dim=8), "qk_rope_head_dim=8"),
    ("glm5_next", dict(index_topk=6), "index_topk=6"),
    ("glm5_next", dict(num_key_value_heads=2), "num_key_value_heads=2"),
    ("glm5_next", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("glm5_next", dict(layer_types=["linear_attention", "sliding_attention", "indexed_attention"]),
     "layer_types='sliding_attention'"),
    # HF hands a layer's top-k only to the layer right after it: a shared layer after a linear one has none.
    ("glm5_next", dict(indexer_types=["full", "shared", "full"]), "makes layer 1 shared"),
    ("glm5_next", dict(linear_attn_config={"kda_layers": [1]}), "linear_attn_config"),
    ("glm5_next", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), "rope_parameters"),
    ("glm5_next", dict(index_kpool_stride=2), "index_kpool_stride=2"),
    ("glm5_next", dict(num_experts_per_tok=3), "num_experts_per_tok=3"),
    ("qwen4_exp", dict(output_gate_type="sigmoid"), "output_gate_type='sigmoid'"),
    ("qwen4_exp", dict(indexer_kv_heads=2), "indexer_kv_heads=2"),
    ("qwen4_exp", dict(indexer_budget=6), "indexer_budget=6"),
    ("qwen4_exp", dict(indexer_budget=None), "indexer_budget=None"),
    ("qwen4_exp", dict(indexer_head_dim=4), "indexer_head_dim=4"),
    ("qwen4_exp", dict(hc_count=1), "hc_count=1"),
    ("qwen4_exp", dict(ple_layer_ids=[2]), "ple_layer_ids"),
    ("qwen4_exp", dict(ple_embed_dim=30), "ple_embed_dim=30"),
    ("qwen4_exp", dict(eos_token_id=None), "eos_token_id=None"),
    ("qwen4_exp", dict(layer_types=["linear_attention", "sliding_attention", "linear_attention"]),
     "layer_types='sliding_attention'"),
    ("qwen4_exp", dict(hidden_act="gelu"), "hidden_act='gelu'"),
] + [(family, dict(num_key_value_heads=2), "num_key_value_heads=2 differs from num_attention_heads=4 (MLA")
     for family in ("deepseek_v3", "deepseek_v2", "mistral4", "mistral_large4", "kimi_linear")]  # one latent for all


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


# Mamba 1's selective scan (mamba, falcon_mamba, jamba) is another operator; zamba2 and plamo2 are not implemented
# yet.
@pytest.mark.parametrize("model_type", ["mamba", "falcon_mamba", "jamba", "zamba2", "plamo2"])
def test_other_state_space_families_are_refused_by_name(model_type):
    from day0jax import models
    from day0jax.core.errors import UnsupportedArchitecture

    with pytest.raises(UnsupportedArchitecture, match=f"model_type '{model_type}' is not supported"):
        models.family(model_type)


def test_glm5_next_derives_its_lists_and_bound_as_transformers():
    """GLM-5-Next's config keys HF reads when the per-layer lists are absent (the pattern, or the freq/offset
    schedule of shared indexers) and its original `linear_attn_config` (whose values win; `safe_gate` puts the -5
    bound back when the bound is null)."""
    from day0jax import models

    model_type, config, _ = FAMILIES["glm5_next"]
    text = {k: v for k, v in config["text_config"].items()
            if k not in ("indexer_types", "layer_types", "mlp_layer_types")}

    def parsed(**changes):
        return models.config_from_hf(dict(config, model_type=model_type, text_config=dict(text, **changes)))

    c = parsed(num_hidden_layers=8)
    assert c.layer_kinds == ("linear_attention",) * 3 + ("indexed_attention",) + ("linear_attention",) * 3 + (
        "indexed_attention",)
    assert c.indexer_kinds == ("full",) * 8  # HF's default freq 1
    c = parsed(layer_types=["linear_attention", "full_attention", "indexed_attention"], index_topk_pattern="FFS")
    assert c.layer_kinds[1] == "indexed_attention" and c.indexer_kinds == ("full", "full", "shared")
    c = parsed(layer_types=["indexed_attention"] * 3, index_topk_freq=2, index_skip_topk_offset=1)
    assert c.indexer_kinds == ("full", "shared", "full")
    assert parsed(linear_attn_config={"gate_lower_bound": -3.0, "num_heads": 4}).lower_bound == -3.0
    assert parsed(linear_attn_config={"gate_lower_bound": None}).lower_bound == -5.0
    assert parsed(linear_attn_config={"gate_lower_bound": None, "safe_gate": False}).lower_bound is None
    assert parsed(linear_lower_bound=None).lower_bound is None  # Kimi's unbounded decay


def test_dots1_null_groups_route_without_a_group_limit():
    """Released dots.llm1 configs write null n_group and topk_group: one group, kept (the original code's reading;
    transformers' router cannot take None)."""
    from flax import nnx

    from day0jax import models
    from day0jax.layers.moe import Router

    model_type, config, _ = FAMILIES["dots1"]
    c = models.config_from_hf(dict(config, model_type=model_type, n_group=None, topk_group=None))
    routers = [m for _, m in nnx.iter_modules(models.abstract_model(c)) if isinstance(m, Router)]
    assert len(routers) == 2 and all((r.n_group, r.topk_group) == (1, 1) for r in routers)
