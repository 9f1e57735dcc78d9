"""Arcee (AFM): Llama with a plain, ungated MLP, down(act(up(x))), whose activation is by default ReLU squared;
q/k/v/o biases per `attention_bias`, MLP biases per `mlp_bias`.
HF reference: transformers/models/arcee/modeling_arcee.py."""

from __future__ import annotations

from dataclasses import dataclass

from day0jax.models import llama
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(llama.Config):
    hidden_size: int = 2560
    intermediate_size: int = 18432
    hidden_act: str = "relu2"
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    model_type: str = "arcee"


class Model(llama.Model):
    def mlp_kwargs(self, index: int) -> dict:
        return dict(super().mlp_kwargs(index), gated=False)


FAMILY = Family(model_types=("arcee",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS)
