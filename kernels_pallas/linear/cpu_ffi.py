"""The CPU candidate: float32 and bfloat16 weights streamed by the C++ kernel quantized weights take
(`quantized_linear/cpu_kernel.cc`, its dense and bf16 kinds), one XLA FFI call for one weight or for several.

For a few rows it streams each weight once per call: a chain of SmolLM2's 210 projections in float32 took 18.8 ms
against XLA's 22.5 at 1 row, 23.3 against 30.2 at 8; bfloat16 weights of any size gain most (XLA:CPU's bfloat16
matrix-vector product is 10x slower than the kernel's).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import cpu_build
from kernels_pallas.quantized_linear.cpu_ffi import KIND_IDS, TARGET

MANY_TARGET = "day0jax_dense_matmul_many"
# Rows up to which float32 and bfloat16 weights take it: XLA's own product of more rows is as fast (bfloat16 ones
# are bound by arithmetic there, which XLA does in the CPU's bfloat16 dot instructions where it has them). A chain
# of SmolLM2's bfloat16 projections on a 2-core Zen 4: 10 ms against XLA's 112 at 1 row, 16 against 21 at 8, 22
# against 22 at 12, 32 against 24 at 16.
DENSE_MAX_ROWS = {jnp.dtype(jnp.float32): 16, jnp.dtype(jnp.bfloat16): 8}
# At one row, float32 weights up to this size only: XLA streams larger ones as fast (SmolLM2's MLP and vocabulary
# projections: a decode step 24.4 ms this way, 26.2 with every weight in the kernel; at 8 rows 38.5 against 42.5
# the other way). bfloat16 weights of any size take it.
ONE_ROW_MAX_BYTES = 2 ** 21


def _check_dense(x: jax.Array, kernels: Sequence[jax.Array]) -> None:
    """Raises NotImplementedError where the kernel does not take x [R, I] times `kernels` (see `dense_matmul`)."""
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
        size = kernel.size * kernel.dtype.itemsize
        if R == 1 and kernel.dtype != jnp.bfloat16 and size > ONE_ROW_MAX_BYTES:
            raise NotImplementedError(f"one row of a {size / 2 ** 20:.1f} MiB {kernel.dtype} weight (XLA's product "
                                      f"streams those over {ONE_ROW_MAX_BYTES // 2 ** 20} MiB as fast)")
    if I % 16:
        raise NotImplementedError(f"{I} inputs, not a multiple of 16")


def dense_matmul(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x [R, I] times a float32 or bfloat16 kernel [O, I]'s transpose, [R, O] in float32 (x widened to float32
    exactly, products summed in float32): the kernel streamed once per call by the same code as quantized weights
    (XLA:CPU's own products of a few rows run at 60-80% of its speed on SmolLM2-sized float32 maps, and a quarter
    of it or less on bfloat16 ones, which it multiplies element by element).

    Raises:
        NotImplementedError: another backend, too many rows, one row of a float32 kernel over 2 MiB, a kernel
            neither float32 nor bfloat16 or x not a float, inputs not a multiple of 16, a multi-device mesh (the
            custom call has no partitioning rule: XLA would gather the kernel), or no compiled kernel.
    """
    _check_dense(x, [kernel])
    cpu_build.require(TARGET, gathered="the kernel")
    none = jnp.zeros((0,), jnp.float32)
    kind = KIND_IDS["dense" if kernel.dtype == jnp.float32 else "bf16"]
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], kernel.shape[0]), jnp.float32))
    return call(x.astype(jnp.float32), kernel, none, none, none, kind=np.int64(kind),
                group=np.int64(64 if x.shape[1] % 64 == 0 else 16), has_offset=False)


def dense_matmul_many(x: jax.Array, kernels: Sequence[jax.Array]) -> list[jax.Array]:
    """`dense_matmul(x, k)` for each of `kernels` in one call, which streams their weights back to back: a layer's
    q, k and v (or gate and up) projections pay one call's start and thread hand-off instead of three (a SmolLM2
    decode step on a 2-core Zen 4: q, k and v took 61, 25 and 22 us as three calls).

    Raises:
        NotImplementedError: as `dense_matmul`, for any of the kernels.
    """
    _check_dense(x, kernels)
    cpu_build.require(MANY_TARGET, gathered="the kernels")
    shapes = [jax.ShapeDtypeStruct((x.shape[0], k.shape[0]), jnp.float32) for k in kernels]
    call = jax.ffi.ffi_call(MANY_TARGET, shapes)
    return list(call(x.astype(jnp.float32), *kernels, group=np.int64(64 if x.shape[1] % 64 == 0 else 16)))


def linear(x: jax.Array, kernels: Sequence[jax.Array], in_ndim: int = 1) -> list[jax.Array]:
    """See `reference.linear`: one call for all of `kernels` (`dense_matmul` for one, `dense_matmul_many` for more),
    the float32 results cast to each map's result dtype.

    Raises:
        NotImplementedError: as `dense_matmul`, for any of the kernels.
    """
    lead = x.shape[:x.ndim - in_ndim]
    rows = math.prod(lead)
    x2 = x.reshape(rows, math.prod(x.shape[x.ndim - in_ndim:]))
    outs = [k.shape[:k.ndim - in_ndim] for k in kernels]
    flat = [k.reshape(math.prod(out), -1) for k, out in zip(kernels, outs)]
    ys = [dense_matmul(x2, flat[0])] if len(flat) == 1 else dense_matmul_many(x2, flat)
    return [y.astype(jnp.result_type(x, k)).reshape(*lead, *out) for y, k, out in zip(ys, kernels, outs)]
