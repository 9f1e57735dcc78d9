"""HY-V4 (Tencent, `hy_v4`): n residual streams joined by plain hyper-connections (each stream keeps its own
residual, post scaled by `hc_magnitude`; `layers/hyper.py`), DeepSeek sparse MLA (`layers/sparse_mla.py`) with
per-head attention sinks and a sigmoid gate on each head's output, the indexer rotating the interleaved tail of its
heads and "shared" layers reusing the top-k of the last "full" one; dense or MoE MLP per layer (`mlp_layer_types`;
sigmoid routing with the score bias, one shared expert, SwiGLU clamped before the activation in the routed experts).
HF reference: transformers/models/hy_v4/modeling_hy_v4.py (and its conversion mapping: checkpoints keep the original
names `hc_pre.hc_attn_layer.hc_fn`, `linear_gate`, `learnable_sink_param`).

Multi-token-prediction layers (`model.mtp_layers.{i}.`, speculative method "mtp"; transformers skips them), as vLLM's
HY-V4 MTP runs them: enorm, hnorm and eh_proj over the model's final hidden state (after the hyper head and the final
norm) and the next token's embedding, then a decoder layer without hyper-connections (pre-norm residual blocks, sparse
MLA with an indexer of its own, the MLP of `mlp_layer_types` extended past the main layers) and its own
`final_layernorm`, whose output the shared head reads and the next step takes (`layers.mtp.MtpStack`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from flax import nnx

from day0jax.core.cache_layout import KVLayer
from day0jax.core.errors import UnsupportedArchitecture
from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.hyper import HyperConnected, HyperDecoderLayer
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.moe import Experts, MoE, Router, clipped_swiglu
from day0jax.layers.mtp import MtpLayer, MtpStack
from day0jax.layers.sparse_mla import Indexer, SparseMLAttention
from day0jax.models import deepseek_v3
from day0jax.models.base import CausalLM, DecoderLayer, HFConfig, fused_experts_source, stored_mtp_path
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    ALIASES = {"num_local_experts": "n_routed_experts"}
    vocab_size: int = 120832
    hidden_size: int = 2816
    intermediate_size: int = 6912
    moe_intermediate_size: int = 768
    num_hidden_layers: int = 34
    num_attention_heads: int = 32
    # HF overwrites these two whatever config.json says: with num_attention_heads (MLA expands one latent per query
    # head) and qk_rope_head_dim (see `head_size`).
    num_key_value_heads: int | None = 32
    head_dim: int | None = 256
    qk_head_dim: int | None = None  # likewise recomputed by HF from the qk_* dims
    hidden_act: str = "silu"
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    n_routed_experts: int = 256
    output_router_logits: bool = False  # training only
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    routed_scaling_factor: float = 2.827
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    mlp_layer_types: list | None = None
    layer_types: list | None = None
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 16
    indexer_types: list | None = None
    hc_mult: int = 4
    hc_magnitude: float = 2.0
    hc_eps: float = 1e-6
    learnable_sink_init: float = 0.0  # initialization only: the checkpoint holds the sinks
    swiglu_limit: float = 10.0
    num_nextn_predict_layers: int = 0  # multi-token-prediction layers (`model.mtp_layers`; HF skips them)
    rope_parameters: dict | None = None
    rope_theta: float | None = None  # legacy keys HF folds into rope_parameters
    rope_scaling: dict | None = None
    model_type: str = "hy_v4"

    def __post_init__(self):
        self._activation()
        self._refuse_if("n_group", lambda g: g != 1, "is not implemented: HY-V4 routes over all experts (only 1)")
        self._refuse_if("topk_group", lambda g: g != 1, "is not implemented: HY-V4 routes over all experts (only 1)")
        self._refuse_if("n_shared_experts", lambda n: n < 1, "is not implemented: HF always builds the shared expert")
        self._refuse_if("hc_mult", lambda n: n < 1, "must be at least 1")
        # HF's docstring says a limit at or below zero disables the clamp; its code clamps at that limit anyway.
        self._refuse_if("swiglu_limit", lambda v: v <= 0, "is not implemented (transformers clamps at a non-positive "
                        "limit where its documentation disables the clamp)")
        self._refuse_if("index_head_dim", lambda d: d < self.qk_rope_head_dim,
                        f"is smaller than qk_rope_head_dim={self.qk_rope_head_dim}")
        self._refuse_if("index_topk", lambda k: k < 1, "must be at least 1")
        for kind in self.layer_types or ():
            if kind != "indexed_attention":
                refuse("layer_types", kind, "is not implemented (only 'indexed_attention')")
        self._check_derived("rope", "mlp_kinds", "indexer_kinds")

    @property
    def head_size(self) -> int:
        """The rotated part of each query/key head, `qk_rope_head_dim` (HF's `head_dim`): the RoPE's size."""
        return self.qk_rope_head_dim

    @property
    def qk_head_size(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """As DeepSeek-V3: qk_head_size ** -0.5 times YaRN's mscale(factor, mscale_all_dim) ** 2."""
        return deepseek_v3.Config.softmax_scale.fget(self)

    def _kinds(self, key: str, default: list[str], known: tuple[str, ...]) -> tuple[str, ...]:
        L = self.num_hidden_layers
        kinds = list(getattr(self, key) if getattr(self, key) is not None else default)
        if len(kinds) < L:
            refuse(key, kinds, f"has {len(kinds)} entries for num_hidden_layers={L}")
        for kind in kinds[:L]:
            if kind not in known:
                refuse(key, kind, f"is not implemented (known: {', '.join(known)})")
        return tuple(kinds[:L])

    @cached_property
    def mlp_kinds(self) -> tuple[str, ...]:
        """Each layer's MLP, "dense" or "sparse" (HF's default: the first dense, the rest sparse)."""
        L = self.num_hidden_layers
        return self._kinds("mlp_layer_types", ["dense"] * min(1, L) + ["sparse"] * max(L - 1, 0), ("dense", "sparse"))

    @cached_property
    def mtp_mlp_kinds(self) -> tuple[str, ...]:
        """Each MTP layer's MLP: the `mlp_layer_types` entry of layer L + i where the list goes that far, else its
        last entry, as vLLM's HY-V4 MTP extends the list (HF's default list where none is given)."""
        L = self.num_hidden_layers
        kinds = list(self.mlp_layer_types) if self.mlp_layer_types is not None else list(self.mlp_kinds)
        mtp = tuple(kinds[min(L + i, len(kinds) - 1)] for i in range(self.num_nextn_predict_layers))
        for kind in mtp:
            if kind not in ("dense", "sparse"):
                refuse("mlp_layer_types", kind, "is not implemented for a multi-token-prediction layer (known: dense, "
                       "sparse; convert with --no-mtp to leave them out)")
        return mtp

    @cached_property
    def indexer_kinds(self) -> tuple[str, ...]:
        """Each layer's indexer, "full" or "shared" (HF's default: layer 0 and every fourth from 1 full).

        Raises:
            UnsupportedArchitecture: an unknown kind, or a shared first layer (no top-k to reuse).
        """
        default = ["full" if i == 0 or (i - 1) % 4 == 0 else "shared" for i in range(self.num_hidden_layers)]
        kinds = self._kinds("indexer_types", default, ("full", "shared"))
        if kinds and kinds[0] != "full":
            refuse("indexer_types", kinds[0], "on the first layer: a shared layer needs a full one before it")
        return kinds


class Model(HyperConnected, CausalLM):
    def make_attention(self, index: int, *, dtype, rngs: nnx.Rngs) -> SparseMLAttention:
        """Layer `index`'s attention; an MTP layer's (index >= num_hidden_layers) has an indexer of its own."""
        c = self.config
        shared = index < c.num_hidden_layers and c.indexer_kinds[index] == "shared"
        indexer = None if shared else Indexer(
            hidden_size=c.hidden_size, q_lora_rank=c.q_lora_rank, n_heads=c.index_n_heads, head_dim=c.index_head_dim,
            rope_dim=c.qk_rope_head_dim, rope_interleave=True, rope_last=True, eps=c.rms_norm_eps, dtype=dtype,
            rngs=rngs)
        # eps: HF builds q_a_layernorm and kv_a_layernorm with RMSNorm's default 1e-6, not rms_norm_eps.
        return SparseMLAttention(indexer=indexer, topk=c.index_topk, sinks=True, output_gate=True,
                                 hidden_size=c.hidden_size, num_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank,
                                 kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                                 qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, rope=self.rope,
                                 rope_interleave=True, scale=c.softmax_scale, eps=1e-6, use_bias=c.attention_bias,
                                 dtype=dtype, rngs=rngs)

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        D, E, F = c.hidden_size, c.n_routed_experts, c.moe_intermediate_size
        L = c.num_hidden_layers
        if (c.mlp_kinds[index] if index < L else c.mtp_mlp_kinds[index - L]) == "dense":
            return GatedMLP(D, c.intermediate_size, c.hidden_act, dtype=dtype, rngs=rngs)
        # n_group = topk_group = 1: DeepSeek-V3's grouped routing over one group is a plain global top-k.
        router = Router(D, E, c.num_experts_per_tok, routing="sigmoid_grouped", norm_topk_prob=c.norm_topk_prob,
                        n_group=1, topk_group=1, routed_scaling_factor=c.routed_scaling_factor, dtype=dtype,
                        rngs=rngs)
        return MoE(router, Experts(E, D, F, clipped_swiglu(c.hidden_act, c.swiglu_limit), dtype=dtype, rngs=rngs),
                   shared=GatedMLP(D, F * c.n_shared_experts, c.hidden_act, dtype=dtype, rngs=rngs),
                   shared_name="shared_experts")

    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> HyperDecoderLayer:
        return self.hyper_layer(index, self.make_attention(index, dtype=dtype, rngs=rngs), dtype=dtype, rngs=rngs,
                                form="plain", post_scale=self.config.hc_magnitude)

    def cache_layout(self) -> list[KVLayer]:
        # One shared "head": [normed latent ; roped key], also the value (layers/mla.py); full layers add index keys.
        c = self.config
        d = c.kv_lora_rank + c.qk_rope_head_dim
        return [KVLayer(1, d, d, index_dim=c.index_head_dim if kind == "full" else 0) for kind in c.indexer_kinds]

    def make_mtp(self, *, dtype, rngs: nnx.Rngs) -> MtpStack:
        """The MTP layers: plain pre-norm decoder layers (the checkpoints hold no hyper-connection weights for them)
        between enorm/hnorm/eh_proj and a `final_layernorm` of their own."""
        c = self.config
        if not c.num_nextn_predict_layers:
            raise UnsupportedArchitecture("this hy_v4 config declares no multi-token-prediction layers")
        L, D = c.num_hidden_layers, c.hidden_size
        norm = lambda: self.make_norm(D, dtype=dtype, rngs=rngs)  # noqa: E731
        return MtpStack([MtpLayer(DecoderLayer(self.make_attention(L + i, dtype=dtype, rngs=rngs),
                                               self.make_mlp(L + i, dtype=dtype, rngs=rngs), norm(), norm()),
                                  self.make_norm, D, post_norm=True, dtype=dtype, rngs=rngs)
                         for i in range(c.num_nextn_predict_layers)])

    def mtp_step(self, index, tokens, hidden, positions, cache=None, seq_len=None):
        """As `CausalLM.mtp_step`, on the plain embeddings: an MTP layer runs over one stream, not the model's n."""
        return self.mtp.step(index, self.model.embed_tokens(tokens), hidden, positions,
                             self.rope_tables(positions, seq_len), cache)

    def mtp_cache_layout(self) -> list[KVLayer]:
        """Each MTP layer's latent keys and, for its own indexer, index keys."""
        c = self.config
        d = c.kv_lora_rank + c.qk_rope_head_dim
        return [KVLayer(1, d, d, index_dim=c.index_head_dim)] * self.mtp_layers


# Runtime path -> the checkpoint's name (the original release's, which transformers also saves), in order.
ORIGINAL_NAMES = [
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_pre.hc_attn_layer.hc_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_pre.hc_mlp_layer.hc_\1"),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"model.hc_pre.hc_head.hc_head_\1"),
    (r"\.gate_proj\.weight$", ".linear_gate.weight"),
    (r"\.self_attn\.sinks$", ".self_attn.learnable_sink_param"),
]


def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict) -> Source | None:
    """Every parameter from its original name (`ORIGINAL_NAMES`); routed experts from the fused `gate_up_proj`
    [E, 2F, D] and `down_proj` [E, D, F]; MTP layer i's under `model.mtp_layers.{i}.`, its decoder layer's tensors
    beside enorm, hnorm, eh_proj and final_layernorm."""
    renamed = stored_mtp_path(path, lambda i: f"model.mtp_layers.{i}.",
                              {"mtp_block.": "", "post_norm.": "final_layernorm."})
    if renamed:
        return hf_source(config, renamed, shape, metadata)
    experts = fused_experts_source(path, shape)
    if experts is not None:
        return experts
    src = default_source(path, shape, metadata)
    name = src.names[0]
    for pattern, repl in ORIGINAL_NAMES:
        name = re.sub(pattern, repl, name)
    return Source((name,), src.combine, src.shapes)


# A checkpoint under transformers' module names (`attn_hc.fn`, `gate_proj`, `sinks`: saved without its conversion
# mapping) reads as the original one: the same renames, which match no original name.
FAMILY = Family(model_types=("hy_v4",), config=Config, model=Model,
                dropped={r"model\.mtp_layers\.\d+\.(embed_tokens|shared_head\.head)\.weight": "the multi-token-"
                         "prediction layer's copy of the model's embedding or output head (shared)",
                         r"model\.mtp_layers\..*": "multi-token-prediction layers, used only for speculative decoding "
                         "(converted without them)"},
                hf_source=hf_source, renames=tuple(ORIGINAL_NAMES),
                mtp=lambda c: r"model\.mtp_layers\.\d+\..*" if c.num_nextn_predict_layers else None)
