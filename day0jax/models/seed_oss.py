"""Seed-OSS: Llama with q/k/v biases per `attention_bias` (on by default), an o_proj bias per its own
`attention_out_bias`, and MLP biases per `mlp_bias`.
HF reference: transformers/models/seed_oss/modeling_seed_oss.py."""

from __future__ import annotations

from dataclasses import dataclass

from day0jax.models import llama
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(llama.Config):
    vocab_size: int = 155136
    hidden_size: int = 4096
    intermediate_size: int = 27648
    num_hidden_layers: int = 64
    num_attention_heads: int = 80
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    max_position_embeddings: int = 524288
    attention_bias: bool = True
    attention_out_bias: bool = False
    residual_dropout: float = 0.1  # training only
    model_type: str = "seed_oss"


class Model(llama.Model):
    def attention_kwargs(self, index: int) -> dict:
        return dict(super().attention_kwargs(index), o_bias=self.config.attention_out_bias)


FAMILY = Family(model_types=("seed_oss",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS)
