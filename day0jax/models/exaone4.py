"""EXAONE 4.0: OLMo 2's post-norm layers (RMSNorm on each block's output before the residual add) with RMSNorm on
each head's q and k (before RoPE), and hybrid attention: with a `sliding_window`, the sliding layers (by default
three of every `sliding_window_pattern`) use RoPE and the full-attention layers no positions at all; without
one, every layer is full attention with RoPE.
HF reference: transformers/models/exaone4/modeling_exaone4.py."""

from __future__ import annotations

from dataclasses import dataclass

from flax import nnx

from day0jax.layers.decoder import PostNormDecoderLayer
from day0jax.models import llama
from day0jax.models.base import HFConfig, LayerTypes
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(LayerTypes, HFConfig):
    vocab_size: int = 102400
    hidden_size: int = 4096
    intermediate_size: int = 16384
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    sliding_window: int | None = 4096
    sliding_window_pattern: int | str | None = 4
    layer_types: list | None = None
    model_type: str = "exaone4"

    def __post_init__(self):
        super().__post_init__()
        self._refuse_if("sliding_window_pattern",
                        lambda v: self.layer_types is None and self.sliding_window and (not isinstance(v, int)
                                                                                         or v < 1),
                        "is not implemented without layer_types (only a period, a positive int)")
        self._check_derived("layer_kinds")

    def slides_by_default(self, index: int) -> bool:
        # Without a window, HF makes every layer full attention.
        return bool(self.sliding_window) and (index + 1) % self.sliding_window_pattern != 0

    def uses_rope(self, index: int) -> bool:
        """With a window, only the sliding layers apply RoPE (HF: `sliding_window is None or is_sliding`)."""
        return self.sliding_window is None or self.layer_kinds[index] == "sliding_attention"


class Model(llama.LlamaLike):
    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        return dict(rope=self.rope if c.uses_rope(index) else None, qk_norm_eps=c.rms_norm_eps,
                    sliding_window=c.layer_window(index))

    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> PostNormDecoderLayer:
        D = self.config.hidden_size
        return PostNormDecoderLayer(self.make_attention(index, dtype=dtype, rngs=rngs),
                                    self.make_mlp(index, dtype=dtype, rngs=rngs),
                                    post_attention_layernorm=self.make_norm(D, dtype=dtype, rngs=rngs),
                                    post_feedforward_layernorm=self.make_norm(D, dtype=dtype, rngs=rngs))


FAMILY = Family(model_types=("exaone4",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS)
