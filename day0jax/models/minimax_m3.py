"""MiniMax-M3's language model (`minimax_m3_vl_text`, or read from the multimodal `minimax_m3_vl` checkpoint, whose
vision tower is dropped): GQA with per-head (1 + weight) q/k RMSNorms and partial RoPE; layers of `layer_types`
"minimax_m3_sparse" attend over the key blocks a lightning indexer keeps (`layers/block_sparse_attention.py`),
"full_attention" layers over every key. MLPs per `mlp_layer_types`: "sparse" an MoE (sigmoid scores, experts chosen
by score + `e_score_correction_bias`, weights renormalized, times `routed_scaling_factor`, plus a shared expert),
"dense" one MLP; every MLP uses gpt-oss's clamped SwiGLU ((up + 1) * gate * sigmoid(alpha * gate)). Every norm is
(1 + weight). Tensor names: see `hf_source`. HF reference: transformers/models/minimax_m3_vl/modeling_minimax_m3_vl.py
(MiniMaxM3VLForCausalLM; MiniMaxM3SparseForConditionalGeneration for the multimodal checkpoint).

Multi-token-prediction modules (`model.mtp.layers.{i}.`, speculative method "mtp"; transformers skips them), as vLLM's
MiniMax-M3 MTP runs them: enorm, hnorm and eh_proj over the next token's embedding and the model's final hidden
state, a decoder layer (`transformer_layer`) with block-sparse attention and an MoE whatever the per-layer lists say,
and `final_layernorm` before the shared head; the next step takes the layer's output before that norm
(`layers.mtp.NextNStack`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import jax
from flax import nnx

from day0jax.core.cache_layout import KVLayer
from day0jax.core.errors import UnsupportedArchitecture
from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.attention import Attention
from day0jax.layers.block_sparse_attention import BlockIndexer, BlockSparseAttention
from day0jax.layers.linear import project_together
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.moe import Experts, MoE, Router, clamped_swiglu
from day0jax.layers.norms import RMSNorm
from day0jax.models import llama
from day0jax.models.base import (HFConfig, fused_experts_source, nextn_mtp, per_expert_source, stored_mtp_path,
                                 vision_dropped)
from day0jax.models.contract import Family

SPARSE, FULL = "minimax_m3_sparse", "full_attention"


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    ALIASES = {"num_experts": "num_local_experts"}
    DEFAULT_THETA = 5000000.0
    COMPOSITE = ("minimax_m3_vl",)
    vocab_size: int = 200064
    hidden_size: int = 6144
    intermediate_size: int = 3072  # each routed expert's
    num_hidden_layers: int = 60
    num_attention_heads: int = 64
    num_key_value_heads: int | None = 4
    head_dim: int | None = 128
    hidden_act: str = "silu"  # HF replaces it by silu: the MLPs' clamped SwiGLU never reads it
    max_position_embeddings: int = 524288
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    num_experts_per_tok: int = 4
    num_local_experts: int = 128
    router_jitter_noise: float = 0.0  # training-time noise only
    dense_intermediate_size: int = 12288
    shared_intermediate_size: int = 3072
    routed_scaling_factor: float = 2.0
    rotary_dim: int = 64  # declared by HF's config, never read by its model (partial_rotary_factor is)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mlp_layer_types: list | None = None  # "dense" or "sparse" per layer (None: all sparse, as HF)
    index_n_heads: int = 4
    index_head_dim: int = 128
    index_block_size: int = 128
    index_topk_blocks: int = 16
    index_local_blocks: int = 1
    layer_types: list | None = None  # "full_attention" or "minimax_m3_sparse" per layer (None: all full, as HF)
    num_mtp_modules: int = 0  # multi-token-prediction modules (`model.mtp.layers`; HF skips them)
    mtp_transformer_layers: int = 1  # decoder layers per MTP module
    model_type: str = "minimax_m3_vl_text"

    def __post_init__(self):
        self._check_heads()
        self._check_derived("rope")
        L = self.num_hidden_layers
        for key, known in (("layer_types", (FULL, SPARSE)), ("mlp_layer_types", ("dense", "sparse"))):
            kinds = getattr(self, key)
            if kinds is None:
                continue
            if len(kinds) != L:
                refuse(key, kinds, f"has {len(kinds)} entries for num_hidden_layers={L}")
            for kind in kinds:
                if kind not in known:
                    refuse(key, kind, f"is not implemented (known: {', '.join(known)})")
        if SPARSE in (self.layer_types or ()) or self.num_mtp_modules:  # MTP modules attend block-sparsely
            self._refuse_if("index_n_heads", lambda i: self.num_attention_heads % i,
                            f"does not divide num_attention_heads={self.num_attention_heads}")
            rotary = int(self.head_size * self.rope.get("partial_rotary_factor", 1.0))
            # HF would rotate a slice of its cos/sin tables that no longer pairs each dim with its frequency.
            self._refuse_if("index_head_dim", lambda d: d < rotary, f"is smaller than the rotated dims ({rotary})")
            self._refuse_if("index_block_size", lambda b: b < 1, "must be at least 1")
            # More forced blocks than kept ones: which forced blocks win is the order of a sort's ties.
            self._refuse_if("index_local_blocks", lambda n: n < 0 or n > self.index_topk_blocks,
                            f"must be between 0 and index_topk_blocks={self.index_topk_blocks}")

    def layer_kind(self, index: int) -> str:
        """Layer `index`'s attention; an MTP module's (index >= num_hidden_layers) is block-sparse."""
        if index >= self.num_hidden_layers:
            return SPARSE
        return FULL if self.layer_types is None else self.layer_types[index]

    def is_moe(self, index: int) -> bool:
        """Whether layer `index`'s MLP is an MoE, as an MTP module's always is."""
        L, kinds = self.num_hidden_layers, self.mlp_layer_types
        return index >= L or kinds is None or kinds[index] == "sparse"


class ClampedSwiGLUMLP(GatedMLP):
    """down((clip(up) + 1) * g * sigmoid(alpha * g)), g = min(gate, limit): HF's `MiniMaxM3VLDenseMLP`."""

    def __init__(self, hidden_size: int, intermediate_size: int, alpha: float, limit: float, *, dtype,
                 rngs: nnx.Rngs):
        super().__init__(hidden_size, intermediate_size, "silu", dtype=dtype, rngs=rngs)
        self.alpha, self.limit_value, self.act_name = alpha, limit, "clamped swiglu"

    @jax.named_scope("mlp")
    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = project_together(x, (self.gate_proj, self.up_proj))
        return self.down_proj(clamped_swiglu(self.alpha, self.limit_value)(gate, up))


