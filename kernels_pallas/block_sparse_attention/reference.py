"""The definition of block-sparse attention, in plain jax.numpy; also the fallback on every backend.

Two steps per layer. The indexer scores every visible key for each query with its own small heads, one per KV
group (score(t, s) = q_i[t] . k[s], no scale, one key head shared by the indexer heads), max-pools the scores into
blocks of `block_size` consecutive positions, forces the `local_blocks` blocks at and before the query's own block,
and keeps the `topk_blocks` best blocks (blocks with no visible key are never kept). Attention then runs causally
over the positions of the kept blocks, each query head over its KV group's blocks. When `topk_blocks` covers every
block, it is dense causal attention computed by the same operations.

The "mean" pooling (Qwen4-Exp's QSA indexer) scores blocks instead of positions: the keys of each complete block
of `block_size` positions averaged (`mean_pool`), which the layer normalizes and rotates at the block's first
position; a block's score is sum_i relu(q_i . k_block) / sqrt(Di) over the indexer heads, one choice shared by
every query head (I = 1 in `kept`); only blocks the query sees whole compete, for `topk_blocks` places, and the
query's own block, when it sees it only in part (its tail), is always kept.

Letters: B batch, T queries, S key positions, N query heads, K kv heads, H head dim (Hv for values), I indexer
heads (one per KV group: I = K in MiniMax-M3), Di indexer head dim, Nb key blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.attention import reference as dense
from kernels_pallas.sparse_attention.reference import gather_pages, visible

FLOOR = dense.FLOOR  # masked scores


def mean_pool(ik: jax.Array, block_size: int) -> jax.Array:
    """[B, S, Di] keys -> [B, S // block_size, Di]: the mean over each complete block, in float32 (as transformers
    averages), in ik's dtype."""
    B, S, Di = ik.shape
    Nb = S // block_size
    blocks = ik[:, :Nb * block_size].astype(jnp.float32).reshape(B, Nb, block_size, Di)
    return blocks.mean(axis=2).astype(ik.dtype)


