"""Mistral 4 (Mistral Small 4's language model): DeepSeek-V3's multi-head latent attention and MoE layout
(deepseek_v3.py) with three differences: the router scores experts by softmax (grouped top-k, no score bias),
the queries are scaled by a Llama-4-style temperature that grows with the position (`llama_4_scaling_beta` in
rope_parameters), and the RoPE is described over HF's whole qk head (`head_dim` = qk_nope_head_dim +
qk_rope_head_dim, `partial_rotary_factor` rotating the qk_rope_head_dim part).
HF reference: transformers/models/mistral4/modeling_mistral4.py. Checkpoints store the experts fused
(`experts.gate_up_proj` [E, 2F, D], `experts.down_proj` [E, D, F]): see `hf_source`. Released checkpoints wrap
this model in a multimodal `mistral3` config, which is not this family.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from flax import nnx

from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source
from day0jax.layers.mla import MLAttention
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.moe import Experts, MoE, Router, swiglu
from day0jax.layers.rope import rope_parameters
from day0jax.models import deepseek_v3, llama
from day0jax.models.base import HFConfig, fused_experts_source
from day0jax.models.contract import Family

# Keys of rope_parameters that are not RoPE: the query temperature's, and a copy of max_position_embeddings that
# HF's RoPE does not read.
NOT_ROPE_KEYS = ("llama_4_scaling_beta", "max_position_embeddings")


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    ALIASES = {"num_local_experts": "n_routed_experts"}
    vocab_size: int = 131072
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    n_shared_experts: int = 1
    n_routed_experts: int = 128
    routed_scaling_factor: float = 1.0
    kv_lora_rank: int = 256
    q_lora_rank: int | None = 1024
    qk_rope_head_dim: int = 64
    v_head_dim: int | None = 128
    qk_nope_head_dim: int = 64
    n_group: int | None = 1
    topk_group: int | None = 1
    num_experts_per_tok: int | None = 4
    first_k_dense_replace: int | None = 0
    norm_topk_prob: bool | None = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    rope_interleave: bool | None = True
    attention_bias: bool = False
    # HF writes these to config.json but recomputes both as qk_nope_head_dim + qk_rope_head_dim: see `head_size`.
    head_dim: int | None = None
    qk_head_dim: int | None = None
    model_type: str = "mistral4"

    qk_head_size = deepseek_v3.Config.qk_head_size
    softmax_scale = deepseek_v3.Config.softmax_scale

    def __post_init__(self):
        deepseek_v3.refuse_grouped_kv(self)
        self._activation()
        for key in ("v_head_dim", "num_experts_per_tok", "first_k_dense_replace"):
            self._refuse_if(key, lambda v: v is None, "must be set (HF's Mistral 4 has no fallback for None)")
        self._refuse_if("n_group", lambda v: not v or self.n_routed_experts % v,
                        f"does not divide n_routed_experts={self.n_routed_experts}")
        self._refuse_if("topk_group", lambda v: not v or v > self.n_group, f"must be in 1..n_group={self.n_group}")
        # Beyond what the chosen groups hold, HF would pick masked-out experts in no defined order.
        kept = self.topk_group * (self.n_routed_experts // self.n_group)
        self._refuse_if("num_experts_per_tok", lambda v: v > kept,
                        f"exceeds the {kept} experts of topk_group={self.topk_group} groups")
        # HF always builds the shared experts; with none, its checkpoint holds empty tensors we do not map.
        self._refuse_if("n_shared_experts", lambda v: v < 1, "must be at least 1 (HF always has shared experts)")
        self._check_derived("rope", "query_scaling")

    @property
    def head_size(self) -> int:
        """HF's `head_dim`, the whole query/key head (C + P): the RoPE rotates `partial_rotary_factor` of it."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @cached_property
    def given_rope(self) -> dict:
        """rope_parameters as HF completes them: its default (YaRN x128 over 8192 positions, temperature beta 0.1)
        when absent, and a `partial_rotary_factor` rotating the qk_rope_head_dim dims unless given."""
        given = dict(self.rope_parameters) if self.rope_parameters is not None else {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 128.0, "original_max_position_embeddings": 8192,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}
        given.setdefault("partial_rotary_factor", self.qk_rope_head_dim / self.head_size)
        return given

    @cached_property
    def rope(self) -> dict:
        """The normalized RoPE dict.

        Raises:
            UnsupportedArchitecture: another rope_type than YaRN, or one that does not rotate exactly the
                qk_rope_head_dim dims.
        """
        params = {k: v for k, v in self.given_rope.items() if k not in NOT_ROPE_KEYS}
        rope = rope_parameters(params, None, None, max_position_embeddings=self.max_position_embeddings)
        # HF's other RoPE types size their tables from head_dim alone, which does not fit the rotated slice.
        if rope["rope_type"] != "yarn":
            refuse("rope_parameters.rope_type", rope["rope_type"], "is not implemented for mistral4 (only 'yarn')")
        if int(self.head_size * rope["partial_rotary_factor"]) != self.qk_rope_head_dim:
            refuse("rope_parameters.partial_rotary_factor", rope["partial_rotary_factor"],
                   f"does not rotate exactly qk_rope_head_dim={self.qk_rope_head_dim} of {self.head_size} dims")
        return rope

    @cached_property
    def query_scaling(self) -> tuple[float, int]:
        """(llama_4_scaling_beta, original_max_position_embeddings): the queries' temperature (`MLAttention`).

        Raises:
            UnsupportedArchitecture: rope_parameters without llama_4_scaling_beta (HF fails without it).
        """
        beta = self.given_rope.get("llama_4_scaling_beta")
        if beta is None:
            refuse("rope_parameters.llama_4_scaling_beta", beta, "must be set (HF's Mistral 4 always applies it)")
        return float(beta), self.rope["original_max_position_embeddings"]


class Model(deepseek_v3.Model):
    def make_attention(self, index: int, *, dtype, rngs: nnx.Rngs) -> MLAttention:
        c = self.config
        # eps: HF builds q_a_layernorm and kv_a_layernorm with RMSNorm's default 1e-6, not rms_norm_eps.
        return MLAttention(hidden_size=c.hidden_size, num_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank,
                           kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                           qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, rope=self.rope,
                           rope_interleave=bool(c.rope_interleave), scale=c.softmax_scale, eps=1e-6,
                           use_bias=c.attention_bias, query_scaling=c.query_scaling, dtype=dtype, rngs=rngs)

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        D = c.hidden_size
        if index < c.first_k_dense_replace:
            return llama.LlamaLike.make_mlp(self, index, dtype=dtype, rngs=rngs)
        return MoE(Router(D, c.n_routed_experts, c.num_experts_per_tok, routing="softmax_grouped",
                          norm_topk_prob=bool(c.norm_topk_prob), n_group=c.n_group, topk_group=c.topk_group,
                          routed_scaling_factor=c.routed_scaling_factor, dtype=dtype, rngs=rngs),
                   Experts(c.n_routed_experts, D, c.moe_intermediate_size, swiglu(c.hidden_act), dtype=dtype,
                           rngs=rngs),
                   shared=GatedMLP(D, c.moe_intermediate_size * c.n_shared_experts, c.hidden_act, dtype=dtype,
                                   rngs=rngs),
                   shared_name="shared_experts")


def hf_source(config: Config, path: str, shape: tuple, metadata: dict) -> Source | None:
    """The experts from HF's fused tensors (`base.fused_experts_source`)."""
    return fused_experts_source(path, shape)


FAMILY = Family(model_types=("mistral4",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS, hf_source=hf_source)
