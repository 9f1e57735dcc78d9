"""Llama (and every family that is Llama with other defaults): RMSNorm, RoPE, GQA attention, SwiGLU MLP.

HF reference: transformers/models/llama/modeling_llama.py. Tensor names are HF's; the default mapping in
`base.py` covers them all.
"""

from __future__ import annotations

from dataclasses import dataclass

from flax import nnx

from day0jax import config as config_lib
from day0jax.errors import UnsupportedArchitecture
from day0jax.layers.attention import Attention
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.norms import RMSNorm
from day0jax.layers.rope import rope_parameters
from day0jax.models.base import CausalLM, DecoderLayer

MODEL_TYPES = ("llama",)

# HF tensors we read nothing from, and why.
DROPPED = {
    r".*\.rotary_emb\.inv_freq$": "recomputed from the config",
}


@dataclass(frozen=True, eq=False)
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
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
    unknown_keys: tuple = ()

    def __post_init__(self):
        set_ = object.__setattr__
        if self.num_key_value_heads is None:
            set_(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            set_(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedArchitecture(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                                          f"num_key_value_heads={self.num_key_value_heads}")
        set_(self, "rope", rope_parameters(self.rope_parameters, self.rope_scaling, self.rope_theta,
                                           max_position_embeddings=self.max_position_embeddings))

    @classmethod
    def from_hf(cls, hf: dict) -> "Config":
        return config_lib.from_hf(cls, hf)


class Model(CausalLM):
    sliding_window: int | None = None  # Mistral sets it per config

    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> DecoderLayer:
        c = self.config
        attn = Attention(hidden_size=c.hidden_size, num_heads=c.num_attention_heads,
                         num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, rope=self.rope,
                         qkv_bias=c.attention_bias, o_bias=c.attention_bias,
                         sliding_window=getattr(c, "sliding_window", None), dtype=dtype, rngs=rngs)
        mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, use_bias=c.mlp_bias, dtype=dtype, rngs=rngs)
        return DecoderLayer(attn, mlp, RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype, rngs=rngs),
                            RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype, rngs=rngs))
