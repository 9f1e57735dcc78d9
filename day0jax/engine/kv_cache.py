"""A contiguous KV cache: one [B, S, K, H] key and value buffer per layer, written in place.

Row b holds one sequence; its token at position p lives at index p. `attend_len` (static) bounds how much of
the buffer attention reads, so a short sequence in a long buffer does not pay for the whole buffer; each
value of it is one compiled program, which is why callers bucket it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from kernels_pallas.attention import api as attention_op


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DenseKVCache:
    k: jax.Array  # [B, S, K, H]
    v: jax.Array  # [B, S, K, H]
    attend_len: int = field(metadata=dict(static=True))

    @classmethod
    def zeros(cls, batch: int, length: int, kv_heads: int, k_dim: int, v_dim: int, dtype,
              sharding=None) -> "DenseKVCache":
        """An empty cache; keys and values may have different head dims (multi-head latent attention)."""
        k = jnp.zeros((batch, length, kv_heads, k_dim), dtype, device=sharding)
        v = jnp.zeros((batch, length, kv_heads, v_dim), dtype, device=sharding)
        return cls(k, v, length)

    def with_attend_len(self, attend_len: int) -> "DenseKVCache":
        return DenseKVCache(self.k, self.v, min(attend_len, self.k.shape[1]))

    def update(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> "DenseKVCache":
        """Writes k, v [B, T, K, H] at `positions` [B, T]; positions past the buffer are dropped."""
        B, T = positions.shape
        rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
        new_k = self.k.at[rows, positions].set(k.astype(self.k.dtype), mode="drop")
        new_v = self.v.at[rows, positions].set(v.astype(self.v.dtype), mode="drop")
        return DenseKVCache(new_k, new_v, self.attend_len)

    def attend(self, q: jax.Array, positions: jax.Array, **kwargs) -> jax.Array:
        """Queries [B, T, N, H] at `positions` attend causally over the first `attend_len` cached positions."""
        k, v = self.k[:, :self.attend_len], self.v[:, :self.attend_len]
        return attention_op.attention(q, k, v, q_positions=positions, kv_lengths=positions[:, -1] + 1, **kwargs)
