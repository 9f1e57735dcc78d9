"""The grouped matmul as tiles of one group's rows: each group's rows (contiguous, as the contract sorts them) are
cut into tiles of `tile` rows, and each tile is one [tile, D] x [D, F] product with its group's weights. The
reference multiplies each row by its own gathered copy of its group's weights, so a prefill of M routed rows reads
M expert matrices; here each non-empty tile reads one, so about M / tile + (experts in use) of them. Tiles past the
ones in use are skipped. Plain jax.numpy: the CPU's candidate (GPUs and TPUs have XLA's ragged_dot)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.moe.reference import dequantize_groups
from kernels_pallas.quantized_linear.reference import QuantizedWeight


def tile_rows(M: int, G: int) -> int:
    """Rows per tile: about a group's share of the rows (so that padding the last tile of each group costs about as
    much as the rows themselves at most), a power of two in [8, 128]."""
    share = max(1, M // max(G, 1))
    return min(128, max(8, 1 << (share.bit_length() - 1)))


def grouped_matmul(lhs: jax.Array, rhs: jax.Array | QuantizedWeight, group_sizes: jax.Array) -> jax.Array:
    """Same contract as `reference.grouped_matmul`.

    Raises:
        NotImplementedError: fewer rows than half the groups (a decode step of few rows over many experts): rows
            then rarely share an expert, and the reference, one row per gathered copy, reads no more and multiplies
            no padding (batch 1, top 8 of 64 experts: 3.1 ms against 3.6 here).
    """
    M, D = lhs.shape
    quantized = isinstance(rhs, QuantizedWeight)
    G, F = (rhs.codes.shape[0], rhs.codes.shape[1]) if quantized else (rhs.shape[0], rhs.shape[2])
    if 2 * M < G:
        raise NotImplementedError(f"{M} rows over {G} groups: few would share a tile")
    tile = tile_rows(M, G)
    # sum over groups of ceil(size / tile) <= M // tile + (non-empty groups): a static bound on the tiles.
    n_tiles = M // tile + min(M, G)
    sizes = group_sizes.astype(jnp.int32)
    tiles_of = (sizes + tile - 1) // tile
    tile_end = jnp.cumsum(tiles_of)
    index = jnp.arange(n_tiles, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tile_end, index, side="right"), G - 1).astype(jnp.int32)
    used = index < tile_end[-1]
    row_end = jnp.cumsum(sizes)
    # Each tile's group's first row, first tile and end row, in one gather (`group` is in range).
    table = jnp.stack([row_end - sizes, tile_end - tiles_of, row_end], axis=1)  # [G, 3]
    group_first_row, group_first_tile, group_end = table.at[group].get(mode="promise_in_bounds").T
    first = group_first_row + (index - group_first_tile) * tile
    rows = first[:, None] + jnp.arange(tile, dtype=jnp.int32)  # [n_tiles, tile]
    valid = used[:, None] & (rows < group_end[:, None])
    x = jnp.where(valid[..., None], jnp.take(lhs, jnp.where(valid, rows, 0), axis=0), 0)  # [n_tiles, tile, D]

    def product(x_tile, g):
        if quantized:  # one expert dequantized exactly, as the reference does per row
            return jnp.dot(x_tile.astype(jnp.float32), dequantize_groups(rhs, g[None])[0],
                           precision=jax.lax.Precision.HIGHEST)
        return jnp.dot(x_tile, jax.lax.dynamic_index_in_dim(rhs, g, keepdims=False),
                       preferred_element_type=jnp.float32)

    def one(args):
        x_tile, g, use = args
        return jax.lax.cond(use, product, lambda *_: jnp.zeros((tile, F), jnp.float32), x_tile, g)

    out = jax.lax.map(one, (x, group, used))  # [n_tiles, tile, F]
    scattered = jnp.zeros((M, F), jnp.float32).at[jnp.where(valid, rows, M)].set(out, mode="drop")
    return scattered.astype(lhs.dtype)
