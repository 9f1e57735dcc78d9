"""The chunked gated delta rule (prefill) as a Mosaic GPU (Hopper) kernel: the sequential scan over chunks.

The work splits as the chunked form does. Everything within a chunk that does not depend on the incoming state
(the UT transform's corrected values u and decayed keys w, the causal q.k scores with decay, the decayed q and k,
the chunk's total decay) is computed for many chunks at once in jax.numpy by `reference.intra_chunk`, its UT
system by a batched triangular solve (all chunks for per-head decay; for per-channel decay as many as keep their
[C, C, Hk] decay tensors under INTRA_BYTES): large, parallel work XLA does well, and most of the time here. On an
H200, 4096 tokens and 32 heads: the kernel alone 0.2 ms, that preparation 1.4 ms (3.3 with forward substitution).
The kernel runs what is sequential: one CUDA block per (batch row, value head, block of value columns) walks the
chunks with its state slice S [Hk, block_v] float32 in registers, and per chunk does four matmuls on the tensor
cores (wgmma), operands streamed by TMA through a double-buffered pipeline:

    v_new = u - w S          out = q_in S + scores v_new          S = S * decay + k_out^T v_new

The delta rule acts on each value column independently, so value columns split across blocks with no
communication: more blocks than (batch, heads) alone, and a smaller state per block (64 float32 registers per
thread for Hk = 128, block_v = 64). The matmul operands are 16-bit (the inputs' dtype): the state is rounded to
it for reading, the float32 state is kept and returned.

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
from kernels_pallas.gated_delta_rule import reference

SMEM_BYTES = 220 * 1024  # what one block may take of the H100/H200's 227 KiB, with room for barriers
INTRA_BYTES = 1 << 28  # the per-channel decay's [C, C, Hk] float32 tensors of the chunks prepared at once


@dataclasses.dataclass(frozen=True)
class Blocks:
    """chunk: tokens per chunk (the UT transform's size, wgmma's M); block_v: value columns per CUDA block; steps:
    chunks in flight in the TMA pipeline."""

    chunk: int = 64
    block_v: int = 64
    steps: int = 2


def _heuristic(shape_class: str, **_) -> Blocks:
    return Blocks()


TABLE: tuning.BlockTable[Blocks] = tuning.BlockTable("gated_delta_rule.mosaic_gpu", _heuristic, {
    ("h100", "k128v128"): tuning.Entry(Blocks(64, 64, 2), "seed"),
    ("h200", "k128v128"): tuning.Entry(Blocks(64, 64, 2), "seed"),
})


def shape_class(Hk: int, Hv: int) -> str:
    return f"k{Hk}v{Hv}"


def _smem_bytes(Hk: int, blocks: Blocks, itemsize: int) -> int:
    C, bv = blocks.chunk, blocks.block_v
    per_step = (3 * C * Hk + C * bv + C * C) * itemsize + Hk * 4  # w, q_in, k_out^T, u, scores; decay
    # S (16-bit), v_new, two output slots; S (float32)
    return blocks.steps * per_step + (Hk * bv + 3 * C * bv) * itemsize + Hk * bv * 4


def _check(q, k, v, g, beta, state, blocks: Blocks) -> None:
    B, T, Nk, Hk = q.shape
    Hv = v.shape[-1]
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1 or dtypes.pop() not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise NotImplementedError(f"needs q, k, v all bfloat16 or all float16; got {q.dtype}, {k.dtype}, {v.dtype}")
    if T == 1:
        raise NotImplementedError("a single token (decode step) is the recurrent form's: nothing to chunk")
    if Hk % 64 or not 64 <= Hk <= 256:
        raise NotImplementedError(f"key head dim {Hk} is not one of 64, 128, 192, 256 (wgmma with 128-byte swizzle)")
    if Hv % blocks.block_v:
        raise NotImplementedError(f"value head dim {Hv} is not a multiple of block_v {blocks.block_v}")
    if blocks.chunk != 64 or blocks.block_v % 64:
        raise NotImplementedError(f"blocks {blocks}: chunk must be 64 and block_v a multiple of 64")
    if _smem_bytes(Hk, blocks, q.dtype.itemsize) > SMEM_BYTES:
        raise NotImplementedError(f"blocks {blocks} need {_smem_bytes(Hk, blocks, q.dtype.itemsize)} bytes of "
                                  f"shared memory for key head dim {Hk}")


def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                     state: jax.Array | None = None, *, scale: float | None = None, l2_normalize: bool = True,
                     interpret: Any = False, blocks: Blocks | None = None) -> tuple[jax.Array, jax.Array]:
    """The contract of `reference.chunked`, on a Hopper GPU (or in the interpreter).

    Args:
        q, k, v, g, beta, state, scale, l2_normalize: as in the reference (g per head or per key channel).
        interpret: True or `plgpu.InterpretGPUParams` (tests: detect_races=True) to run in the CPU interpreter.
        blocks: chunk and block sizes; default from `TABLE`.
    Returns:
        (out [B, T, Nv, Hv] in q's dtype, final state [B, Nv, Hk, Hv] float32).
    Raises:
        NotImplementedError: not a Hopper target, a single token, or dtypes / head dims the kernel does not take.
        ValueError: inconsistent shapes (as the reference).
    """
    target = platform.require_hopper("gated_delta_rule.mosaic_gpu", interpret)
    B, T, _, Hk = q.shape
    Nv, Hv = v.shape[2:]
    blocks = blocks or TABLE.lookup(target.kind, shape_class(Hk, Hv))
    _check(q, k, v, g, beta, state, blocks)
    dtype = q.dtype
    C = blocks.chunk
    qf, kf, vf, gf, bf, s0 = reference.prepare(q, k, v, g, beta, state, scale, l2_normalize)
    pad = (-T) % C
    n = (T + pad) // C

    def chunks(x):  # [B, T, Nv, ...] -> [B, Nv, n, C, ...], padded with g = 0, beta = 0 (and zeros elsewhere)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, n, C, *x.shape[2:])
        return jnp.moveaxis(x, 3, 1)

    xs = tuple(chunks(x) for x in (qf, kf, vf, gf, bf))
    per_channel = g.ndim == 4
    if per_channel:  # [C, C, Hk] pairwise decays per chunk: a few chunks at a time, to bound the memory
        batch = max(1, min(n, INTRA_BYTES // (B * Nv * C * C * Hk * 4)))
        parts = lax.map(lambda x: reference.intra_chunk(*x, triangular_solve=True),
                        tuple(jnp.moveaxis(x, 2, 0) for x in xs), batch_size=batch)
        u, w, scores, q_in, k_out, decay = (jnp.moveaxis(x, 0, 2) for x in parts)
    else:
        u, w, scores, q_in, k_out, decay = reference.intra_chunk(*xs, triangular_solve=True)
    flat = lambda x: x.reshape(B, Nv, n * x.shape[3], x.shape[4]).astype(dtype)  # noqa: E731
    decay = decay.reshape(B, Nv, n * Hk) if per_channel else decay  # [B, Nv, n(, Hk)] float32
    out, final = _call(flat(w), flat(q_in), flat(jnp.swapaxes(k_out, -1, -2)), flat(u), flat(scores), decay, s0,
                       blocks=blocks, per_channel=per_channel, interpret=interpret)
    return jnp.swapaxes(out, 1, 2)[:, :T], final


@functools.partial(jax.jit, static_argnames=("blocks", "per_channel", "interpret"))
def _call(w, q_in, k_out_t, u, scores, decay, state, *, blocks: Blocks, per_channel: bool, interpret: Any):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    B, Nv, Tp, Hk = w.shape
    Hv = u.shape[-1]
    C, bv = blocks.chunk, blocks.block_v
    n_chunks = Tp // C
    dtype = w.dtype

    def kernel(w_ref, q_ref, kt_ref, u_ref, a_ref, d_ref, s0_ref, o_ref, sn_ref, s_smem, s32_smem, vnew_smem,
               o_smem2, bar):
        b, h, j = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("columns")
        cols = pl.ds(j * bv, bv)
        plgpu.copy_gmem_to_smem(s0_ref.at[b, h, :, cols], s32_smem, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        S = s32_smem[...]
        s_smem[...] = S.astype(dtype)
        plgpu.commit_smem()

        def matmul(shape, *pairs):
            def run(acc_ref):
                for a, b_ in pairs:
                    plgpu.wgmma(acc_ref, a, b_)
                return acc_ref[...]

            return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))

        def body(idx, w_smem, q_smem, kt_smem, u_smem, a_smem, *rest):
            if per_channel:
                d_smem, S = rest
            else:
                (S,) = rest
            c = idx[0]
            v_new = u_smem[...].astype(jnp.float32) - matmul((C, bv), (w_smem, s_smem))
            vnew_smem[...] = v_new.astype(dtype)
            plgpu.commit_smem()
            out = matmul((C, bv), (q_smem, s_smem), (a_smem, vnew_smem))
            # Outputs leave through two slots by hand, not the pipeline's out_specs: the interpreter lacks the
            # predicated stores those use. The store issued two chunks ago must have read its slot.
            o_smem = o_smem2.at[lax.rem(c, 2)]
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            o_smem[...] = out.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h, pl.ds(c * C, C), cols])
            if per_channel:
                S = S * lax.broadcast_in_dim(d_smem[...], (Hk, bv), [0])
            else:
                S = S * d_ref[b, h, c]
            S = S + matmul((Hk, bv), (kt_smem, vnew_smem))
            s_smem[...] = S.astype(dtype)
            plgpu.commit_smem()
            return S

        in_specs = [plgpu.BlockSpec((C, Hk), lambda c: (c, 0)), plgpu.BlockSpec((C, Hk), lambda c: (c, 0)),
                    plgpu.BlockSpec((Hk, C), lambda c: (c, 0)), plgpu.BlockSpec((C, bv), lambda c: (c, j)),
                    plgpu.BlockSpec((C, C), lambda c: (c, 0))]
        ins = [w_ref.at[b, h], q_ref.at[b, h], kt_ref.at[b, h], u_ref.at[b, h], a_ref.at[b, h]]
        if per_channel:
            in_specs.append(plgpu.BlockSpec((Hk,), lambda c: (c,)))
            ins.append(d_ref.at[b, h])
        S = plgpu.emit_pipeline(
            body, grid=(n_chunks,), in_specs=in_specs, max_concurrent_steps=min(blocks.steps, n_chunks), init_carry=S,
        )(*ins)
        s32_smem[...] = S
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(s32_smem, sn_ref.at[b, h, :, cols])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((B, Nv, Tp, Hv), dtype), jax.ShapeDtypeStruct((B, Nv, Hk, Hv), jnp.float32)),
        grid=(B, Nv, Hv // bv), grid_names=("batch", "heads", "columns"),
        scratch_types=(plgpu.SMEM((Hk, bv), dtype), plgpu.SMEM((Hk, bv), jnp.float32), plgpu.SMEM((C, bv), dtype),
                       plgpu.SMEM((2, C, bv), dtype), plgpu.Barrier(num_barriers=1)),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=platform.interpret_params(interpret),
    )(w, q_in, k_out_t, u, scores, decay, state)
