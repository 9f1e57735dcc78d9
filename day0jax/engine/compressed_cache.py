"""Compressed attention's cache as a layer sees it during one jitted step (DeepSeek-V4's CSA and HCA layers).

Three parts, each sized by what the model promises a long context costs:
- the uncompressed keys of the sliding window, in the layer's ring of pages (`paged_cache`), one head that is also
  the value (no value pool);
- the compressed entries (and, for an indexer, its index keys), one per `ratio` positions, in pools numbered as the
  page pool: the entries of a row's logical page i live in its page block_tables[b, i] (one page of entries per
  `ratio // page_size` pages when the ratio is larger), so they need no allocation of their own and leave with the
  sequence's pages;
- per sequence slot, the projections of its last `buffer` tokens (`StateCache` arrays, float32): the windows a
  step closes may begin before it. A verify step keeps them as they stand after each of its tokens, one slot each
  (`StateCache.targets`); a window closed by a rejected draft wrote an entry that no query sees (it lies past the
  sequence's length) until the window closes again on the accepted tokens and rewrites it.
A step `extend`s each buffer by its tokens, pools the windows that close in it (the layer), `store`s them, picks its
entries (`index_topk`, CSA) and attends (`attend_compressed`). Padding neither closes a window nor enters a buffer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from day0jax.engine.paged_cache import TRASH_PAGE, PagedKVCache
from day0jax.engine.state_cache import StateCache
from day0jax.layers.gated_delta_net import conv_states_per_token
from kernels_pallas.compressed_attention import api as compressed_op
from kernels_pallas.sparse_attention import api as sparse_op


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class CompressedCache:
    """One compressed layer's caches for this step's rows."""

    state: StateCache  # the projection buffers, one array per compressor (the layer's, then its indexer's)
    kv: PagedKVCache  # the window's keys, over the ring's block table
    entries: tuple[jax.Array, ...]  # [P, per_page, dim] entries, then [P, per_page, Di] index keys if any
    table: jax.Array  # [B, Wc] the entries' pages of each row: block_tables[:, ::stride]
    ratio: int = field(metadata=dict(static=True))

    @classmethod
    def from_pools(cls, pools: tuple, n_state: int, ratio: int, page_size: int, block_tables: jax.Array,
                   ring_table: jax.Array, kv_lengths: jax.Array, positions: jax.Array, slots: jax.Array,
                   targets: jax.Array | None = None) -> "CompressedCache":
        """The cache over a layer's pools in `paged_cache.new_pools`' order: its `n_state` buffers, the window's two
        (keys, and an empty value pool), then the entry pools; `targets`: a verify step's slot for the buffers after
        each token."""
        stride = max(1, ratio // page_size)
        return cls(StateCache.for_rows(pools[:n_state], slots, positions, kv_lengths, targets),
                   PagedKVCache.from_pools(pools[n_state:n_state + 2], ring_table, kv_lengths),
                   tuple(pools[n_state + 2:]), block_tables[:, ::stride], ratio)

    @property
    def pools(self) -> tuple:
        return self.state.pools + self.kv.pools + self.entries

    @property
    def kv_lengths(self) -> jax.Array:
        """[B] positions cached after this step's writes: the first position not yet known."""
        return self.kv.kv_lengths

    def update(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> "CompressedCache":
        """Writes the window's keys k [B, T, 1, H] (v: [B, T, 1, 0], the keys are the values)."""
        return dataclasses.replace(self, kv=self.kv.update(k, v, positions))

    def extend(self, i: int, proj: jax.Array) -> tuple["CompressedCache", jax.Array]:
        """Buffer `i`'s last tokens before this step, then this step's projections proj [B, T, F]: ([B, R + T, F],
        positions start - R ..), and the cache keeping the last R real ones (padding past a row's tokens left out);
        in a verify step (`state.targets`), the R up to each token t in t's target slot, so that whichever draft is
        the last accepted, the buffer after it survives."""
        pool, st = self.state.pools[i], self.state
        R = pool.shape[1]
        old = jnp.where(st.fresh[:, None, None], 0, pool[st.slots]).astype(proj.dtype)
        ext = jnp.concatenate([old, proj], axis=1)
        if st.targets is None:
            keep = jnp.take_along_axis(ext, (st.valid[:, None] + jnp.arange(R)[None, :])[:, :, None], axis=1)
            pool = pool.at[st.slots].set(keep.astype(pool.dtype))
        else:  # after token t, its last R projections, as a convolution's state after it
            pool = pool.at[st.targets].set(conv_states_per_token(old, proj, st.valid).astype(pool.dtype))
        pools = st.pools[:i] + (pool,) + st.pools[i + 1:]
        return dataclasses.replace(self, state=dataclasses.replace(st, pools=pools)), ext

    def store(self, i: int, entries: jax.Array, ids: jax.Array, complete: jax.Array) -> "CompressedCache":
        """Writes entries [B, C, dim] at entry indices ids [B, C] into pool `i`; incomplete ones go to the trash
        page."""
        pool = self.entries[i]
        per_page = pool.shape[1]
        W = self.table.shape[1]
        page_of = jnp.where(complete, ids // per_page, W)  # past the table: the trash page
        pages = jnp.take_along_axis(self.table, page_of, axis=1, mode="fill", fill_value=TRASH_PAGE)
        pool = pool.at[pages, ids % per_page].set(entries.astype(pool.dtype), mode="drop")
        return dataclasses.replace(self, entries=self.entries[:i] + (pool,) + self.entries[i + 1:])

    def index_topk(self, q: jax.Array, weights: jax.Array, last: jax.Array, *, topk: int,
                   scale: float) -> jax.Array:
        """The indexer's top-k entries per query (`sparse_attention.index_topk` over the row's index keys, entry c
        seen by queries whose `last` [B, T] entry is at least c): [B, T, Kt] entry indices."""
        keys = compressed_op.gather_pages(self.entries[1], self.table)
        return sparse_op.index_topk(q, keys, weights, topk=min(topk, keys.shape[1]), scale=scale, q_positions=last,
                                    kv_lengths=self.kv_lengths // self.ratio)

    def attend_compressed(self, q: jax.Array, positions: jax.Array, indices: jax.Array | None = None, *,
                          window: int, ratio: int, sinks: jax.Array | None, scale: float) -> jax.Array:
        """Queries [B, T, N, H] over their window and their entries (`indices` [B, T, Kt], or all)."""
        P, page, _, H = self.kv.k_pages.shape
        return compressed_op.paged_compressed_attention(
            q, self.kv.k_pages.reshape(P, page, H), self.kv.block_tables, self.entries[0], self.table,
            self.kv_lengths, positions, indices, window=window, ratio=ratio, sinks=sinks, scale=scale)
