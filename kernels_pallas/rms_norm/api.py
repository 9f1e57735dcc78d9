"""RMSNorm as the layers see it: the Mosaic GPU kernel on Hopper, else the reference (which XLA fuses well)."""

from __future__ import annotations

import functools

import jax

from kernels_pallas import registry
from kernels_pallas.rms_norm import pallas_mgpu, reference

IMPLEMENTATIONS = {
    registry.REFERENCE: reference.rms_norm,
    "mosaic_gpu": pallas_mgpu.rms_norm,
    "mosaic_gpu_interpret": functools.partial(pallas_mgpu.rms_norm, interpret=True),
}
CANDIDATES: dict[str, tuple[str, ...]] = {"gpu": ("mosaic_gpu",)}
PALLAS = {"mosaic_gpu": "cuda"}
INTERPRET = {"mosaic_gpu": "mosaic_gpu_interpret"}


def rms_norm(x: jax.Array, weight: jax.Array, *, eps: float, offset: float = 0.0,
             residual: jax.Array | None = None, implementation: str | None = None) -> tuple[jax.Array, jax.Array]:
    """See `reference.rms_norm`; `implementation` forces one candidate by name.

    Raises:
        registry.KernelUnavailable: the named implementation cannot take these inputs.
    """
    return registry.dispatch("rms_norm", IMPLEMENTATIONS, CANDIDATES, implementation, x, weight, eps=eps,
                             offset=offset, residual=residual)
