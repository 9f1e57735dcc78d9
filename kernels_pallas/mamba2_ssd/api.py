"""The Mamba2 scan as state-space layers see it: on Hopper the Mosaic GPU kernel for prefill, else
`reference.mamba2_ssd` (the recurrent form for a decode step, the chunked form for prefill)."""

from __future__ import annotations

import functools

import jax

from kernels_pallas import registry
from kernels_pallas.mamba2_ssd import pallas_mgpu, reference

IMPLEMENTATIONS = {
    registry.REFERENCE: reference.mamba2_ssd,
    "mosaic_gpu": pallas_mgpu.mamba2_ssd,
    "mosaic_gpu_interpret": functools.partial(pallas_mgpu.mamba2_ssd, interpret=True),
}
# The kernel declines a decode step (T = 1): the reference's recurrent form takes it.
CANDIDATES: dict[str, tuple[str, ...]] = {"gpu": ("mosaic_gpu",)}
PALLAS = {"mosaic_gpu": "cuda"}
INTERPRET = {"mosaic_gpu": "mosaic_gpu_interpret"}


@jax.named_scope("ssm")
def mamba2_ssd(x: jax.Array, dt: jax.Array, A: jax.Array, b: jax.Array, c: jax.Array,
               state: jax.Array | None = None, *, D: jax.Array | None = None, dt_bias: jax.Array | None = None,
               dt_softplus: bool = True, dt_limit: tuple[float, float] = (0.0, float("inf")),
               valid: jax.Array | None = None, chunk_size: int = reference.CHUNK,
               implementation: str | None = None) -> tuple[jax.Array, jax.Array]:
    """See `reference.recurrent` (the contract) and `reference.chunked`; `implementation` forces one candidate.

    Args:
        x: [B, T, N, H]; dt: [B, T, N]; A: [N] float32 (negative); b, c: [B, T, G, Z]; state: [B, N, H, Z] float32
            or None; D, dt_bias: [N] or None; dt_softplus, dt_limit, valid, chunk_size: as in the reference.
        implementation: a name from `IMPLEMENTATIONS`, or None to choose.
    Returns:
        (y [B, T, N, H] in x's dtype, final state [B, N, H, Z] float32).
    Raises:
        registry.KernelUnavailable: the named implementation cannot take these inputs.
        ValueError: inconsistent shapes.
    """
    return registry.dispatch("mamba2_ssd", IMPLEMENTATIONS, CANDIDATES, implementation, x, dt, A, b, c, state,
                             D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=tuple(dt_limit), valid=valid,
                             chunk_size=chunk_size)
