"""Attention as callers see it: picks a kernel from the candidates, falls back to the reference."""

from __future__ import annotations

import jax

from kernels_pallas import registry
from kernels_pallas.attention import reference

IMPLEMENTATIONS = {registry.REFERENCE: reference.attention}
# backend -> kernels to try, in order, before the reference.
CANDIDATES: dict[str, tuple[str, ...]] = {}


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_positions: jax.Array,
              kv_lengths: jax.Array | None = None, causal: bool = True, sliding_window: int | None = None,
              logit_softcap: float | None = None, sinks: jax.Array | None = None, scale: float | None = None,
              implementation: str | None = None) -> jax.Array:
    """See `reference.attention` for the contract; `implementation` forces one candidate by name.

    Raises:
        registry.KernelUnavailable: the named implementation cannot take these inputs.
    """
    return registry.dispatch("attention", IMPLEMENTATIONS, CANDIDATES, implementation, q, k, v,
                             q_positions=q_positions, kv_lengths=kv_lengths, causal=causal,
                             sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks, scale=scale)
