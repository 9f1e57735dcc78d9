"""Qwen3.5 (dense), text model: Qwen3-Next's hybrid layers (qwen3_next.py) with dense SwiGLU MLPs, the
linear-attention projections stored apart (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`), and interleaved
multimodal RoPE on the full-attention layers' rotated dims. Released checkpoints are multimodal (`qwen3_5`, images in:
qwen3_5_vl.py).
HF reference: transformers/models/qwen3_5/modeling_qwen3_5.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.rope import MRope
from day0jax.models import qwen3_next
from day0jax.models.base import per_expert_source
from day0jax.models.contract import Family

# Multimodal RoPE's keys, read apart from the rest of rope_parameters (which `layers.rope` checks).
MROPE_KEYS = ("mrope_section", "mrope_interleaved")


class Qwen35:
    """Mixin of the Qwen3.5 configs: interleaved multimodal RoPE (`mrope_section`, HF's default [11, 11, 10])."""

    def _rope(self, params: dict | None = None, **kwargs):
        params = {k: v for k, v in (params or self.rope_parameters or {}).items() if k not in MROPE_KEYS} or None
        return super()._rope(params, **kwargs)

    @property
    def mrope_section(self) -> tuple[int, ...]:
        """Frequencies turned by the temporal, height and width positions, taken in turn over the rotated ones
        (HF takes those that exist when the counts add up to more)."""
        section = tuple((self.rope_parameters or {}).get("mrope_section") or (11, 11, 10))
        if len(section) != 3:
            refuse("rope_parameters.mrope_section", list(section), "must give 3 counts (temporal, height, width)")
        return section


class Model(qwen3_next.Model):
    """Qwen3-Next's hybrid layers, the full-attention ones rotated by interleaved multimodal RoPE (plain RoPE on
    text, whose three positions are equal)."""

    def make_rope(self) -> MRope:
        c = self.config
        return MRope(c.rope, c.head_size, c.max_position_embeddings, sections=c.mrope_section, interleaved=True)


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
    return (per_expert_source(path, shape)
            or qwen3_next.linear_attention_source(config, path, split_projection_source)
            or default_source(path, shape, metadata))


FAMILY = Family(model_types=("qwen3_5_text",), config=Config, model=Model, dropped=qwen3_next.DROPPED,
                hf_source=hf_source, mtp=qwen3_next.mtp_tensors)
