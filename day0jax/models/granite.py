"""Granite: Llama with muP-style multipliers: embeddings times `embedding_multiplier`, attention scores times
`attention_multiplier` (not head_dim ** -0.5), block outputs times `residual_multiplier`, logits / `logits_scaling`.
HF reference: transformers/models/granite/modeling_granite.py."""

from __future__ import annotations

from dataclasses import dataclass

from flax import nnx

from day0jax.models import llama
from day0jax.models.base import DecoderLayer
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(llama.Config):
    embedding_multiplier: float = 1.0
    logits_scaling: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    model_type: str = "granite"


class Model(llama.Model):
    def attention_kwargs(self, index: int) -> dict:
        return dict(super().attention_kwargs(index), scale=self.config.attention_multiplier)

    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> DecoderLayer:
        layer = super().make_layer(index, dtype=dtype, rngs=rngs)
        layer.residual_multiplier = self.config.residual_multiplier
        return layer

    def embed(self, tokens):
        return self.model.embed_tokens(tokens) * self.config.embedding_multiplier

    def logits(self, hidden):
        return super().logits(hidden) / self.config.logits_scaling


FAMILY = Family(model_types=("granite",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS)
