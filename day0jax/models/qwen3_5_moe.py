"""Qwen3.5-MoE, text model: Qwen3.5's hybrid layers (qwen3_5.py) with a sparse MoE in every layer (softmax top-k,
always renormalized, plus a sigmoid-gated shared expert). Released checkpoints are multimodal (`qwen3_5_moe`):
their language model converts with the vision tower dropped.
HF reference: transformers/models/qwen3_5_moe/modeling_qwen3_5_moe.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from day0jax.models import qwen3_5, qwen3_next
from day0jax.models.base import HFConfig
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(qwen3_5.Qwen35, qwen3_next.Hybrid, HFConfig):
    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 2
    head_dim: int | None = 256
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 8
    num_experts: int = 256
    layer_types: list | None = None
    full_attention_interval: int = 4
    model_type: str = "qwen3_5_moe_text"

    norm_topk_prob = True  # not a config key: HF always renormalizes the top-k weights here

    def is_sparse(self, index: int) -> bool:
        return True


FAMILY = Family(model_types=("qwen3_5_moe_text", "qwen3_5_moe"), config=Config, model=qwen3_next.Model,
                dropped=qwen3_5.DROPPED, dropped_for=qwen3_5.dropped_for, hf_source=qwen3_5.hf_source)