def _mean_select(iq: jax.Array, bk: jax.Array, *, block_size: int, topk_blocks: int,
                 q_positions: jax.Array) -> jax.Array:
    """The "mean" form of `block_select`: bk [B, Nb, Di] block keys -> [B, 1, T, Nb + 1] (the last block: the one
    past the complete ones, which a query at the end of the keys sees in part)."""
    B, T, I, Di = iq.shape
    Nb = bk.shape[1]
    scores = jnp.einsum("btid,bjd->btij", iq.astype(jnp.float32), bk.astype(jnp.float32))
    scores = jax.nn.relu(scores).sum(axis=2) / jnp.sqrt(jnp.float32(Di))
    blocks = jnp.arange(Nb + 1)[None, None, :]
    seen = q_positions[:, :, None] + 1  # keys at and before the query
    complete = (blocks + 1) * block_size <= seen
    scores = jnp.where(complete, jnp.pad(scores, ((0, 0), (0, 0), (0, 1))), -jnp.inf)
    values, chosen = jax.lax.top_k(scores, min(topk_blocks, Nb + 1))
    hits = (jax.nn.one_hot(chosen, Nb + 1, dtype=jnp.bool_) & (values > -jnp.inf)[..., None]).any(axis=-2)
    # The query's own block when it sees only part of it: its tail, always attended.
    tail = (blocks == seen // block_size) & (seen % block_size != 0)
    return (hits | tail)[:, None]


def block_select(iq: jax.Array, ik: jax.Array, *, block_size: int, topk_blocks: int, local_blocks: int,
                 q_positions: jax.Array, kv_lengths: jax.Array | None = None, pool: str = "max") -> jax.Array:
    """The indexer's choice of key blocks.

    Args:
        iq: [B, T, I, Di] indexer queries.
        ik: [B, S, Di] indexer keys (one head); key s sits at position s. For the "mean" pooling: [B, Nb', Di]
            the keys of the complete blocks (`mean_pool`, then the layer's norm and rotation).
        block_size: positions per block (block j holds positions j * block_size ... (j + 1) * block_size - 1).
        topk_blocks: blocks kept per query and indexer head.
        local_blocks: blocks at and before the query's own block that are always kept.
        q_positions: [B, T] absolute positions of the queries.
        kv_lengths: [B] valid keys per row (None: all S).
        pool: "max" (scores of positions, max-pooled; per indexer head) or "mean" (module docstring; `local_blocks`
            unused, the query's partly seen block always kept).
    Returns:
        [B, I, T, Nb] bool, Nb = ceil(S / block_size): whether the block is kept ("mean": I = 1, Nb = Nb' + 1).
    Raises:
        ValueError: an unknown pooling.
    """
    if pool == "mean":
        return _mean_select(iq, ik, block_size=block_size, topk_blocks=topk_blocks, q_positions=q_positions)
    if pool != "max":
        raise ValueError(f"block pooling {pool!r} is not 'max' or 'mean'")
    B, T, I, _ = iq.shape
    S = ik.shape[1]
    Nb = -(-S // block_size)
    scores = jnp.einsum("btid,bsd->bits", iq.astype(jnp.float32), ik.astype(jnp.float32))
    scores = jnp.where(visible(q_positions, S, kv_lengths)[:, None], scores, -jnp.inf)
    scores = jnp.pad(scores, ((0, 0), (0, 0), (0, 0), (0, Nb * block_size - S)), constant_values=-jnp.inf)
    block_scores = scores.reshape(B, I, T, Nb, block_size).max(axis=-1)
    # The forced blocks outrank every scored one, as transformers' +inf does.
    q_block = (q_positions // block_size)[:, :, None]
    blocks = jnp.arange(Nb)[None, None, :]
    local = (blocks <= q_block) & (blocks > q_block - local_blocks)
    block_scores = jnp.where(local[:, None], jnp.inf, block_scores)
    values, chosen = jax.lax.top_k(block_scores, min(topk_blocks, Nb))
    hits = jax.nn.one_hot(chosen, Nb, dtype=jnp.bool_) & (values > -jnp.inf)[..., None]
    return hits.any(axis=-2)


def block_sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, kept: jax.Array, *, block_size: int,
                           q_positions: jax.Array, kv_lengths: jax.Array | None = None,
                           scale: float | None = None) -> jax.Array:
    """Causal attention of each query over the positions of its kept blocks.

    Args:
        q: [B, T, N, H]; k: [B, S, K, H]; v: [B, S, K, Hv] (N a multiple of K; key s at position s).
        kept: [B, I, T, Nb] bool from `block_select` (I divides N: query head n reads indexer head n // (N / I)).
        block_size: positions per block; q_positions: [B, T]; kv_lengths: [B] or None; scale: default H ** -0.5.
    Returns:
        [B, T, N, Hv] in q's dtype.
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    I = kept.shape[1]
    scale = H ** -0.5 if scale is None else scale
    on_keys = jnp.repeat(kept, block_size, axis=-1)[..., :S]
    on_keys = jnp.repeat(on_keys, N // I, axis=1).reshape(B, K, N // K, T, S)
    allowed = on_keys & visible(q_positions, S, kv_lengths)[:, None, None]
    scores = jnp.where(allowed, dense.grouped_scores(q, k) * scale, FLOOR)
    return dense.weighted_values(jax.nn.softmax(scores, axis=-1), v).astype(q.dtype)


def indexed_block_sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, iq: jax.Array, ik: jax.Array, *,
                                   block_size: int, topk_blocks: int, local_blocks: int, q_positions: jax.Array,
                                   kv_lengths: jax.Array | None = None, scale: float | None = None,
                                   pool: str = "max") -> jax.Array:
    """`block_select` then `block_sparse_attention`: the whole op over contiguous keys."""
    kept = block_select(iq, ik, block_size=block_size, topk_blocks=topk_blocks, local_blocks=local_blocks,
                        q_positions=q_positions, kv_lengths=kv_lengths, pool=pool)
    return block_sparse_attention(q, k, v, kept, block_size=block_size, q_positions=q_positions,
                                  kv_lengths=kv_lengths, scale=scale)


def paged_block_sparse_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, index_pages: jax.Array,
                                 block_tables: jax.Array, kv_lengths: jax.Array, q_positions: jax.Array,
                                 iq: jax.Array, *, block_size: int, topk_blocks: int, local_blocks: int,
                                 scale: float | None = None) -> jax.Array:
    """`indexed_block_sparse_attention` over each row's pages (k_pages [P, page, K, H], v_pages [P, page, K, Hv],
    index_pages [P, page, Di], block tables [B, W]), as over them gathered contiguously: the blocks past a row's
    keys score -inf and are never kept, so the gathered length does not change the choice."""
    return indexed_block_sparse_attention(
        q, gather_pages(k_pages, block_tables), gather_pages(v_pages, block_tables), iq,
        gather_pages(index_pages, block_tables), block_size=block_size, topk_blocks=topk_blocks,
        local_blocks=local_blocks, q_positions=q_positions, kv_lengths=kv_lengths, scale=scale)


def paged_attend_blocks(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                        kv_lengths: jax.Array, q_positions: jax.Array, kept: jax.Array, *, block_size: int,
                        most_blocks: int, scale: float | None = None) -> jax.Array:
    """`block_sparse_attention` over each row's pages (k_pages [P, page, K, H], v_pages [P, page, K, Hv], block
    tables [B, W]) for blocks `kept` [B, I, T, Nb] chosen over them (any pooling; at most `most_blocks` kept per
    query, which only a path that reads the kept blocks alone needs to know)."""
    return block_sparse_attention(q, gather_pages(k_pages, block_tables), gather_pages(v_pages, block_tables), kept,
                                  block_size=block_size, q_positions=q_positions, kv_lengths=kv_lengths, scale=scale)


def pooled_block_select(iq: jax.Array, weights: jax.Array, ik: jax.Array, gate: jax.Array, ape: jax.Array, *,
                        block_size: int, topk_blocks: int, scale: float, q_positions: jax.Array,
                        kv_lengths: jax.Array | None = None) -> jax.Array:
    """GLM-5-Next's choice of key blocks: the indexer scores pooled keys instead of max-pooling token scores.

    Each complete block's key is a learned average of its tokens' keys (softmax over the block's positions, per
    channel, of `gate` + `ape`); a query scores it sum_i w_i * relu(q_i . key * scale) and keeps its `topk_blocks`
    best among the complete blocks it sees whole; its own block, while incomplete (the tail), is always kept on top.
    An incomplete block is never scored, so the choice for a query depends on no key after it.

    Args:
        iq: [B, T, I, Di] indexer queries; weights: [B, T, I] float32 head weights.
        ik: [B, S, Di] indexer keys; gate: [B, S, Di] pooling logits; ape: [block_size, Di] their per-slot bias.
        block_size: positions per block; topk_blocks: complete blocks kept per query; scale: the score scale.
        q_positions: [B, T]; kv_lengths: [B] valid keys per row (None: all S).
    Returns:
        [B, 1, T, Nb] bool, Nb = ceil(S / block_size): whether the block is kept (one selection for every head).
    """
    B, S, Di = ik.shape
    Nb = -(-S // block_size)
    pad = ((0, 0), (0, Nb * block_size - S), (0, 0))
    lengths = jnp.full((B,), S) if kv_lengths is None else kv_lengths
    present = (jnp.arange(Nb * block_size)[None] < lengths[:, None]).reshape(B, Nb, block_size)
    complete = present.all(-1)  # [B, Nb]
    keys = jnp.pad(ik, pad).reshape(B, Nb, block_size, Di)
    logits = jnp.pad(gate, pad).reshape(B, Nb, block_size, Di).astype(jnp.float32) + ape.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=2).astype(ik.dtype)
    pooled = (probs * keys).sum(axis=2)  # [B, Nb, Di]; incomplete blocks' values are never read
    scores = jnp.einsum("btid,bnd->btin", iq.astype(jnp.float32), pooled.astype(jnp.float32))
    index = jnp.einsum("bti,btin->btn", weights.astype(jnp.float32), jax.nn.relu(scores * scale))
    ends = (jnp.arange(Nb) + 1) * block_size - 1
    seen = complete[:, None, :] & (ends[None, None, :] <= q_positions[:, :, None])  # [B, T, Nb]
    values, chosen = jax.lax.top_k(jnp.where(seen, index, -jnp.inf), min(topk_blocks, Nb))
    kept = (jax.nn.one_hot(chosen, Nb, dtype=jnp.bool_) & (values > -jnp.inf)[..., None]).any(axis=-2)
    own = q_positions // block_size
    tail = ((q_positions + 1) % block_size != 0)[..., None] & (jnp.arange(Nb)[None, None] == own[..., None])
    return (kept | tail)[:, None]

