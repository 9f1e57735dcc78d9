"""SmolLM3: Llama where the layers `no_rope_layers` marks 0 use no positions (NoPE); under `use_sliding_window`
they are the ones that slide by default.
HF reference: transformers/models/smollm3/modeling_smollm3.py."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from day0jax.core.hf_config import refuse
from day0jax.models import llama
from day0jax.models.base import LayerTypes
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(LayerTypes, llama.Config):
    DEFAULT_THETA = 2000000.0
    vocab_size: int = 128256
    hidden_size: int = 2048
    num_hidden_layers: int = 36
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 4
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    use_sliding_window: bool = False
    sliding_window: int | None = None
    no_rope_layers: list | None = None
    no_rope_layer_interval: int = 4
    layer_types: list | None = None
    model_type: str = "smollm3"

    def __post_init__(self):
        super().__post_init__()
        self._check_derived("rope_layers", "layer_kinds")

    @cached_property
    def rope_layers(self) -> tuple[bool, ...]:
        """Whether each layer applies RoPE: `no_rope_layers`, by default all but every `no_rope_layer_interval`-th.

        Raises:
            UnsupportedArchitecture: not a 0 or 1 for each layer.
        """
        L = self.num_hidden_layers
        rope_on = list(self.no_rope_layers if self.no_rope_layers is not None else
                       [int((i + 1) % self.no_rope_layer_interval != 0) for i in range(L)])
        if len(rope_on) < L or any(v not in (0, 1) for v in rope_on):
            refuse("no_rope_layers", rope_on, f"must hold a 0 or 1 for each of the {L} layers")
        return tuple(bool(v) for v in rope_on[:L])

    @property
    def window(self) -> int | None:
        return self.sliding_window if self.use_sliding_window else None

    def slides_by_default(self, index: int) -> bool:
        return self.window is not None and not self.rope_layers[index]


class Model(llama.Model):
    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        return dict(super().attention_kwargs(index), rope=self.rope if c.rope_layers[index] else None,
                    sliding_window=c.layer_window(index))


FAMILY = Family(model_types=("smollm3",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS)
