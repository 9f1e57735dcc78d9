"""Qwen2: Llama with q/k/v biases (always on, no config key) and optional sliding-window layers.
HF reference: transformers/models/qwen2/modeling_qwen2.py. The window applies only under `use_sliding_window`, to
the layers `layer_types` marks sliding (by default those from `max_window_layers` on)."""

from __future__ import annotations

from dataclasses import dataclass

from day0jax.models import llama
from day0jax.models.base import HFConfig, LayerTypes
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(LayerTypes, HFConfig):
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: list | None = None
    model_type: str = "qwen2"

    def __post_init__(self):
        super().__post_init__()
        self._check_derived("layer_kinds")

    @property
    def window(self) -> int | None:
        return self.sliding_window if self.use_sliding_window else None

    def slides_by_default(self, index: int) -> bool:
        return self.window is not None and index >= self.max_window_layers


class Model(llama.LlamaLike):
    def attention_kwargs(self, index: int) -> dict:
        return dict(rope=self.rope, qkv_bias=True, sliding_window=self.config.layer_window(index))


FAMILY = Family(model_types=("qwen2",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS)
