"""Qwen3-MoE: Qwen3 attention (per-head q/k RMSNorm) with sparse MoE MLPs (softmax top-k, no shared expert).
HF reference: transformers/models/qwen3_moe/modeling_qwen3_moe.py."""

from __future__ import annotations

from dataclasses import dataclass

from flax import nnx

from day0jax.layers.moe import Experts, MoE, Router, swiglu
from day0jax.models import llama
from day0jax.models.base import HFConfig, per_expert_hf_source
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    ALIASES = {"num_experts": "num_local_experts"}
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 4
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 768
    num_experts_per_tok: int = 8
    num_local_experts: int = 128
    norm_topk_prob: bool = False
    mlp_only_layers: list | None = None
    model_type: str = "qwen3_moe"

    @property
    def window(self) -> int | None:
        """The window of every layer, which HF applies only under `use_sliding_window`."""
        return self.sliding_window if self.use_sliding_window else None

    def is_sparse(self, index: int) -> bool:
        """Whether layer `index` is an MoE: not in `mlp_only_layers`, and on the `decoder_sparse_step`."""
        return (index not in (self.mlp_only_layers or ()) and self.num_local_experts > 0
                and (index + 1) % self.decoder_sparse_step == 0)


class Model(llama.LlamaLike):
    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        return dict(rope=self.rope, qkv_bias=c.attention_bias, o_bias=c.attention_bias, qk_norm_eps=c.rms_norm_eps,
                    sliding_window=c.window)

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        if not c.is_sparse(index):
            return super().make_mlp(index, dtype=dtype, rngs=rngs)
        return MoE(Router(c.hidden_size, c.num_local_experts, c.num_experts_per_tok, routing="softmax_topk",
                          norm_topk_prob=c.norm_topk_prob, dtype=dtype, rngs=rngs),
                   Experts(c.num_local_experts, c.hidden_size, c.moe_intermediate_size, swiglu(c.hidden_act),
                           dtype=dtype, rngs=rngs))


FAMILY = Family(model_types=("qwen3_moe",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS,
                hf_source=per_expert_hf_source)
