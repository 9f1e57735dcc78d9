"""The definition of compressed attention, in plain jax.numpy; also the fallback on every backend.

A layer keeps two kinds of keys, and each is also its value (one shared key-value head, K = V, for all N query heads):
- the uncompressed keys of the last `window` positions: a query at p sees positions p - window < s <= p;
- compressed entries, one per `ratio` positions: entry c pools positions [c ratio, c ratio + ratio) (`kv_compress`),
  and a query at p sees the entries whose positions are all at or before it, c < (p + 1) // ratio. With an indexer
  (CSA), only the entries among its top-k (`indices`) are seen; without (HCA), all of them.
Both kinds share one softmax, with a learned sink logit per head in its denominator (taking no value). The output of
head n at query t is the weighted sum of the seen keys themselves.

Letters: B batch, T queries, N query heads, H head dim, S uncompressed positions, C entries, Kt selected entries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.attention.reference import FLOOR


def entry_positions(q_positions: jax.Array, ratio: int) -> jax.Array:
    """[B, T] the last entry each query may see, (p + 1) // ratio - 1 (-1: none yet): the query position that entry
    indices compare against as key positions do (an entry "sits" at the last of its positions)."""
    return (q_positions + 1) // ratio - 1


def _softmax_with_sinks(scores: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """scores [B, N, T, S] float32 -> weights, with each head's sink logit in the denominator."""
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    sink = sinks.astype(jnp.float32)[None, :, None, None]
    peak = jnp.maximum(scores.max(axis=-1, keepdims=True), sink)
    weights = jnp.exp(scores - peak)
    return weights / (weights.sum(axis=-1, keepdims=True) + jnp.exp(sink - peak))


def compressed_attention(q: jax.Array, k: jax.Array, entries: jax.Array | None, indices: jax.Array | None, *,
                         q_positions: jax.Array, window: int, ratio: int, sinks: jax.Array | None = None,
                         scale: float | None = None, kv_lengths: jax.Array | None = None,
                         entry_counts: jax.Array | None = None) -> jax.Array:
    """Attention of each query over its window and its compressed entries.

    Args:
        q: [B, T, N, H].
        k: [B, S, H] uncompressed keys (and values), key s at position s.
        entries: [B, C, H] compressed keys (and values), entry c over positions [c ratio, c ratio + ratio); None: the
            layer has none (a plain sliding layer).
        indices: [B, T, Kt] int32 entry ids an indexer chose per query (None: every visible entry); ids a query
            cannot see are ignored.
        q_positions: [B, T]; window: uncompressed positions a query sees, itself included; ratio: positions per entry.
        sinks: [N] or None; scale: default H ** -0.5.
        kv_lengths: [B] valid uncompressed keys (None: all S); entry_counts: [B] valid entries (None: all C).
    Returns:
        [B, T, N, H] in q's dtype.
    """
    B, T, N, H = q.shape
    scale = H ** -0.5 if scale is None else scale
    qpos = q_positions[:, :, None]
    s = jnp.arange(k.shape[1])[None, None, :]
    seen = (s <= qpos) & (qpos - s < window)
    if kv_lengths is not None:
        seen &= s < kv_lengths[:, None, None]
    keys, mask = k, seen
    if entries is not None:
        c = jnp.arange(entries.shape[1])[None, None, :]
        seen_c = c <= entry_positions(q_positions, ratio)[:, :, None]
        if entry_counts is not None:
            seen_c &= c < entry_counts[:, None, None]
        if indices is not None:
            chosen = jnp.zeros(seen_c.shape, bool).at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None],
                                                      indices].set(True, mode="drop")
            seen_c &= chosen
        keys, mask = jnp.concatenate([k, entries.astype(k.dtype)], axis=1), jnp.concatenate([seen, seen_c], axis=2)
    scores = jnp.einsum("btnh,bsh->bnts", q, keys, preferred_element_type=jnp.float32) * scale
    weights = _softmax_with_sinks(jnp.where(mask[:, None], scores, FLOOR), sinks)
    out = jnp.einsum("bnts,bsh->btnh", weights.astype(keys.dtype), keys, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


def gather_pages(pages: jax.Array, table: jax.Array) -> jax.Array:
    """A pool [P, page, ...] gathered for each row's pages: [B, W * page, ...], item s at index s."""
    B, W = table.shape
    return pages[table].reshape(B, W * pages.shape[1], *pages.shape[2:])


def paged_compressed_attention(q: jax.Array, k_pages: jax.Array, ring_table: jax.Array, c_pages: jax.Array | None,
                               c_table: jax.Array | None, kv_lengths: jax.Array, q_positions: jax.Array,
                               indices: jax.Array | None = None, *, window: int, ratio: int,
                               sinks: jax.Array | None = None, scale: float | None = None) -> jax.Array:
    """`compressed_attention` over the engine's pools, as over them gathered contiguously.

    Args:
        q: [B, T, N, H].
        k_pages: [P, page, H] the uncompressed keys' pool; position s of row b in page ring_table[b, s // page], slot
            s % page (a ring: positions more than its span apart share a slot, the window never sees both).
        ring_table: [B, W] int32.
        c_pages: [Pc, per_page, H] the entries' pool, entry c of row b in page c_table[b, c // per_page], slot
            c % per_page; None: no entries.
        c_table: [B, Wc] int32 or None.
        kv_lengths: [B] positions cached after this step's writes (row b has kv_lengths // ratio entries).
        q_positions, indices, window, ratio, sinks, scale: as `compressed_attention`.
    Returns:
        [B, T, N, H] in q's dtype.
    """
    k = gather_pages(k_pages, ring_table)
    entries = None if c_pages is None else gather_pages(c_pages, c_table)
    return compressed_attention(q, k, entries, indices, q_positions=q_positions, window=window, ratio=ratio,
                                sinks=sinks, scale=scale, kv_lengths=kv_lengths, entry_counts=kv_lengths // ratio)
