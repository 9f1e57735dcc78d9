"""Block-sparse attention as the layers see it: block selection and attention over the kept blocks (cache-less:
the reference's functions; paged: the gather path that reads only the kept blocks' keys, else the reference)."""

from __future__ import annotations

import jax

from kernels_pallas import registry
from kernels_pallas.block_sparse_attention import gather, reference
from kernels_pallas.block_sparse_attention.reference import (block_select, block_sparse_attention,
                                                             gather_pages, indexed_block_sparse_attention, mean_pool,
                                                             pooled_block_select)

__all__ = ["block_select", "block_sparse_attention", "gather_pages", "indexed_block_sparse_attention", "mean_pool",
           "paged_attend_blocks", "paged_block_sparse_attention", "pooled_block_select"]

IMPLEMENTATIONS = {registry.REFERENCE: reference.paged_block_sparse_attention,
                   "gather": gather.paged_block_sparse_attention}
# The gather path is plain jax.numpy: it pays on every backend once the context outgrows the kept blocks.
CANDIDATES: dict[str, tuple[str, ...]] = {"cpu": ("gather",), "gpu": ("gather",), "tpu": ("gather",)}
PALLAS: dict[str, str] = {}
INTERPRET: dict[str, str] = {}
# The attention over blocks chosen elsewhere (the "mean" and "learned" poolings, a layer reusing another's choice),
# by the same implementations.
ATTEND_BLOCKS = {registry.REFERENCE: reference.paged_attend_blocks, "gather": gather.paged_attend_blocks}


@jax.named_scope("attention")
def paged_block_sparse_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, index_pages: jax.Array,
                                 block_tables: jax.Array, kv_lengths: jax.Array, q_positions: jax.Array,
                                 iq: jax.Array, *, block_size: int, topk_blocks: int, local_blocks: int,
                                 scale: float | None = None, implementation: str | None = None) -> jax.Array:
    """See `reference.paged_block_sparse_attention`; `implementation` forces one candidate by name.

    Raises:
        registry.KernelUnavailable: the named implementation cannot take these inputs.
    """
    return registry.dispatch("block_sparse_attention", IMPLEMENTATIONS, CANDIDATES, implementation, q, k_pages,
                             v_pages, index_pages, block_tables, kv_lengths, q_positions, iq, block_size=block_size,
                             topk_blocks=topk_blocks, local_blocks=local_blocks, scale=scale)


@jax.named_scope("attention")
def paged_attend_blocks(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                        kv_lengths: jax.Array, q_positions: jax.Array, kept: jax.Array, *, block_size: int,
                        most_blocks: int, scale: float | None = None, implementation: str | None = None) -> jax.Array:
    """See `reference.paged_attend_blocks`; `implementation` forces one candidate by name.

    Raises:
        registry.KernelUnavailable: the named implementation cannot take these inputs.
    """
    return registry.dispatch("block_sparse_attention", ATTEND_BLOCKS, CANDIDATES, implementation, q, k_pages,
                             v_pages, block_tables, kv_lengths, q_positions, kept, block_size=block_size,
                             most_blocks=most_blocks, scale=scale)
