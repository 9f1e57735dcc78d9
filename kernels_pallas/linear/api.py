"""Linear maps with float weights as the layers see them: on the CPU, the C++ kernel for decode-sized inputs
(`cpu_ffi`: a few rows, each weight streamed once per call, one call for the maps of one input); otherwise, and
for everything else, XLA's product (`reference`)."""

from __future__ import annotations

from typing import Sequence

import jax

from kernels_pallas import registry
from kernels_pallas.linear import cpu_ffi, reference

IMPLEMENTATIONS = {registry.REFERENCE: reference.linear, "cpu_ffi": cpu_ffi.linear}
CANDIDATES: dict[str, tuple[str, ...]] = {"cpu": ("cpu_ffi",)}
PALLAS: dict[str, str] = {}
INTERPRET: dict[str, str] = {}


def linear(x: jax.Array, kernels: Sequence[jax.Array], in_ndim: int = 1, *,
           implementation: str | None = None) -> list[jax.Array]:
    """See `reference.linear`: x [..., *in] times each of `kernels` [*out_k, *in]; `implementation` forces one.

    Several weights go to a candidate in one call, or, where it declines them together, each on its own: at one
    row a weight over the kernel's size limit (a large q) keeps XLA's product while the small ones (k and v) still
    take the kernel.

    Returns:
        [..., *out_k] per weight, in the result dtype of x and that weight.
    Raises:
        registry.KernelUnavailable: the named implementation cannot take these inputs.
    """
    kernels = list(kernels)
    if implementation is None and len(kernels) > 1:
        return registry.dispatch("linear", {**IMPLEMENTATIONS, registry.REFERENCE: _one_by_one}, CANDIDATES, None,
                                 x, kernels, in_ndim)
    return registry.dispatch("linear", IMPLEMENTATIONS, CANDIDATES, implementation, x, kernels, in_ndim)


def _one_by_one(x: jax.Array, kernels: list[jax.Array], in_ndim: int) -> list[jax.Array]:
    return [linear(x, [kernel], in_ndim)[0] for kernel in kernels]
