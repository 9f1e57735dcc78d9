"""What each layer of a model keeps between steps, as the engine, the planner and the readiness report see it.

A model's `cache_layout()` gives one entry per layer: `KVLayer` (keys and values per token, in the page pool),
`SharedKV` (reads another layer's cache), `StateLayer` (a fixed-size state per sequence) or None (a layer that mixes
no tokens and keeps nothing: NemotronH's MLP and MoE layers).
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


@dataclass(frozen=True)
class StateLayer:
    """A layer that carries fixed-size float32 state per sequence (linear attention: its recurrent and convolution
    states) instead of caching every token: each array's per-sequence shape and the logical axes that split it, and
    what kind of token mixer it is, for reports. `kv`: a layer that also attends, beside its state mixer (Falcon-H1's
    attention and Mamba2 side by side), caches keys and values in the page pool too, as this `KVLayer` describes."""

    arrays: tuple[tuple[tuple[int, ...], tuple[str | None, ...]], ...]
    kind: str = "linear attention"
    kv: KVLayer | None = None

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
