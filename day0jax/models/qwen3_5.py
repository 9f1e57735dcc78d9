"""Qwen3.5 (dense), text model: Qwen3-Next's hybrid layers (qwen3_next.py) with dense SwiGLU MLPs, and the
linear-attention projections stored apart (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`). Released
checkpoints are multimodal (`qwen3_5`): their language model converts with the vision tower dropped.
HF reference: transformers/models/qwen3_5/modeling_qwen3_5.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from day0jax.models import qwen3_next
from day0jax.models.base import Source, default_source, in_language_model, per_expert_source, vision_dropped
from day0jax.models.contract import Family

# Interleaved multimodal RoPE: text positions are equal on its three axes, where it is exactly 1-D RoPE.
MROPE_KEYS = ("mrope_section", "mrope_interleaved")


class Qwen35:
    """Mixin of the Qwen3.5 configs: text-only multimodal RoPE, and refusals of what they do not implement."""

    COMPOSITE = ("qwen3_5", "qwen3_5_moe")

    def _rope(self, params: dict | None = None, **kwargs):
        params = {k: v for k, v in (params or self.rope_parameters or {}).items() if k not in MROPE_KEYS} or None
        return super()._rope(params, **kwargs)


@dataclass(frozen=True, eq=False)
class Config(Qwen35, qwen3_next.HybridConfig):
    vocab_size: int = 248320
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_key_value_heads: int | None = 4
    intermediate_size: int = 12288
    model_type: str = "qwen3_5_text"

    def is_sparse(self, index: int) -> bool:
        return False


def split_projection_source(config, prefix: str, part: str) -> Source | None:
    """q, k and v from `in_proj_qkv` [Nk Hk + Nk Hk + Nv Hv, D]; z, b and a keep HF's own tensors."""
    if part not in "qkv":
        return None
    c = config
    qk, v = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    start, size = {"q": (0, qk), "k": (qk, qk), "v": (2 * qk, v)}[part]
    return Source((f"{prefix}.in_proj_qkv.weight",),
                  lambda arrays, shape: arrays[0][start:start + size].reshape(shape), ((2 * qk + v, c.hidden_size),))


def hf_source(config, path: str, shape: tuple[int, ...], metadata: dict) -> Source:
    src = (per_expert_source(path, shape)
           or qwen3_next.linear_attention_source(config, path, split_projection_source)
           or default_source(path, shape, metadata))
    return in_language_model(src) if config.is_composite else src


def dropped_for(config) -> dict[str, str]:
    return vision_dropped(config, r"model\.visual\..*")


FAMILY = Family(model_types=("qwen3_5_text", "qwen3_5"), config=Config, model=qwen3_next.Model,
                dropped=qwen3_next.DROPPED, dropped_for=dropped_for, hf_source=hf_source)
