"""Mistral Large 4 (text; the language model of the multimodal `mistral_large4` checkpoints): GLM-5's sparse
attention (glm_moe_dsa.py: MLA over the keys a lightning indexer picks, "shared" layers reusing the last full layer's
top-k) and DeepSeek's MoE, with
- a plain q_proj (no low-rank query); the indexer's queries come from the hidden state through a LayerNorm of their
  own, and both query sets are scaled per head by a learned `scale * log(p + 1) + bias` (`mla.SoftmaxScaling`);
- RoPE on interleaved pairs, its frequencies scaled by learned factors (LeRoPE: `rope.LearnedRopeScale`, HF's
  `rotary_emb.alpha`); NoPE layers (`no_rope_layers` 0) rotate nothing, in the attention or the indexer, and fold
  the qk_rope_head_dim dims into the unrotated part;
- KV sharing (`kv_source_layers`): a layer pointing at an earlier one has no kv_a projection and attends over that
  layer's cached latent; with an indexer of its own it still caches its indexer's keys (HF's "reuse_but_indexer");
- softmax routing in groups, top-k weights always renormalized (Mistral 4's router), and a final logit soft-cap.
HF reference: transformers/models/mistral_large4/modeling_mistral_large4.py.

Checkpoints keep Mistral's own tensor names, which transformers renames when it loads and writes back when it saves
(`layers.N.attention.wq`, `tok_embeddings`, `lerope.alpha`, per-expert `w1`/`w3`/`w2`): see `hf_source`. The
multimodal checkpoints hold the language model under the same names, beside the Pixtral vision tower.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.core.cache_layout import KVLayer, SharedKV
from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.moe import Experts, MoE, Router, swiglu
from day0jax.layers.rope import ROPE_TYPES, LearnedRopeScale, rope_parameters
from day0jax.layers.sparse_mla import ContextLatent, Indexer, SparseMLAttention
from day0jax.models import deepseek_v3, glm_moe_dsa, llama
from day0jax.models.base import DecoderLayer, HFConfig, per_expert_source, vision_dropped
from day0jax.models.contract import Family

# HF's default when config.json gives none: YaRN over a 512-token window, no magnitude scaling.
DEFAULT_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2048.0, "original_max_position_embeddings": 512,
                "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.0}


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    ALIASES = {"num_local_experts": "n_routed_experts"}
    COMPOSITE = ("mistral_large4",)
    vocab_size: int = 204800
    hidden_size: int = 6144
    intermediate_size: int = 24576
    moe_intermediate_size: int = 6144
    num_hidden_layers: int = 72
    num_attention_heads: int = 64
    num_key_value_heads: int | None = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 128
    routed_scaling_factor: float = 1.0
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 64
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 4
    hidden_act: str = "silu"
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    mlp_layer_types: list | None = None  # "dense" or "sparse" per layer (None: dense for first_k_dense_replace)
    attention_bias: bool = False
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    first_k_dense_replace: int = 1
    layer_types: list | None = None  # every layer "indexed_attention"
    indexer_types: list | None = None  # "full" or "shared" per layer
    no_rope_layers: list | None = None  # 1: RoPE, 0: NoPE, per layer
    kv_source_layers: list | None = None  # per layer, the layer whose latent it attends over (itself: its own)
    final_logit_softcapping: float | None = 30.0
    # HF writes these but recomputes them: head_dim as qk_rope_head_dim (the RoPE's size), qk_head_dim as
    # qk_nope_head_dim + qk_rope_head_dim.
    head_dim: int | None = 64
    qk_head_dim: int | None = None
    # What HF derives no_rope_layers, indexer_types and n_routed_experts from when those are absent.
    no_rope_layer_interval: int = 4
    index_topk_pattern: str | list | None = None
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 2
    num_experts: int | None = None
    model_type: str = "mistral_large4_text"

    indexer_kinds = glm_moe_dsa.Config.indexer_kinds
    qk_head_size = deepseek_v3.Config.qk_head_size
    softmax_scale = deepseek_v3.Config.softmax_scale

    def __post_init__(self):
        deepseek_v3.refuse_grouped_kv(self)
        self._activation()
        E = self.routed_experts
        self._refuse_if("n_group", lambda v: not v or E % v or E // v < 2,
                        f"must divide n_routed_experts={E} into groups of at least 2 (a group scores its best two)")
        self._refuse_if("topk_group", lambda v: not v or v > self.n_group, f"must be in 1..n_group={self.n_group}")
        # Beyond what the chosen groups hold, HF would pick masked-out experts in no defined order.
        kept = self.topk_group * (E // self.n_group)
        self._refuse_if("num_experts_per_tok", lambda v: v > kept,
                        f"exceeds the {kept} experts of topk_group={self.topk_group} groups")
        # HF always builds the shared experts; with none, its checkpoint holds empty tensors we do not map.
        self._refuse_if("n_shared_experts", lambda v: v < 1, "must be at least 1 (HF always has shared experts)")
        self._refuse_if("final_logit_softcapping", lambda v: v is None or v <= 0,
                        "must be positive (HF's model always divides the logits by it)")
        for kind in self.layer_types or ():
            if kind != "indexed_attention":
                refuse("layer_types", kind, "is not implemented (only 'indexed_attention')")
        self._check_derived("rope", "uses_rope", "indexer_kinds", "kv_sources", "mlp_kinds")
        if any(self.uses_rope):
            self._refuse_if("index_head_dim", lambda d: d < self.qk_rope_head_dim,
                            f"is smaller than qk_rope_head_dim={self.qk_rope_head_dim}, the indexer's rotated dims")

    @property
    def routed_experts(self) -> int:
        """E: `n_routed_experts`, or the older `num_experts` where given (HF lets it win)."""
        return self.n_routed_experts if self.num_experts is None else self.num_experts

    @property
    def head_size(self) -> int:
        """The rotated part of each query/key head, `qk_rope_head_dim` (HF's `head_dim`): the RoPE's size."""
        return self.qk_rope_head_dim

    @cached_property
    def rope(self) -> dict:
        """The normalized RoPE dict (HF's YaRN default when absent), before the learned LeRoPE factors.

        Raises:
            UnsupportedArchitecture: a rope type or key not implemented, or a partial rotation (HF rotates all
                qk_rope_head_dim dims whatever partial_rotary_factor says, with tables sized by it).
        """
        given = DEFAULT_ROPE if self.rope_parameters is None else self.rope_parameters
        rope = rope_parameters(given, None, None, max_position_embeddings=self.max_position_embeddings)
        if rope["rope_type"] == "proportional":
            refuse("rope_parameters.rope_type", "proportional", "is not implemented for mistral_large4 (known: "
                   f"{', '.join(t for t in ROPE_TYPES if t != 'proportional')})")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            refuse("rope_parameters.partial_rotary_factor", rope["partial_rotary_factor"], "is not implemented")
        return rope

    @cached_property
    def uses_rope(self) -> tuple[bool, ...]:
        """Per layer, whether it rotates (HF's `no_rope_layers`, 1 = RoPE; by default every
        `no_rope_layer_interval`-th layer is NoPE).

        Raises:
            UnsupportedArchitecture: fewer entries than layers, or an entry other than 0 and 1.
        """
        L = self.num_hidden_layers
        given = self.no_rope_layers
        if given is None:
            given = [int((i + 1) % self.no_rope_layer_interval != 0) for i in range(L)]
        if len(given) < L:
            refuse("no_rope_layers", given, f"has {len(given)} entries for num_hidden_layers={L}")
        for v in given[:L]:
            if v not in (0, 1):
                refuse("no_rope_layers", v, "is not 0 (NoPE) or 1 (RoPE)")
        return tuple(bool(v) for v in given[:L])

    @cached_property
    def kv_sources(self) -> tuple[int | None, ...]:
        """Per layer, the layer whose cached latent it attends over instead of its own (None: its own).

        Raises:
            UnsupportedArchitecture: `kv_source_layers` without one entry per layer; a source that is not an earlier
                layer computing its own latent; a source of the other RoPE kind; or one that is not the layer whose
                latent transformers hands over (the last earlier layer of the same kind that others read).
        """
        L = self.num_hidden_layers
        sources = list(range(L)) if self.kv_source_layers is None else list(self.kv_source_layers)
        if len(sources) != L:
            refuse("kv_source_layers", sources, f"has {len(sources)} entries for num_hidden_layers={L}")
        # HF's "store" layers: those whose latent a later layer reads, kept by RoPE kind and overwritten in order.
        stored = [i for i in range(L) if i in sources[i + 1:]]
        out = []
        for i, s in enumerate(sources):
            if not isinstance(s, int) or not 0 <= s <= i or sources[s] != s:
                refuse("kv_source_layers", sources, f"gives layer {i} the source {s!r}: it must be an earlier layer "
                       "that computes its own latent")
            if s == i:
                out.append(None)
                continue
            if self.uses_rope[s] != self.uses_rope[i]:
                refuse("kv_source_layers", sources, f"makes layer {i} read the latent of layer {s}, of the other "
                       "RoPE kind: transformers keeps RoPE and NoPE latents apart")
            last = max(p for p in stored if p < i and self.uses_rope[p] == self.uses_rope[i])
            if last != s:
                refuse("kv_source_layers", sources, f"names layer {s} for layer {i}, but transformers hands layer {i} "
                       f"the latent of layer {last}, the last earlier one of its kind that others read")
            out.append(s)
        return tuple(out)

    @cached_property
    def mlp_kinds(self) -> tuple[str, ...]:
        """Per layer "dense" or "sparse" (MoE): `mlp_layer_types`, else dense for the first `first_k_dense_replace`.

        Raises:
            UnsupportedArchitecture: fewer entries than layers, or an unknown kind.
        """
        L = self.num_hidden_layers
        kinds = self.mlp_layer_types
        if kinds is None:
            dense = min(self.first_k_dense_replace, L)
            kinds = ["dense"] * dense + ["sparse"] * (L - dense)
        if len(kinds) < L:
            refuse("mlp_layer_types", kinds, f"has {len(kinds)} entries for num_hidden_layers={L}")
        for kind in kinds[:L]:
            if kind not in ("dense", "sparse"):
                refuse("mlp_layer_types", kind, "is not implemented (known: dense, sparse)")
        return tuple(kinds[:L])


@dataclass
class Carry:
    """What a layer hands on: the top-k of the last layer with an indexer (for "shared" layers), and by layer index
    the caches of the layers whose latent later layers read."""

    topk: jax.Array | None
    kv: dict


class SharingDecoderLayer(DecoderLayer):
    """A pre-norm decoder layer whose sparse attention takes the previous layer's top-k and, where `kv_source` is
    set, the latent that layer cached; it hands on its own top-k, and its cache where later layers read it."""

    carries = True

    def __init__(self, index: int, self_attn: SparseMLAttention, mlp: nnx.Module, input_layernorm,
                 post_attention_layernorm, *, kv_source: int | None, keeps_kv: bool):
        super().__init__(self_attn, mlp, input_layernorm, post_attention_layernorm)
        self.index, self.kv_source, self.keeps_kv = index, kv_source, keeps_kv

    def __call__(self, x, positions, rope_tables, cache, carry: Carry):
        attn = self.self_attn
        if self.kv_source is None:
            cache = ContextLatent() if cache is None else cache  # a cache-less forward hands the latent on this way
        elif attn.indexer is None:
            cache = carry.kv[self.kv_source]  # nothing of its own: the source's cache, left as it is
        else:  # its own indexer keys over the source's latent
            cache = (ContextLatent() if cache is None else cache).with_kv_of(carry.kv[self.kv_source])
        h, cache, topk = attn.run(self.input_layernorm(x), positions, rope_tables, cache, carry.topk)
        if self.keeps_kv:
            carry.kv[self.index] = cache
        if self.kv_source is not None:
            cache = None if attn.indexer is None else cache.without_kv()
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache, Carry(topk, carry.kv)


class Model(llama.LlamaLike):
    def __init__(self, config: Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(config, dtype=dtype, rngs=rngs)
        self.model.rotary_emb = LearnedRopeScale(self.rope, dtype=dtype, rngs=rngs)

    def rope_tables(self, positions, seq_len):
        return {self.rope: self.model.rotary_emb.cos_sin(self.rope, positions, seq_len)}

    def make_attention(self, index: int, *, dtype, rngs: nnx.Rngs) -> SparseMLAttention:
        c = self.config
        rotates = c.uses_rope[index]
        indexer = None if c.indexer_kinds[index] != "full" else Indexer(
            hidden_size=c.hidden_size, q_lora_rank=None, n_heads=c.index_n_heads, head_dim=c.index_head_dim,
            rope_dim=c.qk_rope_head_dim, rope_interleave=True, softmax_scaling=True, dtype=dtype, rngs=rngs)
        # NoPE layers: HF's latent has no rope part and the query's rope dims join the unrotated ones.
        P = c.qk_rope_head_dim if rotates else 0
        return SparseMLAttention(indexer=indexer, topk=c.index_topk, hidden_size=c.hidden_size,
                                 num_heads=c.num_attention_heads, q_lora_rank=None, kv_lora_rank=c.kv_lora_rank,
                                 qk_nope_head_dim=c.qk_head_size - P, qk_rope_head_dim=P, v_head_dim=c.v_head_dim,
                                 rope=self.rope if rotates else None, rope_interleave=True, scale=c.softmax_scale,
                                 eps=c.rms_norm_eps, use_bias=c.attention_bias, softmax_scaling=True,
                                 reads_shared=c.kv_sources[index] is not None, dtype=dtype, rngs=rngs)

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        D, E = c.hidden_size, c.routed_experts
        if c.mlp_kinds[index] == "dense":
            return super().make_mlp(index, dtype=dtype, rngs=rngs)
        return MoE(Router(D, E, c.num_experts_per_tok, routing="softmax_grouped", norm_topk_prob=True,
                          n_group=c.n_group, topk_group=c.topk_group, routed_scaling_factor=c.routed_scaling_factor,
                          dtype=dtype, rngs=rngs),
                   Experts(E, D, c.moe_intermediate_size, swiglu(c.hidden_act), dtype=dtype, rngs=rngs),
                   shared=GatedMLP(D, c.moe_intermediate_size * c.n_shared_experts, c.hidden_act, dtype=dtype,
                                   rngs=rngs),
                   shared_name="shared_experts")

    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> SharingDecoderLayer:
        c, D = self.config, self.config.hidden_size
        return SharingDecoderLayer(index, self.make_attention(index, dtype=dtype, rngs=rngs),
                                   self.make_mlp(index, dtype=dtype, rngs=rngs),
                                   self.make_norm(D, dtype=dtype, rngs=rngs), self.make_norm(D, dtype=dtype, rngs=rngs),
                                   kv_source=c.kv_sources[index], keeps_kv=index in c.kv_sources)

    def cache_layout(self) -> list[KVLayer | SharedKV]:
        # One shared "head": [normed latent ; roped key], also the value (layers/mla.py); NoPE layers have no roped
        # key. A layer without an indexer of its own caches no indexer keys.
        c = self.config
        out = []
        for i, source in enumerate(c.kv_sources):
            index_dim = c.index_head_dim if c.indexer_kinds[i] == "full" else 0
            if source is not None:
                out.append(SharedKV(source, index_dim))
            else:
                d = c.kv_lora_rank + (c.qk_rope_head_dim if c.uses_rope[i] else 0)
                out.append(KVLayer(1, d, d, index_dim=index_dim))
        return out

    def begin_carry(self, tokens: jax.Array, x: jax.Array) -> Carry:
        return Carry(None, {})

    def logits(self, hidden: jax.Array) -> jax.Array:
        logits, cap = super().logits(hidden), self.config.final_logit_softcapping
        return cap * jnp.tanh(logits / cap)


# Runtime (transformers') names -> the checkpoint's, in order: transformers' conversion mapping for mistral_large4
# and mistral_large4_text, reversed.
NATIVE_NAMES = (
    (r"^model\.embed_tokens\.", "tok_embeddings."), (r"^model\.norm\.", "norm."), (r"^lm_head\.", "output."),
    (r"^model\.rotary_emb\.alpha$", "lerope.alpha"), (r"^model\.layers\.", "layers."),
    (r"\.self_attn\.", ".attention."), (r"\.q_proj\.", ".wq."), (r"\.kv_a_proj_with_mqa\.", ".wkv_a_with_mqa."),
    (r"\.kv_a_layernorm\.", ".kv_a_norm."), (r"\.kv_b_proj\.", ".wkv_b."), (r"\.o_proj\.", ".wo."),
    (r"\.softmax_scaling\.scale$", ".ssmax_scaling.s"), (r"\.softmax_scaling\.bias$", ".ssmax_scaling.b"),
    (r"\.input_layernorm\.", ".attention_norm."), (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.mlp\.(gate|experts|shared_experts)\.", r".\1."), (r"\.mlp\.", ".feed_forward."),
    (r"\.gate_proj\.", ".w1."), (r"\.down_proj\.", ".w2."), (r"\.up_proj\.", ".w3."),
)


def native_name(name: str) -> str:
    """A runtime (transformers) tensor name as Mistral's checkpoints spell it: `model.layers.0.self_attn.q_proj.weight`
    -> `layers.0.attention.wq.weight`."""
    for pattern, replacement in NATIVE_NAMES:
        name = re.sub(pattern, replacement, name)
    return name


def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict) -> Source:
    """Every parameter from Mistral's names (`NATIVE_NAMES`); the experts stacked from one tensor per expert."""
    src = per_expert_source(path, shape) or default_source(path, shape, metadata)
    return src.renamed(native_name)


def dropped_for(config: Config) -> dict[str, str]:
    """The Pixtral vision tower and its projector, in a multimodal checkpoint."""
    return vision_dropped(config, r"vision_encoder\..*", r"patch_merger\..*", r"pre_mm_projector_norm\..*",
                          r"vision_language_adapter\..*")


DROPPED = {**llama.ROPE_BUFFERS,
           r"mtp_dspark\..*": "the multi-token-prediction draft head, used only for speculative decoding"}

FAMILY = Family(model_types=("mistral_large4_text", "mistral_large4"), config=Config, model=Model, dropped=DROPPED,
                dropped_for=dropped_for, hf_source=hf_source,
                mtp_refusal="its multi-token-prediction draft head (mtp_dspark) is not implemented (dropped at "
                            "conversion)")
