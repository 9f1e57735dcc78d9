"""Attention as callers see it: the Mosaic GPU kernel (Hopper; every variant of the contract), then cuDNN's flash
attention (where its masks match), then the reference."""

from __future__ import annotations

import functools

import jax

from kernels_pallas import registry
from kernels_pallas.attention import pallas_mgpu, reference, xla_cudnn

IMPLEMENTATIONS = {
    registry.REFERENCE: reference.attention,
    "mosaic_gpu": pallas_mgpu.attention,
    "mosaic_gpu_interpret": functools.partial(pallas_mgpu.attention, interpret=True),
    "cudnn": xla_cudnn.attention,
}
CANDIDATES: dict[str, tuple[str, ...]] = {"gpu": ("mosaic_gpu", "cudnn")}
PALLAS = {"mosaic_gpu": "cuda"}
INTERPRET = {"mosaic_gpu": "mosaic_gpu_interpret"}


@jax.named_scope("attention")
def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_positions: jax.Array,
              kv_lengths: jax.Array | None = None, causal: bool = True, sliding_window: int | None = None,
              logit_softcap: float | None = None, sinks: jax.Array | None = None, scale: float | None = None,
              chunk_size: int | None = None, visible_until: jax.Array | None = None,
              implementation: str | None = None) -> jax.Array:
    """See `reference.attention` for the contract; `implementation` forces one candidate by name.

    Raises:
        registry.KernelUnavailable: the named implementation cannot take these inputs.
    """
    # chunk_size and visible_until go only where set: implementations that predate them need not take them.
    chunked = {} if chunk_size is None else dict(chunk_size=chunk_size)
    if visible_until is not None:
        chunked["visible_until"] = visible_until
    return registry.dispatch("attention", IMPLEMENTATIONS, CANDIDATES, implementation, q, k, v,
                             q_positions=q_positions, kv_lengths=kv_lengths, causal=causal,
                             sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks, scale=scale,
                             **chunked)
