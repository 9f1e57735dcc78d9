"""The definition of correct paged attention, in plain jax.numpy; also the fallback on every backend.

Token p of sequence b lives in page block_tables[b, p // page_size] at slot p % page_size of one layer's pool.
Table entries past a sequence's pages may hold any page index: `kv_lengths` masks them.
"""

from __future__ import annotations

import jax

from kernels_pallas.attention import reference as dense


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                    kv_lengths: jax.Array, q_positions: jax.Array, *, sliding_window: int | None = None,
                    logit_softcap: float | None = None, sinks: jax.Array | None = None,
                    scale: float | None = None, chunk_size: int | None = None,
                    visible_until: jax.Array | None = None) -> jax.Array:
    """Causal attention of q over each sequence's pages, as `attention.reference` over them gathered contiguously.

    Args:
        q: [B, T, N, H].
        k_pages, v_pages: [P, page_size, K, H], one layer's pool: arrays, or `fp8.QuantPages` (float8 codes and
            scales; indexing dequantizes the gathered pages).
        block_tables: [B, max_blocks] int32 page indices.
        kv_lengths: [B] int32, valid cached tokens per sequence (including this call's new ones).
        q_positions: [B, T] int32.
        sliding_window, logit_softcap, sinks, scale, chunk_size, visible_until: as in `attention.reference.attention`.
    Returns:
        [B, T, N, H] in q's dtype.
    """
    B, max_blocks = block_tables.shape
    _, page, K, H = k_pages.shape
    k = k_pages[block_tables].reshape(B, max_blocks * page, K, H)
    v = v_pages[block_tables].reshape(B, max_blocks * page, K, v_pages.shape[-1])  # Hv may differ (MLA)
    return dense.attention(q, k, v, q_positions=q_positions, kv_lengths=kv_lengths, causal=True,
                           sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks, scale=scale,
                           chunk_size=chunk_size, visible_until=visible_until)
