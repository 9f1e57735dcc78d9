"""The gated delta rule as linear-attention layers see it: on Hopper the Mosaic GPU kernel for prefill, else
`reference.gated_delta_rule` (the recurrent form for a decode step, the chunked form for prefill)."""

from __future__ import annotations

import functools

import jax

from kernels_pallas import registry
from kernels_pallas.gated_delta_rule import pallas_mgpu, reference

IMPLEMENTATIONS = {
    registry.REFERENCE: reference.gated_delta_rule,
    "mosaic_gpu": pallas_mgpu.gated_delta_rule,
    "mosaic_gpu_interpret": functools.partial(pallas_mgpu.gated_delta_rule, interpret=True),
}
# The kernel declines a decode step (T = 1): the reference's recurrent form takes it.
CANDIDATES: dict[str, tuple[str, ...]] = {"gpu": ("mosaic_gpu",)}
PALLAS = {"mosaic_gpu": "cuda"}
INTERPRET = {"mosaic_gpu": "mosaic_gpu_interpret"}


@jax.named_scope("attention")
def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                     state: jax.Array | None = None, *, scale: float | None = None, l2_normalize: bool = True,
                     implementation: str | None = None) -> tuple[jax.Array, jax.Array]:
    """See `reference.recurrent` (the contract) and `reference.chunked`; `implementation` forces one candidate.

    Args:
        q, k: [B, T, Nk, Hk]; v: [B, T, Nv, Hv]; g: [B, T, Nv] or [B, T, Nv, Hk] log-space decay; beta: [B, T, Nv];
        state: [B, Nv, Hk, Hv] float32 or None; scale, l2_normalize: as in the reference.
        implementation: a name from `IMPLEMENTATIONS`, or None to choose.
    Returns:
        (out [B, T, Nv, Hv] in q's dtype, final state [B, Nv, Hk, Hv] float32).
    Raises:
        registry.KernelUnavailable: the named implementation cannot take these inputs.
    """
    return registry.dispatch("gated_delta_rule", IMPLEMENTATIONS, CANDIDATES, implementation, q, k, v, g, beta,
                             state, scale=scale, l2_normalize=l2_normalize)
