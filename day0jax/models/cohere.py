"""Cohere (Command R): a parallel block, x + attn(n) + mlp(n) with n one LayerNorm (no bias) of x; RoPE on
interleaved pairs; optional LayerNorm q/k norms with a weight per head (`use_qk_norm`); logits times `logit_scale`;
tied embeddings by default.
HF reference: transformers/models/cohere/modeling_cohere.py."""

from __future__ import annotations

from dataclasses import dataclass

from flax import nnx

from day0jax.layers.decoder import ParallelDecoderLayer
from day0jax.layers.norms import LayerNorm
from day0jax.models import llama
from day0jax.models.base import HFConfig
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    DEFAULT_THETA = 500000.0
    vocab_size: int = 256000
    hidden_size: int = 8192
    intermediate_size: int = 22528
    logit_scale: float | None = 0.0625
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    layer_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    attention_bias: bool = False
    use_qk_norm: bool = False
    # In Cohere's released configs and read by no transformers code: the tokenizer's limit, and switches naming the
    # architecture HF implements (refused where they name another: HF would compute this one regardless).
    model_max_length: int | None = None
    use_parallel_block: bool = True
    use_gated_activation: bool = True
    use_embedding_sharing: bool | None = None  # tie_word_embeddings says it to HF
    use_parallel_embedding: bool | None = None  # a tensor-parallel layout of the embedding, not math
    position_embedding_type: str = "rope_gptj"
    rotary_pct: float = 1.0
    model_type: str = "cohere"

    def __post_init__(self):
        super().__post_init__()
        self._refuse_if("logit_scale", lambda v: v is None, "must be a number: HF multiplies the logits by it")
        self._refuse_if("use_parallel_block", lambda v: not v, "(sequential blocks) is not what HF's Cohere computes")
        self._refuse_if("use_gated_activation", lambda v: not v, "(an ungated MLP) is not what HF's Cohere computes")
        self._refuse_if("position_embedding_type", lambda v: v != "rope_gptj",
                        "is not what HF's Cohere computes (interleaved RoPE, 'rope_gptj')")
        self._refuse_if("rotary_pct", lambda v: v != 1.0, "(a partial rotary) is not what HF's Cohere computes")


class Model(llama.LlamaLike):
    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        qk_norm = dict(qk_norm_eps=c.layer_norm_eps, qk_layer_norm=True) if c.use_qk_norm else {}
        return dict(rope=self.rope, rope_interleave=True, qkv_bias=c.attention_bias, o_bias=c.attention_bias,
                    **qk_norm)

    def make_norm(self, dim: int, *, dtype, rngs: nnx.Rngs) -> LayerNorm:
        return LayerNorm(dim, self.config.layer_norm_eps, bias=False, dtype=dtype, rngs=rngs)

    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> ParallelDecoderLayer:
        return ParallelDecoderLayer(self.make_attention(index, dtype=dtype, rngs=rngs),
                                    self.make_mlp(index, dtype=dtype, rngs=rngs),
                                    input_layernorm=self.make_norm(self.config.hidden_size, dtype=dtype, rngs=rngs))

    def logits(self, hidden):
        return super().logits(hidden) * self.config.logit_scale


FAMILY = Family(model_types=("cohere",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS)
