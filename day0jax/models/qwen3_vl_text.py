"""Qwen3-VL's language model (`qwen3_vl_text`): Qwen3's layers rotated by interleaved multimodal RoPE, whose
`rope_parameters.mrope_section` gives the frequencies turned by the temporal, height and width positions. On text
(three equal positions) it is plain RoPE; `qwen3_vl` gives image tokens their 3-D positions.
HF reference: transformers/models/qwen3_vl/modeling_qwen3_vl.py (`Qwen3VLTextModel`, `Qwen3VLTextRotaryEmbedding`)."""

from __future__ import annotations

from dataclasses import dataclass

from day0jax.core.hf_config import refuse
from day0jax.layers.rope import MRope
from day0jax.models import llama, qwen3
from day0jax.models.contract import Family

MROPE_KEYS = ("mrope_section", "mrope_interleaved")


@dataclass(frozen=True, eq=False)
class Config(qwen3.Config):
    """`Qwen3VLTextConfig`: Qwen3's keys; `rope_parameters` carries `mrope_section` (frequencies per axis)."""

    DEFAULT_THETA = 500000.0
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    head_dim: int | None = 128
    max_position_embeddings: int = 128000
    rope_parameters: dict | None = None
    model_type: str = "qwen3_vl_text"

    def _rope(self, params: dict | None = None, **kwargs):
        params = {k: v for k, v in (params or self.rope_parameters or {}).items() if k not in MROPE_KEYS} or None
        return super()._rope(params, **kwargs)

    @property
    def mrope_section(self) -> tuple[int, ...]:
        """Frequencies turned by the temporal, height and width positions, taken in turn (HF's default [24, 20, 20];
        HF takes those that exist when the counts add up to more)."""
        section = tuple((self.rope_parameters or {}).get("mrope_section") or (24, 20, 20))
        if len(section) != 3:
            refuse("rope_parameters.mrope_section", list(section), "must give 3 counts (temporal, height, width)")
        return section

    def __post_init__(self):
        super().__post_init__()
        self._check_derived("mrope_section")


class Model(qwen3.Model):
    """Qwen3's layers, rotated by multimodal RoPE (interleaved sections, as HF's Qwen3-VL always does)."""

    def make_rope(self) -> MRope:
        c = self.config
        return MRope(c.rope, c.head_size, c.max_position_embeddings, sections=c.mrope_section, interleaved=True)


FAMILY = Family(model_types=("qwen3_vl_text",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS)
