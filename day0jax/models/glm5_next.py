"""GLM-5-Next's language model (`glm5_next_text`, or read from the multimodal `glm5_next` checkpoint, whose vision
tower is dropped): n residual streams joined by manifold-constrained hyper-connections (`layers/hyper.py`, the "mhc"
form, collapsed by their plain mean before the final norm); "linear_attention" layers of Kimi Delta Attention with
the bounded forget gate (`layers/gated_delta_net.py`, `linear_lower_bound`; one short convolution over [q; k; v]);
"indexed_attention" layers of NoPE MLA over the key blocks a pooled indexer keeps (`layers/block_sparse_attention.py`:
the best `index_topk / index_kpool` complete blocks of `index_kpool` keys plus the query's incomplete block), an
indexer "shared" layer reusing the blocks of the layer before it; dense or MoE MLPs (`mlp_layer_types`; DeepSeek-V3's
grouped sigmoid routing with the score bias, shared experts), every SwiGLU clamped before the activation.
HF reference: transformers/models/glm5_next/modeling_glm5_next.py (Glm5NextTextModel)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from flax import nnx

from day0jax.core.cache_layout import KVLayer, StateLayer
from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.block_sparse_attention import PooledIndexer, PooledSparseMLAttention
from day0jax.layers.gated_delta_net import KimiDeltaAttention
from day0jax.layers.hyper import HyperConnected, HyperDecoderLayer
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.moe import Experts, MoE, Router, clipped_swiglu
from day0jax.models.base import CausalLM, HFConfig, in_language_model, per_expert_source, vision_dropped
from day0jax.models.contract import Family

LINEAR, INDEXED = "linear_attention", "indexed_attention"
# What HF's config reads of the original `linear_attn_config` (its values win over the linear_* keys).
LINEAR_ATTN_KEYS = ("head_dim", "num_heads", "short_conv_kernel_size", "gate_lower_bound", "safe_gate")


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    ALIASES = {"num_local_experts": "n_routed_experts"}
    COMPOSITE = ("glm5_next",)
    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    num_key_value_heads: int | None = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 288
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 0
    v_head_dim: int = 256
    qk_nope_head_dim: int = 256
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    mlp_layer_types: list | None = None
    attention_bias: bool = False
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    # HF overwrites these two with qk_rope_head_dim and qk_rope_head_dim + qk_nope_head_dim whatever they say.
    head_dim: int | None = 0
    qk_head_dim: int | None = None
    layer_types: list | None = None
    indexer_types: list | None = None
    # Read by HF's config only when indexer_types is absent.
    index_topk_pattern: str | list | None = None
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 2
    swiglu_limit: float = 10.0
    linear_head_dim: int = 128
    linear_num_heads: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    linear_attn_config: dict | None = None
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    # No layer rotates: only values that describe no scaling are accepted.
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    model_type: str = "glm5_next_text"

    def __post_init__(self):
        self._activation()
        # The short convolution and the routed experts run SiLU whatever hidden_act says (HF's code).
        self._refuse_if("hidden_act", lambda a: a != "silu", "is not implemented (only silu)")
        if self.kv_heads != self.num_attention_heads:
            refuse("num_key_value_heads", self.kv_heads, f"differs from num_attention_heads="
                   f"{self.num_attention_heads} (HF requires them equal)")
        self._refuse_if("q_lora_rank", lambda r: r is None, "must be set (HF's indexer reads the low-rank query)")
        self._refuse_if("qk_rope_head_dim", lambda p: p != 0, "is not implemented: GLM-5-Next's MLA layers are NoPE "
                        "(HF requires 0)")
        self._refuse_if("index_kpool", lambda k: k < 1, "must be at least 1")
        self._refuse_if("index_topk", lambda k: k < self.index_kpool or k % self.index_kpool,
                        f"must be a positive multiple of index_kpool={self.index_kpool}")
        # Without the tail a query sees no key of its own block and, early on, none at all: HF's softmax then
        # spreads over every position, future ones included.
        self._refuse_if("index_kpool_always_select_tail", lambda v: not v, "is not implemented (only true)")
        self._refuse_if("n_shared_experts", lambda n: n < 1, "is not implemented: HF always builds shared experts")
        self._refuse_if("n_group", lambda g: g < 1 or self.n_routed_experts % g,
                        f"does not divide n_routed_experts={self.n_routed_experts}")
        self._refuse_if("topk_group", lambda g: g < 1 or g > self.n_group, f"must be in 1..n_group={self.n_group}")
        # Beyond what the chosen groups hold, HF would pick masked-out experts in no defined order.
        kept = self.topk_group * (self.n_routed_experts // self.n_group)
        self._refuse_if("num_experts_per_tok", lambda k: k > kept,
                        f"exceeds the {kept} experts of topk_group={self.topk_group} groups")
        self._refuse_if("hc_mult", lambda n: n < 1, "must be at least 1")
        self._refuse_if("hc_sinkhorn_iters", lambda n: n < 1, "must be at least 1")
        self._refuse_if("swiglu_limit", lambda v: v <= 0, "must be positive (HF clamps at it)")
        unknown = sorted(set(self.linear_attn_config or ()) - set(LINEAR_ATTN_KEYS))
        if unknown:
            refuse("linear_attn_config", self.linear_attn_config, f"has key(s) {unknown} that are not implemented")
        if self.rope_parameters or self.rope_scaling:
            refuse("rope_parameters" if self.rope_parameters else "rope_scaling",
                   self.rope_parameters or self.rope_scaling, "is not implemented: no GLM-5-Next layer rotates")
        self._check_derived("layer_kinds", "mlp_kinds", "indexer_kinds", "lower_bound")

    @property
    def head_size(self) -> int:
        """HF's `head_dim`: qk_rope_head_dim (0; no RoPE reads it)."""
        return self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5

    def _linear(self, key: str, default):
        return (self.linear_attn_config or {}).get(key, default)

    @property
    def kda_shape(self) -> tuple[int, int, int]:
        """(heads, head dim, convolution width) of the linear-attention layers (HF's precedence)."""
        return (self._linear("num_heads", self.linear_num_heads), self._linear("head_dim", self.linear_head_dim),
                self._linear("short_conv_kernel_size", self.linear_conv_kernel_dim))

    @property
    def lower_bound(self) -> float | None:
        """The forget gate's lower bound (None: Kimi's unbounded decay); `linear_attn_config`'s safe_gate puts back
        HF's -5 when its gate_lower_bound is null."""
        bound = self._linear("gate_lower_bound", self.linear_lower_bound)
        if self.linear_attn_config is not None and self._linear("safe_gate", True) and bound is None:
            bound = -5.0
        return bound

    def _kinds(self, key: str, kinds: list, known: tuple[str, ...]) -> tuple[str, ...]:
        L = self.num_hidden_layers
        if len(kinds) < L:
            refuse(key, kinds, f"has {len(kinds)} entries for num_hidden_layers={L}")
        for kind in kinds[:L]:
            if kind not in known:
                refuse(key, kind, f"is not implemented (known: {', '.join(known)})")
        return tuple(kinds[:L])

    @cached_property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's mixer (HF's default: indexed attention every fourth layer from 3; "full_attention" read as
        indexed)."""
        kinds = self.layer_types or [INDEXED if i % 4 == 3 else LINEAR for i in range(self.num_hidden_layers)]
        return self._kinds("layer_types", [INDEXED if k == "full_attention" else k for k in kinds], (LINEAR, INDEXED))

    @cached_property
    def mlp_kinds(self) -> tuple[str, ...]:
        """Each layer's MLP, "dense" or "sparse" (HF's default: the first three dense)."""
        L = self.num_hidden_layers
        kinds = self.mlp_layer_types or ["dense"] * min(3, L) + ["sparse"] * max(L - 3, 0)
        return self._kinds("mlp_layer_types", list(kinds), ("dense", "sparse"))

    @cached_property
    def indexer_kinds(self) -> tuple[str, ...]:
        """Each layer's indexer, "full" or "shared" (HF's derivation from the pattern or freq/offset keys when
        indexer_types is absent).

        Raises:
            UnsupportedArchitecture: an unknown kind, or a shared indexed layer not right after a full indexed one
                (HF hands the top-k only to the very next layer and fails otherwise).
        """
        L, pattern = self.num_hidden_layers, self.index_topk_pattern
        if self.indexer_types is not None:
            kinds = list(self.indexer_types)
        elif pattern is not None:
            kinds = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) \
                else list(pattern)
        else:
            freq, offset = max(self.index_topk_freq, 1), self.index_skip_topk_offset
            kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(L)]
        kinds = self._kinds("indexer_types", kinds, ("full", "shared"))
        for i, kind in enumerate(kinds):
            if kind == "shared" and self.layer_kinds[i] == INDEXED and not (
                    i > 0 and self.layer_kinds[i - 1] == INDEXED and kinds[i - 1] == "full"):
                refuse("indexer_types", list(kinds), f"makes layer {i} shared without a full indexed layer right "
                       "before it")
        return kinds

    def is_shared(self, index: int) -> bool:
        return self.layer_kinds[index] == INDEXED and self.indexer_kinds[index] == "shared"


class Model(HyperConnected, CausalLM):
    hc_head_mean = True  # HF's Glm5NextTextHyperHead: an unweighted mean of the streams

    def make_rope(self) -> None:
        return None

    def make_ropes(self) -> list:
        return []

    def make_attention(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        D = c.hidden_size
        if c.layer_kinds[index] == LINEAR:
            N, H, W = c.kda_shape
            return KimiDeltaAttention(hidden_size=D, num_heads=N, head_dim=H, conv_kernel=W, eps=c.rms_norm_eps,
                                      lower_bound=c.lower_bound, dtype=dtype, rngs=rngs)
        indexer = None if c.is_shared(index) else PooledIndexer(
            block_size=c.index_kpool, hidden_size=D, q_lora_rank=c.q_lora_rank, n_heads=c.index_n_heads,
            head_dim=c.index_head_dim, eps=1e-6, dtype=dtype, rngs=rngs)
        return PooledSparseMLAttention(indexer=indexer, block_size=c.index_kpool,
                                       topk_blocks=c.index_topk // c.index_kpool, hidden_size=D,
                                       num_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank,
                                       kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                                       qk_rope_head_dim=0, v_head_dim=c.v_head_dim, rope=None, rope_interleave=False,
                                       scale=c.softmax_scale, eps=c.rms_norm_eps, use_bias=c.attention_bias,
                                       dtype=dtype, rngs=rngs)

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        D, E, F, limit = c.hidden_size, c.n_routed_experts, c.moe_intermediate_size, c.swiglu_limit
        if c.mlp_kinds[index] == "dense":
            return GatedMLP(D, c.intermediate_size, c.hidden_act, input_limit=limit, dtype=dtype, rngs=rngs)
        router = Router(D, E, c.num_experts_per_tok, routing="sigmoid_grouped", norm_topk_prob=c.norm_topk_prob,
                        n_group=c.n_group, topk_group=c.topk_group, routed_scaling_factor=c.routed_scaling_factor,
                        dtype=dtype, rngs=rngs)
        return MoE(router, Experts(E, D, F, clipped_swiglu("silu", limit), dtype=dtype, rngs=rngs),
                   shared=GatedMLP(D, F * c.n_shared_experts, c.hidden_act, input_limit=limit, dtype=dtype,
                                   rngs=rngs),
                   shared_name="shared_experts")

    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> HyperDecoderLayer:
        return self.hyper_layer(index, self.make_attention(index, dtype=dtype, rngs=rngs), dtype=dtype, rngs=rngs,
                                form="mhc", sinkhorn_iters=self.config.hc_sinkhorn_iters)

    def cache_layout(self) -> list[KVLayer | StateLayer]:
        # Indexed layers cache the latent as one shared "head" (also the value); a full indexer adds, per token,
        # its key and pooling logits (2 Di).
        c = self.config
        R = c.kv_lora_rank
        return [layer.self_attn.state_layout() if kind == LINEAR
                else KVLayer(1, R, R, index_dim=0 if c.is_shared(i) else 2 * c.index_head_dim)
                for i, (kind, layer) in enumerate(zip(c.layer_kinds, self.model.layers))]


def _reshaped(name: str, hf_shape: tuple[int, ...]) -> Source:
    return Source((name,), lambda arrays, shape: arrays[0].reshape(shape), (hf_shape,))


def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict) -> Source | None:
    """The release's names (what transformers' conversion mapping renames on load, and writes back on save), under
    `model.language_model.` in the multimodal checkpoint: each expert's gate_proj / up_proj / down_proj apart; the
    hyper-connections as `hc_attn_fn`...; the linear attention's convolution per projection (`q_conv1d`... [N H, 1,
    W]) and its decay's tensors directly under `self_attn` (dt_bias [N H])."""
    src = per_expert_source(path, shape)
    m = re.fullmatch(r"(model\.layers\.\d+)\.(self_attn\.|attn_hc\.|ffn_hc\.)(.*)", path)
    if src is None and m:
        prefix, block, name = m[1], m[2], m[3]
        N, H, W = config.kda_shape
        if block != "self_attn.":
            src = Source((f"{prefix}.hc_{block[:-4]}_{name}",), lambda arrays, shape: arrays[0], (shape,))
        elif name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            src = _reshaped(f"{prefix}.self_attn.{name}.weight", (N * H, 1, W))
        elif name == "dt_bias":
            src = _reshaped(f"{prefix}.self_attn.dt_bias", (N * H,))
    if src is None:
        src = default_source(path, shape, metadata)
    return in_language_model(src) if config.is_composite else src


def dropped(config: Config) -> dict[str, str]:
    """The vision tower of a multimodal checkpoint."""
    return vision_dropped(config, r"model\.visual\..*")


FAMILY = Family(model_types=("glm5_next_text", "glm5_next"), config=Config, model=Model, dropped={},
                dropped_for=dropped, hf_source=hf_source)
