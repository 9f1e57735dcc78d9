"""OLMo 3: OLMo 2 (post-norms, RMSNorm over the whole q and k projections) with sliding-window layers (by default
three of every four) and a RoPE per layer kind: the full-attention layers' may be scaled (YaRN), the sliding
layers' is plain.
HF reference: transformers/models/olmo3/modeling_olmo3.py."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from day0jax.core.hf_config import refuse
from day0jax.layers.rope import rope_parameters
from day0jax.models import llama, olmo2
from day0jax.models.base import LayerTypes, LocalRope
from day0jax.models.contract import Family

KINDS = ("full_attention", "sliding_attention")


@dataclass(frozen=True, eq=False)
class Config(LayerTypes, olmo2.Config):
    DEFAULT_THETA = 500000.0
    sliding_window: int | None = 4096
    layer_types: list | None = None
    model_type: str = "olmo3"

    def __post_init__(self):
        super().__post_init__()
        self._check_derived("layer_kinds", "local_rope")

    def slides_by_default(self, index: int) -> bool:
        return (index + 1) % 4 != 0  # every fourth layer is full attention

    @cached_property
    def rope(self) -> dict:
        """The RoPE of the full-attention layers."""
        return self._ropes()[0]

    @cached_property
    def local_rope(self) -> dict:
        """The RoPE of the sliding layers."""
        return self._ropes()[1]

    def _ropes(self) -> tuple[dict, dict]:
        # transformers 5 writes {"full_attention": {...}, "sliding_attention": {...}}; older configs give rope_theta
        # and rope_scaling, which HF applies to the full-attention layers only. As HF, the sliding layers take
        # DEFAULT_THETA unless their own dict names a theta (the top-level rope_theta goes to the full layers).
        given = self.rope_parameters or {}
        if set(given) - set(KINDS):
            refuse("rope_parameters", given, f"has keys outside {KINDS}, which HF's OLMo 3 does not read")
        full = dict(given.get("full_attention") or {"rope_type": "default"})
        full.update(self.rope_scaling or {})
        full.setdefault("rope_theta", self.rope_theta if self.rope_theta is not None else self.DEFAULT_THETA)
        local = dict(given.get("sliding_attention") or {"rope_type": "default"})
        local.setdefault("rope_theta", self.DEFAULT_THETA)
        kw = dict(max_position_embeddings=self.max_position_embeddings)
        return rope_parameters(full, None, None, **kw), rope_parameters(local, None, None, **kw)


class Model(LocalRope, olmo2.Model):
    def attention_kwargs(self, index: int) -> dict:
        return dict(super().attention_kwargs(index), rope=self.layer_rope(index),
                    sliding_window=self.config.layer_window(index))


FAMILY = Family(model_types=("olmo3",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS)
