"""Quantized linear maps as the layers see them: on the CPU, the FFI kernel for decode-sized inputs (it reads each
code once per call); on GPUs and TPUs, for bfloat16 or float16 activations, the dequantization written into the
program in the activations' dtype before XLA's product (`xla_dot`); otherwise the reference (dequantize in float32,
then a float32 product)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import registry
from kernels_pallas.quantized_linear import cpu_ffi, reference
from kernels_pallas.quantized_linear.reference import QuantizedWeight


def _xla_dot(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """The codes dequantized to x's 16-bit dtype inside the program, multiplied with float32 accumulation: XLA's
    GPU GEMM fusion takes the dequantization into the product's operand loads (the codes are what is read), where
    the reference's float32 weight would be written out and read back at 4 bytes per weight. Products of 16-bit
    floats are exact in float32, so the only difference from the reference is the weight rounded to x's dtype.

    Raises:
        NotImplementedError: float32 activations (the reference's float32 product is the one to run).
    """
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        raise NotImplementedError(f"x is {x.dtype}; the 16-bit product serves bfloat16 and float16 activations")
    wq = reference.dequantize(w).astype(x.dtype)
    return jax.lax.dot_general(x, wq, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


IMPLEMENTATIONS = {
    registry.REFERENCE: reference.quantized_matmul,
    "cpu_ffi": cpu_ffi.quantized_matmul,
    "xla_dot": _xla_dot,
}
CANDIDATES: dict[str, tuple[str, ...]] = {"cpu": ("cpu_ffi",), "gpu": ("xla_dot",), "tpu": ("xla_dot",)}
PALLAS: dict[str, str] = {}
INTERPRET: dict[str, str] = {}
LOWERED = {"xla_dot": "cuda"}  # lowered for CUDA by `selfcheck --lower cuda` on machines without a GPU


@jax.named_scope("quantized_linear")
def quantized_matmul(x: jax.Array, w: QuantizedWeight, *, implementation: str | None = None) -> jax.Array:
    """See `reference.quantized_matmul`; `implementation` forces one candidate by name.

    Raises:
        registry.KernelUnavailable: the named implementation cannot take these inputs.
    """
    return registry.dispatch("quantized_linear", IMPLEMENTATIONS, CANDIDATES, implementation, x, w)
