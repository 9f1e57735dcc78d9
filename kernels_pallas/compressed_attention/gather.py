"""Paged compressed attention that reads only what its queries see: the pages of the uncompressed ring that hold the
step's windows (not the ring's whole block table, which spans the context), and of the entries either the indexer's
top-k per query or, without an indexer, the row's entries (the context compressed `ratio` times). A decode step so
touches window + top-k keys whatever the context. Plain jax.numpy; taken on every backend before the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.attention.reference import FLOOR
from kernels_pallas.compressed_attention.reference import _softmax_with_sinks, entry_positions, gather_pages


def window_pages(q_positions: jax.Array, ring_table: jax.Array, page: int, window: int) -> tuple[jax.Array, jax.Array]:
    """The block-table slice holding every position the queries' windows reach: (pages [B, span], their first
    position [B]). A row's real queries are consecutive from q_positions[:, 0] (padding lies beyond them)."""
    B, W = ring_table.shape
    T = q_positions.shape[1]
    span = min(W, -(-(window - 1 + T) // page) + 1)
    first = jnp.clip((q_positions[:, 0] - window + 1) // page, 0, W - span)  # [B]
    pages = jnp.take_along_axis(ring_table, first[:, None] + jnp.arange(span)[None, :], axis=1)
    return pages, first * page


def paged_compressed_attention(q: jax.Array, k_pages: jax.Array, ring_table: jax.Array, c_pages: jax.Array | None,
                               c_table: jax.Array | None, kv_lengths: jax.Array, q_positions: jax.Array,
                               indices: jax.Array | None = None, *, window: int, ratio: int,
                               sinks: jax.Array | None = None, scale: float | None = None) -> jax.Array:
    """Same contract as `reference.paged_compressed_attention`.

    Raises:
        NotImplementedError: selected entries per query that would gather more than the row holds (a prefill chunk
            over a short context): the reference takes it.
    """
    B, T, N, H = q.shape
    page = k_pages.shape[1]
    scale = H ** -0.5 if scale is None else scale
    qpos = q_positions[:, :, None]
    pages, start = window_pages(q_positions, ring_table, page, window)
    k = k_pages[pages].reshape(B, -1, H)  # [B, Sw, H]
    s = start[:, None, None] + jnp.arange(k.shape[1])[None, None, :]
    mask = (s <= qpos) & (qpos - s < window) & (s < kv_lengths[:, None, None])
    scores = jnp.einsum("btnh,bsh->bnts", q, k, preferred_element_type=jnp.float32)
    parts = [(scores, mask, k)]
    if c_pages is not None:
        per_page, Wc = c_pages.shape[1], c_table.shape[1]
        last = entry_positions(q_positions, ratio)[:, :, None]
        counts = (kv_lengths // ratio)[:, None, None]
        if indices is not None and T * indices.shape[-1] <= Wc * per_page:
            ids = indices
            e = c_pages[jnp.take_along_axis(c_table[:, None, :], ids // per_page, axis=2, mode="clip"),
                        ids % per_page]  # [B, T, Kt, H]
            e_mask = (ids <= last) & (ids < counts) & (ids >= 0)
            e_scores = jnp.einsum("btnh,btsh->bnts", q, e.astype(q.dtype), preferred_element_type=jnp.float32)
            parts.append((e_scores, e_mask, e))
        elif indices is not None:
            raise NotImplementedError(f"{T} queries x {indices.shape[-1]} entries gather more than the "
                                      f"{Wc * per_page} the row holds")
        else:
            e = gather_pages(c_pages, c_table)  # [B, C, H]
            c = jnp.arange(e.shape[1])[None, None, :]
            e_scores = jnp.einsum("btnh,bsh->bnts", q, e.astype(q.dtype), preferred_element_type=jnp.float32)
            parts.append((e_scores, (c <= last) & (c < counts), e))
    scores = jnp.concatenate([jnp.where(m[:, None], x * scale, FLOOR) for x, m, _ in parts], axis=-1)
    weights = _softmax_with_sinks(scores, sinks)
    out = jnp.einsum("bnts,bsh->btnh", weights[..., :k.shape[1]].astype(k.dtype), k,
                     preferred_element_type=jnp.float32)
    if len(parts) > 1:
        e = parts[1][2]
        w = weights[..., k.shape[1]:].astype(e.dtype)
        spec = "bnts,btsh->btnh" if e.ndim == 4 else "bnts,bsh->btnh"
        out = out + jnp.einsum(spec, w, e, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)
