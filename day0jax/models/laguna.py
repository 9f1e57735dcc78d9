"""Laguna (Poolside): GQA with RMSNorm on each head's q and k, a query-head count of its own per layer
(`num_attention_heads_per_layer`; the kv heads are shared by all layers), sliding and full-attention layers each with
a RoPE of its own (`rope_parameters` keyed by layer type; by default the full layers rotate half of each head), the
attention output times softplus of a projection of the layer's input (`g_proj`: one gate per head or per element,
`gating`), and dense or MoE MLPs per layer (`mlp_layer_types`): sigmoid scores of optionally soft-capped logits,
experts chosen by score + `e_score_correction_bias`, weights renormalized and times `moe_routed_scaling_factor`, a
shared expert beside them.
HF reference: transformers/models/laguna/modeling_laguna.py. Checkpoints (and save_pretrained) keep one tensor per
expert, the routing bias under `mlp.experts.` and the shared expert as `mlp.shared_expert`; `hf_source` reads them."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from flax import nnx

from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.attention import Attention, OutputGate
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.moe import Experts, MoE, Router, swiglu
from day0jax.layers.rope import Rope, rope_parameters
from day0jax.models import llama
from day0jax.models.base import HFConfig, LayerTypes, per_expert_source
from day0jax.models.contract import Family

# HF's defaults when config.json gives no rope_parameters.
DEFAULT_ROPES = {"full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}
# `gating` -> whether the gate is per head. HF reads every other value (False too) as per element: refused rather
# than guessed.
GATINGS = {True: True, "per-head": True, "per-element": False}
# Poolside's per-layer spelling of the same two forms (`gating_types`).
GATING_TYPES = {"per_head": True, "per-head": True, "per_element": False, "per-element": False}
MLP_KINDS = ("dense", "sparse")


@dataclass(frozen=True, eq=False)
class Config(LayerTypes, HFConfig):
    vocab_size: int = 100352
    hidden_size: int = 2048
    intermediate_size: int = 8192
    num_hidden_layers: int = 40
    num_attention_heads: int = 48
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    sliding_window: int | None = 512
    layer_types: list | None = None
    attention_bias: bool = False
    gating: bool | str = True
    num_attention_heads_per_layer: list | None = None
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts: int = 256
    num_experts_per_tok: int = 8
    mlp_layer_types: list | None = None
    moe_routed_scaling_factor: float = 1.0
    moe_apply_router_weight_on_input: bool = False
    moe_router_logit_softcapping: float | None = 0.0
    # Keys Poolside's checkpoints carry beside HF's, read by its own modeling code and not by transformers: taken only
    # at values that describe the model transformers builds.
    norm_topk_prob: bool = True
    mlp_only_layers: list | None = None
    decoder_sparse_step: int | None = None
    gating_types: list | None = None
    swa_attention_sink_enabled: bool = False
    model_type: str = "laguna"

    def __post_init__(self):
        super().__post_init__()
        self._refuse_if("head_dim", lambda v: v is None, "must be set (HF's Laguna has no fallback for None)")
        self._check_derived("layer_kinds", "mlp_kinds", "gate_per_head", "ropes")
        self._refuse_if("sliding_window", lambda v: not v and "sliding_attention" in self.layer_kinds,
                        "must be set when a layer is sliding_attention")
        # transformers raises NotImplementedError for it: no reference to check the math against.
        self._refuse_if("moe_apply_router_weight_on_input", bool, "is not implemented (nor by transformers)")
        if "sparse" in self.mlp_kinds:
            # The router's single group of experts ranks by the sum of its two best scores: two experts at least.
            self._refuse_if("num_experts", lambda v: v < 2, "is not implemented (at least 2 experts)")
            self._refuse_if("num_experts_per_tok", lambda v: not 1 <= v <= self.num_experts,
                            f"must be between 1 and num_experts={self.num_experts}")
            # HF always builds the shared expert; without one the checkpoint holds empty tensors we do not map.
            self._refuse_if("shared_expert_intermediate_size", lambda v: v < 1, "must be at least 1")
        self._refuse_if("norm_topk_prob", lambda v: not v, "is not implemented (HF always renormalizes the top k)")
        self._refuse_if("swa_attention_sink_enabled", bool, "(attention sinks) is not implemented, nor read by HF")
        if self.mlp_only_layers is not None or self.decoder_sparse_step is not None:
            step, dense = self.decoder_sparse_step or 1, set(self.mlp_only_layers or ())
            implied = tuple("dense" if i in dense or (i + 1) % step else "sparse"
                            for i in range(self.num_hidden_layers))
            if implied != self.mlp_kinds:
                key = "mlp_only_layers" if self.mlp_only_layers is not None else "decoder_sparse_step"
                refuse(key, getattr(self, key), f"makes other layers dense than mlp_layer_types={list(self.mlp_kinds)}"
                       " (which transformers follows)")
        if self.gating_types is not None and [GATING_TYPES.get(t) for t in self.gating_types] != \
                [self.gate_per_head] * self.num_hidden_layers:
            refuse("gating_types", self.gating_types, f"differs from gating={self.gating!r} (which transformers "
                   "follows in every layer)")

    def slides_by_default(self, index: int) -> bool:
        return False  # HF's default: every layer full attention

    def _check_heads(self) -> None:
        for n in self.heads_per_layer:
            if n % self.kv_heads:
                refuse("num_key_value_heads", self.kv_heads, f"does not divide a layer's {n} attention heads")

    @cached_property
    def layer_kinds(self) -> tuple[str, ...]:
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            refuse("layer_types", self.layer_types, f"has {len(self.layer_types)} entries for num_hidden_layers="
                   f"{self.num_hidden_layers}")
        return super().layer_kinds

    @cached_property
    def heads_per_layer(self) -> tuple[int, ...]:
        """Each layer's query heads N: `num_attention_heads_per_layer`, or `num_attention_heads` everywhere."""
        L = self.num_hidden_layers
        heads = self.num_attention_heads_per_layer
        if heads is None:
            return (self.num_attention_heads,) * L
        if len(heads) != L or not all(isinstance(n, int) and n > 0 for n in heads):
            refuse("num_attention_heads_per_layer", heads, f"must be {L} positive ints (num_hidden_layers)")
        return tuple(heads)

    @cached_property
    def mlp_kinds(self) -> tuple[str, ...]:
        """Each layer's MLP, "dense" or "sparse": `mlp_layer_types`, or HF's default (the first layer dense)."""
        L = self.num_hidden_layers
        kinds = self.mlp_layer_types or ["dense"] + ["sparse"] * (L - 1)
        if len(kinds) != L:
            refuse("mlp_layer_types", kinds, f"has {len(kinds)} entries for num_hidden_layers={L}")
        for kind in kinds:
            if kind not in MLP_KINDS:
                refuse("mlp_layer_types", kind, f"is not implemented (known: {', '.join(MLP_KINDS)})")
        return tuple(kinds)

    @cached_property
    def gate_per_head(self) -> bool:
        if not isinstance(self.gating, (bool, str)) or self.gating not in GATINGS:
            refuse("gating", self.gating, "is not implemented (known: true, 'per-head', 'per-element')")
        return GATINGS[self.gating]

    @cached_property
    def ropes(self) -> dict[str, dict]:
        """The normalized RoPE dict of each layer kind present."""
        given = self.rope_parameters or DEFAULT_ROPES
        out = {}
        for kind in sorted(set(self.layer_kinds)):
            if not isinstance(given.get(kind), dict):
                refuse("rope_parameters", given, f"has no entry for {kind!r} (HF reads one per layer type)")
            out[kind] = rope_parameters(given[kind], None, None, max_position_embeddings=self.max_position_embeddings)
        return out

    @cached_property
    def rope(self) -> dict:
        """The full-attention layers' RoPE (the sliding layers' if there are none): the context length's."""
        return self.ropes.get("full_attention") or self.ropes["sliding_attention"]


