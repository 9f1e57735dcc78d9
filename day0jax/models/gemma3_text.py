"""Gemma 3 (text): Gemma 2's sandwich layers with RMSNorm on q and k instead of attention soft-capping (HF does
not apply `attn_logit_softcapping` even when set; neither do we), and a separate RoPE for the sliding ("local")
layers.
HF reference: transformers/models/gemma3/modeling_gemma3.py."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from day0jax.layers.rope import rope_parameters
from day0jax.models import gemma2, llama
from day0jax.models.base import LocalRope
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(gemma2.Config):
    ALIASES = {"_sliding_window_pattern": "sliding_window_pattern"}  # transformers 5 writes the private name
    vocab_size: int = 262208
    max_position_embeddings: int = 131072
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    rope_local_base_freq: float | None = None
    sliding_window_pattern: int = 6
    use_bidirectional_attention: bool | None = False
    model_type: str = "gemma3_text"

    def __post_init__(self):
        self._check_heads()
        self._activation("hidden_activation")
        self._refuse_if("use_bidirectional_attention", bool, "(non-causal attention) is not implemented")
        self._check_derived("layer_kinds", "rope", "local_rope")

    def slides_by_default(self, index: int) -> bool:
        return (index + 1) % self.sliding_window_pattern != 0  # every `sliding_window_pattern`-th layer is full

    @cached_property
    def rope(self) -> dict:
        """The RoPE of the full-attention ("global") layers."""
        return self._ropes()[0]

    @cached_property
    def local_rope(self) -> dict:
        return self._ropes()[1]

    def _ropes(self) -> tuple[dict, dict]:
        # transformers 5 writes {"full_attention": {...}, "sliding_attention": {...}}; older configs give
        # rope_theta (+ rope_scaling) for the global layers and rope_local_base_freq for the local ones.
        given = self.rope_parameters or {}
        if "full_attention" in given or "sliding_attention" in given:
            full, local = dict(given.get("full_attention") or {}), dict(given.get("sliding_attention") or {})
        else:  # the flat, older form: it scales the global layers only
            full, local = dict(given or self.rope_scaling or {}), {}
        full.setdefault("rope_theta", self.rope_theta if self.rope_theta is not None else 1_000_000.0)
        local.setdefault("rope_theta", self.rope_local_base_freq if self.rope_local_base_freq is not None else 10_000.0)
        kw = dict(max_position_embeddings=self.max_position_embeddings)
        return rope_parameters(full, None, None, **kw), rope_parameters(local, None, None, **kw)


class Model(LocalRope, gemma2.Model):
    def attention_kwargs(self, index: int) -> dict:
        return dict(super().attention_kwargs(index), rope=self.layer_rope(index), logit_softcap=None,
                    qk_norm_eps=self.config.rms_norm_eps, qk_norm_offset=1.0)


FAMILY = Family(model_types=("gemma3_text",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS)
