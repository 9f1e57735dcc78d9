"""cuDNN's flash attention, through `jax.nn.dot_product_attention(implementation="cudnn")`, as a candidate.

jax exposes cuDNN's masks as top-left causal, per-row kv lengths and a left window, with no soft-cap or sinks. They
equal the op's contract only when queries sit at positions 0..T-1 (prefill from 0) or nothing depends on positions
(non-causal, no window). Positions are run-time data, so causal calls check them on the device and run the
reference otherwise (`lax.cond`: one branch executes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas import platform
from kernels_pallas.attention import reference


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_positions: jax.Array,
              kv_lengths: jax.Array | None = None, causal: bool = True, sliding_window: int | None = None,
              logit_softcap: float | None = None, sinks: jax.Array | None = None,
              scale: float | None = None, chunk_size: int | None = None,
              visible_until: jax.Array | None = None) -> jax.Array:
    """The contract of `reference.attention` through cuDNN where its masks match (see the module docstring).

    Raises:
        NotImplementedError: not a CUDA target, soft-cap, sinks or chunks, or shapes / dtypes cuDNN does not take.
    """
    if chunk_size is not None:
        raise NotImplementedError("jax's cuDNN attention has no chunked mask (chunk_size)")
    if visible_until is not None:
        raise NotImplementedError("jax's cuDNN attention has no mask for bidirectional spans (visible_until)")
    target = platform.current()
    if target.platform != "cuda":
        raise NotImplementedError(f"cuDNN attention needs an NVIDIA GPU; the target is {target.device_kind}")
    if logit_softcap is not None or sinks is not None:
        raise NotImplementedError("jax's cuDNN attention has neither logit soft-cap nor sinks")
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise NotImplementedError(f"cuDNN attention needs bfloat16/float16 q, k, v; got {q.dtype}")
    B, T, N, H = q.shape
    if k.shape != v.shape or H % 8 or H > 256:
        raise NotImplementedError(f"cuDNN attention needs k, v of one shape and head dim <= 256, a multiple of 8; "
                                  f"got {k.shape}, {v.shape}")
    if causal and T > k.shape[1]:
        raise NotImplementedError("more queries than keys: no 0..T-1 prefill")
    S = k.shape[1]
    kv_len = jnp.full((B,), S, jnp.int32) if kv_lengths is None else kv_lengths.astype(jnp.int32)
    window = None if sliding_window is None else (sliding_window - 1, 0)

    def cudnn(q, k, v, kv_len):
        return jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, query_seq_lengths=jnp.full((B,), T, jnp.int32),
            key_value_seq_lengths=kv_len, local_window_size=window, implementation="cudnn")

    try:
        jax.eval_shape(cudnn, q, k, v, kv_len)  # cuDNN's own shape and version checks, at trace time
    except (RuntimeError, ValueError) as e:
        raise NotImplementedError(f"cuDNN refuses these inputs: {e}") from e
    if not causal and sliding_window is None:
        return cudnn(q, k, v, kv_len)

    def fallback(q, k, v, kv_len):
        return reference.attention(q, k, v, q_positions=q_positions, kv_lengths=kv_len, causal=causal,
                                   sliding_window=sliding_window, scale=scale)

    from_zero = jnp.all(q_positions == jnp.arange(T, dtype=q_positions.dtype)[None, :])
    return lax.cond(from_zero, cudnn, fallback, q, k, v, kv_len)
