"""What each layer of a model keeps between steps, as the engine, the planner and the readiness report see it.

A model's `cache_layout()` gives one entry per layer: `KVLayer` (keys and values per token, in the page pool),
`SharedKV` (reads another layer's cache), `StateLayer` (a fixed-size state per sequence; with `compressed`, also
entries per block of positions: DeepSeek-V4's compressed attention) or None (a layer that mixes no tokens and keeps
nothing: NemotronH's MLP and MoE layers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple


class KVLayer(NamedTuple):
    """A layer that caches keys and values in the page pool, per token: K kv heads of key and value head dims, and
    for indexed sparse attention the indexer's key (one head of `index_dim`, 0: none). `window`: a sliding-window
    layer's window (0: it attends over every position), whose pool the engine may keep to the window
    (`Workload.window_slots`)."""

    kv_heads: int
    k_dim: int
    v_dim: int
    index_dim: int = 0
    window: int = 0

    @property
    def token_elements(self) -> int:
        """Cached numbers per token (before any split over devices)."""
        return self.kv_heads * (self.k_dim + self.v_dim) + self.index_dim


class SharedKV(NamedTuple):
    """A layer that attends over the keys and values another layer (`source`, earlier) cached: nothing of its own is
    allocated (Gemma 4's KV sharing), except, with `index_dim`, its sparse-attention indexer's key per token (one
    head of `index_dim`: Mistral Large 4's layers that read another's latent but pick their own top-k)."""

    source: int
    index_dim: int = 0


class CompressedKV(NamedTuple):
    """Compressed entries a layer caches: one per `ratio` positions, `dim` numbers (its key, also its value) and, for
    an indexer, `index_dim` more (its index key). They live in pages of their own, numbered as the page pool's: the
    entries of positions [i page, (i + 1) page) in page i, `per_page(page_size)` of them (a ratio above the page
    size: one per `ratio // page_size` pages, in the first)."""

    ratio: int
    dim: int
    index_dim: int = 0

    def per_page(self, page_size: int) -> int:
        """Entries one page of the pool holds.

        Raises:
            ValueError: a page size that is neither a multiple nor a divisor of the ratio.
        """
        if page_size % self.ratio and self.ratio % page_size:
            raise ValueError(f"page size {page_size} and compression ratio {self.ratio} must divide one another")
        return max(1, page_size // self.ratio)

    def stride(self, page_size: int) -> int:
        """Pages of the pool per page of entries (1 unless the ratio exceeds the page size)."""
        return max(1, self.ratio // page_size)

    def entries(self, token_slots: int, page_size: int) -> int:
        """Entry slots beside a page pool of `token_slots` token slots."""
        return token_slots // page_size * self.per_page(page_size)


@dataclass(frozen=True)
class StateLayer:
    """A layer that carries fixed-size float32 state per sequence (linear attention: its recurrent and convolution
    states) instead of caching every token: each array's per-sequence shape and the logical axes that split it, and
    what kind of token mixer it is, for reports. `kv`: a layer that also attends, beside its state mixer (Falcon-H1's
    attention and Mamba2 side by side), caches keys and values in the page pool too, as this `KVLayer` describes.
    `compressed`: its compressed entries (`CompressedKV`; the state then holds the projections of the tokens whose
    block is not complete yet)."""

    arrays: tuple[tuple[tuple[int, ...], tuple[str | None, ...]], ...]
    kind: str = "linear attention"
    kv: KVLayer | None = None
    compressed: CompressedKV | None = None

    @property
    def bytes_per_sequence(self) -> int:
        return sum(math.prod(shape) for shape, _ in self.arrays) * 4


def kv_part(entry) -> KVLayer | None:
    """What a `cache_layout()` entry caches per token in the page pool: a `KVLayer` itself, a `StateLayer`'s `kv`,
    else None."""
    return entry if isinstance(entry, KVLayer) else entry.kv if isinstance(entry, StateLayer) else None


def layer_windows(cache_layout) -> list[int]:
    """The sliding windows of a model's KV layers (0: full attention), from its `cache_layout()`."""
    return [kv.window for kv in map(kv_part, cache_layout) if kv is not None]
