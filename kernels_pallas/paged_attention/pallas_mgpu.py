"""Paged decode attention as a Mosaic GPU (Hopper) kernel: split-KV flash decoding over the page pool.

Decode is a read of the KV cache, so the kernel is built around moving pages, not around arithmetic:
- One CUDA block per (row b, split s, kv head, 64-row tile). A tile's rows are the T new tokens x G query heads
  sharing a kv head (64 is the smallest wgmma; a decode step needs one tile), so each page is read once per kv
  head and tile, not once per query head.
- Each tile visits only the key blocks its own tokens see (`tile_key_blocks`): in a prefill chunk of many tiles,
  the early tokens' tiles stop where their causal range does (and, with a window, the late ones start where
  theirs does), so a chunk computes about the causal triangle, not the rectangle of the whole chunk's range.
- A block walks its share of the row's key blocks: `block_kv` tokens gathered from block_kv / page_size pages by
  one TMA copy each, `steps` blocks in flight in a ring of shared-memory slots.
- Splitting a row's keys over `splits` blocks keeps every SM busy when B x K is small (long contexts, few rows);
  each split writes its output normalized by its own sum, with its running max and sum, and a cheap jnp step
  combines the splits (and the sinks, which belong to no split) exactly.
The blocks a tile visits and their splits are computed in jnp from kv_lengths, q_positions and the window, so ragged
batches and sliding windows read only the pages that matter. Interpret mode stages P in shared memory and adds
P V, as in attention/pallas_mgpu.py.
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
from kernels_pallas.attention.pallas_mgpu import online_softmax_step
from kernels_pallas.paged_attention import fp8

LOG2E = math.log2(math.e)
M0 = -1e30  # the running max before any key: masked (-inf) scores vanish against it; see attention/pallas_mgpu
ROWS = 64  # one wgmma tile of query rows (T new tokens x G heads per kv head, padded to whole tiles)
SMEM_BYTES = 220 * 1024


@dataclasses.dataclass(frozen=True)
class Blocks:
    """block_kv: keys per step (a multiple of the page size, at least 64); steps: key blocks in flight;
    max_splits: upper bound on the splits of one row's keys (0: no split)."""

    block_kv: int = 64
    steps: int = 3
    max_splits: int = 16


def _heuristic(shape_class: str, *, head_dim: int, page_size: int, **_) -> Blocks:
    block_kv = max(64, page_size)
    # Three blocks in flight hide HBM latency for 128-wide heads; wider heads get two to fit shared memory.
    return Blocks(block_kv, 3 if head_dim <= 128 else 2, 16)


TABLE: tuning.BlockTable[Blocks] = tuning.BlockTable("paged_attention.mosaic_gpu", _heuristic, {
    ("h100", "h128-p16"): tuning.Entry(Blocks(64, 3, 16), "seed"),
    ("h200", "h128-p16"): tuning.Entry(Blocks(64, 3, 16), "seed"),
})


def shape_class(head_dim: int, page_size: int) -> str:
    return f"h{head_dim}-p{page_size}"


def _check(q, k_pages, v_pages, sinks, blocks: Blocks, interpret: Any) -> None:
    if fp8.is_quantized(k_pages) or fp8.is_quantized(v_pages):
        raise NotImplementedError("fp8 pages (the blockwise program dequantizes them a key block at a time)")
    B, T, N, H = q.shape
    P, page, K, Hk = k_pages.shape
    if v_pages.shape != k_pages.shape or Hk != H:
        raise NotImplementedError(f"needs k_pages, v_pages [P, page, K, {H}] of one shape; got {k_pages.shape}, "
                                  f"{v_pages.shape}")
    if N % K:
        raise NotImplementedError(f"query heads {N} not a multiple of kv heads {K}")
    dtypes = {jnp.dtype(x.dtype) for x in (q, k_pages, v_pages)}
    if len(dtypes) != 1 or dtypes.pop() not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise NotImplementedError(f"needs q and the pages all bfloat16 or all float16; got {q.dtype}, "
                                  f"{k_pages.dtype}, {v_pages.dtype}")
    if H % 64 or not 64 <= H <= 256:
        raise NotImplementedError(f"head dim {H} is not one of 64, 128, 192, 256")
    if page % 8 or (page < 64 and 64 % page) or (page > 64 and page % 64) or page > 256:
        raise NotImplementedError(f"page size {page} must divide 64 (and be a multiple of 8) or be a multiple "
                                  "of 64 up to 256")
    if blocks.block_kv % page or blocks.block_kv % 64 or blocks.block_kv > 256:
        raise NotImplementedError(f"block_kv {blocks.block_kv} must be a multiple of 64 and of the page size")
    if sinks is not None and sinks.shape != (N,):
        raise NotImplementedError(f"sinks must be [N={N}], got {sinks.shape}")
    itemsize = q.dtype.itemsize
    smem = (ROWS * H + 2 * blocks.steps * blocks.block_kv * H) * itemsize
    if interpret:
        smem += ROWS * blocks.block_kv * itemsize
    if smem > SMEM_BYTES:
        raise NotImplementedError(f"blocks {blocks} need {smem} bytes of shared memory for head dim {H}")


