"""Prefill attention as a Mosaic GPU (Hopper) kernel: FlashAttention-3 style, warp-specialized.

One CUDA block per (batch row, tile of 2 * block_q queries, query head): two compute warpgroups of block_q queries
and a memory warpgroup that streams key/value blocks by TMA through a ring of shared-memory slots. Each compute
warpgroup runs Q K^T and P V on the tensor cores (wgmma) with a base-2 online softmax between (scores pre-scaled
by log2 e), ping-ponging with the other on a schedule barrier so one's softmax overlaps the other's matmuls.

The wrapper computes in jnp what spares the kernel special cases: the [lo, hi) key blocks each (row, tile) visits,
from its query positions, the causal limit, the window and the kv length (ragged batches, decode-like offsets and
windows skip blocks nobody sees); per-warpgroup position ranges, so blocks every query sees fully skip the mask;
per-query positions, so the mask is exact for any `q_positions`. Sinks start the running max and sum at (sink, 1):
exp(sink) joins the denominator with no value. Rows that see no key come out zero.

Interpret mode differs in two ways forced by jax 0.11's interpreter: it takes no wgmma operand from registers and
cannot accumulate into an existing accumulator (`run_state`), so P goes through shared memory and P V is added to
the output (same arithmetic); and it runs one compute warpgroup, because each interpreted warpgroup holds a host
thread of XLA:CPU's pool while it waits on a barrier, and three starve a 2-core machine's pool (a deadlock seen).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
import math

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas import platform, tuning

LOG2E = math.log2(math.e)
# A running max to start from when there is no sink: below any real score (scaled scores are far smaller in
# magnitude), so masked (-inf) scores give exp2(-inf - M0) = 0 and a row that sees nothing keeps l = 0.
M0 = -1e30
SMEM_BYTES = 220 * 1024  # what one block may take of the H100/H200's 227 KiB, with room for barriers


@dataclasses.dataclass(frozen=True)
class Blocks:
    """block_q: queries per compute warpgroup (a tile is compute_wgs * block_q); block_kv: keys per pipeline step;
    steps: key/value blocks in flight; compute_wgs: compute warpgroups per block (2 on a GPU, 1 interpreted)."""

    block_q: int = 64
    block_kv: int = 128
    steps: int = 2
    compute_wgs: int = 2


def online_softmax_step(s, m_i, l_i, acc):
    """One block of the base-2 online softmax: rescales the running sum `l_i` and accumulator `acc` [rows, H] to the
    new row maxima; returns (p, m_new, l_i, acc), p = 2^(s - m_new) still to be multiplied by the block's values."""
    m_new = jnp.maximum(m_i, s.max(axis=1))
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    return p, m_new, l_i * alpha + p.sum(axis=1), acc


def _heuristic(shape_class: str, *, head_dim: int, **_) -> Blocks:
    # Wide heads need more registers per query row (the f32 accumulator is block_q x H) and shared memory per
    # key block: halve the key block past 128.
    return Blocks(64, 128 if head_dim <= 128 else 64, 2)


TABLE: tuning.BlockTable[Blocks] = tuning.BlockTable("attention.mosaic_gpu", _heuristic, {
    # Seeds (not yet measured here): jax's FlashAttention-3 example runs block_q 64 and 2 steps on H100.
    ("h100", "h128"): tuning.Entry(Blocks(64, 128, 2), "seed"),
    ("h100", "h256"): tuning.Entry(Blocks(64, 64, 2), "seed"),
    ("h200", "h128"): tuning.Entry(Blocks(64, 128, 2), "seed"),
    ("h200", "h256"): tuning.Entry(Blocks(64, 64, 2), "seed"),
})


def shape_class(head_dim: int) -> str:
    return f"h{head_dim}"


