"""Paged attention as the engine sees it: the Mosaic GPU split-KV kernel (Hopper); on the CPU, decode steps in a C++
kernel that reads each row's visible keys from its pages (`cpu_ffi`), prefill chunks in key blocks up to the longest
row (`xla_blocks`, also the GPU's where the Mosaic kernel declines); else the reference."""

from __future__ import annotations

import functools

import jax

from kernels_pallas import registry
from kernels_pallas.paged_attention import cpu_ffi, pallas_mgpu, reference, xla_blocks

IMPLEMENTATIONS = {
    registry.REFERENCE: reference.paged_attention,
    "mosaic_gpu": pallas_mgpu.paged_attention,
    "mosaic_gpu_interpret": functools.partial(pallas_mgpu.paged_attention, interpret=True),
    "xla_blocks": xla_blocks.paged_attention,
    "cpu_ffi": cpu_ffi.paged_attention,
}
# On a GPU, where the Mosaic kernel declines (MLA's 576-wide keys, chunked attention), the blockwise program runs
# before the reference: it never gathers a row's whole span of pages at once.
CANDIDATES: dict[str, tuple[str, ...]] = {"gpu": ("mosaic_gpu", "xla_blocks"), "cpu": ("cpu_ffi", "xla_blocks")}
PALLAS = {"mosaic_gpu": "cuda"}
INTERPRET = {"mosaic_gpu": "mosaic_gpu_interpret"}


@jax.named_scope("attention")
def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                    kv_lengths: jax.Array, q_positions: jax.Array, *, sliding_window: int | None = None,
                    logit_softcap: float | None = None, sinks: jax.Array | None = None, scale: float | None = None,
                    chunk_size: int | None = None, visible_until: jax.Array | None = None,
                    implementation: str | None = None) -> jax.Array:
    """See `reference.paged_attention`; `implementation` forces one candidate by name.

    Raises:
        registry.KernelUnavailable: the named implementation cannot take these inputs.
    """
    return registry.dispatch("paged_attention", IMPLEMENTATIONS, CANDIDATES, implementation, q, k_pages, v_pages,
                             block_tables, kv_lengths, q_positions, sliding_window=sliding_window,
                             logit_softcap=logit_softcap, sinks=sinks, scale=scale,
                             **({} if chunk_size is None else dict(chunk_size=chunk_size)),
                             **({} if visible_until is None else dict(visible_until=visible_until)))
