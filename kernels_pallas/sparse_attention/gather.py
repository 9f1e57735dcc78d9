"""Paged sparse attention that reads only the selected keys: each query gathers its Kt positions from the pages
(page block_tables[b, s // page_size], slot s % page_size) and attends over those, so a decode step touches
Kt keys per query whatever the context. Plain jax.numpy; taken on every backend before the reference, which
gathers every page of the row."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.sparse_attention.reference import FLOOR, softmax


def paged_sparse_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                           kv_lengths: jax.Array, q_positions: jax.Array, indices: jax.Array, *,
                           scale: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """Same contract as `reference.paged_sparse_attention`.

    Raises:
        NotImplementedError: more selected keys per query than cached positions would gather more than the
            reference reads (a prefill chunk over a short context): the reference takes it.
    """
    B, T, N, H = q.shape
    _, page, K, _ = k_pages.shape
    Kt = indices.shape[-1]
    if T * Kt > block_tables.shape[1] * page:
        raise NotImplementedError(f"{T} queries x {Kt} keys gather more than the {block_tables.shape[1] * page} "
                                  "cached positions")
    G = N // K
    scale = H ** -0.5 if scale is None else scale
    pages = jnp.take_along_axis(block_tables[:, None, :], indices // page, axis=2)  # [B, T, Kt]
    slots = indices % page
    k = k_pages[pages, slots]  # [B, T, Kt, K, H]
    v = v_pages[pages, slots]
    allowed = (indices <= q_positions[:, :, None]) & (indices < kv_lengths[:, None, None])  # [B, T, Kt]
    scores = jnp.einsum("btkgh,btskh->bkgts", q.reshape(B, T, K, G, H), k, preferred_element_type=jnp.float32)
    scores = jnp.where(allowed[:, None, None], scores * scale, FLOOR)
    weights = softmax(scores, sinks)
    out = jnp.einsum("bkgts,btskh->btkgh", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, N, v.shape[-1]).astype(q.dtype)