def _check(q, k, v, sinks, blocks: Blocks, interpret: Any) -> None:
    B, T, N, H = q.shape
    if k.ndim != 4 or v.shape != k.shape or k.shape[0] != B or k.shape[3] != H:
        raise NotImplementedError(f"needs k, v [B, S, K, {H}] of one shape; got {k.shape}, {v.shape}")
    if N % k.shape[2]:
        raise NotImplementedError(f"query heads {N} not a multiple of kv heads {k.shape[2]}")
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1 or dtypes.pop() not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise NotImplementedError(f"needs q, k, v all bfloat16 or all float16; got {q.dtype}, {k.dtype}, {v.dtype}")
    if H % 64 or not 64 <= H <= 256:
        raise NotImplementedError(f"head dim {H} is not one of 64, 128, 192, 256 (wgmma with 128-byte swizzle)")
    if sinks is not None and sinks.shape != (N,):
        raise NotImplementedError(f"sinks must be [N={N}], got {sinks.shape}")
    itemsize = q.dtype.itemsize
    wgs = blocks.compute_wgs
    smem = (wgs * blocks.block_q * H + 2 * blocks.steps * blocks.block_kv * H) * itemsize
    if interpret:
        smem += wgs * blocks.block_q * blocks.block_kv * itemsize
    if smem > SMEM_BYTES:
        raise NotImplementedError(f"blocks {blocks} need {smem} bytes of shared memory for head dim {H}")


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_positions: jax.Array,
              kv_lengths: jax.Array | None = None, causal: bool = True, sliding_window: int | None = None,
              logit_softcap: float | None = None, sinks: jax.Array | None = None, scale: float | None = None,
              interpret: Any = False, blocks: Blocks | None = None, chunk_size: int | None = None,
              visible_until: jax.Array | None = None) -> jax.Array:
    """The contract of `reference.attention`, on a Hopper GPU (or in the interpreter).

    Args:
        q, k, v, q_positions, kv_lengths, causal, sliding_window, logit_softcap, sinks, scale: as in the reference;
            chunk_size and visible_until are not taken (the dispatcher falls back).
        interpret: True or `plgpu.InterpretGPUParams` (tests: detect_races=True) to run in the CPU interpreter.
        blocks: block sizes; default from `TABLE` for the device and head dim.
    Returns:
        [B, T, N, H] in q's dtype; rows that see no key are zero.
    Raises:
        NotImplementedError: not a Hopper target, or dtypes / head dims / shapes the kernel does not take.
    """
    if chunk_size is not None:
        raise NotImplementedError("chunked attention (chunk_size) is not implemented in this kernel")
    if visible_until is not None:
        raise NotImplementedError("bidirectional spans (visible_until) are not implemented in this kernel")
    target = platform.require_hopper("attention.mosaic_gpu", interpret)
    B, T, N, H = q.shape
    blocks = blocks or TABLE.lookup(target.kind, shape_class(H), head_dim=H)
    if interpret:
        # One compute warpgroup: three interpreted ones can deadlock a 2-core machine (see the module docstring).
        blocks = dataclasses.replace(blocks, compute_wgs=1)
    _check(q, k, v, sinks, blocks, interpret)
    bq, bkv = blocks.block_q, blocks.block_kv
    S = k.shape[1]
    scale = H ** -0.5 if scale is None else float(scale)

    # Pad queries to whole tiles and keys to whole blocks; padded keys sit past kv_lengths, padded queries repeat
    # the last real position (so they widen no tile's key range) and are cut off at the end.
    tile = blocks.compute_wgs * bq
    Tp, Sp = -(-T // tile) * tile, -(-S // bkv) * bkv
    q_positions = q_positions.astype(jnp.int32)
    if Tp != T:
        q = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0)))
        q_positions = jnp.pad(q_positions, ((0, 0), (0, Tp - T)), mode="edge")
    if Sp != S:
        k = jnp.pad(k, ((0, 0), (0, Sp - S), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, Sp - S), (0, 0), (0, 0)))
    kv_len = jnp.full((B,), S, jnp.int32) if kv_lengths is None else jnp.minimum(kv_lengths.astype(jnp.int32), S)

    lo, hi = key_block_range(q_positions, kv_len, tile=tile, block_kv=bkv, num_blocks=Sp // bkv, causal=causal,
                             window=sliding_window)
    rows = q_positions.reshape(B, Tp // bq, bq)
    row_min, row_max = rows.min(-1), rows.max(-1)  # per compute warpgroup, to skip the mask where it is moot
    sink_arr = jnp.zeros((N,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    out = _call(q, k, v, q_positions, lo, hi, row_min, row_max, kv_len, sink_arr, blocks=blocks, causal=causal,
                window=sliding_window, softcap=logit_softcap, scale=scale, has_sinks=sinks is not None,
                interpret=interpret)
    return out[:, :T]


def key_block_range(q_positions, kv_len, *, tile: int, block_kv: int, num_blocks: int, causal: bool,
                    window: int | None):
    """[lo, hi) key blocks each (row, query tile) must visit; at least one, so the pipeline never runs empty (a
    block nobody sees is fully masked and adds nothing)."""
    B, Tp = q_positions.shape
    t = q_positions.reshape(B, Tp // tile, tile)
    first, last = t.min(-1), t.max(-1)
    end = jnp.minimum(last + 1, kv_len[:, None]) if causal else jnp.broadcast_to(kv_len[:, None], first.shape)
    start = jnp.zeros_like(end) if window is None else jnp.maximum(first - window + 1, 0)
    lo = jnp.clip(start // block_kv, 0, num_blocks - 1)
    hi = jnp.clip(-(-end // block_kv), lo + 1, num_blocks)
    return lo.astype(jnp.int32), hi.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("blocks", "causal", "window", "softcap", "scale", "has_sinks",
                                             "interpret"))
def _call(q, k, v, q_positions, lo, hi, row_min, row_max, kv_len, sinks, *, blocks: Blocks, causal: bool,
          window: int | None, softcap: float | None, scale: float, has_sinks: bool, interpret: Any):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    bq, bkv = blocks.block_q, blocks.block_kv
    wgs = blocks.compute_wgs
    n_tiles = T // (wgs * bq)
    dtype = q.dtype
    score_scale = (scale / softcap) if softcap is not None else scale * LOG2E

    def kernel(q_ref, k_ref, v_ref, pos_ref, lo_ref, hi_ref, rmin_ref, rmax_ref, len_ref, sink_ref, o_ref,
               qo_smem2, pos_smem2, p_smem2, q_bar, pos_bar, sched_bar):
        b = lax.axis_index("batch")
        i = n_tiles - 1 - lax.axis_index("tiles")  # heaviest (causal) tiles first: a shorter tail
        n = lax.axis_index("heads")
        wg = lax.axis_index("wg")
        kh = lax.div(n, jnp.int32(G))
        lo, hi, kv_len = lo_ref[b, i], hi_ref[b, i], len_ref[b]
        base = i * (wgs * bq) + wg * bq

        def schedule():
            plgpu.barrier_arrive(sched_bar)
            plgpu.barrier_wait(sched_bar)

        def compute(pipeline):
            qo_smem, pos_smem = qo_smem2.at[wg], pos_smem2.at[wg]
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(base, bq), n], qo_smem, q_bar.at[wg])
            plgpu.copy_gmem_to_smem(pos_ref.at[b, pl.ds(base, bq)], pos_smem, pos_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])
            plgpu.barrier_wait(pos_bar.at[wg])
            if has_sinks:
                m_i = jnp.full((bq,), sink_ref[n] * LOG2E, jnp.float32)
                l_i = jnp.full((bq,), 1.0, jnp.float32)
            else:
                m_i = jnp.full((bq,), M0, jnp.float32)
                l_i = jnp.full((bq,), 0.0, jnp.float32)
            acc = jnp.full((bq, H), 0.0, jnp.float32)
            pl.when(wg == 1)(schedule)
            acc, m_i, l_i = pipeline((acc, m_i, l_i))
            pl.when(wg == 0)(schedule)
            l_i = jnp.maximum(l_i, 1e-30)  # rows that saw nothing: 0 / tiny = 0
            acc = acc / lax.broadcast_in_dim(l_i, (bq, H), [0])
            qo_smem[...] = acc.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_smem, o_ref.at[b, pl.ds(base, bq), n])
            plgpu.wait_smem_to_gmem(0)

        def step(idx, k_smem, v_smem, k_consumed, v_consumed, carry):
            acc, m_i, l_i = carry
            kb = lo + idx[0]
            qo_smem = qo_smem2.at[wg]

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, qo_smem, k_smem.T)
                schedule()
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32))
            plgpu.barrier_arrive(k_consumed)
            if softcap is not None:
                s = jnp.tanh(s * score_scale) * (softcap * LOG2E)
            else:
                s = s * score_scale

            start = kb * bkv
            wg_row = i * wgs + wg
            full = (start + bkv) <= kv_len
            if causal:
                full = full & (start + bkv - 1 <= rmin_ref[b, wg_row])
            if window is not None:
                full = full & (rmax_ref[b, wg_row] - start < window)

            def masked(s):
                key = lax.broadcasted_iota(jnp.int32, (bq, bkv), 1) + start
                pos = lax.broadcast_in_dim(pos_smem2.at[wg][...], (bq, bkv), [0])
                visible = key < kv_len
                if causal:
                    visible = visible & (key <= pos)
                if window is not None:
                    visible = visible & (pos - key < window)
                return jnp.where(visible, s, -jnp.inf)

            s = lax.cond(full, lambda s: s, masked, s)
            p, m_new, l_i, acc = online_softmax_step(s, m_i, l_i, acc)
            p16 = p.astype(dtype)
            schedule()
            if interpret:
                p_smem = p_smem2.at[wg]
                p_smem[...] = p16
                plgpu.commit_smem()

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem, v_smem)
                    return acc_ref[...]

                acc = acc + pl.run_scoped(pv, plgpu.ACC((bq, H), jnp.float32))
            else:
                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem)

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_consumed)
            return acc, m_new, l_i

        pipeline = plgpu.emit_pipeline_warp_specialized(
            step, grid=(hi - lo,), memory_registers=40, max_concurrent_steps=blocks.steps, num_compute_wgs=wgs,
            wg_axis="wg", manual_consumed_barriers=True, compute_context=compute,
            in_specs=[plgpu.BlockSpec((bkv, H), lambda j: (lo + j, 0)),
                      plgpu.BlockSpec((bkv, H), lambda j: (lo + j, 0))])
        pipeline(k_ref.at[b, :, kh, :], v_ref.at[b, :, kh, :])

    p_scratch = plgpu.SMEM((wgs, bq, bkv), dtype) if interpret else plgpu.SMEM((wgs, 8, 64), dtype)
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct(q.shape, dtype),
        # Heads fastest: the G query heads that share a kv head run together and share its blocks in L2.
        grid=(B, n_tiles, N), grid_names=("batch", "tiles", "heads"), num_threads=wgs + 1, thread_name="wg",
        scratch_types=(plgpu.SMEM((wgs, bq, H), dtype), plgpu.SMEM((wgs, bq), jnp.int32), p_scratch,
                       plgpu.Barrier(num_barriers=wgs), plgpu.Barrier(num_barriers=wgs),
                       plgpu.Barrier(num_arrivals=wgs)),
        compiler_params=plgpu.CompilerParams(approx_math=True,
                                             lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=platform.interpret_params(interpret),
    )(q, k, v, q_positions, lo, hi, row_min, row_max, kv_len, sinks)
