"""SmolLM3: Llama with some layers that use no positions at all (NoPE), per `no_rope_layers`.

HF reference: transformers/models/smollm3/modeling_smollm3.py. `no_rope_layers[i]` is 1 where layer i applies
RoPE and 0 where it does not (by default every `no_rope_layer_interval`-th layer); with `use_sliding_window`,
NoPE layers may be marked "sliding_attention" in `layer_types`.
"""

from __future__ import annotations

from dataclasses import dataclass

from day0jax.models import llama
from day0jax.models.base import HFConfig, refuse

MODEL_TYPES = ("smollm3",)
DROPPED = llama.DROPPED


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    DEFAULT_THETA = 2000000.0
    vocab_size: int = 128256
    hidden_size: int = 2048
    intermediate_size: int = 11008
    num_hidden_layers: int = 36
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 4
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    use_sliding_window: bool = False
    sliding_window: int | None = None
    no_rope_layers: list | None = None
    no_rope_layer_interval: int = 4
    layer_types: list | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = True
    model_type: str = "smollm3"

    def __post_init__(self):
        self._heads()
        self._activation()
        L = self.num_hidden_layers
        rope_on = list(self.no_rope_layers if self.no_rope_layers is not None else
                       [int((i + 1) % self.no_rope_layer_interval != 0) for i in range(L)])
        if len(rope_on) < L or any(v not in (0, 1) for v in rope_on):
            refuse("no_rope_layers", rope_on, f"must hold a 0 or 1 for each of the {L} layers")
        sliding = self.use_sliding_window and self.sliding_window is not None
        self._set(no_rope_layers=rope_on, rope=self._rope())
        self._set(layer_types=self._layer_types(
            ["sliding_attention" if sliding and not rope_on[i] else "full_attention" for i in range(L)]))


class Model(llama.Model):
    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        window = c.sliding_window if c.use_sliding_window and c.layer_types[index] == "sliding_attention" else None
        return dict(rope=self.rope if c.no_rope_layers[index] else None, qkv_bias=c.attention_bias,
                    o_bias=c.attention_bias, sliding_window=window)
