"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): multi-head latent attention (`layers/mla.py`) restricted, per
query, to the top-k keys a lightning indexer picks.

The indexer has its own small heads: queries from MLA's low-rank query (wq_b), one key per token from the hidden
state (wk, then a LayerNorm), both with RoPE on their first P dims, and per-head weights (weights_proj); its score
of a key is sum_i w_i * relu(q_i . k / sqrt(Di)). The engine caches its keys beside the latent
(`PagedKVCache.index_topk`). A layer may instead reuse the top-k of the layer before it (GLM-5's shared layers,
which have no indexer), and attend over the latent another layer cached (Mistral Large 4's KV sharing: the layer
gets a cache holding the source's latent pages and its own indexer pages). HY-V4 adds per-head attention sinks and
a sigmoid gate on each head's output, and rotates the indexer's trailing dims. Letters: see `MLAttention`; I indexer
heads, Di their dims.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.layers.linear import Linear, param
from day0jax.layers.mla import MLAttention, SoftmaxScaling
from day0jax.layers.norms import LayerNorm
from kernels_pallas.calls import OpCall
from kernels_pallas.sparse_attention import api as sparse_op


class Indexer(nnx.Module):
    """The lightning indexer. Args: hidden_size D; q_lora_rank (None: queries from the hidden state through a
    LayerNorm of their own, `q_input_norm`: Mistral Large 4, whose attention has no low-rank query); n_heads I;
    head_dim Di; rope_dim P (the rotated leading dims, when the layer has a RoPE); rope_interleave: HF rotates
    interleaved pairs (GLM-5) rather than the half-split layout (DeepSeek-V3.2); rope_last: the rotated dims are the
    last P rather than the first (HY-V4); softmax_scaling: queries times a learned per-head `SoftmaxScaling` of the
    position (Mistral Large 4); eps: the key LayerNorm's."""

    def __init__(self, *, hidden_size: int, q_lora_rank: int | None, n_heads: int, head_dim: int, rope_dim: int,
                 rope_interleave: bool, rope_last: bool = False, softmax_scaling: bool = False, eps: float = 1e-6,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        D, I, Di = hidden_size, n_heads, head_dim
        # Small heads shared by every query head: kept whole on every tensor-parallel rank.
        if q_lora_rank is None:
            self.q_input_norm = LayerNorm(D, 1e-6, dtype=dtype, rngs=rngs)
            self.wq_b = Linear((D,), (I, Di), ("embed", None, None), dtype=dtype, rngs=rngs)
        else:
            self.q_input_norm = None
            self.wq_b = Linear((q_lora_rank,), (I, Di), ("q_lora", None, None), dtype=dtype, rngs=rngs)
        self.wk = Linear((D,), (Di,), ("embed", None), dtype=dtype, rngs=rngs)
        self.k_norm = LayerNorm(Di, eps, dtype=dtype, rngs=rngs)
        self.weights_proj = Linear((D,), (I,), ("embed", None), dtype=dtype, rngs=rngs)
        self.softmax_scaling = SoftmaxScaling(I, head_axis=None, dtype=dtype, rngs=rngs) if softmax_scaling else None
        self.rope_dim, self.rope_interleave, self.rope_last = rope_dim, rope_interleave, rope_last

    def queries_keys(self, x: jax.Array, q_resid: jax.Array | None, rope, rope_tables,
                     positions: jax.Array | None = None) -> tuple[jax.Array, ...]:
        """Index queries [B, T, I, Di], keys [B, T, Di] and head weights [B, T, I] (float32). `rope` None: nothing
        rotated; `positions` [B, T]: for the softmax scaling."""
        q = self.wq_b(q_resid if self.q_input_norm is None else self.q_input_norm(x))
        k = self.k_norm(self.wk(x))
        if self.softmax_scaling is not None:
            q = self.softmax_scaling(q, positions)
        I = q.shape[-2]
        weights = self.weights_proj(x).astype(jnp.float32) * I ** -0.5
        if rope is None:
            return q, k, weights
        P = self.rope_dim
        # Only dot products of q and k are used: the rotated slice may move to the front when it is the tail.
        rot = slice(-P, None) if self.rope_last else slice(None, P)
        keep = slice(None, -P) if self.rope_last else slice(P, None)
        q_rot, k_rot = q[..., rot], k[..., None, rot]
        if self.rope_interleave:  # q and k permuted alike: the scores, all they are used for, are unchanged
            q_rot, k_rot = MLAttention._deinterleave(q_rot), MLAttention._deinterleave(k_rot)
        cos, sin = rope_tables[rope]
        q = jnp.concatenate([rope.apply(q_rot, cos, sin), q[..., keep]], axis=-1)
        k = jnp.concatenate([rope.apply(k_rot, cos, sin)[:, :, 0], k[..., keep]], axis=-1)
        return q, k, weights

    @property
    def scale(self) -> float:
        return self.wk.out_shape[0] ** -0.5


class SparseMLAttention(MLAttention):
    """MLA over the top-k keys of its `indexer`, or, without one, of the layer before it (GLM-5's shared layers);
    `topk` keys per query; sinks: a learned logit per head in every softmax denominator (HF: `sinks`); output_gate:
    each head's output times sigmoid(gate_proj(x)) before o_proj (HY-V4); other arguments as `MLAttention`. A layer
    that `reads_shared` needs a cache (a `PagedKVCache` or a `ContextLatent`) holding its source's latent."""

    def __init__(self, *, indexer: Indexer | None, topk: int, sinks: bool = False, output_gate: bool = False,
                 **mla_kwargs):
        super().__init__(**mla_kwargs)
        self.indexer, self.topk = indexer, topk
        N, (_, _, _, U) = self.kv_b_proj.out_shape[0], self.dims
        D, dtype, rngs = mla_kwargs["hidden_size"], mla_kwargs.get("dtype", jnp.float32), mla_kwargs["rngs"]
        # float32, as HF keeps them whatever the model's dtype.
        self.sinks = param(rngs, (N,), ("heads",), jnp.float32, 0.0) if sinks else None
        self.gate_proj = (Linear((D,), (N, U), ("embed", "heads", "head_dim"), dtype=dtype, rngs=rngs)
                          if output_gate else None)

    def __call__(self, x: jax.Array, positions: jax.Array, rope_tables, cache=None):
        """x [B, T, D], positions [B, T] -> ([B, T, D], updated cache)."""
        out, cache, _ = self.run(x, positions, rope_tables, cache)
        return out, cache

    def run(self, x: jax.Array, positions: jax.Array, rope_tables, cache=None, shared_topk=None):
        """As `__call__`, also taking the previous layer's top-k (for a layer without an indexer) and returning
        this layer's ([B, T, Kt] positions)."""
        query, key, q_resid = self.project(x, rope_tables)
        query = self.scale_queries(query, positions)
        if cache is not None and key is not None:
            cache = cache.update(key, key, positions)
        if self.indexer is None:
            indices = shared_topk
        else:
            q, k, weights = self.indexer.queries_keys(x, q_resid, self.rope, rope_tables, positions)
            if cache is None:
                indices = sparse_op.index_topk(q, k, weights, topk=self.topk, scale=self.indexer.scale,
                                               q_positions=positions)
            else:
                cache, indices = cache.index_topk(k, q, weights, positions, topk=self.topk, scale=self.indexer.scale)
        sinks = None if self.sinks is None else self.sinks[...]
        if cache is None:
            out = sparse_op.sparse_attention(query, key, key, indices, q_positions=positions, scale=self.scale,
                                             sinks=sinks)
        else:
            out = cache.attend_sparse(query, positions, indices, scale=self.scale, sinks=sinks)
        gate = None if self.gate_proj is None else jax.nn.sigmoid(self.gate_proj(x))
        return self.output(out, gate), cache, indices

    def op_calls(self) -> list[OpCall]:
        R, P, _, _ = self.dims
        indexer = self.indexer
        call = OpCall.of("sparse_attention", N=self.kv_b_proj.out_shape[0], K=1, H=R + P, Hv=R + P,
                         scale=self.scale, latent=True, topk=self.topk,
                         I=None if indexer is None else indexer.wq_b.out_shape[0],
                         Di=None if indexer is None else indexer.wk.out_shape[0], indexer=indexer is not None,
                         **({} if self.sinks is None else {"sinks": True}))  # absent: none (older reports)
        return [call, *self.norm_and_rope_calls()]


@dataclass(frozen=True)
class ContextLatent:
    """This call's latent keys as a cache with `PagedKVCache`'s sparse protocol and no cache behind them: a
    cache-less forward's way to hand one layer's latent to the layers that attend over it too (Mistral Large 4's
    KV sharing). `key` [B, S, 1, R + P], key s at position s; it is also the value."""

    key: jax.Array | None = None

    def update(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> "ContextLatent":
        return ContextLatent(k)

    def index_topk(self, k: jax.Array, q: jax.Array, weights: jax.Array, positions: jax.Array, *, topk: int,
                   scale: float) -> tuple["ContextLatent", jax.Array]:
        """This call's indexer keys k [B, T, Di] scored by q: (self, indices [B, T, Kt])."""
        return self, sparse_op.index_topk(q, k, weights, topk=topk, scale=scale, q_positions=positions)

    def attend_sparse(self, q: jax.Array, positions: jax.Array, indices: jax.Array, *, scale: float,
                      sinks: jax.Array | None = None) -> jax.Array:
        return sparse_op.sparse_attention(q, self.key, self.key, indices, q_positions=positions, scale=scale,
                                          sinks=sinks)

    def with_kv_of(self, source: "ContextLatent") -> "ContextLatent":
        """This layer's view over `source`'s latent (see `PagedKVCache.with_kv_of`)."""
        return ContextLatent(source.key)

    def without_kv(self) -> "ContextLatent":
        return ContextLatent()
