"""HY-V3 (Tencent Hunyuan 3, Hy3-preview): GQA with q/k/v/o biases per `attention_bias` and RMSNorm on each head's
q and k before RoPE, dense or MoE MLPs per layer (`mlp_layer_types`; by default the first layer dense), the MoE a
sigmoid router choosing experts by score + `e_score_correction_bias`, weighing them by the plain scores renormalized
(HF adds 1e-20 to their sum) and times `router_scaling_factor`, beside `num_shared_experts` shared experts as one
MLP every token goes through. The dense MLP and the shared experts carry biases per `mlp_bias`, the routed experts
never. HF reference: transformers/models/hy_v3/modeling_hy_v3.py.

save_pretrained keeps one Linear per expert, the router as `mlp.router.gate`, the routing bias as `mlp.expert_bias`
and the shared experts as `mlp.shared_mlp` (the layout of Tencent's transformers 4 release, which transformers renames
when it loads it); checkpoints in the transformers 5 layout use HF's module names and fused experts. `hf_source`
reads both."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import cached_property

from flax import nnx

from day0jax.core.cache_layout import KVLayer
from day0jax.core.errors import UnsupportedArchitecture
from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.moe import Experts, MoE, Router, swiglu
from day0jax.layers.mtp import MtpLayer, MtpStack
from day0jax.models import llama
from day0jax.models.base import (HFConfig, fused_experts_source, nextn_dropped, nextn_tensors, per_expert_source,
                                 stored_mtp_path)
from day0jax.models.contract import Family

MLP_KINDS = ("dense", "sparse")


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    ALIASES = {"num_local_experts": "num_experts"}  # HF's attribute_map
    DEFAULT_THETA = 11_158_840.0
    vocab_size: int = 120832
    hidden_size: int = 4096
    intermediate_size: int = 13312
    num_hidden_layers: int = 80
    num_attention_heads: int = 64
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    num_experts: int | None = 192
    num_experts_per_tok: int | None = 8
    num_shared_experts: int | None = 1
    moe_intermediate_size: int = 1536
    router_scaling_factor: float = 2.826
    # HF adds the routed and the shared outputs in float32 (True) or in the model's dtype. Both are values of the
    # model's dtype: their float32 sum, rounded to it, is their sum in it (the flag changes no value).
    enable_moe_fp32_combine: bool = True
    mlp_layer_types: list | None = None
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    # Keys of Tencent's own config.json that HF's model does not read: it always routes by sigmoid scores with the
    # bias, renormalizes, norms q and k, and builds its MLPs from mlp_layer_types and moe_intermediate_size, so
    # values saying otherwise are refused.
    moe_router_use_sigmoid: bool = True
    moe_router_enable_expert_bias: bool = True
    route_norm: bool = True
    qk_norm: bool = True
    first_k_dense_replace: int | None = None
    expert_hidden_dim: int | None = None
    num_nextn_predict_layers: int = 0  # multi-token-prediction layers after the last one (HF skips them)
    enable_attention_fp32_softmax: bool = False  # attention scores and softmax are float32 here in any case
    enable_lm_head_fp32: bool = False  # a precision hint HF's model ignores; the logits come out float32 here
    use_grouped_mm: bool = True  # how Tencent's code runs the experts, not what they compute
    eod_token_id: int | None = None
    model_type: str = "hy_v3"

    def __post_init__(self):
        super().__post_init__()
        self._check_derived("mlp_kinds")
        if "sparse" in self.mlp_kinds:
            self._refuse_if("num_experts", lambda v: not isinstance(v, int) or v < 1, "must be at least 1")
            E = self.num_experts
            self._refuse_if("num_experts_per_tok", lambda v: not isinstance(v, int) or not 1 <= v <= E,
                            f"must be in 1..num_experts={E}")
            # HF always builds the shared experts; with none, its checkpoint holds empty tensors we do not map.
            self._refuse_if("num_shared_experts", lambda v: not isinstance(v, int) or v < 1,
                            "must be at least 1 (HF always has shared experts)")
        for key in ("moe_router_use_sigmoid", "moe_router_enable_expert_bias", "route_norm", "qk_norm"):
            self._refuse_if(key, lambda v: not v, "is not implemented (transformers' HY-V3 always does it)")
        k = self.first_k_dense_replace
        if k is not None and self.mlp_kinds != ("dense",) * k + ("sparse",) * (self.num_hidden_layers - k):
            refuse("first_k_dense_replace", k, f"disagrees with the MLP kinds transformers builds: {self.mlp_kinds}")
        self._refuse_if("expert_hidden_dim", lambda v: v is not None and v != self.moe_intermediate_size,
                        f"differs from moe_intermediate_size={self.moe_intermediate_size}, the experts' width in "
                        "transformers' model")

    @cached_property
    def rope(self) -> dict:
        """The normalized RoPE dict. HF's RoPE rotates every dim of each head whatever the dict says, and a
        partial frequency table would not broadcast over the whole head: a partial rotary factor is refused."""
        r = self._rope()
        if r.get("partial_rotary_factor", 1.0) != 1.0:
            refuse("rope_parameters.partial_rotary_factor", r["partial_rotary_factor"],
                   "is not implemented (HF's HY-V3 rotates whole heads)")
        return r

    @cached_property
    def mlp_kinds(self) -> tuple[str, ...]:
        """Each layer's MLP, "dense" or "sparse": `mlp_layer_types`, or HF's default (the first layer dense).

        Raises:
            UnsupportedArchitecture: too few entries, or a kind other than dense and sparse.
        """
        L = self.num_hidden_layers
        kinds = self.mlp_layer_types
        if kinds is None:
            kinds = ["dense"] * min(L, 1) + ["sparse"] * max(L - 1, 0)
        if len(kinds) < L:
            refuse("mlp_layer_types", kinds, f"has {len(kinds)} entries for num_hidden_layers={L}")
        for kind in kinds[:L]:
            if kind not in MLP_KINDS:
                refuse("mlp_layer_types", kind, f"is not implemented (known: {', '.join(MLP_KINDS)})")
        return tuple(kinds[:L])


class Model(llama.LlamaLike):
    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        return dict(rope=self.rope, qkv_bias=c.attention_bias, o_bias=c.attention_bias, qk_norm_eps=c.rms_norm_eps)

    def mlp_kwargs(self, index: int) -> dict:
        return dict(use_bias=self.config.mlp_bias)

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        if index < c.num_hidden_layers and c.mlp_kinds[index] == "dense":  # MTP layers' are MoE (`make_mtp`)
            return super().make_mlp(index, dtype=dtype, rngs=rngs)
        D, E, F = c.hidden_size, c.num_experts, c.moe_intermediate_size
        # HF keeps the router weight in float32; Router scores in float32 whatever the weight's dtype.
        router = Router(D, E, c.num_experts_per_tok, routing="scored_topk", score_fn="sigmoid", norm_topk_prob=True,
                        routed_scaling_factor=c.router_scaling_factor, dtype=dtype, rngs=rngs)
        return MoE(router, Experts(E, D, F, swiglu(c.hidden_act), dtype=dtype, rngs=rngs),
                   shared=GatedMLP(D, F * c.num_shared_experts, c.hidden_act, use_bias=c.mlp_bias, dtype=dtype,
                                   rngs=rngs),
                   shared_name="shared_experts")

    def make_mtp(self, *, dtype, rngs: nnx.Rngs) -> MtpStack:
        """The multi-token-prediction layers Tencent's checkpoints store after the last layer, as vLLM's HY-V3 MTP
        runs them (transformers skips them): enorm, hnorm, eh_proj, a decoder layer with an MoE (the layer index is
        past `first_k_dense_replace`) and its own `final_layernorm`, whose output the shared head reads and the next
        step takes."""
        c = self.config
        if not c.num_nextn_predict_layers:
            raise UnsupportedArchitecture("this hy_v3 config declares no multi-token-prediction layers")
        if "sparse" not in c.mlp_kinds:
            refuse("num_nextn_predict_layers", c.num_nextn_predict_layers,
                   "declares MTP layers, whose MLP is an MoE, for a config without experts")
        L, D = c.num_hidden_layers, c.hidden_size
        return MtpStack([MtpLayer(self.make_layer(L + i, dtype=dtype, rngs=rngs), self.make_norm, D, post_norm=True,
                                  dtype=dtype, rngs=rngs) for i in range(c.num_nextn_predict_layers)])

    def mtp_cache_layout(self) -> list[KVLayer]:
        c = self.config
        return [KVLayer(c.kv_heads, c.head_size, c.head_size)] * self.mtp_layers


# Runtime parameter -> its tensor in save_pretrained's layout (Tencent's transformers 4 release), and in the
# transformers 5 layout (HF's module names, the routing bias beside the router).
SAVED_NAMES = ((r"(.*\.mlp)\.gate\.kernel", r"\1.router.gate.kernel", r"\1.gate.kernel"),
               (r"(.*\.mlp)\.gate\.e_score_correction_bias", r"\1.expert_bias", r"\1.e_score_correction_bias"),
               (r"(.*\.mlp)\.shared_experts\.(.*)", r"\1.shared_mlp.\2", r"\1.shared_experts.\2"))


def hf_source(config: Config, path: str, shape: tuple, metadata: dict) -> Source | None:
    """The router, its routing bias and the shared experts under save_pretrained's names, the experts one Linear
    each; or, where the checkpoint has those instead, the transformers 5 names and the experts fused
    (`experts.gate_up_proj`, `experts.down_proj`). MTP layer i's as `model.layers.{L + i}.`: its decoder layer's
    tensors beside enorm, hnorm, eh_proj and final_layernorm."""
    renamed = stored_mtp_path(path, lambda i: f"model.layers.{config.num_hidden_layers + i}.",
                              {"mtp_block.": "", "post_norm.": "final_layernorm."})
    if renamed:
        return hf_source(config, renamed, shape, metadata) or default_source(renamed, shape, metadata)
    for pattern, saved, fused_layout in SAVED_NAMES:
        if re.fullmatch(pattern, path):
            return replace(default_source(re.sub(pattern, saved, path), shape, metadata),
                           alternative=default_source(re.sub(pattern, fused_layout, path), shape, metadata))
    per_expert = per_expert_source(path, shape)
    return per_expert and replace(per_expert, alternative=fused_experts_source(path, shape))


def dropped(config: Config) -> dict[str, str]:
    """The MTP layers' copies of the embedding and the head, and the layers themselves where the model is built
    without them."""
    return nextn_dropped(config, config.num_nextn_predict_layers)


FAMILY = Family(model_types=("hy_v3",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS, dropped_for=dropped,
                hf_source=hf_source, mtp=lambda c: nextn_tensors(c, c.num_nextn_predict_layers))
