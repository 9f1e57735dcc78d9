"""The paged KV cache as the model sees it: one layer's page pool plus the block tables of this step's rows.

Row b's token at position p lives in page `block_tables[b, p // page_size]`, slot `p % page_size`. Page 0, the trash
page, is never handed to a sequence: padding tokens get a position beyond the block table, which maps them there, so
their writes never land in a page holding live keys. Attention is the `kernels_pallas` paged attention op.

A sliding-window layer may keep only its window (`EngineLayout.rings`): its own pool holds R pages per running
sequence (ring g for the sequence holding state-slot group g), and its block table maps a row's logical page i to page
g * R + i % R (`ring_table`), so positions wrap around the ring. R pages cover the window plus the longest chunk
(a verify step's k + 1 tokens included), so every key a query sees is still there; the older keys that share its
pages lie outside the window, which attention masks, and so do a rejected draft's. Ring 0 holds the trash page.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from day0jax.core.errors import UnsupportedKVCache

from kernels_pallas.block_sparse_attention import api as block_op
from kernels_pallas.compressed_attention import api as compressed_op
from kernels_pallas.paged_attention import api as paged_op
from kernels_pallas.paged_attention import fp8
from kernels_pallas.sparse_attention import api as sparse_op

TRASH_PAGE = 0


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PagedKVCache:
    """One layer's view of the paged cache during one jitted step (the `KVCache` protocol of layers/attention.py)."""

    # k_pages, v_pages: None in the cache of a layer that reads another's (`with_kv_of`) and keeps only its indexer's
    k_pages: jax.Array | None  # [P, page_size, K, Hk], donated to the step and updated in place
    v_pages: jax.Array | None  # [P, page_size, K, Hv]; Hv may differ from Hk (multi-head latent attention)
    block_tables: jax.Array  # [B, W] int32 page ids per row; entries past a row's pages hold TRASH_PAGE
    kv_lengths: jax.Array  # [B] int32 valid cached tokens per row after this step's writes
    index_pages: jax.Array | None = None  # [P, page_size, Di] the sparse-attention indexer's keys, if the layer has one
    # [B, T] the last position each query sees (attention op's `visible_until`): set by vision-language models whose
    # image tokens attend to each other both ways; None: causal.
    visible_until: jax.Array | None = None

    @classmethod
    def from_pools(cls, pools: tuple, block_tables: jax.Array, kv_lengths: jax.Array) -> "PagedKVCache":
        """The cache over a layer's pools: (k, v), (k, v, index) or, for a `SharedKV` with an indexer, (index,)."""
        if len(pools) == 1:
            return cls(None, None, block_tables, kv_lengths, pools[0])
        return cls(pools[0], pools[1], block_tables, kv_lengths, pools[2] if len(pools) > 2 else None)

    @property
    def pools(self) -> tuple:
        """The arrays `from_pools` takes, updated."""
        return tuple(p for p in (self.k_pages, self.v_pages, self.index_pages) if p is not None)

    @property
    def page_size(self) -> int:
        return (self.index_pages if self.k_pages is None else self.k_pages).shape[1]

    def with_kv_of(self, source: "PagedKVCache") -> "PagedKVCache":
        """This layer's indexer pages over `source`'s keys and values, updated this step (a layer that attends over
        another's latent but picks its own top-k: Mistral Large 4's `reuse_but_indexer`)."""
        return dataclasses.replace(self, k_pages=source.k_pages, v_pages=source.v_pages)

    def without_kv(self) -> "PagedKVCache":
        """What such a layer hands back as its own: its indexer pages (the source's pages are the source's)."""
        return dataclasses.replace(self, k_pages=None, v_pages=None)

    def _slots(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        # Positions beyond the block table (how the engine marks padding) map to the trash page.
        pages = jnp.take_along_axis(self.block_tables, positions // self.page_size, axis=1, mode="fill",
                                    fill_value=TRASH_PAGE)
        return pages, positions % self.page_size

    @jax.named_scope("cache_write")
    def update(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> "PagedKVCache":
        """Writes k [B, T, K, Hk] and v [B, T, K, Hv] at `positions` [B, T]."""
        pages, slots = self._slots(positions)
        if fp8.is_quantized(self.k_pages):  # fp8 pages: quantized here, one scale per token and head
            return dataclasses.replace(self, k_pages=self.k_pages.write(pages, slots, k),
                                       v_pages=self.v_pages.write(pages, slots, v))
        k_pages = self.k_pages.at[pages, slots].set(k.astype(self.k_pages.dtype), mode="drop")
        v_pages = self.v_pages.at[pages, slots].set(v.astype(self.v_pages.dtype), mode="drop")
        return dataclasses.replace(self, k_pages=k_pages, v_pages=v_pages)

    def _plain(self, what: str) -> None:
        # `kv_cache_refusal` refuses these layers' families before any pool is made; this holds if a new family's
        # layout lets one through.
        if fp8.is_quantized(self.k_pages):
            raise UnsupportedKVCache(f"{what} over an fp8 KV cache is not implemented (use kv_cache_dtype='auto')",
                                     kind=what)

    def attend(self, q: jax.Array, positions: jax.Array, **kwargs) -> jax.Array:
        """Queries [B, T, N, H] at `positions` attend causally over each row's first `kv_lengths` positions."""
        if self.visible_until is not None:
            kwargs["visible_until"] = self.visible_until
        return paged_op.paged_attention(q, self.k_pages, self.v_pages, self.block_tables, self.kv_lengths,
                                        positions, **kwargs)

    def attend_compressed(self, q: jax.Array, positions: jax.Array, indices: jax.Array | None = None, *,
                          window: int, ratio: int, sinks: jax.Array | None, scale: float) -> jax.Array:
        """A compressed-attention layer without entries (DeepSeek-V4's sliding layers): queries [B, T, N, H] over the
        window of one head that is also the value (`compressed_cache.CompressedCache` for the layers with entries)."""
        self._plain("compressed attention")
        P, page, _, H = self.k_pages.shape
        return compressed_op.paged_compressed_attention(q, self.k_pages.reshape(P, page, H), self.block_tables, None,
                                                        None, self.kv_lengths, positions, None, window=window,
                                                        ratio=ratio, sinks=sinks, scale=scale)

    def index_topk(self, k: jax.Array, q: jax.Array, weights: jax.Array, positions: jax.Array, *, topk: int,
                   scale: float) -> tuple["PagedKVCache", jax.Array]:
        """Writes the indexer keys k [B, T, Di] at `positions`, then picks each query's top-k cached positions
        (`sparse_attention.index_topk` over the row's pages): (updated cache, indices [B, T, Kt])."""
        self._plain("the sparse-attention indexer")
        pages, slots = self._slots(positions)
        index_pages = self.index_pages.at[pages, slots].set(k.astype(self.index_pages.dtype), mode="drop")
        keys = sparse_op.gather_pages(index_pages, self.block_tables)
        indices = sparse_op.index_topk(q, keys, weights, topk=topk, scale=scale, q_positions=positions,
                                       kv_lengths=self.kv_lengths)
        return dataclasses.replace(self, index_pages=index_pages), indices

    def attend_sparse(self, q: jax.Array, positions: jax.Array, indices: jax.Array, *, scale: float,
                      sinks: jax.Array | None = None) -> jax.Array:
        """Queries attend over their selected positions only (`indices` [B, T, Kt], from `index_topk`); `sinks` [N]
        join each head's softmax denominator."""
        self._plain("sparse attention")
        return sparse_op.paged_sparse_attention(q, self.k_pages, self.v_pages, self.block_tables, self.kv_lengths,
                                                positions, indices, scale=scale, sinks=sinks)

    def attend_block_sparse(self, q: jax.Array, positions: jax.Array, iq: jax.Array, ik: jax.Array, *,
                            block_size: int, topk_blocks: int, local_blocks: int, scale: float | None = None,
                            block_keys=None) -> tuple["PagedKVCache", jax.Array]:
        """Writes the indexer keys ik [B, T, Di] at `positions`, then queries [B, T, N, H] attend over the key blocks
        the indexer queries iq [B, T, I, Di] keep among the cached ones (`block_sparse_attention`): (updated cache,
        [B, T, N, Hv]). `block_keys`: the "mean" pooling's, a function of the cached keys [B, S, Di] (gathered
        from the pages) -> the keys of their complete blocks (the layer's pooling, norm and rotation)."""
        self._plain("block-sparse attention")
        pages, slots = self._slots(positions)
        index_pages = self.index_pages.at[pages, slots].set(ik.astype(self.index_pages.dtype), mode="drop")
        if block_keys is not None:
            # Blocks past a row's keys are never complete for its queries, so the gathered width does not matter.
            kept = block_op.block_select(iq, block_keys(block_op.gather_pages(index_pages, self.block_tables)),
                                         block_size=block_size, topk_blocks=topk_blocks, local_blocks=local_blocks,
                                         q_positions=positions, kv_lengths=self.kv_lengths, pool="mean")
            cache = dataclasses.replace(self, index_pages=index_pages)
            return cache, cache.attend_blocks(q, positions, kept, block_size=block_size,
                                              most_blocks=topk_blocks + 1, scale=scale)
        out = block_op.paged_block_sparse_attention(q, self.k_pages, self.v_pages, index_pages, self.block_tables,
                                                    self.kv_lengths, positions, iq, block_size=block_size,
                                                    topk_blocks=topk_blocks, local_blocks=local_blocks, scale=scale)
        return dataclasses.replace(self, index_pages=index_pages), out

    def pooled_blocks(self, ik: jax.Array, positions: jax.Array, iq: jax.Array, weights: jax.Array, ape: jax.Array,
                      *, block_size: int, topk_blocks: int, scale: float) -> tuple["PagedKVCache", jax.Array]:
        """Writes the indexer's packed [key ; pooling logits] ik [B, T, 2 Di] at `positions`, then picks each query's
        blocks over the row's cached ones (`block_sparse_attention.pooled_block_select`): (updated cache, kept
        [B, 1, T, Nb] over the gathered length)."""
        self._plain("block-sparse attention")
        pages, slots = self._slots(positions)
        index_pages = self.index_pages.at[pages, slots].set(ik.astype(self.index_pages.dtype), mode="drop")
        packed = block_op.gather_pages(index_pages, self.block_tables)
        Di = packed.shape[-1] // 2
        kept = block_op.pooled_block_select(iq, weights, packed[..., :Di], packed[..., Di:], ape,
                                            block_size=block_size, topk_blocks=topk_blocks, scale=scale,
                                            q_positions=positions, kv_lengths=self.kv_lengths)
        return dataclasses.replace(self, index_pages=index_pages), kept

    def attend_blocks(self, q: jax.Array, positions: jax.Array, kept: jax.Array, *, block_size: int,
                      most_blocks: int, scale: float | None = None) -> jax.Array:
        """Queries [B, T, N, H] attend causally over the cached positions of the blocks `kept` [B, I, T, Nb] (from
        `pooled_blocks`, maybe another layer's over the same block tables; at most `most_blocks` per query)."""
        self._plain("block-sparse attention")
        return block_op.paged_attend_blocks(q, self.k_pages, self.v_pages, self.block_tables, self.kv_lengths,
                                            positions, kept, block_size=block_size, most_blocks=most_blocks,
                                            scale=scale)


def ring_table(slots: jax.Array, ring_pages: int, width: int) -> jax.Array:
    """[B, width] block table of rows whose sequences hold rings `slots` [B], for a layer whose pool is a ring of
    `ring_pages` pages per sequence."""
    return (slots[:, None] * ring_pages + jnp.arange(width, dtype=jnp.int32)[None, :] % ring_pages).astype(jnp.int32)


def layer_caches(pools: list, stateful: list[int], rings: list[int], block_tables: jax.Array, kv_lengths: jax.Array,
                 positions: jax.Array, state_slots: jax.Array, state_targets: jax.Array | None = None,
                 compressed: list | None = None, page_size: int = 0, state_copies: int = 1) -> list:
    """Each layer's cache for one step: a `StateCache` for state layers (`stateful[i]`: the number of their state
    arrays, the first of their pools; `state_targets`: a verify step's slot for the state after each token), a
    `PagedKVCache` over the shared block tables or, for a layer with a ring (`rings[i]` pages per sequence), over its
    ring table; a `ParallelCache` of both for a state layer that also attends (pools beyond its state arrays); a
    `CompressedCache` for a layer with compressed entries (`compressed[i]`, its `CompressedKV`, with the pool's
    `page_size`); None for a layer that keeps nothing of its own. A sequence's state slots come in groups of
    `state_copies` (`EngineLayout.state_copies`), and its ring is its group's: the same ring whichever slot of the
    group holds its state after a verify step."""
    from day0jax.engine.compressed_cache import CompressedCache
    from day0jax.engine.state_cache import ParallelCache, StateCache

    groups = (state_slots + state_copies - 1) // state_copies  # slot 0 -> ring 0, the trash's
    tables = {r: ring_table(groups, r, block_tables.shape[1]) for r in set(rings) if r}
    caches = []
    for i, (p, n, ring) in enumerate(zip(pools, stateful, rings)):
        if compressed and compressed[i] is not None:
            caches.append(CompressedCache.from_pools(p, n, compressed[i].ratio, page_size, block_tables,
                                                     tables.get(ring, block_tables), kv_lengths, positions,
                                                     state_slots, state_targets))
            continue
        kv = PagedKVCache.from_pools(p[n:], tables.get(ring, block_tables), kv_lengths) if p[n:] else None
        state = StateCache.for_rows(p[:n], state_slots, positions, kv_lengths, state_targets) if n else None
        caches.append(ParallelCache(state, kv) if state is not None and kv is not None else state or kv)
    return caches


def new_pools(layout: list, num_pages: int, page_size: int, state_slots: int, dtype, mesh=None,
              ring_pages=None, kv_cache_dtype: str = "auto", ring_slots: int = 0) -> list[tuple]:
    """Zeroed pools per layer, shaped from the model's `cache_layout()`: (k_pages, v_pages) for a `KVLayer`
    ([P, page_size, K, H] each, split like the kv heads), for a `StateLayer` one float32 [S, *shape] pool per
    state array (split like its heads), then its `kv` part's pools if it has one and its compressed entries' if it
    has some ([P, entries per page, dim], and the index keys'), for a `SharedKV` layer only its
    indexer's keys, if it has an indexer, and nothing for a layer that keeps nothing (None).

    Args:
        layout: the model's `cache_layout()`.
        num_pages, page_size: pages per layer (the trash page included), token slots per page.
        state_slots: sequence slots of state layers (the trash slot included).
        dtype: KV cache dtype.
        mesh: the mesh the pools live on (None: the default device).
        ring_pages: callable(window) -> pages per ring of a sliding-window layer that keeps only its window (0: the
            shared pool's `num_pages`); None: every layer keeps them all.
        ring_slots: rings of such a layer, one per running sequence and the trash's (0: `state_slots`).
        kv_cache_dtype: "auto" (keys and values in `dtype`) or "fp8" (`fp8.QuantPages`: float8 codes and float32
            scales, read back as `dtype`); `kv_cache_refusal` names the layouts fp8 cannot take.
    """
    from day0jax.core.cache_layout import SharedKV, StateLayer
    from sharding.rules import KV_POOL, named_sharding

    def zeros(shape, axes, dt):
        return jnp.zeros(shape, dt, device=None if mesh is None else named_sharding(axes, shape, mesh))

    def kv_pools(entry):
        ring = ring_pages(entry.window) if ring_pages else 0
        pages = (ring_slots or state_slots) * ring if ring else num_pages
        if kv_cache_dtype == "fp8":  # scales [P, page, K] split like the codes' kv heads
            pool = [fp8.QuantPages.zeros((pages, page_size, entry.kv_heads, d), dtype,
                                         lambda shape, dt: zeros(shape, KV_POOL[:len(shape)], dt))
                    for d in entry[1:3]]
        else:
            pool = [zeros((pages, page_size, entry.kv_heads, d), KV_POOL, dtype) for d in entry[1:3]]
        if entry.index_dim:  # the indexer's keys: one head, never split
            pool.append(zeros((num_pages, page_size, entry.index_dim), (None, None, None), dtype))
        return tuple(pool)

    pools = []
    for entry in layout:
        if entry is None:
            pools.append(())
        elif isinstance(entry, SharedKV):
            pools.append((zeros((num_pages, page_size, entry.index_dim), (None, None, None), dtype),)
                         if entry.index_dim else ())
        elif isinstance(entry, StateLayer):
            state = tuple(zeros((state_slots,) + shape, (None,) + axes, jnp.float32) for shape, axes in entry.arrays)
            c = entry.compressed
            # Compressed entries (and index keys), numbered as the page pool: one K=V head, never split.
            entries = () if c is None else tuple(zeros((num_pages, c.per_page(page_size), d), (None, None, None),
                                                       dtype) for d in (c.dim, c.index_dim) if d)
            pools.append(state + (kv_pools(entry.kv) if entry.kv is not None else ()) + entries)
        else:
            pools.append(kv_pools(entry))
    return pools


KV_CACHE_DTYPES = ("auto", "fp8")


def kv_cache_refusal(layout: list, family: str, kv_cache_dtype: str) -> None:
    """Refuses a `kv_cache_dtype` this model's cache kinds cannot take: fp8 covers the page pool's keys and values
    (standard and sliding-window attention, also a window's ring, and multi-head latent attention's latent, all
    written by `PagedKVCache.update` and read by `attend`), not the sparse-attention indexer's keys nor compressed
    attention's entries and windows.

    Args:
        layout: the model's `cache_layout()`.
        family: its model_type, for the message.
        kv_cache_dtype: one of KV_CACHE_DTYPES (as `EngineConfig` checks it).
    Raises:
        UnsupportedKVCache: naming the first cache kind that fp8 does not cover, and the family.
    """
    from day0jax.core.cache_layout import KVLayer, SharedKV, StateLayer

    if kv_cache_dtype == "auto":
        return
    for i, entry in enumerate(layout):
        kind = None
        if isinstance(entry, SharedKV) and entry.index_dim or isinstance(entry, KVLayer) and entry.index_dim:
            kind = "sparse-attention indexer keys"
        elif isinstance(entry, StateLayer) and entry.compressed is not None:
            kind = "compressed attention entries"
        elif isinstance(entry, KVLayer) and entry.v_dim == 0:
            kind = "compressed attention's window (one head that is key and value)"
        elif isinstance(entry, StateLayer) and entry.kv is not None and entry.kv.index_dim:
            kind = "sparse-attention indexer keys"
        if kind is not None:
            raise UnsupportedKVCache(f"kv_cache_dtype={kv_cache_dtype!r} is not implemented for {kind} (layer {i} "
                                     f"of this {family} model); use kv_cache_dtype='auto'", kind=kind, family=family)
