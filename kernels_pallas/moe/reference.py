"""The definition of a correct grouped matmul, in plain jax.numpy. Also the fallback on every backend.

Contract (as `jax.lax.ragged_dot`): lhs [M, D] holds rows sorted by group; group g owns the next
`group_sizes[g]` rows; out[m] = lhs[m] @ rhs[g(m)], with rhs [G, D, F]. Rows past sum(group_sizes) are zero.

Each row gathers its own group's weight matrix, in chunks of rows so memory stays bounded. The work is
proportional to the rows (tokens x chosen experts), never to every expert for every token, which a dense
masked formulation (and XLA's generic `ragged_dot` expansion on the CPU) would cost.
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
