"""Qwen2-MoE: Qwen2 attention (q/k/v biases per `qkv_bias`) with softmax top-k MoE MLPs plus a shared expert
scaled by sigmoid(shared_expert_gate(x)); dense layers (see `is_sparse`) use `intermediate_size`.
HF reference: transformers/models/qwen2_moe/modeling_qwen2_moe.py."""

from __future__ import annotations

from dataclasses import dataclass

from flax import nnx

from day0jax.layers.linear import Linear
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.moe import Experts, MoE, Router, swiglu
from day0jax.models import llama, qwen2
from day0jax.models.base import per_expert_hf_source
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(qwen2.Config):
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 16
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 1408
    shared_expert_intermediate_size: int = 5632
    num_experts_per_tok: int = 4
    num_experts: int = 60
    norm_topk_prob: bool = False
    mlp_only_layers: list | None = None
    qkv_bias: bool = True
    model_type: str = "qwen2_moe"

    def slides_by_default(self, index: int) -> bool:
        """With a window, every other layer below `max_window_layers` slides."""
        return self.window is not None and (index + 1) % 2 != 0 and index < self.max_window_layers

    def is_sparse(self, index: int) -> bool:
        """Whether layer `index` is an MoE: not in `mlp_only_layers`, and on the `decoder_sparse_step`."""
        return (index not in (self.mlp_only_layers or ()) and self.num_experts > 0
                and (index + 1) % self.decoder_sparse_step == 0)


class Model(llama.LlamaLike):
    def attention_kwargs(self, index: int) -> dict:
        return dict(rope=self.rope, qkv_bias=self.config.qkv_bias, sliding_window=self.config.layer_window(index))

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        D = c.hidden_size
        if not c.is_sparse(index):
            return super().make_mlp(index, dtype=dtype, rngs=rngs)
        return MoE(Router(D, c.num_experts, c.num_experts_per_tok, routing="softmax_topk",
                          norm_topk_prob=c.norm_topk_prob, dtype=dtype, rngs=rngs),
                   Experts(c.num_experts, D, c.moe_intermediate_size, swiglu(c.hidden_act), dtype=dtype, rngs=rngs),
                   shared=GatedMLP(D, c.shared_expert_intermediate_size, c.hidden_act, dtype=dtype, rngs=rngs),
                   shared_gate=Linear((D,), (1,), ("embed", None), dtype=dtype, rngs=rngs))


FAMILY = Family(model_types=("qwen2_moe",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS,
                hf_source=per_expert_hf_source)
