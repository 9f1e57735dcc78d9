"""Mistral: Llama plus a sliding attention window (`sliding_window`, None for full attention).
HF reference: transformers/models/mistral/modeling_mistral.py. MistralConfig's defaults (window 4096, 4096 * 32
positions) differ from Llama's, and a config.json that omits them means these."""

from __future__ import annotations

from dataclasses import dataclass

from day0jax.models import llama
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(llama.Config):
    max_position_embeddings: int = 4096 * 32
    sliding_window: int | None = 4096
    model_type: str = "mistral"


class Model(llama.Model):
    def attention_kwargs(self, index: int) -> dict:
        return dict(super().attention_kwargs(index), sliding_window=self.config.sliding_window)


FAMILY = Family(model_types=("mistral",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS)
