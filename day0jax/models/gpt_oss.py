"""gpt-oss: attention with learned sinks and biases, alternating sliding/global layers, YaRN RoPE, and an MoE
in every layer (softmax over the top k of biased router logits; experts with biases and a clamped SwiGLU).
HF reference: transformers/models/gpt_oss/modeling_gpt_oss.py. Experts are stored fused and not transposed
(`gate_up_proj` [E, D, 2F], `down_proj` [E, F, D]). OpenAI's MXFP4-packed release (`*_blocks`/`*_scales`, each
expert's [out, in] map) stays MXFP4: gate and up are its gate_up rows taken alternately."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from functools import cached_property

from flax import nnx

from day0jax.core.hf_tensors import Source
from day0jax.layers.moe import Experts, MoE, Router, clamped_swiglu
from day0jax.models import llama
from day0jax.models.base import HFConfig, LayerTypes
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(LayerTypes, HFConfig):
    ALIASES = {"num_experts": "num_local_experts", "experts_per_token": "num_experts_per_tok"}
    DEFAULT_THETA = 150000.0
    num_hidden_layers: int = 36
    num_local_experts: int = 128
    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880
    head_dim: int | None = 64
    num_attention_heads: int = 64
    num_key_value_heads: int | None = 8
    sliding_window: int | None = 128
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"  # HF's experts use the clamped SwiGLU whatever this says
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    layer_types: list | None = None
    attention_bias: bool = True
    initial_context_length: int | None = None  # OpenAI's name for YaRN's original_max_position_embeddings
    model_type: str = "gpt_oss"

    def __post_init__(self):
        self._check_heads()
        self._check_derived("rope", "layer_kinds")

    @cached_property
    def rope(self) -> dict:
        """The normalized RoPE dict; HF's YaRN default when the config gives no RoPE parameters."""
        params = self.rope_parameters if self.rope_parameters or self.rope_scaling else {
            "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 4096}
        return self._rope(params)

    def slides_by_default(self, index: int) -> bool:
        return (index + 1) % 2 != 0  # sliding and full alternate


class Model(llama.LlamaLike):
    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        return dict(rope=self.rope, qkv_bias=c.attention_bias, o_bias=c.attention_bias, sinks=True,
                    sliding_window=c.layer_window(index))

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> MoE:
        c = self.config
        return MoE(Router(c.hidden_size, c.num_local_experts, c.num_experts_per_tok, routing="topk_softmax",
                          use_bias=True, dtype=dtype, rngs=rngs),
                   Experts(c.num_local_experts, c.hidden_size, c.intermediate_size,
                           clamped_swiglu(c.swiglu_alpha, c.swiglu_limit), use_bias=True, dtype=dtype, rngs=rngs),
                   router_name="router")


def hf_source(config: Config, path: str, shape: tuple, metadata: dict) -> Source | None:
    """Splits gate_up_proj (and its bias), gate and up interleaved column by column, into gate_proj and up_proj."""
    m = re.fullmatch(r"(.*\.experts)\.(gate|up)_proj(_bias)?", path)
    if not m:
        return None
    E, F = shape[0], shape[-1]
    offset = 0 if m[2] == "gate" else 1
    if m[3]:
        return Source((f"{m[1]}.gate_up_proj_bias",), lambda a, s: a[0][:, offset::2].reshape(s), ((E, 2 * F),))
    D = shape[1]
    # Quantized, the experts' maps are [E, 2F, D'] (rows are outputs): gate and up are alternate rows.
    rows = lambda w: dataclasses.replace(w, codes=w.codes[:, offset::2], scale=w.scale[:, offset::2])  # noqa: E731
    return Source((f"{m[1]}.gate_up_proj",), lambda a, s: a[0][:, :, offset::2].reshape(s), ((E, D, 2 * F),),
                  quantized=rows)


FAMILY = Family(model_types=("gpt_oss",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS,
                hf_source=hf_source)