class Model(llama.LlamaLike):
    def make_norm(self, dim: int, *, dtype, rngs: nnx.Rngs) -> RMSNorm:
        return RMSNorm(dim, self.config.rms_norm_eps, offset=1.0, dtype=dtype, rngs=rngs)

    def make_attention(self, index: int, *, dtype, rngs: nnx.Rngs) -> Attention:
        c = self.config
        kwargs = dict(hidden_size=c.hidden_size, num_heads=c.num_attention_heads, num_kv_heads=c.kv_heads,
                      head_dim=c.head_size, rope=self.rope, qk_norm_eps=c.rms_norm_eps, qk_norm_offset=1.0,
                      dtype=dtype, rngs=rngs)
        if c.layer_kind(index) == FULL:
            return Attention(**kwargs)
        indexer = BlockIndexer(hidden_size=c.hidden_size, n_heads=c.index_n_heads, head_dim=c.index_head_dim,
                               eps=c.rms_norm_eps, dtype=dtype, rngs=rngs)
        return BlockSparseAttention(indexer=indexer, block_size=c.index_block_size, topk_blocks=c.index_topk_blocks,
                                    local_blocks=c.index_local_blocks, **kwargs)

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        if not c.is_moe(index):
            return ClampedSwiGLUMLP(c.hidden_size, c.dense_intermediate_size, c.swiglu_alpha, c.swiglu_limit,
                                    dtype=dtype, rngs=rngs)
        # One group holding every expert: plain top-k of the biased sigmoid scores, renormalized, then scaled.
        router = Router(c.hidden_size, c.num_local_experts, c.num_experts_per_tok, routing="sigmoid_grouped",
                        norm_topk_prob=True, n_group=1, topk_group=1, routed_scaling_factor=c.routed_scaling_factor,
                        dtype=dtype, rngs=rngs)
        experts = Experts(c.num_local_experts, c.hidden_size, c.intermediate_size,
                          clamped_swiglu(c.swiglu_alpha, c.swiglu_limit), dtype=dtype, rngs=rngs)
        shared = ClampedSwiGLUMLP(c.hidden_size, c.shared_intermediate_size, c.swiglu_alpha, c.swiglu_limit,
                                  dtype=dtype, rngs=rngs)
        return MoE(router, experts, shared=shared, shared_name="shared_experts")

    def cache_layout(self) -> list[KVLayer]:
        c = self.config
        return [KVLayer(c.kv_heads, c.head_size, c.head_size,
                        index_dim=c.index_head_dim if c.layer_kind(i) == SPARSE else 0)
                for i in range(c.num_hidden_layers)]

    def make_mtp(self, *, dtype, rngs: nnx.Rngs):
        """The MTP modules, DeepSeek-style layers around `make_layer(L + i)` (block-sparse and MoE: see `layer_kind`,
        `is_moe`), `final_layernorm` as the head's norm."""
        c = self.config
        if c.num_mtp_modules and c.mtp_transformer_layers != 1:
            raise UnsupportedArchitecture(f"mtp_transformer_layers={c.mtp_transformer_layers} is not implemented "
                                          "(one decoder layer per MTP module, as vLLM runs them; convert with "
                                          "--no-mtp to leave them out)")
        return nextn_mtp(self, c.num_mtp_modules, dtype=dtype, rngs=rngs)

    def mtp_cache_layout(self) -> list[KVLayer]:
        """Each MTP module's keys and values and its indexer's keys (block-sparse attention)."""
        c = self.config
        return [KVLayer(c.kv_heads, c.head_size, c.head_size, index_dim=c.index_head_dim)] * self.mtp_layers


