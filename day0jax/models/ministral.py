"""Ministral: Mistral whose layers each attend fully or over a sliding window, as `layer_types` says; without it,
every layer slides when `sliding_window` is set and none does when it is None.
HF reference: transformers/models/ministral/modeling_ministral.py (Qwen2's layers with no q/k/v biases)."""

from __future__ import annotations

from dataclasses import dataclass

from day0jax.models import llama
from day0jax.models.base import HFConfig, LayerTypes
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(LayerTypes, HFConfig):
    # MinistralConfig's keys and defaults; it has no attention_bias or mlp_bias: HF's projections never have biases.
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096 * 32
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    sliding_window: int | None = 4096
    layer_types: list | None = None
    model_type: str = "ministral"

    def __post_init__(self):
        super().__post_init__()
        self._check_derived("layer_kinds")

    def slides_by_default(self, index: int) -> bool:
        return self.sliding_window is not None


class Model(llama.LlamaLike):
    def attention_kwargs(self, index: int) -> dict:
        # A "sliding_attention" layer under sliding_window None attends fully, as HF's does (`layer_window`).
        return dict(rope=self.rope, sliding_window=self.config.layer_window(index))


FAMILY = Family(model_types=("ministral",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS)
