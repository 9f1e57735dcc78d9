"""The paged KV cache as the model sees it: one layer's page pool plus the block tables of this step's rows.

Row b's token at position p lives in page `block_tables[b, p // page_size]`, slot `p % page_size`. Page 0, the trash
page, is never handed to a sequence: padding tokens get a position beyond the block table, which maps them there, so
their writes never land in a page holding live keys. Attention is the `kernels_pallas` paged attention op.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from kernels_pallas.paged_attention import api as paged_op

TRASH_PAGE = 0


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PagedKVCache:
    """One layer's view of the paged cache during one jitted step (the `KVCache` protocol of layers/attention.py)."""

    k_pages: jax.Array  # [P, page_size, K, Hk], donated to the step and updated in place
    v_pages: jax.Array  # [P, page_size, K, Hv]; Hv may differ from Hk (multi-head latent attention)
    block_tables: jax.Array  # [B, W] int32 page ids per row; entries past a row's pages hold TRASH_PAGE
    kv_lengths: jax.Array  # [B] int32 valid cached tokens per row after this step's writes

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    def update(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> "PagedKVCache":
        """Writes k [B, T, K, Hk] and v [B, T, K, Hv] at `positions` [B, T]; positions beyond the block table (how
        the engine marks padding) go to the trash page."""
        page = self.page_size
        blocks = positions // page
        pages = jnp.take_along_axis(self.block_tables, blocks, axis=1, mode="fill", fill_value=TRASH_PAGE)
        slots = positions % page
        k_pages = self.k_pages.at[pages, slots].set(k.astype(self.k_pages.dtype), mode="drop")
        v_pages = self.v_pages.at[pages, slots].set(v.astype(self.v_pages.dtype), mode="drop")
        return PagedKVCache(k_pages, v_pages, self.block_tables, self.kv_lengths)

    def attend(self, q: jax.Array, positions: jax.Array, **kwargs) -> jax.Array:
        """Queries [B, T, N, H] at `positions` attend causally over each row's first `kv_lengths` positions."""
        return paged_op.paged_attention(q, self.k_pages, self.v_pages, self.block_tables, self.kv_lengths,
                                        positions, **kwargs)


def new_pools(layout: list[tuple[int, int, int]], num_pages: int, page_size: int, dtype,
              sharding_for=None) -> list[tuple[jax.Array, jax.Array]]:
    """Zeroed (k_pages, v_pages) per layer, shaped from the model's `cache_layout()`.

    Args:
        layout: per layer (kv heads, key head dim, value head dim).
        num_pages, page_size: pages per layer (the trash page included), token slots per page.
        dtype: cache dtype.
        sharding_for: optional callable (shape) -> sharding for a pool (kv heads split like the model's).
    Returns:
        One (k_pages, v_pages) pair per layer.
    """
    pools = []
    for kv_heads, k_dim, v_dim in layout:
        k_shape, v_shape = (num_pages, page_size, kv_heads, k_dim), (num_pages, page_size, kv_heads, v_dim)
        pools.append(tuple(jnp.zeros(s, dtype, device=sharding_for(s) if sharding_for else None)
                           for s in (k_shape, v_shape)))
    return pools
