"""Cohere 2 (Command R7B, Command A): Cohere's parallel block and logit scale, with sliding-window layers (by default
three of every four, `sliding_window_pattern`) that rotate with RoPE and full-attention layers without positions;
no q/k norms; head_dim is always hidden_size // num_attention_heads.
HF reference: transformers/models/cohere2/modeling_cohere2.py."""

from __future__ import annotations

from dataclasses import dataclass

from day0jax.models import cohere, llama
from day0jax.models.base import LayerTypes
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(LayerTypes, cohere.Config):
    DEFAULT_THETA = 10000.0
    logit_scale: float = 0.0625
    sliding_window: int | None = 4096
    layer_types: list | None = None
    sliding_window_pattern: int = 4  # read by HF only when layer_types is None
    # In Cohere's released configs: "local_attn_first" is HF's default pattern (layer_types says the rest).
    order_of_interleaved_layers: str = "local_attn_first"
    model_type: str = "cohere2"

    def __post_init__(self):
        super().__post_init__()
        self._refuse_if("use_qk_norm", bool, "is not read by HF's Cohere 2, which has no q/k norms")
        self._refuse_if("order_of_interleaved_layers", lambda v: v != "local_attn_first" and self.layer_types is None,
                        "is not HF's default layer pattern; give layer_types")
        self._check_derived("layer_kinds")

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads  # HF recomputes head_dim so, whatever the config says

    def slides_by_default(self, index: int) -> bool:
        return (index + 1) % self.sliding_window_pattern != 0


class Model(cohere.Model):
    def attention_kwargs(self, index: int) -> dict:
        window = self.config.layer_window(index)
        # HF rotates q and k only in the layers that slide; the full-attention ones have no positions.
        return dict(super().attention_kwargs(index), sliding_window=window, rope=self.rope if window else None)


FAMILY = Family(model_types=("cohere2",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS)
