"""Indexed sparse attention as the layers see it: the indexer's top-k (reference everywhere), attention over the
selected keys (cache-less: the reference; paged: the gather path that reads only the selected keys, else the
reference)."""

from __future__ import annotations

import jax

from kernels_pallas import registry
from kernels_pallas.sparse_attention import gather, reference
from kernels_pallas.sparse_attention.reference import gather_pages, index_topk, sparse_attention

__all__ = ["index_topk", "sparse_attention", "paged_sparse_attention", "gather_pages"]

IMPLEMENTATIONS = {registry.REFERENCE: reference.paged_sparse_attention, "gather": gather.paged_sparse_attention}
# The gather path is plain jax.numpy: it pays on every backend once the context outgrows top-k.
CANDIDATES: dict[str, tuple[str, ...]] = {"cpu": ("gather",), "gpu": ("gather",), "tpu": ("gather",)}
PALLAS: dict[str, str] = {}
INTERPRET: dict[str, str] = {}


@jax.named_scope("attention")
def paged_sparse_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                           kv_lengths: jax.Array, q_positions: jax.Array, indices: jax.Array, *,
                           scale: float | None = None, sinks: jax.Array | None = None,
                           implementation: str | None = None) -> jax.Array:
    """See `reference.paged_sparse_attention`; `implementation` forces one candidate by name.

    Raises:
        registry.KernelUnavailable: the named implementation cannot take these inputs.
    """
    return registry.dispatch("sparse_attention", IMPLEMENTATIONS, CANDIDATES, implementation, q, k_pages, v_pages,
                             block_tables, kv_lengths, q_positions, indices, scale=scale, sinks=sinks)
