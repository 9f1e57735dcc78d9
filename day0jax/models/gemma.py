"""Gemma: Llama's layout with embeddings scaled by sqrt(hidden_size), (1 + weight) RMSNorms (weights stored as
w - 1, HF's layout), tanh-GELU gating, and tied embeddings.
HF reference: transformers/models/gemma/modeling_gemma.py."""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
from flax import nnx

from day0jax.layers.mlp import GatedMLP
from day0jax.layers.norms import RMSNorm
from day0jax.models import llama
from day0jax.models.base import HFConfig
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    vocab_size: int = 256000
    hidden_size: int = 3072
    intermediate_size: int = 24576
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 16
    head_dim: int | None = 256
    hidden_act: str = "gelu_pytorch_tanh"
    # Some Gemma configs also carry `hidden_activation`; HF's Gemma (v1) reads only hidden_act.
    hidden_activation: str | None = None
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    attention_bias: bool = False
    use_bidirectional_attention: bool | None = None
    model_type: str = "gemma"

    def __post_init__(self):
        self._check_heads()
        self._activation()
        self._refuse_if("use_bidirectional_attention", bool, "(non-causal attention) is not implemented")
        self._check_derived("rope")

    @property
    def activation(self) -> str:
        """`hidden_act`, where the legacy "gelu" means the tanh approximation (HF's GemmaConfig rewrites it so)."""
        return "gelu_pytorch_tanh" if self.hidden_act == "gelu" else self.hidden_act


class Model(llama.LlamaLike):
    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        return dict(rope=self.rope, qkv_bias=c.attention_bias, o_bias=c.attention_bias)

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> GatedMLP:
        c = self.config
        return GatedMLP(c.hidden_size, c.intermediate_size, c.activation, dtype=dtype, rngs=rngs)

    def make_norm(self, dim: int, *, dtype, rngs: nnx.Rngs) -> RMSNorm:
        return RMSNorm(dim, self.config.rms_norm_eps, offset=1.0, dtype=dtype, rngs=rngs)

    def embed(self, tokens):
        x = self.model.embed_tokens(tokens)
        return x * jnp.asarray(self.config.hidden_size ** 0.5, x.dtype)  # HF rounds the scale to the dtype


FAMILY = Family(model_types=("gemma",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS)
