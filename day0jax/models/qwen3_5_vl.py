"""Qwen3.5 and Qwen3.5-MoE with images: Qwen3-VL's vision path (qwen3_vl.py: the tower of any image size, 3-D
multimodal RoPE with the offset carried into decoding) without DeepStack (Qwen3.5's tower has no DeepStack mergers),
over the hybrid Gated DeltaNet / full-attention language models `qwen3_5_text` and `qwen3_5_moe_text`.
HF reference: transformers/models/qwen3_5/modeling_qwen3_5.py (`Qwen3_5Model`)."""

from __future__ import annotations

from dataclasses import dataclass

from day0jax.models import qwen3_vl
from day0jax.models.contract import Family

TEXT_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")


@dataclass(frozen=True, eq=False)
class Config(qwen3_vl.Config):
    DEFAULT_TEXT_TYPE = "qwen3_5_text"
    TEXT_TYPES = TEXT_TYPES
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    model_type: str = "qwen3_5"


FAMILY = Family(model_types=("qwen3_5", "qwen3_5_moe"), config=Config, model=qwen3_vl.Model, dropped={},
                dropped_for=qwen3_vl.dropped_for, hf_source=qwen3_vl.hf_source)