def hf_source(config: Config, path: str, shape: tuple, metadata: dict) -> Source | None:
    """transformers' names: dense and shared MLPs' gate_proj / up_proj [F, D] <- the halves of `gate_up_proj.weight`
    [2F, D]; routed experts from the fused `experts.gate_up_proj` [E, 2F, D] and `experts.down_proj` [E, D, F]. A
    multimodal (`minimax_m3_vl`) checkpoint keeps MiniMax's own names instead (what transformers' conversion mapping
    renames on load): see `original_source`. MTP module i's as `model.mtp.layers.{i}.`: enorm, hnorm, eh_proj,
    final_layernorm and its decoder layer's tensors under `transformer_layer.`, named as a main layer's."""
    renamed = stored_mtp_path(path, lambda i: f"model.mtp.layers.{i}.",
                              {"decoder.": "transformer_layer.", "shared_head.norm.": "final_layernorm."})
    if renamed:
        return hf_source(config, renamed, shape, metadata) or default_source(renamed, shape, metadata)
    if config.is_composite:
        return original_source(path, shape, metadata)
    if m := re.fullmatch(r"(.*\.mlp(?:\.shared_experts)?)\.(gate|up)_proj\.kernel", path):
        F, D = shape
        start = 0 if m[2] == "gate" else F
        return Source((f"{m[1]}.gate_up_proj.weight",), lambda a, s: a[0][start:start + F].reshape(s), ((2 * F, D),))
    return fused_experts_source(path, shape)


# transformers' names -> MiniMax's, in the language model of the multimodal checkpoint.
ORIGINAL_NAMES = ((".self_attn.indexer.", ".self_attn.index_"), (".mlp.gate.e_score_correction_bias",
                  ".block_sparse_moe.e_score_correction_bias"), (".mlp.gate.", ".block_sparse_moe.gate."),
                  (".mlp.shared_experts.", ".block_sparse_moe.shared_experts."))


def _original(name: str) -> str:
    for ours, theirs in ORIGINAL_NAMES:
        name = name.replace(ours, theirs)
    # The whole causal LM sits under `language_model.`, lm_head included.
    return "language_model." + name


def original_source(path: str, shape: tuple, metadata: dict) -> Source:
    """MiniMax's names: `language_model.` before the causal LM's, the indexer's `index_q_proj`, `index_k_proj`,
    `index_q_norm`, `index_k_norm` on the attention; the MoE as `block_sparse_moe` with its routing bias beside the
    gate and each expert's w1 / w3 / w2 (gate, up, down) apart; dense and shared MLPs' projections apart."""
    experts = per_expert_source(path, shape, prefix=lambda p: p.replace(".mlp", ".block_sparse_moe"),
                                names={"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})
    if experts is not None:
        return experts.renamed(lambda n: "language_model." + n)
    return default_source(path, shape, metadata).renamed(_original)


def dropped(config: Config) -> dict[str, str]:
    """The vision tower, its projector and patch merger of a multimodal checkpoint (and its lm_head, when tied), and
    the multi-token-prediction modules (`mtp.*`) where the model is built without them."""
    out = vision_dropped(config, r"vision_tower\..*", r"multi_modal_projector\..*", r"patch_merge_mlp\..*")
    out[r"(.*\.)?mtp\..*"] = ("multi-token-prediction modules, used only for speculative decoding (converted "
                              "without them)")
    if config.is_composite and config.tie_word_embeddings:
        out[r"language_model\.lm_head\.weight"] = "tied to the embeddings"
    return out


FAMILY = Family(model_types=("minimax_m3_vl_text", "minimax_m3_vl"), config=Config, model=Model,
                dropped=llama.ROPE_BUFFERS, dropped_for=dropped, hf_source=hf_source,
                mtp=lambda c: r"(language_model\.)?model\.mtp\.layers\.\d+\..*" if c.num_mtp_modules else None)
