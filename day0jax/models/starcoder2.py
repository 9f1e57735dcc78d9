"""StarCoder2: Llama's pre-norm blocks with LayerNorms (with bias), an ungated MLP c_proj(act(c_fc(x))), biases on
every projection per `use_bias`, one sliding window for every layer, tied embeddings by default.
HF reference: transformers/models/starcoder2/modeling_starcoder2.py."""

from __future__ import annotations

from dataclasses import dataclass

from flax import nnx

from day0jax.layers.mlp import GatedMLP
from day0jax.layers.norms import LayerNorm
from day0jax.models import llama
from day0jax.models.base import HFConfig
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    vocab_size: int = 49152
    hidden_size: int = 3072
    intermediate_size: int = 12288
    num_hidden_layers: int = 30
    num_attention_heads: int = 24
    num_key_value_heads: int | None = 2
    head_dim: int | None = None
    hidden_act: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 4096
    norm_epsilon: float = 1e-5
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    sliding_window: int | None = None
    use_bias: bool = True
    tie_word_embeddings: bool = True
    residual_dropout: float = 0.0  # training only
    # In BigCode's released configs and read by no transformers code: a duplicate of norm_epsilon, and switches
    # naming the architecture HF implements (refused where they name another: HF would compute this one regardless).
    layer_norm_epsilon: float | None = None
    norm_type: str = "layer_norm"
    mlp_type: str = "default"
    model_type: str = "starcoder2"

    def __post_init__(self):
        super().__post_init__()
        self._refuse_if("norm_type", lambda v: v != "layer_norm", "is not what HF's StarCoder2 computes (LayerNorm)")
        self._refuse_if("mlp_type", lambda v: v != "default",
                        "is not what HF's StarCoder2 computes (the ungated c_fc/c_proj MLP)")


class Model(llama.LlamaLike):
    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        return dict(rope=self.rope, qkv_bias=c.use_bias, o_bias=c.use_bias, sliding_window=c.sliding_window)

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> GatedMLP:
        c = self.config
        return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, use_bias=c.use_bias, gated=False,
                        names=("c_fc", "c_proj"), dtype=dtype, rngs=rngs)

    def make_norm(self, dim: int, *, dtype, rngs: nnx.Rngs) -> LayerNorm:
        return LayerNorm(dim, self.config.norm_epsilon, dtype=dtype, rngs=rngs)


FAMILY = Family(model_types=("starcoder2",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS)
