"""Qwen3.5-MoE, text model: Qwen3.5's hybrid layers (qwen3_5.py) with a sparse MoE in every layer (softmax top-k,
always renormalized, plus a sigmoid-gated shared expert). Released checkpoints are multimodal (`qwen3_5_moe`,
images in: qwen3_5_vl.py).
HF reference: transformers/models/qwen3_5_moe/modeling_qwen3_5_moe.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from day0jax.models import qwen3_5, qwen3_next
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(qwen3_5.Qwen35, qwen3_next.HybridConfig):
    vocab_size: int = 248320
    num_hidden_layers: int = 40
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 8
    num_experts: int = 256
    model_type: str = "qwen3_5_moe_text"

    norm_topk_prob = True  # not a config key: HF always renormalizes the top-k weights here

    def is_sparse(self, index: int) -> bool:
        return True


FAMILY = Family(model_types=("qwen3_5_moe_text",), config=Config, model=qwen3_5.Model, dropped=qwen3_next.DROPPED,
                hf_source=qwen3_5.hf_source, mtp=qwen3_next.mtp_tensors)
