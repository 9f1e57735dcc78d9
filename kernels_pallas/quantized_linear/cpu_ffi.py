"""The CPU candidate: `cpu_kernel.cc` as an XLA FFI custom call, compiled on first use for this machine's CPU
(`kernels_pallas.cpu_build`; without a compiler the candidate declines and the reference runs). The same handler
streams float32 and bfloat16 weights (kinds dense and bf16) for the `linear` op (`linear/cpu_ffi.py`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import cpu_build
from kernels_pallas.quantized_linear.reference import CODE_DTYPES, MX_KINDS, NVFP4_KINDS, QuantizedWeight

TARGET = "day0jax_quantized_matmul"
KIND_IDS = {"int8": 0, "int4": 1, "fp8": 2, "dense": 3, "bf16": 4, "mxfp4": 5, "nvfp4": 6, "nvfp4_modelopt": 7,
            "mxfp8_e4m3": 8, "mxfp8_e5m2": 9}
# The scale dtype each MX and NVFP4 kind's bytes are read as (E8M0 exponents; float8_e4m3fn).
SCALE_DTYPES = {**{k: np.dtype(np.uint8) for k in MX_KINDS}, **{k: np.dtype(jnp.float8_e4m3fn) for k in NVFP4_KINDS}}
# Rows (tokens) up to which the kernel takes quantized weights: it dequantizes each chunk of codes once per 8 rows
# (the chunk stays in L2), where the reference writes a float32 copy of the whole weight per call and then runs a
# full-speed product. Chains of SmolLM2's projections on a 2-core Zen 4, kernel against reference (int4 / int8 /
# fp8): 32 rows 24 / 26 / 27 ms against 67 / 56 / 56, 128 rows 75 / 76 / 77 against 98 / 86 / 87; at 256 they tie.
MAX_ROWS = 128


def quantized_matmul(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """See `reference.quantized_matmul`: x [R, I] with R <= MAX_ROWS, on the CPU, multiplied in float32 (16-bit
    activations widened exactly, as the reference does).

    Raises:
        NotImplementedError: another backend, a kind it does not decode, too many rows, non-float input, a group
            that is not a multiple of 16, codes or MX / NVFP4 scales not in their format's dtype, a multi-device
            mesh (the custom call has no partitioning rule: XLA would gather the codes onto every device, where the
            reference's dequantize-then-dot stays split), or no compiled kernel.
    """
    if jax.default_backend() != "cpu":
        raise NotImplementedError("the FFI kernel is built for the CPU")
    if w.kind not in KIND_IDS:
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
    if w.kind in SCALE_DTYPES and (w.codes.dtype != CODE_DTYPES[w.kind] or w.scale.dtype != SCALE_DTYPES[w.kind]):
        raise NotImplementedError(f"{w.kind} codes {w.codes.dtype} and scales {w.scale.dtype} (the kernel reads "
                                  f"{CODE_DTYPES[w.kind]} and {SCALE_DTYPES[w.kind]})")
    cpu_build.require(TARGET, gathered="the codes")
    O, _ = w.shape
    none = jnp.zeros((0,), jnp.float32)
    offset = w.offset if w.offset is not None else jnp.zeros((0,), w.scale.dtype)
    global_scale = w.global_scale.astype(jnp.float32) if w.kind in NVFP4_KINDS else none
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((R, O), jnp.float32))
    return call(x.astype(jnp.float32), w.codes, w.scale, offset, global_scale, kind=np.int64(KIND_IDS[w.kind]),
                group=np.int64(w.group), has_offset=w.offset is not None)