class Model(llama.LlamaLike):
    def make_rope(self) -> None:
        return None  # no model-wide RoPE: one per layer kind

    def make_ropes(self) -> list[Rope]:
        c = self.config
        self.rope_of = {kind: Rope(params, c.head_size, c.max_position_embeddings) for kind, params in c.ropes.items()}
        return list(self.rope_of.values())

    def make_attention(self, index: int, *, dtype, rngs: nnx.Rngs) -> Attention:
        c = self.config
        return Attention(hidden_size=c.hidden_size, num_heads=c.heads_per_layer[index], num_kv_heads=c.kv_heads,
                         head_dim=c.head_size, rope=self.rope_of[c.layer_kinds[index]], qkv_bias=c.attention_bias,
                         o_bias=c.attention_bias, qk_norm_eps=c.rms_norm_eps,
                         gate=OutputGate(name="g_proj", per_head=c.gate_per_head, fn="softplus"),
                         sliding_window=c.layer_window(index), dtype=dtype, rngs=rngs)

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        if c.mlp_kinds[index] == "dense":
            return super().make_mlp(index, dtype=dtype, rngs=rngs)
        D, cap = c.hidden_size, c.moe_router_logit_softcapping
        # One group holding every expert: top-k of the biased sigmoid scores, renormalized, times the routed scale.
        router = Router(D, c.num_experts, c.num_experts_per_tok, routing="sigmoid_grouped", norm_topk_prob=True,
                        n_group=1, topk_group=1, routed_scaling_factor=c.moe_routed_scaling_factor,
                        logit_softcap=cap if cap and cap > 0 else None, dtype=dtype, rngs=rngs)
        # The checkpoint's name for the shared MLP (HF's module is `shared_experts`, renamed when it loads).
        return MoE(router, Experts(c.num_experts, D, c.moe_intermediate_size, swiglu(c.hidden_act), dtype=dtype,
                                   rngs=rngs),
                   shared=GatedMLP(D, c.shared_expert_intermediate_size, c.hidden_act, dtype=dtype, rngs=rngs),
                   shared_name="shared_expert")


def hf_source(config: Config, path: str, shape: tuple, metadata: dict) -> Source | None:
    """The routing bias, saved under `mlp.experts.`; per-expert weights stacked."""
    if path.endswith(".mlp.gate.e_score_correction_bias"):
        return default_source(path.replace(".gate.", ".experts."), shape, metadata)
    return per_expert_source(path, shape)


FAMILY = Family(model_types=("laguna",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS, hf_source=hf_source)
