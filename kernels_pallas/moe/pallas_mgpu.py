"""Grouped matmul (the `ragged_dot` contract) as a Mosaic GPU (Hopper) kernel.

The wrapper cuts the group-sorted rows into `block_m`-row blocks and lists the (row block, group) pairs that
overlap: one for a block inside one group, k + 1 for a block straddling k boundaries, none for an empty group. That
list (at most cdiv(M, block_m) + G - 1 long, fixed at trace time; pairs past the real count exit at once), times
the `block_n`-column blocks of the output, is the grid. Each CUDA block computes its pair's whole block_m x block_n
tile, lhs rows x rhs[group], with a TMA/wgmma pipeline over the contraction, into its own slot of a
[pairs, block_m, F] buffer: no partial-row stores, atomics or read-modify-write. A jnp gather then picks each row
from its own group's pair. Rows of other groups in a tile are computed and dropped: waste bounded by the boundary
blocks (and in decode, with a handful of rows per expert, the weights' bytes, not the arithmetic, are the cost).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas import platform, tuning
from kernels_pallas.quantized_linear.reference import QuantizedWeight


@dataclasses.dataclass(frozen=True)
class Blocks:
    """block_m rows x block_n columns per CUDA block; block_k of the contraction per pipeline step."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    steps: int = 4


def _heuristic(shape_class: str, *, rows: int, groups: int, n: int, **_) -> Blocks:
    # Few rows per group (decode, or many experts): 64-row blocks waste less on rows of other groups.
    block_m = 64 if rows <= 64 * groups else 128
    block_n = 128 if n % 128 == 0 else 64
    return Blocks(block_m, block_n, 64, 4)


TABLE: tuning.BlockTable[Blocks] = tuning.BlockTable("moe.mosaic_gpu", _heuristic, {
    ("h100", "prefill"): tuning.Entry(Blocks(128, 128, 64, 4), "seed"),
    ("h100", "decode"): tuning.Entry(Blocks(64, 128, 64, 4), "seed"),
    ("h200", "prefill"): tuning.Entry(Blocks(128, 128, 64, 4), "seed"),
    ("h200", "decode"): tuning.Entry(Blocks(64, 128, 64, 4), "seed"),
})


def shape_class(rows: int, groups: int) -> str:
    return "decode" if rows <= 64 * groups else "prefill"


