"""GLM-4.5 / 4.6 / 4.7 (MoE): GQA with q/k/v biases per `attention_bias` (never on o_proj), optional RMSNorm on
each head's q and k (`use_qk_norm`), half the head dims rotated by default, and, after `first_k_dense_replace`
dense layers, DeepSeek-V3's MoE: grouped sigmoid routing with `e_score_correction_bias`, `routed_scaling_factor`,
and shared experts.
HF reference: transformers/models/glm4_moe/modeling_glm4_moe.py."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from flax import nnx

from day0jax.layers.mlp import GatedMLP
from day0jax.layers.moe import Experts, MoE, Router, swiglu
from day0jax.models import llama
from day0jax.models.base import (HFConfig, nextn_dropped, nextn_mtp, nextn_source, nextn_tensors,
                                  per_expert_hf_source, per_expert_source)
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    ALIASES = {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}
    vocab_size: int = 151552
    hidden_size: int = 4096
    intermediate_size: int = 10944
    num_hidden_layers: int = 46
    num_attention_heads: int = 96
    num_key_value_heads: int | None = 8
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    partial_rotary_factor: float = 0.5  # HF's default when config.json does not say
    attention_bias: bool = False
    moe_intermediate_size: int = 1408
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_routed_experts: int = 128
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    use_qk_norm: bool = False
    num_nextn_predict_layers: int = 1  # multi-token-prediction layers (speculative method "mtp")
    model_type: str = "glm4_moe"

    def __post_init__(self):
        super().__post_init__()
        self._refuse_if("n_group", lambda v: not v or self.n_routed_experts % v,
                        f"does not divide n_routed_experts={self.n_routed_experts}")
        self._refuse_if("topk_group", lambda v: not v or v > self.n_group, f"must be in 1..n_group={self.n_group}")
        # HF always builds the shared experts; with none, its checkpoint holds empty tensors we do not map.
        self._refuse_if("n_shared_experts", lambda v: v < 1, "must be at least 1 (HF always has shared experts)")

    @cached_property
    def rope(self) -> dict:
        """The normalized RoPE dict, rotating `partial_rotary_factor` of each head unless rope_parameters says."""
        return self._rope(partial_rotary_factor=self.partial_rotary_factor)


class Model(llama.LlamaLike):
    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        return dict(rope=self.rope, qkv_bias=c.attention_bias, qk_norm_eps=c.rms_norm_eps if c.use_qk_norm else None)

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        D = c.hidden_size
        if index < c.first_k_dense_replace:
            return super().make_mlp(index, dtype=dtype, rngs=rngs)
        return MoE(Router(D, c.n_routed_experts, c.num_experts_per_tok, routing="sigmoid_grouped",
                          norm_topk_prob=c.norm_topk_prob, n_group=c.n_group, topk_group=c.topk_group,
                          routed_scaling_factor=c.routed_scaling_factor, dtype=dtype, rngs=rngs),
                   Experts(c.n_routed_experts, D, c.moe_intermediate_size, swiglu(c.hidden_act), dtype=dtype,
                           rngs=rngs),
                   shared=GatedMLP(D, c.moe_intermediate_size * c.n_shared_experts, c.hidden_act, dtype=dtype,
                                   rngs=rngs),
                   shared_name="shared_experts")

    def make_mtp(self, *, dtype, rngs: nnx.Rngs):
        """The multi-token-prediction layers released checkpoints store after the last decoder layer."""
        return nextn_mtp(self, self.config.num_nextn_predict_layers, dtype=dtype, rngs=rngs)


def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict):
    return nextn_source(config, path, shape, metadata, per_expert_hf_source) or per_expert_source(path, shape)


FAMILY = Family(model_types=("glm4_moe",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS,
                dropped_for=lambda c: nextn_dropped(c, c.num_nextn_predict_layers), hf_source=hf_source,
                mtp=lambda c: nextn_tensors(c, c.num_nextn_predict_layers))
