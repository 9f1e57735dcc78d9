"""Paged attention in key blocks, stopping at the longest row: the CPU's candidate.

The engine's programs take block tables padded to a width bucket (prefill widths grow 4x), and the reference scores
every slot of that width. Here a loop walks blocks of `BLOCK_PAGES` pages with an online softmax (running max and
sum per query, as flash attention does) and runs only up to the block holding the longest row's last key (from a
sliding window's first one): a 2048-token prompt's last chunks score 2048 keys, not the 4096 of their bucket, and
the score buffer is one block wide whatever the context. Plain `jax.numpy`, so any backend can run it.
Decode steps (one query per row) take it too once their table spans more than one block of `DECODE_BLOCK_PAGES`:
each block's gathered keys are used while they are in cache instead of the whole span being copied out first
(on a 2-core Xeon, one row over 16k keys: 3.2 ms against the reference's 7.4; at 32k, 8.4 against 16-23).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.attention.reference import FLOOR, grouped_scores, weighted_values

BLOCK_PAGES = 16  # pages per key block: 256 keys at the engine's 16-token pages
# A decode step's blocks: 1024 keys, so the loop's fixed cost per block stays small against one query's work.
DECODE_BLOCK_PAGES = 64


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                    kv_lengths: jax.Array, q_positions: jax.Array, *, sliding_window: int | None = None,
                    logit_softcap: float | None = None, sinks: jax.Array | None = None,
                    scale: float | None = None, chunk_size: int | None = None,
                    visible_until: jax.Array | None = None) -> jax.Array:
    """The contract of `reference.paged_attention`, computed block by block.

    Raises:
        NotImplementedError: a table no wider than one block (`DECODE_BLOCK_PAGES` for decode steps): nothing to
            skip, the reference's single pass is as fast.
    """
    B, T, N, H = q.shape
    block_pages = DECODE_BLOCK_PAGES if T == 1 else BLOCK_PAGES
    if block_tables.shape[1] <= block_pages:
        raise NotImplementedError(f"a table of one block ({block_pages} pages{' for decode' if T == 1 else ''}): "
                                  "nothing to skip, the reference's single pass")
    _, page, K, _ = k_pages.shape
    Hv, G = v_pages.shape[-1], N // K
    scale = H ** -0.5 if scale is None else scale
    width = -(-block_tables.shape[1] // block_pages) * block_pages
    # Padding columns point at page 0; kv_lengths hides whatever they hold.
    tables = jnp.pad(block_tables, ((0, 0), (0, width - block_tables.shape[1])))
    block_keys = block_pages * page
    last = (jnp.max(kv_lengths) + block_keys - 1) // block_keys  # blocks holding any row's keys
    first = jnp.int32(0)
    if sliding_window is not None:  # blocks wholly before every query's window hold nothing it sees
        first = jnp.maximum(jnp.min(q_positions) - sliding_window + 1, 0) // block_keys
    qpos = q_positions[:, :, None]  # [B, T, 1]
    until = qpos if visible_until is None else visible_until[:, :, None]

    def block(j, carry):
        peak, total, acc = carry  # [B, K, G, T] running max and sum of exp(score - max), [B, T, N, Hv] numerators
        ids = jax.lax.dynamic_slice_in_dim(tables, j * block_pages, block_pages, axis=1)
        k = k_pages[ids].reshape(B, block_keys, K, H)
        v = v_pages[ids].reshape(B, block_keys, K, Hv)
        scores = grouped_scores(q, k) * scale  # [B, K, G, T, Sb]
        if logit_softcap is not None:
            scores = logit_softcap * jnp.tanh(scores / logit_softcap)
        key_pos = j * block_keys + jnp.arange(block_keys)[None, None, :]
        visible = (key_pos < kv_lengths[:, None, None]) & (key_pos <= until)
        if sliding_window is not None:
            visible &= qpos - key_pos < sliding_window
        if chunk_size is not None:
            visible &= key_pos // chunk_size == qpos // chunk_size
        scores = jnp.where(visible[:, None, None], scores, FLOOR)
        new_peak = jnp.maximum(peak, scores.max(axis=-1))
        weights = jnp.exp(scores - new_peak[..., None])
        fade = jnp.exp(peak - new_peak)  # rescales what earlier blocks summed under the old max
        total = total * fade + weights.sum(axis=-1)
        acc = acc * heads_last(fade) + weighted_values(weights, v)
        return new_peak, total, acc

    carry = (jnp.full((B, K, G, T), FLOOR), jnp.zeros((B, K, G, T), jnp.float32),
             jnp.zeros((B, T, N, Hv), jnp.float32))
    peak, total, acc = jax.lax.fori_loop(first, last, block, carry)
    if sinks is not None:  # a sink logit joins each denominator and takes no value
        sink = sinks.astype(jnp.float32).reshape(1, K, G, 1)
        top = jnp.maximum(peak, sink)
        fade = jnp.exp(peak - top)
        acc, total = acc * heads_last(fade), total * fade + jnp.exp(sink - top)
    return (acc / heads_last(total)).astype(q.dtype)


def heads_last(x: jax.Array) -> jax.Array:
    """[B, K, G, T] -> [B, T, N, 1], to scale the [B, T, N, Hv] numerators per query and head."""
    B, K, G, T = x.shape
    return x.transpose(0, 3, 1, 2).reshape(B, T, K * G, 1)