def num_splits(batch: int, kv_heads: int, num_blocks: int, cores: int, max_splits: int) -> int:
    """Splits per row so that about two blocks run per SM, never more than the row's key blocks."""
    want = -(-2 * cores // max(batch * kv_heads, 1))
    return int(max(1, min(want, num_blocks, max_splits or 1)))


def tile_key_blocks(row_pos: jax.Array, kv_len: jax.Array, window: int | None, block_kv: int, num_blocks: int):
    """The key blocks each (row, query tile) must visit, and the positions that bound its queries.

    Args:
        row_pos: [B, Rp] int32, the position of each query row (token t's G heads share it), Rp a multiple of ROWS.
        kv_len: [B] int32 keys cached per row.
    Returns:
        (lo [B, tiles], hi [B, tiles], first [B, tiles], last [B, tiles]): blocks lo..hi-1 hold every key a query
        of the tile sees; first and last are its lowest and highest query position.
    """
    B, Rp = row_pos.shape
    tiles = row_pos.reshape(B, Rp // ROWS, ROWS)
    first, last = tiles.min(-1), tiles.max(-1)
    end = jnp.minimum(last + 1, kv_len[:, None])
    start = jnp.zeros_like(end) if window is None else jnp.maximum(first - window + 1, 0)
    lo = jnp.clip(start // block_kv, 0, num_blocks)
    hi = jnp.clip(-(-end // block_kv), lo, num_blocks)
    return lo, hi, first, last


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                    kv_lengths: jax.Array, q_positions: jax.Array, *, sliding_window: int | None = None,
                    logit_softcap: float | None = None, sinks: jax.Array | None = None, scale: float | None = None,
                    interpret: Any = False, blocks: Blocks | None = None, splits: int | None = None,
                    chunk_size: int | None = None, visible_until: jax.Array | None = None) -> jax.Array:
    """The contract of `reference.paged_attention`, on a Hopper GPU (or in the interpreter).

    Args:
        q, k_pages, v_pages, block_tables, kv_lengths, q_positions, sliding_window, logit_softcap, sinks, scale:
            as in the reference; chunk_size and visible_until are not taken (the dispatcher falls back).
        interpret: True or `plgpu.InterpretGPUParams` (tests: detect_races=True) to run in the CPU interpreter.
        blocks: block sizes; default from `TABLE`.
        splits: force the number of splits per row (tests); default from the batch, heads and SM count.
    Returns:
        [B, T, N, H] in q's dtype; queries that see no key are zero.
    Raises:
        NotImplementedError: not a Hopper target, or inputs the kernel does not take.
    """
    if chunk_size is not None:
        raise NotImplementedError("chunked attention (chunk_size) is not implemented in this kernel")
    if visible_until is not None:
        raise NotImplementedError("bidirectional spans (visible_until) are not implemented in this kernel")
    target = platform.require_hopper("paged_attention.mosaic_gpu", interpret)
    B, T, N, H = q.shape
    P, page, K, _ = k_pages.shape
    G = N // K if K and N % K == 0 else 1
    blocks = blocks or TABLE.lookup(target.kind, shape_class(H, page), head_dim=H, page_size=page)
    _check(q, k_pages, v_pages, sinks, blocks, interpret)
    scale = H ** -0.5 if scale is None else float(scale)
    ppb = blocks.block_kv // page
    W = block_tables.shape[1]
    Wp = -(-W // ppb) * ppb
    tables = block_tables.astype(jnp.int32)
    if Wp != W:
        tables = jnp.pad(tables, ((0, 0), (0, Wp - W)))  # page 0, past kv_lengths: masked
    num_blocks = Wp // ppb
    kv_len = jnp.minimum(kv_lengths.astype(jnp.int32), Wp * page)
    q_positions = q_positions.astype(jnp.int32)

    R = T * G
    Rp = -(-R // ROWS) * ROWS
    # Query rows of one kv head: row t * G + g is token t, head kh * G + g; padded to whole wgmma tiles (the
    # padding repeats the last token's position, so it widens no tile's key range).
    rows = q.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, R, H)
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, Rp - R), (0, 0)))
    row_pos = jnp.pad(jnp.repeat(q_positions, G, axis=1), ((0, 0), (0, Rp - R)), mode="edge")

    lo, hi, first, last = tile_key_blocks(row_pos, kv_len, sliding_window, blocks.block_kv, num_blocks)
    n_split = splits or num_splits(B * (Rp // ROWS), K, num_blocks, target.num_cores, blocks.max_splits)
    chunk = -(-(hi - lo) // n_split)  # [B, tiles]
    split_start = lo[..., None] + jnp.arange(n_split, dtype=jnp.int32) * chunk[..., None]
    split_count = jnp.clip(jnp.minimum(hi[..., None], split_start + chunk[..., None]) - split_start, 0)

    out, m, l = _call(rows, k_pages, v_pages, tables, split_start.astype(jnp.int32),
                      split_count.astype(jnp.int32), row_pos, first, last, kv_len, blocks=blocks,
                      window=sliding_window, softcap=logit_softcap, scale=scale, interpret=interpret)
    # Combine the splits (base-2 log-sum-exp); a sink adds exp(sink) to the denominator of its head's rows.
    m_all = m.max(axis=2)  # [B, K, Rp]
    if sinks is not None:
        sink_rows = jnp.tile(sinks.astype(jnp.float32).reshape(K, G), (1, T))  # [K, R]
        sink_rows = jnp.pad(sink_rows, ((0, 0), (0, Rp - R)))[None] * LOG2E
        m_all = jnp.maximum(m_all, sink_rows)
    weight = l * jnp.exp2(m - m_all[:, :, None])  # [B, K, splits, Rp]
    denom = weight.sum(axis=2)
    if sinks is not None:
        denom = denom + jnp.exp2(sink_rows - m_all)
    o = jnp.einsum("bksr,bksrh->bkrh", weight, out.astype(jnp.float32))
    o = o / jnp.maximum(denom, 1e-30)[..., None]
    o = o[:, :, :R].reshape(B, K, T, G, H).transpose(0, 2, 1, 3, 4).reshape(B, T, N, H)
    return o.astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("blocks", "window", "softcap", "scale", "interpret"))
def _call(rows, k_pages, v_pages, tables, split_start, split_count, row_pos, first, last, kv_len, *,
          blocks: Blocks, window: int | None, softcap: float | None, scale: float, interpret: Any):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    B, K, Rp, H = rows.shape
    page = k_pages.shape[1]
    n_split = split_start.shape[2]
    bkv, steps = blocks.block_kv, blocks.steps
    ppb = bkv // page
    dtype = rows.dtype
    score_scale = (scale / softcap) if softcap is not None else scale * LOG2E

    def kernel(q_ref, k_ref, v_ref, tab_ref, start_ref, count_ref, pos_ref, first_ref, last_ref, len_ref,
               o_ref, m_ref, l_ref, q_smem, pos_smem, k_smem, v_smem, p_smem, ml_smem,
               q_bar, k_bar, v_bar):
        b = lax.axis_index("batch")
        s_idx = lax.axis_index("splits")
        kh = lax.axis_index("kv_heads")
        tile = lax.axis_index("row_tiles")
        rt = pl.ds(tile * ROWS, ROWS)
        start, count, kv_len = start_ref[b, tile, s_idx], count_ref[b, tile, s_idx], len_ref[b]
        first, last = first_ref[b, tile], last_ref[b, tile]
        plgpu.copy_gmem_to_smem(q_ref.at[b, kh, rt], q_smem, q_bar.at[0])
        plgpu.copy_gmem_to_smem(pos_ref.at[b, rt], pos_smem, q_bar.at[1])

        def fetch(j, slot):
            kb = start + j
            for pi in range(ppb):
                pg = tab_ref[b, kb * ppb + pi]
                dst = pl.ds(pi * page, page)
                plgpu.copy_gmem_to_smem(k_ref.at[pg, :, kh, :], k_smem.at[slot, dst], k_bar.at[slot * ppb + pi])
                plgpu.copy_gmem_to_smem(v_ref.at[pg, :, kh, :], v_smem.at[slot, dst], v_bar.at[slot * ppb + pi])

        for slot in range(steps):
            pl.when(slot < count)(functools.partial(fetch, slot, slot))
        plgpu.barrier_wait(q_bar.at[0])
        plgpu.barrier_wait(q_bar.at[1])

        def step(j, carry):
            acc, m_i, l_i = carry
            slot = lax.rem(j, jnp.int32(steps))
            key0 = (start + j) * bkv
            for pi in range(ppb):
                plgpu.barrier_wait(k_bar.at[slot * ppb + pi])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((ROWS, bkv), jnp.float32))
            if softcap is not None:
                s = jnp.tanh(s * score_scale) * (softcap * LOG2E)
            else:
                s = s * score_scale
            full = (key0 + bkv <= kv_len) & (key0 + bkv - 1 <= first)
            if window is not None:
                full = full & (last - key0 < window)

            def masked(s):
                key = lax.broadcasted_iota(jnp.int32, (ROWS, bkv), 1) + key0
                pos = lax.broadcast_in_dim(pos_smem[...], (ROWS, bkv), [0])
                visible = (key < kv_len) & (key <= pos)
                if window is not None:
                    visible = visible & (pos - key < window)
                return jnp.where(visible, s, -jnp.inf)

            s = lax.cond(full, lambda s: s, masked, s)
            p, m_new, l_i, acc = online_softmax_step(s, m_i, l_i, acc)
            p16 = p.astype(dtype)
            for pi in range(ppb):
                plgpu.barrier_wait(v_bar.at[slot * ppb + pi])
            if interpret:
                p_smem[...] = p16
                plgpu.commit_smem()

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                    return acc_ref[...]

                acc = acc + pl.run_scoped(pv, plgpu.ACC((ROWS, H), jnp.float32))
            else:
                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            # Both matmuls of this step are complete: the slot may take the block `steps` ahead.
            pl.when(j + steps < count)(lambda: fetch(j + steps, slot))
            return acc, m_new, l_i

        init = (jnp.full((ROWS, H), 0.0, jnp.float32), jnp.full((ROWS,), M0, jnp.float32),
                jnp.full((ROWS,), 0.0, jnp.float32))
        acc, m_i, l_i = lax.fori_loop(0, count, step, init)
        acc = acc / lax.broadcast_in_dim(jnp.maximum(l_i, 1e-30), (ROWS, H), [0])
        o_smem = q_smem  # every matmul has completed: the query tile's buffer takes the output
        o_smem[...] = acc.astype(dtype)
        ml_smem.at[0][...] = m_i
        ml_smem.at[1][...] = l_i
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, kh, s_idx, rt])
        plgpu.copy_smem_to_gmem(ml_smem.at[0], m_ref.at[b, kh, s_idx, rt])
        plgpu.copy_smem_to_gmem(ml_smem.at[1], l_ref.at[b, kh, s_idx, rt])
        plgpu.wait_smem_to_gmem(0)

    p_scratch = plgpu.SMEM((ROWS, bkv), dtype) if interpret else plgpu.SMEM((8, 64), dtype)
    out_types = (jax.ShapeDtypeStruct((B, K, n_split, Rp, H), dtype),
                 jax.ShapeDtypeStruct((B, K, n_split, Rp), jnp.float32),
                 jax.ShapeDtypeStruct((B, K, n_split, Rp), jnp.float32))
    return plgpu.kernel(
        kernel, out_type=out_types,
        grid=(B, n_split, K, Rp // ROWS), grid_names=("batch", "splits", "kv_heads", "row_tiles"),
        scratch_types=(plgpu.SMEM((ROWS, H), dtype), plgpu.SMEM((ROWS,), jnp.int32),
                       plgpu.SMEM((steps, bkv, H), dtype), plgpu.SMEM((steps, bkv, H), dtype), p_scratch,
                       plgpu.SMEM((2, ROWS), jnp.float32),
                       plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=steps * ppb),
                       plgpu.Barrier(num_barriers=steps * ppb)),
        compiler_params=plgpu.CompilerParams(approx_math=True,
                                             lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=platform.interpret_params(interpret),
    )(rows, k_pages, v_pages, tables, split_start, split_count, row_pos, first, last, kv_len)
