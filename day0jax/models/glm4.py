"""GLM-4 (dense, GLM-4-0414): GQA with q/k/v biases per `attention_bias` (never on o_proj), RoPE on interleaved
pairs of the first half of each head's dims (`partial_rotary_factor`), a fused gate/up projection, and four norms
per layer: before and after attention and before and after the MLP.
HF reference: transformers/models/glm4/modeling_glm4.py. `hf_source` maps HF's names onto the runtime's sandwich
layer (HF's `post_self_attn_layernorm` is the runtime's `post_attention_layernorm`, HF's
`post_attention_layernorm` the runtime's `pre_feedforward_layernorm`, `post_mlp_layernorm` its
`post_feedforward_layernorm`), splits `gate_up_proj`, and reorders q and k rows as ERNIE 4.5 does (see there)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from flax import nnx

from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.decoder import SandwichDecoderLayer
from day0jax.models import llama
from day0jax.models.base import HFConfig
from day0jax.models.contract import Family
from day0jax.models.ernie4_5 import interleaved_to_halves

NORMS = {"post_attention_layernorm": "post_self_attn_layernorm",
         "pre_feedforward_layernorm": "post_attention_layernorm",
         "post_feedforward_layernorm": "post_mlp_layernorm"}  # runtime name -> HF name


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    vocab_size: int = 151552
    hidden_size: int = 4096
    intermediate_size: int = 13696
    num_hidden_layers: int = 40
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 2
    head_dim: int | None = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 0.00000015625
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    partial_rotary_factor: float = 0.5  # HF's default when config.json does not say
    attention_bias: bool = True
    model_type: str = "glm4"

    @cached_property
    def rope(self) -> dict:
        """The normalized RoPE dict, rotating `partial_rotary_factor` of each head unless rope_parameters says."""
        return self._rope(partial_rotary_factor=self.partial_rotary_factor)


class Model(llama.LlamaLike):
    def attention_kwargs(self, index: int) -> dict:
        return dict(rope=self.rope, qkv_bias=self.config.attention_bias)

    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> SandwichDecoderLayer:
        norms = [self.make_norm(self.config.hidden_size, dtype=dtype, rngs=rngs) for _ in range(4)]
        return SandwichDecoderLayer(
            self.make_attention(index, dtype=dtype, rngs=rngs), self.make_mlp(index, dtype=dtype, rngs=rngs),
            input_layernorm=norms[0], post_attention_layernorm=norms[1], pre_feedforward_layernorm=norms[2],
            post_feedforward_layernorm=norms[3])


def hf_source(config: Config, path: str, shape: tuple, metadata: dict) -> Source | None:
    if m := re.fullmatch(r"(.*)\.(\w+_layernorm)\.weight", path):
        return default_source(f"{m[1]}.{NORMS.get(m[2], m[2])}.weight", shape, metadata)
    if m := re.fullmatch(r"(.*\.mlp)\.(gate|up)_proj\.kernel", path):
        F, D = config.intermediate_size, config.hidden_size
        start = 0 if m[2] == "gate" else F
        return Source((f"{m[1]}.gate_up_proj.weight",), lambda a, s: a[0][start:start + F].reshape(s), ((2 * F, D),))
    return interleaved_to_halves(config, path, shape, metadata)


FAMILY = Family(model_types=("glm4",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS, hf_source=hf_source)
