"""Gemma 2: Gemma with norms before and after both blocks, alternating sliding/global attention layers, the
softmax scaled by `query_pre_attn_scalar` ** -0.5, and tanh soft-capping of attention scores and final logits.
HF reference: transformers/models/gemma2/modeling_gemma2.py."""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
from flax import nnx

from day0jax.layers.decoder import SandwichDecoderLayer
from day0jax.models import gemma, llama
from day0jax.models.base import LayerTypes
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(LayerTypes, gemma.Config):
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int | None = 4
    hidden_activation: str = "gelu_pytorch_tanh"
    hidden_act: str | None = None  # in some configs; HF's Gemma 2 reads only hidden_activation
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    sliding_window_size: int | None = None  # an older duplicate of sliding_window; HF reads sliding_window
    layer_types: list | None = None
    final_logit_softcapping: float | None = 30.0
    attn_logit_softcapping: float | None = 50.0
    model_type: str = "gemma2"

    def __post_init__(self):
        self._check_heads()
        self._activation("hidden_activation")
        self._refuse_if("use_bidirectional_attention", bool, "(non-causal attention) is not implemented")
        self._check_derived("rope", "layer_kinds")

    @property
    def activation(self) -> str:
        return self.hidden_activation

    def slides_by_default(self, index: int) -> bool:
        return (index + 1) % 2 != 0  # sliding and full alternate


class Model(gemma.Model):
    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        return dict(super().attention_kwargs(index), sliding_window=c.layer_window(index),
                    scale=c.query_pre_attn_scalar ** -0.5, logit_softcap=c.attn_logit_softcapping)

    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> SandwichDecoderLayer:
        norms = [self.make_norm(self.config.hidden_size, dtype=dtype, rngs=rngs) for _ in range(4)]
        return SandwichDecoderLayer(
            self.make_attention(index, dtype=dtype, rngs=rngs), self.make_mlp(index, dtype=dtype, rngs=rngs),
            input_layernorm=norms[0], post_attention_layernorm=norms[1], pre_feedforward_layernorm=norms[2],
            post_feedforward_layernorm=norms[3])

    def logits(self, hidden):
        logits, cap = super().logits(hidden), self.config.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)


FAMILY = Family(model_types=("gemma2",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS)
