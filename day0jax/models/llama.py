"""Llama (and `LlamaLike`, the base of families that are Llama with other defaults): RMSNorm, RoPE, GQA, SwiGLU.
HF reference: transformers/models/llama/modeling_llama.py (plain HF tensor names)."""

from __future__ import annotations

from dataclasses import dataclass

from flax import nnx

from day0jax.layers.attention import Attention
from day0jax.layers.mlp import GatedMLP
from day0jax.models.base import CausalLM, DecoderLayer, HFConfig
from day0jax.models.contract import Family

# HF buffers that RoPE models may save and that we recompute: every RoPE family drops them.
ROPE_BUFFERS = {r".*\.rotary_emb\.inv_freq$": "recomputed from the config"}


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    model_type: str = "llama"


class LlamaLike(CausalLM):
    """Llama's layers reading only the keys every Llama-like config has; families override what differs."""

    def attention_kwargs(self, index: int) -> dict:
        """Layer `index`'s `Attention` arguments beyond the head shapes (here: no biases, full attention)."""
        return dict(rope=self.rope)

    def mlp_kwargs(self, index: int) -> dict:
        """Layer `index`'s `GatedMLP` arguments beyond its sizes and activation."""
        return {}

    def make_attention(self, index: int, *, dtype, rngs: nnx.Rngs) -> Attention:
        c = self.config
        return Attention(hidden_size=c.hidden_size, num_heads=c.num_attention_heads, num_kv_heads=c.kv_heads,
                         head_dim=c.head_size, **self.attention_kwargs(index), dtype=dtype, rngs=rngs)

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, **self.mlp_kwargs(index), dtype=dtype,
                        rngs=rngs)

    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> DecoderLayer:
        D = self.config.hidden_size
        return DecoderLayer(self.make_attention(index, dtype=dtype, rngs=rngs),
                            self.make_mlp(index, dtype=dtype, rngs=rngs),
                            self.make_norm(D, dtype=dtype, rngs=rngs), self.make_norm(D, dtype=dtype, rngs=rngs))


class Model(LlamaLike):
    """Llama: q/k/v/o biases per `attention_bias`, MLP biases per `mlp_bias`."""

    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        return dict(rope=self.rope, qkv_bias=c.attention_bias, o_bias=c.attention_bias)

    def mlp_kwargs(self, index: int) -> dict:
        return dict(use_bias=self.config.mlp_bias)


FAMILY = Family(model_types=("llama",), config=Config, model=Model, dropped=ROPE_BUFFERS)
