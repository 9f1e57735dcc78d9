"""Kimi Linear: Kimi Delta Attention (the gated delta rule with a decay per key channel, `layers.gated_delta_net`)
in most layers, multi-head latent attention without positions (NoPE: no RoPE anywhere in the model) in the rest, and
DeepSeek-V3's MoE (sigmoid scores routed in groups with a score bias, shared experts) after the first dense layers.
HF reference: transformers/models/kimi_linear/modeling_kimi_linear.py.

Checkpoints keep Moonshot's names, which transformers renames when it loads: the MoE under `block_sparse_moe` with
per-expert w1/w3/w2, one convolution weight per projection (`q_conv1d`...) and the decay's tensors directly under
`self_attn`; see `hf_source`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from flax import nnx

from day0jax.core.cache_layout import KVLayer, StateLayer
from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.gated_delta_net import KimiDeltaAttention
from day0jax.layers.mla import MLAttention
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.moe import Experts, MoE, Router, swiglu
from day0jax.models import deepseek_v3, llama
from day0jax.models.base import DecoderLayer, HFConfig, per_expert_source
from day0jax.models.contract import Family

LAYER_KINDS = ("linear_attention", "full_attention")
MLP_KINDS = ("dense", "sparse")
# What transformers reads of Moonshot's `linear_attn_config` (layers 1-indexed).
LINEAR_ATTN_KEYS = ("head_dim", "num_heads", "short_conv_kernel_size", "kda_layers", "full_attn_layers")


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    # HF's attribute_map: config.json keeps Moonshot's names, transformers' code reads the DeepSeek-style ones.
    ALIASES = {"max_position_embeddings": "model_max_length", "norm_topk_prob": "moe_renormalize",
               "n_group": "num_expert_group", "num_local_experts": "num_experts",
               "num_experts_per_tok": "num_experts_per_token", "n_shared_experts": "num_shared_experts"}
    vocab_size: int = 163840
    hidden_size: int = 2304
    intermediate_size: int = 9216
    moe_intermediate_size: int = 1024
    num_hidden_layers: int = 27
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    num_shared_experts: int = 1
    routed_scaling_factor: float = 2.446
    kv_lora_rank: int = 512
    q_lora_rank: int | None = None
    qk_rope_head_dim: int = 64
    v_head_dim: int | None = 128
    qk_nope_head_dim: int = 128
    num_expert_group: int = 1
    topk_group: int | None = 1
    num_experts_per_token: int | None = 8
    moe_renormalize: bool = True
    hidden_act: str = "silu"
    model_max_length: int = 1048576
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_experts: int = 256
    mlp_layer_types: list | None = None
    layer_types: list | None = None
    linear_head_dim: int = 128
    linear_num_heads: int = 32
    linear_conv_kernel_dim: int = 4
    # Moonshot's keys that HF's config reads: they fill the three above and the layer kinds when those are absent.
    linear_attn_config: dict | None = None
    first_k_dense_replace: int = 1
    # HF writes these to config.json but its model reads neither (head_dim is recomputed as qk_rope_head_dim).
    head_dim: int | None = None
    qk_head_dim: int | None = None
    # Keys of Moonshot's config.json that transformers does not read: the values its math matches are the only ones
    # accepted. HF has no `mla_use_nope` and never rotates, hence the default.
    mla_use_nope: bool = True
    moe_router_activation_func: str = "sigmoid"
    moe_layer_freq: int = 1
    use_grouped_topk: bool = True
    num_nextn_predict_layers: int = 0
    # No layer uses RoPE: only values that describe no scaling are accepted (see `rope`).
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    model_type: str = "kimi_linear"

    def __post_init__(self):
        deepseek_v3.refuse_grouped_kv(self)
        self._activation()
        # The short convolution runs hidden_act too, and only SiLU is implemented there.
        self._refuse_if("hidden_act", lambda a: a != "silu", "is not implemented for linear attention (only silu)")
        for key in ("v_head_dim", "num_experts_per_token", "topk_group"):
            self._refuse_if(key, lambda v: v is None, "must be set (HF's Kimi Linear has no fallback for None)")
        self._refuse_if("num_expert_group", lambda v: not v or self.num_experts % v,
                        f"does not divide num_experts={self.num_experts}")
        self._refuse_if("topk_group", lambda v: not v or v > self.num_expert_group,
                        f"must be in 1..num_expert_group={self.num_expert_group}")
        # Beyond what the chosen groups hold, HF would pick masked-out experts in no defined order.
        kept = self.topk_group * (self.num_experts // self.num_expert_group)
        self._refuse_if("num_experts_per_token", lambda v: v > kept,
                        f"exceeds the {kept} experts of topk_group={self.topk_group} groups")
        self._refuse_if("num_shared_experts", lambda v: v < 1, "must be at least 1 (HF always has shared experts)")
        self._refuse_if("tie_word_embeddings", bool,
                        "is not implemented: HF's Kimi Linear keeps its own lm_head.weight whatever this says")
        self._refuse_if("mla_use_nope", lambda v: not v,
                        "is not implemented: transformers' Kimi Linear never rotates the MLA layers' q and k")
        self._refuse_if("moe_router_activation_func", lambda v: v != "sigmoid", "is not implemented (only 'sigmoid')")
        self._refuse_if("moe_layer_freq", lambda v: v != 1, "is not implemented (only 1)")
        self._refuse_if("use_grouped_topk", lambda v: not v, "is not implemented (transformers routes in groups)")
        unknown = sorted(set(self.linear_attn_config or ()) - set(LINEAR_ATTN_KEYS))
        if unknown:
            refuse("linear_attn_config", self.linear_attn_config, f"has key(s) {unknown} that are not implemented")
        self._check_derived("rope", "layer_kinds", "mlp_kinds")

    @property
    def max_position_embeddings(self) -> int:
        return self.model_max_length

    @property
    def head_size(self) -> int:
        """HF's `head_dim`: qk_rope_head_dim (no RoPE reads it here; the engine's reports do)."""
        return self.qk_rope_head_dim

    qk_head_size = deepseek_v3.Config.qk_head_size

    @property
    def softmax_scale(self) -> float:
        """qk_head_size ** -0.5 (no RoPE, so no YaRN mscale)."""
        return self.qk_head_size ** -0.5

    @cached_property
    def rope(self) -> dict:
        """The normalized RoPE dict, which must describe plain RoPE: no layer rotates, so a scaling would be ignored
        by transformers where other implementations may apply it to the softmax.

        Raises:
            UnsupportedArchitecture: a rope_type other than 'default'.
        """
        rope = self._rope()
        if rope["rope_type"] != "default":
            key = "rope_parameters" if self.rope_parameters is not None else "rope_scaling"
            refuse(f"{key}.rope_type", rope["rope_type"], "is not implemented for kimi_linear, whose layers have no "
                   "RoPE (only 'default')")
        return rope

    def _linear_attn(self, key: str, default):
        return (self.linear_attn_config or {}).get(key, default)

    @property
    def kda_shape(self) -> tuple[int, int, int]:
        """(heads, head dim, convolution width) of the linear-attention layers: `linear_attn_config`'s, else
        linear_num_heads, linear_head_dim and linear_conv_kernel_dim (HF's precedence)."""
        return (self._linear_attn("num_heads", self.linear_num_heads),
                self._linear_attn("head_dim", self.linear_head_dim),
                self._linear_attn("short_conv_kernel_size", self.linear_conv_kernel_dim))

    @cached_property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's kind: `layer_types`, else `linear_attn_config`'s 1-indexed kda_layers and full_attn_layers,
        else HF's default (full attention at layers 4, 8, ...; 0-indexed).

        Raises:
            UnsupportedArchitecture: too few entries, an unknown kind, a layer in neither list or out of range.
        """
        L = self.num_hidden_layers
        lists = self.linear_attn_config or {}
        if self.layer_types is not None:
            kinds = list(self.layer_types)
        elif "full_attn_layers" in lists and "kda_layers" in lists:
            kinds = [None] * L
            for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
                for n in lists[key]:
                    if not 1 <= n <= L:
                        refuse(f"linear_attn_config.{key}", lists[key], f"names layer {n}, not in 1..{L}")
                    kinds[n - 1] = kind
        else:
            kinds = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(L)]
        if len(kinds) < L:
            refuse("layer_types", kinds, f"has {len(kinds)} entries for num_hidden_layers={L}")
        for i, kind in enumerate(kinds[:L]):
            if kind is None:
                refuse("linear_attn_config", lists, f"puts layer {i + 1} in neither kda_layers nor full_attn_layers")
            if kind not in LAYER_KINDS:
                refuse("layer_types", kind, f"is not implemented (known: {', '.join(LAYER_KINDS)})")
        return tuple(kinds[:L])

    @cached_property
    def mlp_kinds(self) -> tuple[str, ...]:
        """Each layer's MLP: `mlp_layer_types`, else dense for the first `first_k_dense_replace` layers, MoE after.

        Raises:
            UnsupportedArchitecture: too few entries or an unknown kind.
        """
        L = self.num_hidden_layers
        kinds = list(self.mlp_layer_types or ["dense" if i < self.first_k_dense_replace else "sparse"
                                              for i in range(L)])
        if len(kinds) < L:
            refuse("mlp_layer_types", kinds, f"has {len(kinds)} entries for num_hidden_layers={L}")
        for kind in kinds:
            if kind not in MLP_KINDS:
                refuse("mlp_layer_types", kind, f"is not implemented (known: {', '.join(MLP_KINDS)})")
        return tuple(kinds[:L])


class Model(llama.LlamaLike):
    def make_rope(self) -> None:
        return None

    def make_ropes(self) -> list:
        return []

    def make_attention(self, index: int, *, dtype, rngs: nnx.Rngs) -> MLAttention:
        c = self.config
        # eps: HF builds q_a_layernorm and kv_a_layernorm with RMSNorm's default 1e-6, not rms_norm_eps.
        return MLAttention(hidden_size=c.hidden_size, num_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank,
                           kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                           qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, rope=None,
                           rope_interleave=False, scale=c.softmax_scale, eps=1e-6, use_bias=c.attention_bias,
                           dtype=dtype, rngs=rngs)

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        D = c.hidden_size
        if c.mlp_kinds[index] == "dense":
            return super().make_mlp(index, dtype=dtype, rngs=rngs)
        return MoE(Router(D, c.num_experts, c.num_experts_per_token, routing="sigmoid_grouped",
                          norm_topk_prob=c.moe_renormalize, n_group=c.num_expert_group, topk_group=c.topk_group,
                          routed_scaling_factor=c.routed_scaling_factor, dtype=dtype, rngs=rngs),
                   Experts(c.num_experts, D, c.moe_intermediate_size, swiglu(c.hidden_act), dtype=dtype, rngs=rngs),
                   shared=GatedMLP(D, c.moe_intermediate_size * c.num_shared_experts, c.hidden_act, dtype=dtype,
                                   rngs=rngs),
                   shared_name="shared_experts")

    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> DecoderLayer:
        c = self.config
        if c.layer_kinds[index] == "full_attention":
            return super().make_layer(index, dtype=dtype, rngs=rngs)
        N, H, W = c.kda_shape
        D = c.hidden_size
        kda = KimiDeltaAttention(hidden_size=D, num_heads=N, head_dim=H, conv_kernel=W, eps=c.rms_norm_eps,
                                 dtype=dtype, rngs=rngs)
        return DecoderLayer(kda, self.make_mlp(index, dtype=dtype, rngs=rngs),
                            self.make_norm(D, dtype=dtype, rngs=rngs), self.make_norm(D, dtype=dtype, rngs=rngs))

    def cache_layout(self) -> list[KVLayer | StateLayer]:
        # MLA layers cache one shared "head", [normed latent ; unrotated key part], also the value (layers/mla.py).
        c = self.config
        d = c.kv_lora_rank + c.qk_rope_head_dim
        return [layer.mixer.state_layout() if kind == "linear_attention" else KVLayer(1, d, d)
                for kind, layer in zip(c.layer_kinds, self.model.layers)]


# --- checkpoint layout ---------------------------------------------------------------------------------------

EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def reshaped(name: str, hf_shape: tuple[int, ...]) -> Source:
    return Source((name,), lambda arrays, shape: arrays[0].reshape(shape), (hf_shape,))


def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict) -> Source | None:
    """Moonshot's tensor names and layouts where they differ from the runtime's.

    MoE layers live under `block_sparse_moe`, their experts as w1 (gate), w3 (up), w2 (down). Dense MLPs are `mlp`
    in Moonshot's checkpoints but also `block_sparse_moe` in those transformers saves (its renaming back to
    Moonshot's names catches them too), recognized by the `mlp_layer_types` only transformers writes. The linear
    attention's convolutions are [N * H, 1, W] per projection, `A_log` [1, 1, N, 1], `dt_bias` [N * H].
    """
    m = re.fullmatch(r"(model\.layers\.(\d+))\.(mlp|self_attn)\.(.*)", path)
    if not m:
        return None
    prefix, index, block, name = m[1], int(m[2]), m[3], m[4]
    if block == "mlp":
        if config.mlp_kinds[index] == "dense" and config.mlp_layer_types is None:
            return None
        src = per_expert_source(path, shape, names=EXPERT_NAMES) or default_source(path, shape, metadata)
        return src.renamed(lambda n: n.replace(f"{prefix}.mlp.", f"{prefix}.block_sparse_moe.", 1))
    N, H, W = config.kda_shape
    if name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        return reshaped(f"{path}.weight", (N * H, 1, W))
    if name == "A_log":
        return reshaped(path, (1, 1, N, 1))
    if name == "dt_bias":
        return reshaped(path, (N * H,))
    return None


FAMILY = Family(model_types=("kimi_linear",), config=Config, model=Model, dropped={},
                dropped_for=deepseek_v3.dropped, hf_source=hf_source)
