"""DeepSeek-V3: multi-head latent attention (`layers/mla.py`) and, after the first `first_k_dense_replace` dense
layers, MoE layers with grouped sigmoid routing and shared experts.
HF reference: transformers/models/deepseek_v3/modeling_deepseek_v3.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

from flax import nnx

from day0jax.core.cache_layout import KVLayer
from day0jax.core.hf_config import refuse
from day0jax.layers.mla import MLAttention
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.moe import Experts, MoE, Router, swiglu
from day0jax.models import llama
from day0jax.models.base import (HFConfig, nextn_dropped, nextn_mtp, nextn_source, nextn_tensors,
                                  per_expert_hf_source, per_expert_source)
from day0jax.models.contract import Family


def refuse_grouped_kv(config) -> None:
    """Multi-head latent attention keeps one latent for every head: a config whose key/value heads differ from its
    query heads describes another attention (every MLA family's check)."""
    if config.kv_heads != config.num_attention_heads:
        refuse("num_key_value_heads", config.kv_heads,
               f"differs from num_attention_heads={config.num_attention_heads} (MLA has one latent for all)")


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    ALIASES = {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int | None = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    num_nextn_predict_layers: int = 1
    # HF writes these to config.json but recomputes them from the qk_* dims whatever they say: see `head_size`
    # and `qk_head_size`.
    head_dim: int | None = None
    qk_head_dim: int | None = None
    # Keys of DeepSeek's own config.json: the values transformers implements are the only ones accepted.
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    moe_layer_freq: int = 1
    ep_size: int = 1                # the original code's expert-parallel hint; the mesh decides here
    aux_loss_alpha: float = 0.0     # training only
    seq_aux: bool = True            # training only
    model_type: str = "deepseek_v3"

    def __post_init__(self):
        refuse_grouped_kv(self)
        self._activation()
        self._refuse_if("scoring_func", lambda v: v != "sigmoid", "is not implemented (only 'sigmoid')")
        self._refuse_if("topk_method", lambda v: v != "noaux_tc", "is not implemented (only 'noaux_tc')")
        self._refuse_if("moe_layer_freq", lambda v: v != 1, "is not implemented (only 1)")
        self._refuse_if("n_group", lambda v: not v or self.n_routed_experts % v,
                        f"does not divide n_routed_experts={self.n_routed_experts}")
        self._refuse_if("topk_group", lambda v: not v or v > self.n_group, f"must be in 1..n_group={self.n_group}")
        self._check_derived("rope")

    def is_sparse(self, index: int) -> bool:
        """Whether layer `index` is an MoE: all after the first `first_k_dense_replace`."""
        return index >= self.first_k_dense_replace

    @property
    def head_size(self) -> int:
        """The rotated part of each query/key head, `qk_rope_head_dim` (HF's `head_dim`): the RoPE's size."""
        return self.qk_rope_head_dim

    @property
    def qk_head_size(self) -> int:
        """A whole query/key head: qk_nope_head_dim + qk_rope_head_dim (HF's `qk_head_dim`)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_size ** -0.5, times mscale(factor, mscale_all_dim) ** 2 when a scaled RoPE sets it (as HF)."""
        scale = self.qk_head_size ** -0.5
        r = self.rope
        if r["rope_type"] != "default" and r.get("mscale_all_dim"):
            m = 0.1 * r["mscale_all_dim"] * math.log(r["factor"]) + 1.0 if r["factor"] > 1 else 1.0
            scale *= m * m
        return scale


class Model(llama.LlamaLike):
    def make_attention(self, index: int, *, dtype, rngs: nnx.Rngs) -> MLAttention:
        c = self.config
        # eps: HF builds q_a_layernorm and kv_a_layernorm with RMSNorm's default 1e-6, not rms_norm_eps.
        return MLAttention(hidden_size=c.hidden_size, num_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank,
                           kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                           qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, rope=self.rope,
                           rope_interleave=c.rope_interleave, scale=c.softmax_scale, eps=1e-6,
                           use_bias=c.attention_bias, dtype=dtype, rngs=rngs)

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        D = c.hidden_size
        if not c.is_sparse(index):
            return super().make_mlp(index, dtype=dtype, rngs=rngs)
        shared = (GatedMLP(D, c.moe_intermediate_size * c.n_shared_experts, c.hidden_act, dtype=dtype, rngs=rngs)
                  if c.n_shared_experts else None)
        return MoE(Router(D, c.n_routed_experts, c.num_experts_per_tok, routing="sigmoid_grouped",
                          norm_topk_prob=c.norm_topk_prob, n_group=c.n_group, topk_group=c.topk_group,
                          routed_scaling_factor=c.routed_scaling_factor, dtype=dtype, rngs=rngs),
                   Experts(c.n_routed_experts, D, c.moe_intermediate_size, swiglu(c.hidden_act), dtype=dtype,
                           rngs=rngs),
                   shared=shared, shared_name="shared_experts")

    def cache_layout(self) -> list[KVLayer]:
        # One shared "head": [normed latent ; roped key], also the value (see layers/mla.py).
        c = self.config
        d = c.kv_lora_rank + c.qk_rope_head_dim
        return [KVLayer(1, d, d)] * c.num_hidden_layers

    def make_mtp(self, *, dtype, rngs: nnx.Rngs):
        """The multi-token-prediction layers released checkpoints store after the last decoder layer."""
        return nextn_mtp(self, self.config.num_nextn_predict_layers, dtype=dtype, rngs=rngs)


def dropped(config: Config) -> dict[str, str]:
    """Released checkpoints store the multi-token-prediction layers after the last decoder layer (families built on
    this one without a `Family.mtp` drop them all: they build none)."""
    return nextn_dropped(config, config.num_nextn_predict_layers)


def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict):
    return nextn_source(config, path, shape, metadata, per_expert_hf_source) or per_expert_source(path, shape)


# Kimi K2's checkpoints name their own model_type but are DeepseekV3ForCausalLM (its remote code is DeepSeek-V3's).
FAMILY = Family(model_types=("deepseek_v3", "kimi_k2"), config=Config, model=Model, dropped=llama.ROPE_BUFFERS,
                dropped_for=dropped, hf_source=hf_source,
                mtp=lambda c: nextn_tensors(c, c.num_nextn_predict_layers))
