"""The paged KV cache as the model sees it: one layer's page pool plus the block tables of this step's rows.

A pool holds `P` pages of `page_size` token slots, [P, page_size, K, H] for keys and for values (their head
dims may differ: multi-head latent attention). Row b of a step owns the pages `block_tables[b, :]` in order, so
its token at position p lives in page `block_tables[b, p // page_size]`, slot `p % page_size`.

Page 0 is never handed to a sequence: it is the trash page. Padding tokens (past a row's real tokens, or whole
padding rows) are given a position beyond the block table, which maps them to page 0, so their writes can never
land in a page that holds live keys. Attention goes through the `kernels_pallas` paged attention op.
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
    """One layer's view of the paged cache during one jitted step (the `KVCache` protocol of layers/attention.py).

    Attributes:
        k_pages: [P, page_size, K, Hk] key pool (donated to the step, updated in place).
        v_pages: [P, page_size, K, Hv] value pool.
        block_tables: [B, W] int32 page ids per row; entries past a row's pages hold TRASH_PAGE.
        kv_lengths: [B] int32 valid cached tokens per row after this step's writes.
    """

    k_pages: jax.Array
    v_pages: jax.Array
    block_tables: jax.Array
    kv_lengths: jax.Array

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    def update(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> "PagedKVCache":
        """Writes k [B, T, K, Hk] and v [B, T, K, Hv] at `positions` [B, T].

        Positions whose block index falls outside the block table (how the engine marks padding) go to the
        trash page.
        """
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
        num_pages: pages per layer, the trash page included.
        page_size: token slots per page.
        dtype: cache dtype.
        sharding_for: optional callable (shape) -> sharding for a pool (kv heads split like the model's).
    Returns:
        A list with one (k_pages, v_pages) pair per layer.
    """
    pools = []
    for kv_heads, k_dim, v_dim in layout:
        k_shape, v_shape = (num_pages, page_size, kv_heads, k_dim), (num_pages, page_size, kv_heads, v_dim)
        k_sharding = sharding_for(k_shape) if sharding_for else None
        v_sharding = sharding_for(v_shape) if sharding_for else None
        pools.append((jnp.zeros(k_shape, dtype, device=k_sharding), jnp.zeros(v_shape, dtype, device=v_sharding)))
    return pools
