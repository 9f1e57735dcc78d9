"""Qwen3-VL-MoE: Qwen3-VL's vision path (`qwen3_vl`: the tower of any image size with its DeepStack mergers, 3-D
multimodal RoPE with the offset carried into decoding, DeepStack features added to the first layers) over the
sparse `qwen3_vl_moe_text` language model.
HF reference: transformers/models/qwen3_vl_moe/modeling_qwen3_vl_moe.py (`Qwen3VLMoeModel`)."""

from __future__ import annotations

from dataclasses import dataclass

from day0jax.models import qwen3_vl
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(qwen3_vl.Config):
    DEFAULT_TEXT_TYPE = "qwen3_vl_moe_text"
    TEXT_TYPES = ("qwen3_vl_moe_text",)
    model_type: str = "qwen3_vl_moe"


FAMILY = Family(model_types=("qwen3_vl_moe",), config=Config, model=qwen3_vl.Model, dropped={},
                dropped_for=qwen3_vl.dropped_for, hf_source=qwen3_vl.hf_source)
