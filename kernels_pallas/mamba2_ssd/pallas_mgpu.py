"""The chunked Mamba2 scan (prefill) as a Mosaic GPU (Hopper) kernel: the sequential pass over chunks.

The work splits as the chunked form does. What each chunk computes from its own tokens (the causal, decay-weighted
c.b "attention" inside the chunk, `reference.own_outputs`) and the per-token decays are computed for all chunks at once
in jax.numpy: large, parallel work XLA does well. The kernel runs what is sequential: one CUDA block per (batch row,
head, block of head-dim columns) walks the chunks with the transposed state slice S^T [Z, block_h] float32 in
registers and, per chunk, does two matmuls on the tensor cores (wgmma), operands streamed by TMA through a
double-buffered pipeline:

    y_in = (c S^T) * exp(cum)          the chunk's outputs from the state it starts from
    S^T = S^T * exp(cum_last) + b^T (x * dt * exp(cum_last - cum))     the state at the chunk's end

So the chunks' own contributions to the state ([chunks, Z, H] per head) never reach memory. Head-dim columns are
independent in the recurrence, so they split across blocks with no communication. The matmul operands are 16-bit
(the inputs' dtype): the state is rounded to it for reading, the float32 state is kept and returned; y_in leaves in
the inputs' dtype and is added to the float32 rest.

Interpret mode needs nothing special here: every wgmma starts from a zeroed accumulator and reads shared memory.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas import platform, tuning
from kernels_pallas.mamba2_ssd import reference

SMEM_BYTES = 220 * 1024  # what one block may take of the H100/H200's 227 KiB, with room for barriers


@dataclasses.dataclass(frozen=True)
class Blocks:
    """chunk: tokens per chunk (wgmma's M of the output matmul, K of the state's); block_h: head-dim columns per
    CUDA block; steps: chunks in flight in the TMA pipeline."""

    chunk: int = 64
    block_h: int = 64
    steps: int = 2


def _smem_bytes(Z: int, blocks: Blocks, itemsize: int) -> int:
    C, bh = blocks.chunk, blocks.block_h
    per_step = (2 * C * Z + C * bh) * itemsize + C * 4  # c, b^T, the weighted x; the decays from the chunk's start
    return blocks.steps * per_step + Z * bh * (itemsize + 4) + 2 * C * bh * itemsize  # S^T 16-bit and f32; outputs


def _heuristic(shape_class: str, **_) -> Blocks:
    Z = int(shape_class.split("h")[0][1:])
    two = Blocks()
    return two if _smem_bytes(Z, two, 2) <= SMEM_BYTES else dataclasses.replace(two, steps=1)


TABLE: tuning.BlockTable[Blocks] = tuning.BlockTable("mamba2_ssd.mosaic_gpu", _heuristic, {})


def shape_class(Z: int, H: int) -> str:
    return f"z{Z}h{H}"


def _check(x, b, c, blocks: Blocks) -> None:
    T, H = x.shape[1], x.shape[3]
    Z = b.shape[3]
    dtypes = {jnp.dtype(a.dtype) for a in (x, b, c)}
    if len(dtypes) != 1 or dtypes.pop() not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise NotImplementedError(f"needs x, b, c all bfloat16 or all float16; got {x.dtype}, {b.dtype}, {c.dtype}")
    if T == 1:
        raise NotImplementedError("a single token (decode step) is the recurrent form's: nothing to chunk")
    if Z % 64 or not 64 <= Z <= 256:
        raise NotImplementedError(f"state size {Z} is not one of 64, 128, 192, 256 (wgmma with 128-byte swizzle)")
    if H % blocks.block_h:
        raise NotImplementedError(f"head dim {H} is not a multiple of block_h {blocks.block_h}")
    if blocks.chunk != 64 or blocks.block_h % 64:
        raise NotImplementedError(f"blocks {blocks}: chunk must be 64 and block_h a multiple of 64")
    if _smem_bytes(Z, blocks, x.dtype.itemsize) > SMEM_BYTES:
        raise NotImplementedError(f"blocks {blocks} need {_smem_bytes(Z, blocks, x.dtype.itemsize)} bytes of shared "
                                  f"memory for state size {Z}")


def mamba2_ssd(x: jax.Array, dt: jax.Array, A: jax.Array, b: jax.Array, c: jax.Array,
               state: jax.Array | None = None, *, D: jax.Array | None = None, dt_bias: jax.Array | None = None,
               dt_softplus: bool = True, dt_limit: tuple[float, float] = (0.0, float("inf")),
               valid: jax.Array | None = None, chunk_size: int = reference.CHUNK, interpret: Any = False,
               blocks: Blocks | None = None) -> tuple[jax.Array, jax.Array]:
    """The contract of `reference.chunked`, on a Hopper GPU (or in the interpreter). `chunk_size` is the model's;
    the kernel's chunk is its own (`blocks.chunk`): the result does not depend on it beyond rounding.

    Args:
        x, dt, A, b, c, state, D, dt_bias, dt_softplus, dt_limit, valid: as in the reference.
        interpret: True or `plgpu.InterpretGPUParams` to run in the CPU interpreter.
        blocks: chunk and block sizes; default from `TABLE`.
    Returns:
        (y [B, T, N, H] in x's dtype, final state [B, N, H, Z] float32).
    Raises:
        NotImplementedError: not a Hopper target, a single token, or dtypes / sizes the kernel does not take.
        ValueError: inconsistent shapes (as the reference).
    """
    target = platform.require_hopper("mamba2_ssd.mosaic_gpu", interpret)
    Bsz, T, N, H = x.shape
    G, Z = b.shape[2:]
    blocks = blocks or TABLE.lookup(target.kind, shape_class(Z, H))
    _check(x, b, c, blocks)
    dtype = x.dtype
    xf, dtf, Af, bf, cf, S0, Df = reference.prepare(x, dt, A, b, c, state, D, dt_bias, dt_softplus, dt_limit, valid)
    C = blocks.chunk
    pad = (-T) % C
    n = (T + pad) // C

    def chunks(a):  # [B, T, ...] -> [B, n, C, ...], zero-padded (dt = 0: no decay, no write)
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return a.reshape(Bsz, n, C, *a.shape[2:])

    xc, dtc, bc, cc = (chunks(a) for a in (xf, dtf, bf, cf))
    cum = jnp.cumsum(dtc * Af, axis=2)  # [B, n, C, G, r]
    y_own = reference.own_outputs(xc, dtc, cum, bc, cc)  # [B, n, C, G, r, H]
    weighted = xc * (jnp.exp(cum[:, :, -1:] - cum) * dtc)[..., None]  # x dt exp(cum_last - cum)
    heads = lambda a: jnp.moveaxis(a.reshape(Bsz, n * C, N, *a.shape[5:]), 2, 1)  # noqa: E731  [B, N, Tp, ...]
    y_in, final = _call(
        jnp.moveaxis(cc.reshape(Bsz, n * C, G, Z), 2, 1).astype(dtype),  # c [B, G, Tp, Z]
        jnp.moveaxis(bc.reshape(Bsz, n * C, G, Z), 1, 3).astype(dtype),  # b^T [B, G, Z, Tp]
        heads(weighted).astype(dtype),  # [B, N, Tp, H]
        heads(jnp.exp(cum)),  # [B, N, Tp] the decay from the chunk's start through each token
        jnp.moveaxis(jnp.exp(cum[:, :, -1]).reshape(Bsz, n, N), 1, 2),  # [B, N, n] the chunk's whole decay
        jnp.swapaxes(S0.reshape(Bsz, N, H, Z), 2, 3),  # S^T [B, N, Z, H]
        blocks=blocks, heads_per_group=N // G, interpret=interpret)
    y = y_own.reshape(Bsz, n * C, N, H) + jnp.moveaxis(y_in, 1, 2).astype(jnp.float32)
    y = y[:, :T] + (Df[..., None] * xf).reshape(Bsz, T, N, H)
    return y.astype(dtype), jnp.swapaxes(final, 2, 3)


@functools.partial(jax.jit, static_argnames=("blocks", "heads_per_group", "interpret"))
def _call(c, b_t, weighted, start, end, state_t, *, blocks: Blocks, heads_per_group: int, interpret: Any):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    B, N, Tp, H = weighted.shape
    Z = c.shape[-1]
    C, bh = blocks.chunk, blocks.block_h
    n_chunks = Tp // C
    dtype = weighted.dtype

    def kernel(c_ref, bt_ref, w_ref, st_ref, e_ref, s0_ref, o_ref, sn_ref, s_smem, s32_smem, o_smem2, bar):
        bi, h, j = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("columns")
        g = lax.div(h, heads_per_group)
        cols = pl.ds(j * bh, bh)
        plgpu.copy_gmem_to_smem(s0_ref.at[bi, h, :, cols], s32_smem, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        S = s32_smem[...]
        s_smem[...] = S.astype(dtype)
        plgpu.commit_smem()

        def matmul(shape, a, b_):
            def run(acc_ref):
                plgpu.wgmma(acc_ref, a, b_)
                return acc_ref[...]

            return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))

        def body(idx, c_smem, bt_smem, w_smem, st_smem, S):
            k = idx[0]
            y = matmul((C, bh), c_smem, s_smem) * lax.broadcast_in_dim(st_smem[...], (C, bh), [0])
            # Outputs leave through two slots by hand, not the pipeline's out_specs: the interpreter lacks the
            # predicated stores those use. The store issued two chunks ago must have read its slot.
            o_smem = o_smem2.at[lax.rem(k, 2)]
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            o_smem[...] = y.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[bi, h, pl.ds(k * C, C), cols])
            S = S * e_ref[bi, h, k] + matmul((Z, bh), bt_smem, w_smem)
            s_smem[...] = S.astype(dtype)
            plgpu.commit_smem()
            return S

        in_specs = [plgpu.BlockSpec((C, Z), lambda k: (k, 0)), plgpu.BlockSpec((Z, C), lambda k: (0, k)),
                    plgpu.BlockSpec((C, bh), lambda k: (k, j)), plgpu.BlockSpec((C,), lambda k: (k,))]
        S = plgpu.emit_pipeline(
            body, grid=(n_chunks,), in_specs=in_specs, max_concurrent_steps=min(blocks.steps, n_chunks),
            init_carry=S,
        )(c_ref.at[bi, g], bt_ref.at[bi, g], w_ref.at[bi, h], st_ref.at[bi, h])
        s32_smem[...] = S
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(s32_smem, sn_ref.at[bi, h, :, cols])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((B, N, Tp, H), dtype), jax.ShapeDtypeStruct((B, N, Z, H), jnp.float32)),
        grid=(B, N, H // bh), grid_names=("batch", "heads", "columns"),
        scratch_types=(plgpu.SMEM((Z, bh), dtype), plgpu.SMEM((Z, bh), jnp.float32), plgpu.SMEM((2, C, bh), dtype),
                       plgpu.Barrier(num_barriers=1)),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=platform.interpret_params(interpret),
    )(c, b_t, weighted, start, end, state_t)
