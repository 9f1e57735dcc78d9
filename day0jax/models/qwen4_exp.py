"""Qwen4-Exp, text model (`qwen4_exp_text`, or read from the multimodal `qwen4_exp` checkpoint, whose vision tower is
dropped): Qwen3.5-MoE's hybrid of Gated DeltaNet linear attention and gated full attention, with
- `hc_count` residual streams joined by gated residuals (`layers/hyper.py`, form "gated") around every block, and a
  final mixer in place of the final norm (no other norm in a layer: the gated residual normalizes);
- "indexed_attention" layers attending over the tokens a QSA indexer keeps (mean-pooled key blocks: the best
  `indexer_budget // indexer_compress_ratio`, plus the query's partly seen block; `layers/block_sparse_attention.py`);
- per-layer embeddings on the linear-attention layers of `ple_layer_ids` (hashed n-gram embeddings, `layers/ple.py`);
- MoE MLPs (softmax top-k, renormalized per `norm_topk_prob`, plus a sigmoid-gated shared expert).
HF reference: transformers/models/qwen4_exp/modeling_qwen4_exp.py (Qwen4ExpForCausalLM; Qwen4ExpForConditionalGeneration
for the multimodal checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from day0jax.core.cache_layout import KVLayer, StateLayer
from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.block_sparse_attention import QSAAttention, QSAIndexer
from day0jax.layers.hyper import GatedResidual, HyperCarry
from day0jax.layers.linear import Linear
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.moe import Experts, MoE, Router, swiglu
from day0jax.layers.ple import GatedResidualLayer, PLELayer
from day0jax.layers.rope import Rope
from day0jax.models import qwen3_5, qwen3_next
from day0jax.models.base import (CausalLM, HFConfig, fused_experts_source, in_language_model, per_expert_source,
                                 vision_dropped)
from day0jax.models.contract import Family
from kernels_pallas.calls import OpCall
from kernels_pallas.ngram_embedding import api as ngram_op

LINEAR, INDEXED = "linear_attention", "indexed_attention"
QSA_KEYS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


@dataclass(frozen=True, eq=False)
class Config(qwen3_5.Qwen35, HFConfig):
    COMPOSITE = ("qwen4_exp",)
    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 2
    head_dim: int | None = 256
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    attention_bias: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 10
    num_experts: int = 512
    norm_topk_prob: bool = True
    layer_types: list | None = None
    full_attention_interval: int = 4  # HF reads it (popped) where layer_types is unset
    eos_token_id: int | list | None = None  # PLE's n-grams restart after it
    hc_count: int = 4
    hc_lowrank: int = 320
    ple_layer_ids: list | None = None
    ple_embed_dim: int | None = None
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    split_ngram_parts: int = 512  # how checkpoints split each n-gram table (`hf_source`)
    indexer_n_heads: int | None = None
    indexer_kv_heads: int | None = None
    indexer_head_dim: int | None = None
    indexer_budget: int | None = None
    indexer_compress_ratio: int | None = None
    output_gate_type: str | None = None
    number_of_conv_states: int | None = None  # what HF derives for its cache's bookkeeping; no math
    model_type: str = "qwen4_exp_text"

    def __post_init__(self):
        super().__post_init__()
        self._check_derived("layer_kinds", "ple_layers")
        # The convolution and the gated norm of the linear attention use hidden_act; only SiLU is implemented there.
        self._refuse_if("hidden_act", lambda a: a != "silu", "is not implemented for linear attention (only silu)")
        if (self.output_gate_type or "silu") != "silu":
            refuse("output_gate_type", self.output_gate_type, "is not implemented (only silu)")
        self._refuse_if("linear_num_value_heads", lambda n: n % self.linear_num_key_heads,
                        f"is not a multiple of linear_num_key_heads={self.linear_num_key_heads}")
        self._refuse_if("hc_count", lambda n: n < 2, "must be at least 2")
        if INDEXED in self.layer_kinds:
            for key in QSA_KEYS:
                self._refuse_if(key, lambda v: v is None or v <= 0, "must be set (positive) for indexed_attention "
                                "layers")
            self._refuse_if("indexer_kv_heads", lambda k: k != 1, "must be 1 (one indexer key head)")
            self._refuse_if("indexer_budget", lambda b: b % self.indexer_compress_ratio,
                            f"is not a multiple of indexer_compress_ratio={self.indexer_compress_ratio}")
            rotary = int(self.head_size * self.rope.get("partial_rotary_factor", 1.0))
            self._refuse_if("indexer_head_dim", lambda d: d < rotary, f"is smaller than the rotated dims ({rotary})")

    @cached_property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's kind: `layer_types` ("full_attention" read as "indexed_attention", as HF), else indexed
        attention every `full_attention_interval` layers."""
        L = self.num_hidden_layers
        kinds = self.layer_types or [INDEXED if (i + 1) % self.full_attention_interval == 0 else LINEAR
                                     for i in range(L)]
        kinds = [INDEXED if k == "full_attention" else k for k in kinds]
        if len(kinds) != L:
            refuse("layer_types", kinds, f"has {len(kinds)} entries for num_hidden_layers={L}")
        for kind in kinds:
            if kind not in (LINEAR, INDEXED):
                refuse("layer_types", kind, f"is not implemented (known: {LINEAR}, {INDEXED})")
        return tuple(kinds)

    @cached_property
    def ple_layers(self) -> tuple[int, ...]:
        """The 0-based layers with per-layer embeddings (`ple_layer_ids` counts from 1)."""
        ids = sorted(set(self.ple_layer_ids or ()))
        if not ids:
            return ()
        heads = (self.ngram_size - 1) * self.heads_per_ngram
        self._refuse_if("ple_embed_dim", lambda _: heads <= 0 or self.ple_dim % heads,
                        f"must be a multiple of the n-gram heads ({heads})")
        for i in ids:
            if not 1 <= i <= self.num_hidden_layers:
                refuse("ple_layer_ids", ids, f"counts layers from 1 to {self.num_hidden_layers}")
            if self.layer_kinds[i - 1] != LINEAR:
                refuse("ple_layer_ids", ids, "holds a layer that is not linear_attention")
        if self.eos_id is None:
            refuse("eos_token_id", self.eos_token_id, "must be set where ple_layer_ids is (n-grams restart at it)")
        return tuple(i - 1 for i in ids)

    @property
    def eos_id(self) -> int | None:
        eos = self.eos_token_id
        return (eos[0] if eos else None) if isinstance(eos, list) else eos

    @property
    def ple_dim(self) -> int:
        return self.hidden_size if self.ple_embed_dim is None else self.ple_embed_dim

    def ngram_hash(self, index: int) -> tuple[dict, int]:
        """The `index`-th PLE layer's hash constants (multipliers, primes and offsets per order) and table rows."""
        n, per = self.ngram_size, self.heads_per_ngram
        primes = ngram_op.head_primes(self.ngram_vocab_size_base, (n - 1) * per, index)
        offsets = np.concatenate([[0], np.cumsum(primes)[:-1]]).tolist()
        by_order = lambda flat: tuple(tuple(int(v) for v in flat[g * per:(g + 1) * per]) for g in range(n - 1))  # noqa
        rows = -(-sum(primes) // self.make_ngram_vocab_size_divisible_by) * self.make_ngram_vocab_size_divisible_by
        return dict(multipliers=ngram_op.multipliers(self.vocab_size, n, index, self.seed), primes=by_order(primes),
                    offsets=by_order(offsets)), rows


class Passthrough(nnx.Module):
    """`model.norm`'s place: Qwen4-Exp has no final norm (its final mixer, `hyper_connection_mixer`, normalizes)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return x

    def op_calls(self) -> list[OpCall]:
        return []


class Model(CausalLM):
    def __init__(self, config: Config, *, dtype=jnp.float32, rngs: nnx.Rngs, mtp: bool = False):
        super().__init__(config, dtype=dtype, rngs=rngs, mtp=mtp)
        self.model.hyper_connection_mixer = GatedResidual(config.hidden_size, config.hc_count, config.hc_lowrank,
                                                          eps=config.rms_norm_eps, combine=False, rngs=rngs)

    def make_rope(self) -> Rope:
        c = self.config
        return Rope(c.rope, c.head_size, c.max_position_embeddings)

    def make_norm(self, dim: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        return Passthrough()

    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> GatedResidualLayer:
        c = self.config
        D = c.hidden_size
        if c.layer_kinds[index] == LINEAR:
            mixer, name = qwen3_next.Model.make_linear_attention(self, dtype=dtype, rngs=rngs), "linear_attn"
        else:
            indexer = QSAIndexer(hidden_size=D, n_heads=c.indexer_n_heads, head_dim=c.indexer_head_dim,
                                 eps=c.rms_norm_eps, dtype=dtype, rngs=rngs)
            mixer, name = QSAAttention(
                indexer=indexer, block_size=c.indexer_compress_ratio, budget=c.indexer_budget, hidden_size=D,
                num_heads=c.num_attention_heads, num_kv_heads=c.kv_heads, head_dim=c.head_size, rope=self.rope,
                qkv_bias=c.attention_bias, o_bias=c.attention_bias, qk_norm_eps=c.rms_norm_eps, qk_norm_offset=1.0,
                output_gate=True, dtype=dtype, rngs=rngs), "self_attn"
        mlp = MoE(Router(D, c.num_experts, c.num_experts_per_tok, routing="softmax_topk",
                         norm_topk_prob=c.norm_topk_prob, dtype=dtype, rngs=rngs),
                  Experts(c.num_experts, D, c.moe_intermediate_size, swiglu(c.hidden_act), dtype=dtype, rngs=rngs),
                  shared=GatedMLP(D, c.shared_expert_intermediate_size, c.hidden_act, dtype=dtype, rngs=rngs),
                  shared_gate=Linear((D,), (1,), ("embed", None), dtype=dtype, rngs=rngs))
        hc = lambda: GatedResidual(D, c.hc_count, c.hc_lowrank, eps=c.rms_norm_eps, rngs=rngs)  # noqa: E731
        ple = None
        if index in c.ple_layers:
            hash_, rows = c.ngram_hash(c.ple_layers.index(index))
            ple = PLELayer(hidden_size=D, streams=c.hc_count, embed_dim=c.ple_dim, eos=c.eos_id,
                           vocab_size=c.vocab_size, hash=hash_, rows=rows, conv_kernel=c.ple_conv_kernel_size,
                           eps=c.rms_norm_eps, dtype=dtype, rngs=rngs)
        return GatedResidualLayer(mixer, name, mlp, hc(), hc(), ple)

    def cache_layout(self) -> list[KVLayer | StateLayer]:
        c = self.config
        out = []
        for i, layer in enumerate(self.model.layers):
            if c.layer_kinds[i] == INDEXED:
                out.append(KVLayer(c.kv_heads, c.head_size, c.head_size, index_dim=c.indexer_head_dim))
                continue
            state = layer.mixer.state_layout()
            if layer.ple is not None:
                state = StateLayer(state.arrays + layer.ple.state_arrays(), kind="linear attention + per-layer "
                                   "embeddings")
            out.append(state)
        return out

    def embed(self, tokens: jax.Array) -> jax.Array:
        x = super().embed(tokens)
        return jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], self.config.hc_count, x.shape[-1]))

    def begin_carry(self, tokens: jax.Array, x: jax.Array) -> HyperCarry:
        return HyperCarry(tokens)

    def final_norm(self, x: jax.Array) -> jax.Array:
        return self.model.hyper_connection_mixer(x)[0]

    def op_calls(self) -> list[tuple[int | None, OpCall]]:
        return super().op_calls() + [(None, call) for call in self.model.hyper_connection_mixer.op_calls()]


# --- checkpoint layout ---------------------------------------------------------------------------------------

def ngram_source(config: Config, path: str, shape: tuple) -> Source:
    """The n-gram table [rows, Dh] <- its `split_ngram_parts` pieces `ngram_embedding.shard_<i>.weight`,
    concatenated (torch.chunk's pieces, as transformers' save_pretrained writes them)."""
    rows, dim = shape
    size = -(-rows // config.split_ngram_parts)
    sizes = [min(size, rows - start) for start in range(0, rows, size)]
    prefix = path[: -len(".weight")]
    return Source(tuple(f"{prefix}.shard_{i}.weight" for i in range(len(sizes))),
                  lambda arrays, s: np.concatenate(arrays, axis=0).reshape(s), tuple((n, dim) for n in sizes))


def text_source(config: Config, path: str, shape: tuple, metadata: dict) -> Source:
    if path.endswith(".ple_embedding.ngram_embedding.weight"):
        return ngram_source(config, path, shape)
    return (per_expert_source(path, shape) or fused_experts_source(path, shape)
            or qwen3_next.linear_attention_source(config, path, qwen3_5.split_projection_source)
            or default_source(path, shape, metadata))


def hf_source(config: Config, path: str, shape: tuple, metadata: dict) -> Source:
    src = text_source(config, path, shape, metadata)
    return in_language_model(src) if config.is_composite else src


def dropped(config: Config) -> dict[str, str]:
    """The rotary buffers and `mtp.*` (as Qwen3.5's), and a multimodal checkpoint's vision tower."""
    hashed = {r".*\.ple_embedding\.(layer_multipliers|ngram_heads_vocab_sizes|ngram_heads_offsets)":
              "the n-gram hash's constants, derived from the config (seed, vocab sizes) as transformers derives them"}
    return {**qwen3_next.DROPPED, **hashed, **vision_dropped(config, r"model\.visual\..*")}


FAMILY = Family(model_types=("qwen4_exp_text", "qwen4_exp"), config=Config, model=Model, dropped={},
                dropped_for=dropped, hf_source=hf_source,
                mtp_refusal="its multi-token-prediction layers (mtp.*) are not implemented (dropped at conversion)")
