"""The definition of a correct grouped matmul, in plain jax.numpy; also the fallback on every backend.

Contract (`jax.lax.ragged_dot`'s): lhs [M, D] rows sorted by group, group g owning the next group_sizes[g] rows;
out[m] = lhs[m] @ rhs[g(m)], rhs [G, D, F]; rows past sum(group_sizes) are zero. Each row gathers its own group's
weights, ROW_CHUNK rows at a time to bound memory: work grows with the rows (tokens x chosen experts), never with
every expert for every token as in a dense masked form (or XLA's generic `ragged_dot` expansion on the CPU).
Quantized experts (a `QuantizedWeight` whose codes are [G, F, D'], each group's [F, D] map as
`quantized_linear` stores it) are dequantized exactly, only the gathered ones, then multiplied in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.quantized_linear.reference import QuantizedWeight, dequantize

ROW_CHUNK = 16


def dequantize_groups(w: QuantizedWeight, groups: jax.Array | None = None) -> jax.Array:
    """Groups `groups` (all when None) of stacked quantized maps, codes [G, F, D'], as float32 [n, D, F]."""
    pick = (lambda a: a) if groups is None else (lambda a: jnp.take(a, groups, axis=0))  # noqa: E731
    codes, scale = pick(w.codes), pick(w.scale)
    offset = None if w.offset is None else pick(w.offset)
    glob = None if w.global_scale is None else pick(w.global_scale)
    n, F = codes.shape[:2]
    flat = QuantizedWeight(codes.reshape(n * F, -1), scale.reshape(n * F, -1),
                           None if offset is None else offset.reshape(n * F, -1), w.kind, w.group,
                           None if glob is None else glob.reshape(n * F, 1))
    return jnp.swapaxes(dequantize(flat).reshape(n, F, -1), 1, 2)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array | QuantizedWeight, group_sizes: jax.Array) -> jax.Array:
    """[M, D] x [G, D, F] (or quantized experts) with group sizes [G] -> [M, F] in lhs's dtype (float32
    accumulation)."""
    M, D = lhs.shape
    quantized = isinstance(rhs, QuantizedWeight)
    G, F = (rhs.codes.shape[0], rhs.codes.shape[1]) if quantized else (rhs.shape[0], rhs.shape[2])
    group_of_row = jnp.repeat(jnp.arange(G, dtype=jnp.int32), group_sizes, total_repeat_length=M)
    valid = jnp.arange(M) < jnp.sum(group_sizes)
    pad = (-M) % ROW_CHUNK
    rows = jnp.pad(lhs, ((0, pad), (0, 0))).reshape(-1, ROW_CHUNK, D)
    groups = jnp.pad(group_of_row, (0, pad)).reshape(-1, ROW_CHUNK)

    def chunk(args):
        x, g = args
        if quantized:
            return jnp.einsum("md,mdf->mf", x.astype(jnp.float32), dequantize_groups(rhs, g),
                              precision=jax.lax.Precision.HIGHEST)
        return jnp.einsum("md,mdf->mf", x, rhs[g], preferred_element_type=jnp.float32)

    out = jax.lax.map(chunk, (rows, groups)).reshape(-1, F)[:M]
    return jnp.where(valid[:, None], out, 0).astype(lhs.dtype)
