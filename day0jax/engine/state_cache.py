"""Linear-attention state as a layer sees it during one jitted step: the layer's slot pools and this step's rows.

Each running sequence owns one slot (its index into every state pool) from admission to its end, the same slot in
every layer. Slot 0, like the trash page, belongs to no sequence: padding rows read and write it. A row whose first
position is 0 starts from zeros whatever its slot held, and padding tokens at the end of a row leave its state as
it was, so one program serves prefill chunks and decode rows alike.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

TRASH_SLOT = 0


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StateCache:
    """One layer's state pools plus the rows of this step."""

    pools: tuple[jax.Array, ...]  # per state array [S, *per-sequence shape], float32, donated and updated in place
    slots: jax.Array  # [B] int32 each row's slot
    fresh: jax.Array  # [B] bool: the row starts its sequence here, from a zero state
    valid: jax.Array  # [B] int32 real tokens of the row in this step; the rest of its T positions are padding

    @classmethod
    def for_rows(cls, pools: tuple[jax.Array, ...], slots: jax.Array, positions: jax.Array,
                 kv_lengths: jax.Array) -> "StateCache":
        """From the engine's batch: a row's real tokens sit at positions [p0, kv_length), padding beyond."""
        start = positions[:, 0]
        valid = jnp.clip(kv_lengths - start, 0, positions.shape[1]).astype(jnp.int32)
        return cls(tuple(pools), slots, start == 0, valid)

    def read(self) -> tuple[jax.Array, ...]:
        """Each state array for this step's rows, [B, *shape]; zeros for rows that start their sequence."""
        out = []
        for pool in self.pools:
            rows = pool[self.slots]
            out.append(jnp.where(self.fresh.reshape((-1,) + (1,) * (rows.ndim - 1)), 0, rows))
        return tuple(out)

    def write(self, states: tuple[jax.Array, ...]) -> "StateCache":
        """The cache with each row's new state stored in its slot."""
        pools = tuple(pool.at[self.slots].set(s.astype(pool.dtype)) for pool, s in zip(self.pools, states))
        return StateCache(pools, self.slots, self.fresh, self.valid)

    def token_mask(self, tokens: int) -> jax.Array:
        """[B, T] bool: which positions of each row are real tokens."""
        return jnp.arange(tokens)[None, :] < self.valid[:, None]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ParallelCache:
    """The caches of a layer that runs a state mixer and attention side by side (Falcon-H1): the layer hands each
    part to its mixer and returns `with_parts` of their updates."""

    state: StateCache
    kv: Any  # the attention's `PagedKVCache`

    @property
    def pools(self) -> tuple:
        """The layer's pools in `paged_cache.new_pools`' order: the state arrays, then the keys and values."""
        return self.state.pools + self.kv.pools

    def with_parts(self, state: StateCache, kv: Any) -> "ParallelCache":
        return dataclasses.replace(self, state=state, kv=kv)
