"""RMSNorm with the residual add fused, as a Mosaic GPU (Hopper) kernel.

A memory-bound op: each CUDA block loads `block_rows` rows straight from global memory into registers (16-byte
vectors over the warpgroup's 128 lanes), adds the residual, reduces the float32 sum of squares across the
warpgroup and writes the normalized row and h = x + residual: x and the residual read once, each output written
once, the minimum traffic. The arithmetic is the reference's step for step, so the two agree to the last bit but
for the order of the float32 sum.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas import platform, tuning


@dataclasses.dataclass(frozen=True)
class Blocks:
    """block_rows: rows per CUDA block, unrolled so their loads are in flight together."""

    block_rows: int = 4


def _heuristic(shape_class: str, *, dim: int, **_) -> Blocks:
    # About 32 KiB of loads in flight per block: more rows for narrow models.
    return Blocks(max(1, min(8, 16384 // dim)))


TABLE: tuning.BlockTable[Blocks] = tuning.BlockTable("rms_norm.mosaic_gpu", _heuristic, {
    ("h100", "d4096"): tuning.Entry(Blocks(4), "seed"),
    ("h200", "d4096"): tuning.Entry(Blocks(4), "seed"),
})


def shape_class(dim: int) -> str:
    return f"d{dim}"


def _vector(dim: int) -> int:
    """Elements per lane per access: the widest of 8, 4, 2, 1 that spreads `dim` evenly over 128 lanes."""
    for vec in (8, 4, 2, 1):
        if dim % (128 * vec) == 0:
            return vec
    raise NotImplementedError(f"hidden size {dim} is not a multiple of 128")


def rms_norm(x: jax.Array, weight: jax.Array, *, eps: float, offset: float = 0.0,
             residual: jax.Array | None = None, interpret: Any = False,
             blocks: Blocks | None = None) -> tuple[jax.Array, jax.Array]:
    """The contract of `reference.rms_norm`, on a Hopper GPU (or in the interpreter).

    Args:
        x, weight, eps, offset, residual: as in the reference.
        interpret: True or `plgpu.InterpretGPUParams` (tests: detect_races=True) to run in the CPU interpreter.
        blocks: rows per block; default from `TABLE`.
    Returns:
        (normalized [..., D], h [..., D]) with the reference's dtypes.
    Raises:
        NotImplementedError: not a Hopper target, or shapes / dtypes the kernel does not take.
    """
    target = platform.require_hopper("rms_norm.mosaic_gpu", interpret)
    D = x.shape[-1]
    if weight.shape != (D,):
        raise NotImplementedError(f"weight must be [{D}], got {weight.shape}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise NotImplementedError(f"residual must match x {x.shape} {x.dtype}, got {residual.shape} "
                                  f"{residual.dtype}")
    supported = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
    if jnp.dtype(x.dtype) not in supported or jnp.dtype(weight.dtype) not in supported:
        raise NotImplementedError(f"dtypes {x.dtype}, {weight.dtype} are not floating types the kernel takes")
    vec = _vector(D)
    blocks = blocks or TABLE.lookup(target.kind, shape_class(D), dim=D)
    rows = x.reshape(-1, D)
    M = rows.shape[0]
    br = blocks.block_rows
    Mp = -(-M // br) * br
    res = None if residual is None else residual.reshape(-1, D)
    if Mp != M:
        rows = jnp.pad(rows, ((0, Mp - M), (0, 0)))
        res = None if res is None else jnp.pad(res, ((0, Mp - M), (0, 0)))
    # The reference's output dtype: Llama-style multiplies weight by the normalized h in h's dtype (so a
    # float32 weight promotes), Gemma-style casts back to h's dtype.
    out_dtype = x.dtype if offset else jnp.result_type(weight.dtype, x.dtype)
    normed, h = _call(rows, res, weight, eps=float(eps), offset=float(offset), out_dtype=jnp.dtype(out_dtype),
                      block_rows=br, vec=vec, interpret=interpret)
    normed = normed[:M].reshape(x.shape)
    h = x if residual is None else h[:M].reshape(x.shape)
    return normed, h


@functools.partial(jax.jit, static_argnames=("eps", "offset", "out_dtype", "block_rows", "vec", "interpret"))
def _call(rows, res, weight, *, eps: float, offset: float, out_dtype, block_rows: int, vec: int,
          interpret: bool):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    M, D = rows.shape
    dtype = rows.dtype
    layout = plgpu.Layout.WG_STRIDED((D,), vec_size=vec)
    has_res = res is not None

    def kernel(*refs):
        if has_res:
            x_ref, r_ref, w_ref, o_ref, h_ref = refs
        else:
            x_ref, w_ref, o_ref = refs
        blk = lax.axis_index("rows")
        w = plgpu.load(w_ref, layout=layout)
        for i in range(block_rows):
            row = blk * block_rows + i
            h = plgpu.load(x_ref.at[row], layout=layout)
            if has_res:
                h = h + plgpu.load(r_ref.at[row], layout=layout)
                h_ref[row] = h
            h32 = h.astype(jnp.float32)
            normed = h32 * lax.rsqrt(jnp.sum(h32 * h32) / D + eps)
            if offset:
                out = normed * (offset + w.astype(jnp.float32))
            else:
                out = w.astype(out_dtype) * normed.astype(dtype).astype(out_dtype)
            o_ref[row] = out.astype(out_dtype)

    out_types = [jax.ShapeDtypeStruct((M, D), out_dtype)]
    args = [rows, weight]
    if has_res:
        out_types.append(jax.ShapeDtypeStruct((M, D), dtype))
        args = [rows, res, weight]
    outs = plgpu.kernel(
        kernel, out_type=tuple(out_types), grid=(M // block_rows,), grid_names=("rows",),
        interpret=platform.interpret_params(interpret),
    )(*args)
    return outs[0], (outs[1] if has_res else None)
