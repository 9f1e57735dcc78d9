"""The CPU's decode candidate: `cpu_kernel.cc` as an XLA FFI custom call, compiled on first use for this machine's
CPU (`kernels_pallas.cpu_build`; without a compiler it declines and the next candidate runs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import cpu_build
from kernels_pallas.paged_attention import fp8

TARGET = "day0jax_paged_decode"


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                    kv_lengths: jax.Array, q_positions: jax.Array, *, sliding_window: int | None = None,
                    logit_softcap: float | None = None, sinks: jax.Array | None = None,
                    scale: float | None = None, chunk_size: int | None = None,
                    visible_until: jax.Array | None = None) -> jax.Array:
    """See `reference.paged_attention`, for decode steps (one query per row) on the CPU, in float32 (16-bit queries
    widened exactly). Rows that see no key at all (batch padding) come out as zeros.

    Raises:
        NotImplementedError: another backend, several queries per row, pages neither float32, bfloat16 nor fp8
            (`fp8.QuantPages`), a multi-device mesh (the custom call has no partitioning rule: XLA would gather the
            whole pool onto each device), or no compiled kernel.
    """
    if jax.default_backend() != "cpu":
        raise NotImplementedError("the FFI kernel is built for the CPU")
    B, T, N, H = q.shape
    if T != 1:
        raise NotImplementedError(f"{T} queries per row (the kernel serves decode steps, one)")
    quantized = fp8.is_quantized(k_pages)
    if quantized != fp8.is_quantized(v_pages):
        raise NotImplementedError("fp8 keys with other values, or the reverse")
    scales = (k_pages.scales, v_pages.scales) if quantized else None
    if quantized:  # the kernel reads the codes and applies the scales per key (`fp8.QuantPages`)
        k_pages, v_pages = k_pages.codes, v_pages.codes
    elif k_pages.dtype not in (jnp.float32, jnp.bfloat16) or v_pages.dtype != k_pages.dtype:
        raise NotImplementedError(f"pages of {k_pages.dtype} and {v_pages.dtype} (float32 or bfloat16, both alike)")
    if (sliding_window is not None and sliding_window < 1) or (chunk_size is not None and chunk_size < 1):
        raise NotImplementedError(f"window {sliding_window}, chunk {chunk_size}: the kernel takes positive ones")
    cpu_build.require(TARGET, gathered="the pool")
    Hv = v_pages.shape[-1]
    none = jnp.zeros((0,), jnp.int32)
    k_scales, v_scales = scales or (jnp.zeros((0,), jnp.float32),) * 2
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((B, N, Hv), jnp.float32))
    out = call(q.reshape(B, N, H).astype(jnp.float32), k_pages, v_pages, block_tables.astype(jnp.int32),
               kv_lengths.astype(jnp.int32), q_positions.reshape(B).astype(jnp.int32),
               none if visible_until is None else visible_until.reshape(B).astype(jnp.int32),
               jnp.zeros((0,), jnp.float32) if sinks is None else sinks.astype(jnp.float32).reshape(N),
               k_scales, v_scales,
               scale=np.float32(H ** -0.5 if scale is None else scale),
               softcap=np.float32(0.0 if logit_softcap is None else logit_softcap),
               window=np.int64(sliding_window or 0), chunk=np.int64(chunk_size or 0))
    return out.reshape(B, 1, N, Hv).astype(q.dtype)
