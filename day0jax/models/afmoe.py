"""AFMoE (Arcee's Trinity): GQA with RMSNorm on each head's q and k, an elementwise sigmoid gate on the attention
output from a projection of its own (`gate_proj`), sliding-window layers with RoPE and full-attention layers
without positions (by default every `global_attn_every_n_layers`-th), four norms per layer (before and after
attention and the MLP), optional muP input scaling, and, after `num_dense_layers` dense layers, MoE layers:
sigmoid scores, experts chosen by score + `expert_bias`, weights renormalized and times `route_scale`, shared
experts beside them.
HF reference: transformers/models/afmoe/modeling_afmoe.py. `hf_source` maps HF's names onto the runtime's sandwich
layer (`pre_mlp_layernorm`, `post_mlp_layernorm`) and router (`router.gate`, the routing bias `expert_bias`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from flax import nnx

from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.attention import OutputGate
from day0jax.layers.decoder import SandwichDecoderLayer
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.moe import Experts, MoE, Router, swiglu
from day0jax.models import llama
from day0jax.models.base import HFConfig, LayerTypes, per_expert_source
from day0jax.models.contract import Family

NORMS = {"pre_feedforward_layernorm": "pre_mlp_layernorm",
         "post_feedforward_layernorm": "post_mlp_layernorm"}  # runtime name -> HF name


@dataclass(frozen=True, eq=False)
class Config(LayerTypes, HFConfig):
    vocab_size: int = 200192
    hidden_size: int = 2048
    intermediate_size: int = 6144
    moe_intermediate_size: int = 1408
    num_hidden_layers: int = 32
    num_dense_layers: int | None = 1
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 16384
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    num_experts: int | None = 64
    num_experts_per_tok: int | None = 6
    num_shared_experts: int | None = 2
    route_scale: float | None = 1.0
    global_attn_every_n_layers: int | None = 4
    sliding_window: int | None = 1024
    layer_types: list | None = None
    mup_enabled: bool | None = False
    attention_bias: bool = False
    model_type: str = "afmoe"

    def __post_init__(self):
        super().__post_init__()
        # HF reads these without a fallback: None fails there, so it is refused here.
        for key in ("head_dim", "num_dense_layers", "num_experts", "num_experts_per_tok", "route_scale"):
            self._refuse_if(key, lambda v: v is None, "must be set (HF's AFMoE has no fallback for None)")
        self._refuse_if("global_attn_every_n_layers", lambda v: self.layer_types is None and not v,
                        "must be a positive int when layer_types is not given")
        # HF always builds the shared experts; with none, its checkpoint holds empty tensors we do not map.
        self._refuse_if("num_shared_experts", lambda v: not v or v < 1,
                        "must be at least 1 (HF's AFMoE always has shared experts)")
        self._check_derived("layer_kinds")
        self._refuse_if("sliding_window", lambda v: v is None and "sliding_attention" in self.layer_kinds,
                        "must be set when a layer is sliding_attention")

    def slides_by_default(self, index: int) -> bool:
        return (index + 1) % self.global_attn_every_n_layers != 0  # every n-th layer is full attention

    def is_sparse(self, index: int) -> bool:
        return index >= self.num_dense_layers


class Model(llama.LlamaLike):
    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        local = c.layer_kinds[index] == "sliding_attention"
        # HF rotates q and k in the sliding ("local") layers only; the full-attention layers have no positions.
        return dict(rope=self.rope if local else None, qkv_bias=c.attention_bias, o_bias=c.attention_bias,
                    qk_norm_eps=c.rms_norm_eps, gate=OutputGate(), sliding_window=c.layer_window(index))

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        if not c.is_sparse(index):
            return super().make_mlp(index, dtype=dtype, rngs=rngs)
        D, F = c.hidden_size, c.moe_intermediate_size
        # One group holding every expert: top-k of the biased sigmoid scores, always renormalized, times route_scale.
        return MoE(Router(D, c.num_experts, c.num_experts_per_tok, routing="sigmoid_grouped", norm_topk_prob=True,
                          n_group=1, topk_group=1, routed_scaling_factor=c.route_scale, dtype=dtype, rngs=rngs),
                   Experts(c.num_experts, D, F, swiglu(c.hidden_act), dtype=dtype, rngs=rngs),
                   router_name="router", shared=GatedMLP(D, F * c.num_shared_experts, c.hidden_act, dtype=dtype,
                                                         rngs=rngs),
                   shared_name="shared_experts")

    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> SandwichDecoderLayer:
        norms = [self.make_norm(self.config.hidden_size, dtype=dtype, rngs=rngs) for _ in range(4)]
        return SandwichDecoderLayer(
            self.make_attention(index, dtype=dtype, rngs=rngs), self.make_mlp(index, dtype=dtype, rngs=rngs),
            input_layernorm=norms[0], post_attention_layernorm=norms[1], pre_feedforward_layernorm=norms[2],
            post_feedforward_layernorm=norms[3])

    def embed(self, tokens):
        x = super().embed(tokens)
        return x * self.config.hidden_size ** 0.5 if self.config.mup_enabled else x  # muP input scaling


def hf_source(config: Config, path: str, shape: tuple, metadata: dict) -> Source | None:
    """The MLP norms, the router's `router.gate` and its bias `mlp.expert_bias`, per-expert weights stacked."""
    if m := re.fullmatch(r"(.*)\.(\w+_layernorm)\.weight", path):
        return default_source(f"{m[1]}.{NORMS.get(m[2], m[2])}.weight", shape, metadata)
    if path.endswith(".mlp.router.kernel"):
        return default_source(path.replace(".router.", ".router.gate."), shape, metadata)
    if path.endswith(".mlp.router.e_score_correction_bias"):
        return default_source(path.replace(".router.e_score_correction_bias", ".expert_bias"), shape, metadata)
    return per_expert_source(path, shape)


FAMILY = Family(model_types=("afmoe",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS, hf_source=hf_source)