def _check(lhs, rhs, group_sizes, blocks: Blocks) -> None:
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1] or group_sizes.shape != rhs.shape[:1]:
        raise NotImplementedError(f"needs lhs [M, D], rhs [G, D, F], group_sizes [G]; got {lhs.shape}, "
                                  f"{rhs.shape}, {group_sizes.shape}")
    if jnp.dtype(lhs.dtype) != jnp.dtype(rhs.dtype) or jnp.dtype(lhs.dtype) not in (
            jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise NotImplementedError(f"needs lhs and rhs both bfloat16 or both float16; got {lhs.dtype}, {rhs.dtype}")
    D, F = rhs.shape[1], rhs.shape[2]
    if D % blocks.block_k:
        raise NotImplementedError(f"contraction {D} is not a multiple of block_k {blocks.block_k}")
    if F % blocks.block_n or blocks.block_n > 256:
        raise NotImplementedError(f"output width {F} is not a multiple of block_n {blocks.block_n} (<= 256)")
    if blocks.block_m % 64:
        raise NotImplementedError(f"block_m {blocks.block_m} is not a multiple of 64")
    if blocks.steps < 2:  # a slot is released one step after its wgmma: two slots at least
        raise NotImplementedError(f"steps {blocks.steps} < 2")


def pair_table(group_sizes: jax.Array, rows: int, block_m: int):
    """The (row block, group) pairs the kernel computes, padded to the static bound, and for each row the
    index of the buffer row that holds its result.

    Returns:
        (pair_block [P], pair_group [P], pair_valid [P], source_row [M], row_valid [M]) int32 / bool, with
        P = cdiv(M, block_m) + G - 1.
    """
    G = group_sizes.shape[0]
    n_pairs = -(-rows // block_m) + G - 1
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // block_m
    last = (jnp.maximum(ends, 1) - 1) // block_m
    count = jnp.where(sizes > 0, last - first + 1, 0)
    pair_end = jnp.cumsum(count)
    pair_start = pair_end - count
    p = jnp.arange(n_pairs, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(pair_end, p, side="right"), G - 1).astype(jnp.int32)
    block = (first[group] + p - pair_start[group]).astype(jnp.int32)
    valid = p < pair_end[-1]
    r = jnp.arange(rows, dtype=jnp.int32)
    row_group = jnp.minimum(jnp.searchsorted(ends, r, side="right"), G - 1)
    row_pair = pair_start[row_group] + r // block_m - first[row_group]
    row_valid = r < ends[-1]
    source = jnp.where(row_valid, row_pair * block_m + r % block_m, 0).astype(jnp.int32)
    return jnp.where(valid, block, 0), group, valid.astype(jnp.int32), source, row_valid


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, interpret: Any = False,
                   blocks: Blocks | None = None) -> jax.Array:
    """The contract of `reference.grouped_matmul`, on a Hopper GPU (or in the interpreter).

    Args:
        lhs: [M, D] rows sorted by group.
        rhs: [G, D, F].
        group_sizes: [G] int.
        interpret: True or `plgpu.InterpretGPUParams` (tests: detect_races=True) to run in the CPU interpreter.
        blocks: block sizes; default from `TABLE`.
    Returns:
        [M, F] in lhs's dtype, float32 accumulation; rows past sum(group_sizes) are zero.
    Raises:
        NotImplementedError: not a Hopper target, or shapes / dtypes the kernel does not take.
    """
    if isinstance(rhs, QuantizedWeight):
        raise NotImplementedError("moe.mosaic_gpu multiplies float experts; quantized ones take the reference")
    target = platform.require_hopper("moe.mosaic_gpu", interpret)
    M, D = lhs.shape
    G, _, F = rhs.shape if rhs.ndim == 3 else (0, 0, 0)
    blocks = blocks or TABLE.lookup(target.kind, shape_class(M, max(G, 1)), rows=M, groups=max(G, 1), n=F)
    _check(lhs, rhs, group_sizes, blocks)
    bm = blocks.block_m
    Mp = -(-M // bm) * bm
    lhs_p = jnp.pad(lhs, ((0, Mp - M), (0, 0))) if Mp != M else lhs
    pair_block, pair_group, pair_valid, source, row_valid = pair_table(group_sizes, M, bm)
    buf = _call(lhs_p, rhs, pair_block, pair_group, pair_valid, blocks=blocks, interpret=interpret)
    out = jnp.take(buf.reshape(-1, F), source, axis=0)
    return jnp.where(row_valid[:, None], out, 0).astype(lhs.dtype)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def _call(lhs, rhs, pair_block, pair_group, pair_valid, *, blocks: Blocks, interpret: Any):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    _, D = lhs.shape
    G, _, F = rhs.shape
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    n_pairs = pair_block.shape[0]
    k_steps = D // bk
    dtype = lhs.dtype

    def kernel(lhs_ref, rhs_ref, block_ref, group_ref, valid_ref, o_ref, o_smem):
        ni = lax.axis_index("n")
        p = lax.axis_index("pairs")

        @pl.when(valid_ref[p] != 0)
        def _():
            blk, g = block_ref[p], group_ref[p]

            def tile(acc_ref):
                def step(_, a_smem, b_smem):
                    # The wgmma is asynchronous: wait for the previous step's (not this one's), so that its slots,
                    # released one step late (delay_release=1), are never refilled while a wgmma still reads them.
                    plgpu.wgmma(acc_ref, a_smem, b_smem)
                    plgpu.wgmma_wait(1)

                plgpu.emit_pipeline(
                    step,
                    grid=(k_steps,),
                    in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (blk, kk), delay_release=1),
                              plgpu.BlockSpec((bk, bn), lambda kk: (kk, ni), delay_release=1)],
                    max_concurrent_steps=blocks.steps,  # > delay_release; emit_pipeline caps it at k_steps
                )(lhs_ref, rhs_ref.at[g])
                return acc_ref[...]

            acc = pl.run_scoped(tile, plgpu.ACC((bm, bn), jnp.float32))
            o_smem[...] = acc.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[p, :, pl.ds(ni * bn, bn)])
            plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((n_pairs, bm, F), dtype),
        # Pairs fastest: neighbouring pairs mostly share a group, so they share its rhs column block in L2.
        grid=(F // bn, n_pairs), grid_names=("n", "pairs"),
        scratch_types=(plgpu.SMEM((bm, bn), dtype),),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=platform.interpret_params(interpret),
    )(lhs, rhs, pair_block, pair_group, pair_valid)
