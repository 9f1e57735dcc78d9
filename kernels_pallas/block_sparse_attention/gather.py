"""Paged block-sparse attention that reads only the kept blocks' keys: each query's kept blocks (at most
`most_blocks` of them) become the positions they hold, which are gathered from the pages (page block_tables[b,
s // page_size], slot s % page_size) per KV group, so a decode step reads most_blocks x block_size keys per group
whatever the context. The indexer still scores every cached index key (its keys are small, and the choice needs
them all). Plain jax.numpy; taken on every backend before the reference, which gathers every page of the row."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.block_sparse_attention.reference import block_select, gather_pages
from kernels_pallas.sparse_attention.reference import FLOOR


def kept_positions(kept: jax.Array, block_size: int, most_blocks: int) -> tuple[jax.Array, jax.Array]:
    """kept [B, G, T, Nb] bool -> (positions [B, G, T, P], whether each is a kept block's) with P = M * block_size,
    M = min(most_blocks, Nb): the kept blocks first, in order, then blocks marked not kept."""
    Nb = kept.shape[-1]
    M = min(most_blocks, Nb)
    rank, blocks = jax.lax.top_k(jnp.where(kept, Nb - jnp.arange(Nb), 0), M)  # earlier blocks rank higher
    shape = (*kept.shape[:-1], M * block_size)
    positions = (blocks[..., None] * block_size + jnp.arange(block_size)).reshape(shape)
    return positions, jnp.repeat(rank > 0, block_size, axis=-1)


def paged_attend_blocks(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                        kv_lengths: jax.Array, q_positions: jax.Array, kept: jax.Array, *, block_size: int,
                        most_blocks: int, scale: float | None = None) -> jax.Array:
    """Same contract as `reference.paged_attend_blocks`.

    Raises:
        NotImplementedError: indexer heads that do not divide the kv heads (a KV group reading several choices), or
            more kept positions over the queries than the row's pages hold (a prefill chunk over a short context:
            the reference reads less).
    """
    B, T, N, H = q.shape
    _, page, K, _ = k_pages.shape
    I = kept.shape[1]
    S = block_tables.shape[1] * page
    if K % I:
        raise NotImplementedError(f"{I} indexer heads over {K} kv heads: a KV group would read several choices")
    positions, kept_block = kept_positions(jnp.repeat(kept, K // I, axis=1), block_size, most_blocks)
    if T * positions.shape[-1] > S:
        raise NotImplementedError(f"{T} queries x {positions.shape[-1]} kept positions gather more than the {S} "
                                  "cached positions")
    scale = H ** -0.5 if scale is None else scale
    allowed = (kept_block & (positions <= q_positions[:, None, :, None])
               & (positions < kv_lengths[:, None, None, None]))  # [B, K, T, P]
    safe = jnp.minimum(positions, S - 1)
    pages = jnp.take_along_axis(block_tables[:, None, None, :], safe // page, axis=-1)
    heads = jnp.arange(K)[None, :, None, None]
    k, v = k_pages[pages, safe % page, heads], v_pages[pages, safe % page, heads]  # [B, K, T, P, H]
    scores = jnp.einsum("btkgh,bktph->bkgtp", q.reshape(B, T, K, N // K, H), k, preferred_element_type=jnp.float32)
    scores = jnp.where(allowed[:, :, None], scores * scale, FLOOR)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgtp,bktph->btkgh", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, N, v.shape[-1]).astype(q.dtype)


def paged_block_sparse_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, index_pages: jax.Array,
                                 block_tables: jax.Array, kv_lengths: jax.Array, q_positions: jax.Array,
                                 iq: jax.Array, *, block_size: int, topk_blocks: int, local_blocks: int,
                                 scale: float | None = None) -> jax.Array:
    """Same contract as `reference.paged_block_sparse_attention` (max pooling: the forced local blocks are among
    the `topk_blocks` kept)."""
    kept = block_select(iq, gather_pages(index_pages, block_tables), block_size=block_size, topk_blocks=topk_blocks,
                        local_blocks=local_blocks, q_positions=q_positions, kv_lengths=kv_lengths)
    return paged_attend_blocks(q, k_pages, v_pages, block_tables, kv_lengths, q_positions, kept,
                               block_size=block_size, most_blocks=topk_blocks, scale=scale)
