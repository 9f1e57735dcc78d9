"""The definition of indexed sparse attention, in plain jax.numpy; also the fallback on every backend.

Two steps per layer: the lightning indexer scores every visible key for each query with its own small heads,
score(t, s) = sum_i w[t, i] * relu(scale * q_i[t] . k[s]), and keeps the `topk` best positions; attention then
runs over those positions only. When a query sees no more than `topk` keys it selects all of them, and
`sparse_attention` is then dense causal attention, computed by the same operations (bit for bit). Optional `sinks`
(HY-V4): one learned logit per query head that joins every softmax denominator and takes no value.

Letters: B batch, T queries, S key positions, N query heads, K kv heads, H head dim (Hv for values), I indexer
heads, Di indexer head dim, Kt selected keys per query.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.attention import reference as dense

FLOOR = dense.FLOOR  # masked scores


def visible(q_positions: jax.Array, S: int, kv_lengths: jax.Array | None) -> jax.Array:
    """[B, T, S] bool: key s is at or before the query and among the row's valid keys."""
    key_pos = jnp.arange(S)[None, None, :]
    seen = key_pos <= q_positions[:, :, None]
    if kv_lengths is not None:
        seen &= key_pos < kv_lengths[:, None, None]
    return seen


def index_topk(q: jax.Array, k: jax.Array, weights: jax.Array, *, topk: int, scale: float, q_positions: jax.Array,
               kv_lengths: jax.Array | None = None) -> jax.Array:
    """The indexer's choice: for each query, the positions of its `topk` highest-scoring visible keys.

    Args:
        q: [B, T, I, Di] indexer queries.
        k: [B, S, Di] indexer keys (one head, shared by the indexer heads); key s sits at position s.
        weights: [B, T, I] per-query weights of the indexer heads.
        topk: keys kept per query.
        scale: the score scale inside the relu.
        q_positions: [B, T] absolute positions of the queries.
        kv_lengths: [B] valid keys per row (None: all S).
    Returns:
        [B, T, min(topk, S)] int32 positions, best first (lower positions first among equal scores). A query that
        sees fewer than `topk` keys also gets invisible positions, which attention masks.
    """
    scores = jnp.einsum("btid,bsd->btis", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    scores = jnp.einsum("bti,btis->bts", weights.astype(jnp.float32), jax.nn.relu(scores))
    scores = jnp.where(visible(q_positions, k.shape[1], kv_lengths), scores, -jnp.inf)
    return jax.lax.top_k(scores, min(topk, k.shape[1]))[1].astype(jnp.int32)


def softmax(scores: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """scores [B, K, G, T, S] float32 -> weights over S, with query head k * G + g's sink logit (sinks [N], or None)
    in the denominator."""
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    B, K, G = scores.shape[:3]
    sink = sinks.astype(jnp.float32).reshape(1, K, G, 1, 1)
    peak = jnp.maximum(scores.max(axis=-1, keepdims=True), sink)
    weights = jnp.exp(scores - peak)
    return weights / (weights.sum(axis=-1, keepdims=True) + jnp.exp(sink - peak))


def sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, indices: jax.Array, *, q_positions: jax.Array,
                     kv_lengths: jax.Array | None = None, scale: float | None = None,
                     sinks: jax.Array | None = None) -> jax.Array:
    """Causal attention of each query over its selected keys only.

    Args:
        q: [B, T, N, H]; k: [B, S, K, H]; v: [B, S, K, Hv] (N a multiple of K; key s at position s).
        indices: [B, T, Kt] int32 selected positions per query (`index_topk`).
        q_positions: [B, T]; kv_lengths: [B] or None; scale: default H ** -0.5.
        sinks: [N] per-head logits that join every softmax denominator (None: none).
    Returns:
        [B, T, N, Hv] in q's dtype.
    """
    B, T, N, H = q.shape
    S = k.shape[1]
    scale = H ** -0.5 if scale is None else scale
    selected = jnp.zeros((B, T, S), bool).at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None],
                                               indices].set(True)
    allowed = selected & visible(q_positions, S, kv_lengths)
    scores = jnp.where(allowed[:, None, None], dense.grouped_scores(q, k) * scale, FLOOR)
    return dense.weighted_values(softmax(scores, sinks), v).astype(q.dtype)


def gather_pages(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
    """A pool [P, page, ...] gathered for each row's pages: [B, W * page, ...], position s at index s."""
    B, W = block_tables.shape
    return pages[block_tables].reshape(B, W * pages.shape[1], *pages.shape[2:])


def paged_sparse_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                           kv_lengths: jax.Array, q_positions: jax.Array, indices: jax.Array, *,
                           scale: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """`sparse_attention` over each row's pages (k_pages [P, page, K, H], v_pages [P, page, K, Hv], block tables
    [B, W]), as over them gathered contiguously."""
    return sparse_attention(q, gather_pages(k_pages, block_tables), gather_pages(v_pages, block_tables), indices,
                            q_positions=q_positions, kv_lengths=kv_lengths, scale=scale, sinks=sinks)
