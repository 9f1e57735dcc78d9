"""The CPU candidate: `cpu_kernel.cc` as an XLA FFI custom call, compiled on first use for this machine's CPU
(`kernels_pallas.cpu_build`; without a compiler the candidate declines and the reference runs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import cpu_build
from kernels_pallas.quantized_linear.reference import QuantizedWeight

TARGET = "day0jax_quantized_matmul"
MANY_TARGET = "day0jax_dense_matmul_many"
KIND_IDS = {"int8": 0, "int4": 1, "fp8": 2, "dense": 3, "bf16": 4}
# Rows (tokens) up to which the kernel takes quantized weights: it dequantizes each chunk of codes once per 8 rows
# (the chunk stays in L2), where the reference writes a float32 copy of the whole weight per call and then runs a
# full-speed product. Chains of SmolLM2's projections on a 2-core Zen 4, kernel against reference (int4 / int8 /
# fp8): 32 rows 24 / 26 / 27 ms against 67 / 56 / 56, 128 rows 75 / 76 / 77 against 98 / 86 / 87; at 256 they tie.
MAX_ROWS = 128
# Rows up to which float32 and bfloat16 weights take it: XLA's own product of more rows is as fast (bfloat16 ones
# are bound by arithmetic there, which XLA does in the CPU's bfloat16 dot instructions where it has them). A chain
# of SmolLM2's bfloat16 projections on a 2-core Zen 4: 10 ms against XLA's 112 at 1 row, 16 against 21 at 8, 22
# against 22 at 12, 32 against 24 at 16.
DENSE_MAX_ROWS = {jnp.dtype(jnp.float32): 16, jnp.dtype(jnp.bfloat16): 8}


def quantized_matmul(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """See `reference.quantized_matmul`: x [R, I] with R <= MAX_ROWS, on the CPU, multiplied in float32 (16-bit
    activations widened exactly, as the reference does).

    Raises:
        NotImplementedError: another backend, too many rows, non-float input, a group that is not a multiple of 16,
            a multi-device mesh (the custom call has no partitioning rule: XLA would gather the codes onto every
            device, where the reference's dequantize-then-dot stays split), or no compiled kernel.
    """
    if jax.default_backend() != "cpu":
        raise NotImplementedError("the FFI kernel is built for the CPU")
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


def _check_dense(x: jax.Array, kernels: list[jax.Array]) -> None:
    """Raises NotImplementedError where the dense path does not take x times `kernels` (see `dense_matmul`)."""
    if jax.default_backend() != "cpu":
        raise NotImplementedError("the FFI kernel is built for the CPU")
    R, I = x.shape
    for kernel in kernels:
        if kernel.dtype not in DENSE_MAX_ROWS or x.dtype not in (jnp.float32, jnp.bfloat16):
            raise NotImplementedError(f"x {x.dtype}, kernel {kernel.dtype}: the dense path takes float32 and bfloat16")
        if R > DENSE_MAX_ROWS[kernel.dtype]:
            raise NotImplementedError(f"{R} rows (the kernel takes up to {DENSE_MAX_ROWS[kernel.dtype]} of "
                                      f"{kernel.dtype}; XLA's product is as fast for more)")
        if kernel.ndim != 2 or kernel.shape[1] != I:
            raise NotImplementedError(f"kernel {kernel.shape} does not take x {x.shape}")
    if I % 16:
        raise NotImplementedError(f"{I} inputs, not a multiple of 16")


def dense_matmul(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x [R, I] times a float32 or bfloat16 kernel [O, I]'s transpose, [R, O] in float32 (x widened to float32
    exactly, products summed in float32): the kernel streamed once per call by the same code as quantized weights
    (XLA:CPU's own products of a few rows run at 60-80% of its speed on SmolLM2-sized float32 maps, and a quarter
    of it or less on bfloat16 ones, which it multiplies element by element).

    Raises:
        NotImplementedError: another backend, too many rows, a kernel neither float32 nor bfloat16 or x not a float,
            inputs not a multiple of 16, a multi-device mesh (the custom call has no partitioning rule: XLA would
            gather the kernel), or no compiled kernel.
    """
    _check_dense(x, [kernel])
    cpu_build.require(TARGET, gathered="the kernel")
    none = jnp.zeros((0,), jnp.float32)
    kind = KIND_IDS["dense" if kernel.dtype == jnp.float32 else "bf16"]
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], kernel.shape[0]), jnp.float32))
    return call(x.astype(jnp.float32), kernel, none, none, kind=np.int64(kind),
                group=np.int64(64 if x.shape[1] % 64 == 0 else 16), has_offset=False)


def dense_matmul_many(x: jax.Array, kernels: list[jax.Array]) -> list[jax.Array]:
    """`dense_matmul(x, k)` for each of `kernels` in one call, which streams their weights back to back: a layer's
    q, k and v (or gate and up) projections pay one call's start and thread hand-off instead of three.

    Raises:
        NotImplementedError: as `dense_matmul`, for any of the kernels.
    """
    _check_dense(x, kernels)
    cpu_build.require(MANY_TARGET, gathered="the kernels")
    shapes = [jax.ShapeDtypeStruct((x.shape[0], k.shape[0]), jnp.float32) for k in kernels]
    call = jax.ffi.ffi_call(MANY_TARGET, shapes)
    return list(call(x.astype(jnp.float32), *kernels, group=np.int64(64 if x.shape[1] % 64 == 0 else 16)))
