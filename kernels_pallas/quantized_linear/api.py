"""Quantized linear maps as the layers see them: on the CPU, the FFI kernel for decode-sized inputs (it reads each
code once per call); elsewhere, and for prefill-sized inputs, the reference (dequantize, then XLA's product)."""

from __future__ import annotations

import jax

from kernels_pallas import registry
from kernels_pallas.quantized_linear import cpu_ffi, reference
from kernels_pallas.quantized_linear.reference import QuantizedWeight

IMPLEMENTATIONS = {
    registry.REFERENCE: reference.quantized_matmul,
    "cpu_ffi": cpu_ffi.quantized_matmul,
}
CANDIDATES: dict[str, tuple[str, ...]] = {"cpu": ("cpu_ffi",)}
PALLAS: dict[str, str] = {}
INTERPRET: dict[str, str] = {}


@jax.named_scope("quantized_linear")
def quantized_matmul(x: jax.Array, w: QuantizedWeight, *, implementation: str | None = None) -> jax.Array:
    """See `reference.quantized_matmul`; `implementation` forces one candidate by name.

    Raises:
        registry.KernelUnavailable: the named implementation cannot take these inputs.
    """
    return registry.dispatch("quantized_linear", IMPLEMENTATIONS, CANDIDATES, implementation, x, w)
