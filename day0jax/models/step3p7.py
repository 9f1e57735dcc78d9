"""Step-3.7 (StepFun), the language model of its vision-language checkpoints (the vision tower and projector are
dropped, with a log line): GQA with per-head (1 + w) q/k norms before a RoPE per layer kind (each over a part of the
head), scores scaled by `query_pre_attn_scalar`, a sigmoid gate per head from a projection of its own (`g_proj`),
sliding layers with a head count of their own; dense SwiGLU MLPs in the first layers, then MoEs (sigmoid scores
chosen with a score bias, renormalized, scaled) beside a shared expert; per-layer clamps of the gate and up
projections after the activation; (1 + w) RMSNorms. HF reference: transformers/models/step3p7/modeling_step3p7.py.

Checkpoints keep StepFun's names: the experts stacked as `moe.gate_proj` / `up_proj` [E, F, D] and `down_proj`
[E, D, F], the router `moe.gate` with its `moe.router_bias`, the shared expert `share_expert` beside `moe`; see
`hf_source`. Multi-token-prediction layers (`model.layers.{L + i}`, speculative method "mtp") are transformers' generic
ones: enorm, hnorm, eh_proj, a decoder layer built as HF's MTP config builds layer i (its kinds from `mtp_layer_types`
and `mtp_mlp_layer_types`, all heads full, layer i's clamps) and `shared_head.norm` as its post-norm, chained after it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from flax import nnx

from day0jax.core.cache_layout import KVLayer
from day0jax.core.errors import UnsupportedArchitecture
from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.attention import Attention, OutputGate
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.mtp import MtpLayer, MtpStack
from day0jax.layers.moe import Experts, MoE, Router, limited_swiglu, swiglu
from day0jax.layers.norms import RMSNorm
from day0jax.layers.rope import rope_parameters
from day0jax.models import llama
from day0jax.models.base import (DecoderLayer, LayerTypes, LocalRope, nextn_dropped, nextn_tensors, stored_mtp_path,
                                 vision_dropped)
from day0jax.models.contract import Family

KINDS = ("full_attention", "sliding_attention")


@dataclass(frozen=True, eq=False)
class Config(LayerTypes, llama.Config):
    # HF's attribute_map: StepFun's names of the same keys.
    ALIASES = {"num_local_experts": "n_routed_experts", "num_attention_groups": "num_key_value_heads",
               "moe_num_experts": "n_routed_experts", "moe_top_k": "num_experts_per_tok",
               "share_expert_dims": "share_expert_dim", "num_mtp_layers": "num_nextn_predict_layers"}
    COMPOSITE = ("step3p7",)
    vocab_size: int = 128815
    hidden_size: int = 4096
    intermediate_size: int = 11264
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 128000
    # HF's model always runs SiLU, whatever this says.
    hidden_act: str = "silu"
    num_experts_per_tok: int = 8
    n_routed_experts: int = 288
    moe_intermediate_size: int = 1280
    share_expert_dim: int = 1280
    sliding_window: int | None = None
    num_sliding_attention_heads: int | None = None
    query_pre_attn_scalar: float | None = None
    moe_router_scaling_factor: float = 1.0
    swiglu_limits: list | None = None
    swiglu_limits_shared: list | None = None
    layer_types: list | None = None
    mlp_layer_types: list | None = None
    # Per layer index, the attention's own `num_attention_heads` (HF derives it from num_sliding_attention_heads).
    per_layer_config: dict | None = None
    gating: bool | str = True
    use_bidirectional_attention: bool = False
    # StepFun's keys HF reads when the current ones are absent (see the properties), and what only MTP reads.
    moe_layers_enum: str | list | None = None
    attention_other_setting: dict | None = None
    partial_rotary_factors: list | None = None
    rope_theta: float | list | None = None
    moe_layer_freq: list | None = None  # HF never reads it: moe_layers_enum (or its default) decides first
    num_nextn_predict_layers: int = 0
    mtp_layer_types: list | None = None
    mtp_mlp_layer_types: list | None = None
    model_type: str = "step3p7"

    def __post_init__(self):
        self._check_heads()
        self._check_derived("layer_kinds", "mlp_kinds", "layer_heads", "rope", "local_rope")
        self._refuse_if("use_bidirectional_attention", bool, "is not implemented (a bidirectional sliding window)")
        self._refuse_if("gating", lambda g: g not in (True, False, "per-head", "per-element"),
                        "is not implemented (True or 'per-head', False or 'per-element')")
        self._refuse_if("mlp_bias", bool, "is not implemented: HF's Step-3.7 experts have no biases")
        for key in ("swiglu_limits", "swiglu_limits_shared"):
            self._refuse_if(key, lambda v: v is not None and len(v) < self.num_hidden_layers,
                            f"has fewer entries than num_hidden_layers={self.num_hidden_layers}")

    def slides_by_default(self, index: int) -> bool:
        return False

    @cached_property
    def mlp_kinds(self) -> tuple[str, ...]:
        """Each layer's MLP: `mlp_layer_types`, else StepFun's `moe_layers_enum` (MoE layer indices, a list or a
        comma-separated string), else MoE from layer 3 on (HF's default).

        Raises:
            UnsupportedArchitecture: too few entries or an unknown kind.
        """
        L = self.num_hidden_layers
        if self.mlp_layer_types is not None:
            kinds = list(self.mlp_layer_types)
        else:
            enum = self.moe_layers_enum
            items = enum.split(",") if isinstance(enum, str) else enum
            moe = {int(i) for i in items if str(i).strip()} if items is not None else set(range(3, L))
            kinds = ["sparse" if i in moe else "dense" for i in range(L)]
        if len(kinds) < L:
            refuse("mlp_layer_types", kinds, f"has {len(kinds)} entries for num_hidden_layers={L}")
        for kind in kinds:
            if kind not in ("dense", "sparse"):
                refuse("mlp_layer_types", kind, "is not implemented (known: dense, sparse)")
        return tuple(kinds[:L])

    @cached_property
    def layer_heads(self) -> tuple[int, ...]:
        """Each layer's query heads: `per_layer_config`'s where it names them, else the sliding layers'
        `num_sliding_attention_heads` (or StepFun's attention_other_setting's) and num_attention_heads elsewhere.

        Raises:
            UnsupportedArchitecture: a per-layer override of anything else, or heads the kv heads do not group.
        """
        other = (self.attention_other_setting or {}).get("num_attention_heads", self.num_attention_heads)
        sliding = other if self.num_sliding_attention_heads is None else self.num_sliding_attention_heads
        if self.per_layer_config is None:
            heads = [sliding if k == "sliding_attention" else self.num_attention_heads for k in self.layer_kinds]
        else:
            overrides = {int(i): entry for i, entry in self.per_layer_config.items()}
            for entry in overrides.values():
                if set(entry) - {"num_attention_heads"}:
                    refuse("per_layer_config", self.per_layer_config, "overrides keys other than num_attention_heads")
            heads = [overrides.get(i, {}).get("num_attention_heads", self.num_attention_heads)
                     for i in range(self.num_hidden_layers)]
        for n in heads:
            if n % self.kv_heads:
                refuse("num_sliding_attention_heads", n, f"is not a multiple of num_key_value_heads={self.kv_heads}")
        return tuple(heads)

    def _mtp_kinds(self, key: str, mtp_key: str, default) -> tuple[str, ...]:
        # HF splits them off the per-layer list's trailing entries; without either it builds defaults only where
        # the per-layer list is absent too (else its MTP config refuses as ambiguous).
        L, n = self.num_hidden_layers, self.num_nextn_predict_layers
        given, listed = getattr(self, mtp_key), getattr(self, key)
        if given is None and listed is not None and len(listed) == L + n:
            given = listed[L:]
        if given is None and listed is None:
            given = default
        if given is None or len(given) != n:
            refuse(mtp_key, given, f"must give num_nextn_predict_layers={n} kinds (or convert with --no-mtp)")
        return tuple(given)

    @cached_property
    def mtp_kinds(self) -> tuple[str, ...]:
        """Each MTP layer's attention kind (only full attention is implemented)."""
        kinds = self._mtp_kinds("layer_types", "mtp_layer_types", ["full_attention"] * self.num_nextn_predict_layers)
        for kind in kinds:
            if kind != "full_attention":
                refuse("mtp_layer_types", kind, "is not implemented for multi-token-prediction layers (known: "
                       "full_attention; convert with --no-mtp to leave them out)")
        return kinds

    @cached_property
    def mtp_mlp_kinds(self) -> tuple[str, ...]:
        """Each MTP layer's MLP: HF's list, or StepFun's `moe_layers_enum` over the layers past the last (its default,
        MoE from layer 3 to the last, makes them dense)."""
        L, n = self.num_hidden_layers, self.num_nextn_predict_layers
        enum = self.moe_layers_enum
        items = enum.split(",") if isinstance(enum, str) else enum
        moe = {int(i) for i in items if str(i).strip()} if items is not None else set(range(3, L))
        kinds = self._mtp_kinds("mlp_layer_types", "mtp_mlp_layer_types",
                                ["sparse" if L + i in moe else "dense" for i in range(n)])
        for kind in kinds:
            if kind not in ("dense", "sparse"):
                refuse("mtp_mlp_layer_types", kind, "is not implemented (known: dense, sparse)")
        return kinds

    def limit(self, key: str, index: int) -> float | None:
        """Layer `index`'s clamp from `swiglu_limits` or `swiglu_limits_shared` (None: no clamp, also for 0)."""
        limits = getattr(self, key)
        return float(limits[index]) if limits and limits[index] else None

    @property
    def softmax_scale(self) -> float:
        return (self.head_size if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar) ** -0.5

    @cached_property
    def rope(self) -> dict:
        """The full-attention layers' RoPE."""
        return self._kind_rope("full_attention")

    @cached_property
    def local_rope(self) -> dict:
        """The sliding layers' RoPE."""
        return self._kind_rope("sliding_attention")

    def _kind_rope(self, kind: str) -> dict:
        # HF: rope_parameters keyed by kind where it gives every kind of the model; else StepFun's rope_theta (one,
        # or one per layer) and partial_rotary_factors, of the kind's first layer, and rope_scaling on the full
        # layers.
        given = self.rope_parameters or {}
        kinds = set(self.layer_kinds)
        if all(isinstance(given.get(k), dict) for k in kinds):
            params = dict(given.get(kind) or given[next(iter(kinds))])
        else:
            first = self.layer_kinds.index(kind) if kind in self.layer_kinds else 0
            theta = self.rope_theta if self.rope_theta is not None else self.DEFAULT_THETA
            params = {"rope_type": "default", "rope_theta": theta[first] if isinstance(theta, list) else theta}
            if self.partial_rotary_factors:
                params["partial_rotary_factor"] = self.partial_rotary_factors[first]
            if kind == "full_attention":
                params.update(self.rope_scaling or {})
        return rope_parameters(params, None, None, max_position_embeddings=self.max_position_embeddings)


class Model(LocalRope, llama.Model):
    def make_norm(self, dim: int, *, dtype, rngs: nnx.Rngs) -> RMSNorm:
        return RMSNorm(dim, self.config.rms_norm_eps, offset=1.0, dtype=dtype, rngs=rngs)

    def make_attention(self, index: int, *, dtype, rngs: nnx.Rngs) -> Attention:
        c = self.config
        return self._attention(c.layer_heads[index], self.layer_rope(index), c.layer_window(index), dtype=dtype,
                               rngs=rngs)

    def _attention(self, heads: int, rope, window: int | None, *, dtype, rngs: nnx.Rngs) -> Attention:
        c = self.config
        per_head = c.gating in (True, "per-head")
        return Attention(hidden_size=c.hidden_size, num_heads=heads, num_kv_heads=c.kv_heads,
                         head_dim=c.head_size, rope=rope, qkv_bias=c.attention_bias,
                         o_bias=c.attention_bias, qk_norm_eps=c.rms_norm_eps, qk_norm_offset=1.0,
                         gate=OutputGate("g_proj", per_head=per_head), sliding_window=window,
                         scale=c.softmax_scale, dtype=dtype, rngs=rngs)

    def make_mtp(self, *, dtype, rngs: nnx.Rngs) -> MtpStack:
        """HF's MTP config builds MTP layer i as layer i with `mtp_layer_types` and `mtp_mlp_layer_types` for its
        kinds, no per-layer head counts (num_attention_heads) and layer i's clamps."""
        c = self.config
        if not c.num_nextn_predict_layers:
            raise UnsupportedArchitecture("this step3p7 config declares no multi-token-prediction layers")
        D, layers = c.hidden_size, []
        for i in range(c.num_nextn_predict_layers):
            block = DecoderLayer(self._attention(c.num_attention_heads, self.rope, None, dtype=dtype, rngs=rngs),
                                 self._mlp(c.mtp_mlp_kinds[i], i, dtype=dtype, rngs=rngs),
                                 self.make_norm(D, dtype=dtype, rngs=rngs), self.make_norm(D, dtype=dtype, rngs=rngs))
            layers.append(MtpLayer(block, self.make_norm, D, post_norm=True, dtype=dtype, rngs=rngs))
        return MtpStack(layers)

    def mtp_cache_layout(self) -> list[KVLayer]:
        c = self.config
        return [KVLayer(c.kv_heads, c.head_size, c.head_size)] * self.mtp_layers

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        return self._mlp(self.config.mlp_kinds[index], index, dtype=dtype, rngs=rngs)

    def _mlp(self, kind: str, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        D, shared_limit = c.hidden_size, c.limit("swiglu_limits_shared", index)
        # HF's dense layers read the shared expert's clamps too.
        if kind == "dense":
            return GatedMLP(D, c.intermediate_size, "silu", limit=shared_limit, dtype=dtype, rngs=rngs)
        limit = c.limit("swiglu_limits", index)
        return MoE(Router(D, c.n_routed_experts, c.num_experts_per_tok, routing="sigmoid_grouped",
                          norm_topk_prob=True, routed_scaling_factor=c.moe_router_scaling_factor, dtype=dtype,
                          rngs=rngs),
                   Experts(c.n_routed_experts, D, c.moe_intermediate_size,
                           swiglu("silu") if limit is None else limited_swiglu("silu", limit), dtype=dtype, rngs=rngs),
                   shared=GatedMLP(D, c.share_expert_dim, "silu", limit=shared_limit, dtype=dtype, rngs=rngs),
                   shared_name="shared_experts")

    def cache_layout(self) -> list[KVLayer]:
        c = self.config
        return [KVLayer(c.kv_heads, c.head_size, c.head_size, window=self.attention_window(i))
                for i in range(c.num_hidden_layers)]


# --- checkpoint layout ---------------------------------------------------------------------------------------

def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict) -> Source | None:
    """StepFun's MoE names: experts stacked [E, out, in] under `moe`, the router's bias `moe.router_bias`, the
    shared expert `share_expert` beside the MoE."""
    L = config.num_hidden_layers
    renamed = stored_mtp_path(path, lambda i: f"model.layers.{L + i}.",
                              {"mtp_block.": "", "post_norm.": "shared_head.norm."})
    if renamed:
        return hf_source(config, renamed, shape, metadata) or default_source(renamed, shape, metadata)
    m = re.fullmatch(r"(model\.layers\.\d+)\.mlp\.(.*)", path)
    index = int(m[1].rsplit(".", 1)[1]) if m else 0
    if not m or (config.mlp_kinds[index] if index < L else config.mtp_mlp_kinds[index - L]) == "dense":
        return None
    layer, name = m.groups()
    experts = re.fullmatch(r"experts\.(gate_proj|up_proj|down_proj)", name)
    if experts:
        E, fan_in, fan_out = shape
        return Source((f"{layer}.moe.{experts[1]}.weight",), lambda a, s: a[0].swapaxes(1, 2).reshape(s),
                      ((E, fan_out, fan_in),))
    if name.startswith("shared_experts."):
        return default_source(path, shape, metadata).renamed(
            lambda n: n.replace(f"{layer}.mlp.shared_experts.", f"{layer}.share_expert.", 1))
    names = {"gate.kernel": "moe.gate.weight", "gate.e_score_correction_bias": "moe.router_bias"}
    return Source((f"{layer}.{names[name]}",), lambda a, s: a[0], (shape,))


def dropped(config: Config) -> dict[str, str]:
    """The vision tower and projector of the multimodal checkpoint; the MTP layers' copies of the embedding and the
    head, and the layers themselves where the model is built without them."""
    out = vision_dropped(config, r"vision_model\..*", r"vit_large_projector\..*")
    return {**out, **nextn_dropped(config, config.num_nextn_predict_layers)}


FAMILY = Family(model_types=("step3p7", "step3p5"), config=Config, model=Model, dropped=llama.ROPE_BUFFERS,
                dropped_for=dropped, hf_source=hf_source,
                mtp=lambda c: nextn_tensors(c, c.num_nextn_predict_layers))
