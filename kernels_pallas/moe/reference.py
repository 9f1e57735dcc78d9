"""The definition of a correct grouped matmul, in plain jax.numpy; also the fallback on every backend.

Contract (`jax.lax.ragged_dot`'s): lhs [M, D] rows sorted by group, group g owning the next group_sizes[g] rows;
out[m] = lhs[m] @ rhs[g(m)], rhs [G, D, F]; rows past sum(group_sizes) are zero. Each row gathers its own group's
weights, ROW_CHUNK rows at a time to bound memory: work grows with the rows (tokens x chosen experts), never with
every expert for every token as in a dense masked form (or XLA's generic `ragged_dot` expansion on the CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ROW_CHUNK = 16


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """[M, D] x [G, D, F] with group sizes [G] -> [M, F] in lhs's dtype (float32 accumulation)."""
    M, D = lhs.shape
    G, _, F = rhs.shape
    group_of_row = jnp.repeat(jnp.arange(G, dtype=jnp.int32), group_sizes, total_repeat_length=M)
    valid = jnp.arange(M) < jnp.sum(group_sizes)
    pad = (-M) % ROW_CHUNK
    rows = jnp.pad(lhs, ((0, pad), (0, 0))).reshape(-1, ROW_CHUNK, D)
    groups = jnp.pad(group_of_row, (0, pad)).reshape(-1, ROW_CHUNK)

    def chunk(args):
        x, g = args
        return jnp.einsum("md,mdf->mf", x, rhs[g], preferred_element_type=jnp.float32)

    out = jax.lax.map(chunk, (rows, groups)).reshape(-1, F)[:M]
    return jnp.where(valid[:, None], out, 0).astype(lhs.dtype)
