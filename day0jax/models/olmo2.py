"""OLMo 2: no pre-norms; RMSNorm on each block's output before the residual add, and on the whole q and k
projections (all heads together, before RoPE).
HF reference: transformers/models/olmo2/modeling_olmo2.py."""

from __future__ import annotations

from dataclasses import dataclass

from flax import nnx

from day0jax.layers.decoder import PostNormDecoderLayer
from day0jax.models import llama
from day0jax.models.base import HFConfig
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    vocab_size: int = 50304
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    attention_bias: bool = False
    model_type: str = "olmo2"


class Model(llama.LlamaLike):
    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        return dict(rope=self.rope, qkv_bias=c.attention_bias, o_bias=c.attention_bias, qk_norm_eps=c.rms_norm_eps,
                    qk_norm_over="all")

    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> PostNormDecoderLayer:
        D = self.config.hidden_size
        return PostNormDecoderLayer(self.make_attention(index, dtype=dtype, rngs=rngs),
                                    self.make_mlp(index, dtype=dtype, rngs=rngs),
                                    post_attention_layernorm=self.make_norm(D, dtype=dtype, rngs=rngs),
                                    post_feedforward_layernorm=self.make_norm(D, dtype=dtype, rngs=rngs))


FAMILY = Family(model_types=("olmo2",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS)
