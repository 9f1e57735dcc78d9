"""Compressed attention as the layers see it: cache-less, the reference; in the engine, the gather path that reads
only the window's pages and the chosen entries, else the reference."""

from __future__ import annotations

import jax

from kernels_pallas import registry
from kernels_pallas.compressed_attention import gather, reference
from kernels_pallas.compressed_attention.reference import compressed_attention, entry_positions, gather_pages

__all__ = ["compressed_attention", "paged_compressed_attention", "entry_positions", "gather_pages"]

IMPLEMENTATIONS = {registry.REFERENCE: reference.paged_compressed_attention,
                   "gather": gather.paged_compressed_attention}
# The gather path is plain jax.numpy: it pays on every backend once the context outgrows the window and top-k.
CANDIDATES: dict[str, tuple[str, ...]] = {"cpu": ("gather",), "gpu": ("gather",), "tpu": ("gather",)}
PALLAS: dict[str, str] = {}
INTERPRET: dict[str, str] = {}


@jax.named_scope("attention")
def paged_compressed_attention(q: jax.Array, k_pages: jax.Array, ring_table: jax.Array, c_pages: jax.Array | None,
                               c_table: jax.Array | None, kv_lengths: jax.Array, q_positions: jax.Array,
                               indices: jax.Array | None = None, *, window: int, ratio: int,
                               sinks: jax.Array | None = None, scale: float | None = None,
                               implementation: str | None = None) -> jax.Array:
    """See `reference.paged_compressed_attention`; `implementation` forces one candidate by name.

    Raises:
        registry.KernelUnavailable: the named implementation cannot take these inputs.
    """
    return registry.dispatch("compressed_attention", IMPLEMENTATIONS, CANDIDATES, implementation, q, k_pages,
                             ring_table, c_pages, c_table, kv_lengths, q_positions, indices, window=window,
                             ratio=ratio, sinks=sinks, scale=scale)
