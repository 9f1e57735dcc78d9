"""The CPU candidate: `cpu_kernel.cc` as an XLA FFI custom call, compiled on first use for this machine's CPU
(`kernels_pallas.cpu_build`; without a compiler the candidate declines and the reference runs). The same handler
streams float32 and bfloat16 weights (kinds dense and bf16) for the `linear` op (`linear/cpu_ffi.py`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import cpu_build
from kernels_pallas.quantized_linear.reference import QuantizedWeight

TARGET = "day0jax_quantized_matmul"
KIND_IDS = {"int8": 0, "int4": 1, "fp8": 2, "dense": 3, "bf16": 4}
# Rows (tokens) up to which the kernel takes quantized weights: it dequantizes each chunk of codes once per 8 rows
# (the chunk stays in L2), where the reference writes a float32 copy of the whole weight per call and then runs a
# full-speed product. Chains of SmolLM2's projections on a 2-core Zen 4, kernel against reference (int4 / int8 /
# fp8): 32 rows 24 / 26 / 27 ms against 67 / 56 / 56, 128 rows 75 / 76 / 77 against 98 / 86 / 87; at 256 they tie.
MAX_ROWS = 128


def quantized_matmul(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """See `reference.quantized_matmul`: x [R, I] with R <= MAX_ROWS, on the CPU, multiplied in float32 (16-bit
    activations widened exactly, as the reference does).

    Raises:
        NotImplementedError: another backend, a kind it does not decode (the MX and NVFP4 ones), too many rows, non-float input, a group that is not a multiple of 16,
            a multi-device mesh (the custom call has no partitioning rule: XLA would gather the codes onto every
            device, where the reference's dequantize-then-dot stays split), or no compiled kernel.
    """
    if jax.default_backend() != "cpu":
        raise NotImplementedError("the FFI kernel is built for the CPU")
    if w.kind not in KIND_IDS:  # MX formats: the reference's 16-entry lookup runs
        raise NotImplementedError(f"the kernel does not decode {w.kind} codes")
    R, I = x.shape
    if R > MAX_ROWS:
        raise NotImplementedError(f"{R} rows (the kernel takes up to {MAX_ROWS}; the reference's product of a "
                                  "dequantized weight is as fast for more)")
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise NotImplementedError(f"x is {x.dtype}; the kernel multiplies float activations")
    if w.group % 16:
        raise NotImplementedError(f"group size {w.group} is not a multiple of 16")
    if w.codes.dtype != np.dtype(jnp.int8) and w.kind == "int8":
        raise NotImplementedError(f"int8 codes stored as {w.codes.dtype}")
    cpu_build.require(TARGET, gathered="the codes")
    O, _ = w.shape
    offset = w.offset if w.offset is not None else jnp.zeros((0,), w.scale.dtype)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((R, O), jnp.float32))
    return call(x.astype(jnp.float32), w.codes, w.scale, offset, kind=np.int64(KIND_IDS[w.kind]),
                group=np.int64(w.group), has_offset=w.offset is not None)
