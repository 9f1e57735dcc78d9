"""Gemma 2: Gemma with norms before and after both blocks, alternating sliding/global attention layers, the
softmax scaled by `query_pre_attn_scalar` ** -0.5, and tanh soft-capping of attention scores and final logits.

HF reference: transformers/models/gemma2/modeling_gemma2.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from flax import nnx

from day0jax.layers.decoder import SandwichDecoderLayer
from day0jax.layers.mlp import GatedMLP
from day0jax.models import gemma, llama
from day0jax.models.base import HFConfig, softcap
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    vocab_size: int = 256000
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int | None = 4
    head_dim: int | None = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    hidden_act: str | None = None  # in some configs; HF's Gemma 2 reads only hidden_activation
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    attention_bias: bool = False
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    sliding_window_size: int | None = None  # an older duplicate of sliding_window; HF reads sliding_window
    layer_types: list | None = None
    final_logit_softcapping: float | None = 30.0
    attn_logit_softcapping: float | None = 50.0
    use_bidirectional_attention: bool | None = None
    model_type: str = "gemma2"

    def __post_init__(self):
        self._check_heads()
        self._activation("hidden_activation")
        self._refuse_if("use_bidirectional_attention", bool, "(non-causal attention) is not implemented")
        self._check_derived("rope", "layer_kinds")

    @cached_property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's attention kind: `layer_types`, by default sliding and full alternating."""
        return self._checked_layer_kinds(
            ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(self.num_hidden_layers)])

    def layer_window(self, index: int) -> int | None:
        """The sliding window of layer `index` (None: full attention)."""
        return self.sliding_window if self.layer_kinds[index] == "sliding_attention" else None


class Model(gemma.Model):
    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        return dict(rope=self.rope, qkv_bias=c.attention_bias, o_bias=c.attention_bias,
                    sliding_window=c.layer_window(index), scale=c.query_pre_attn_scalar ** -0.5,
                    logit_softcap=c.attn_logit_softcapping)

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> GatedMLP:
        c = self.config
        return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_activation, dtype=dtype, rngs=rngs)

    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> SandwichDecoderLayer:
        norms = [self.make_norm(self.config.hidden_size, dtype=dtype, rngs=rngs) for _ in range(4)]
        return SandwichDecoderLayer(
            self.make_attention(index, dtype=dtype, rngs=rngs), self.make_mlp(index, dtype=dtype, rngs=rngs),
            input_layernorm=norms[0], post_attention_layernorm=norms[1], pre_feedforward_layernorm=norms[2],
            post_feedforward_layernorm=norms[3])

    def logits(self, hidden):
        return softcap(super().logits(hidden), self.config.final_logit_softcapping)


FAMILY = Family(model_types=("gemma2",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS)
