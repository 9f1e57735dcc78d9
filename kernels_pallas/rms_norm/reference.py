"""The definition of correct RMSNorm, with an optional fused residual add: transformers' arithmetic.

Statistics in float32; Llama-style (offset 0) scales after casting back to the input dtype, Gemma-style (offset 1:
the weight is stored as w - 1) scales in float32 before casting.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, *, eps: float, offset: float = 0.0,
             residual: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Returns (norm(h) * scale, h) where h = x + residual (or x when residual is None).

    Args:
        x: [..., D].
        weight: [D].
        eps: added to the mean square.
        offset: 0 for weight * norm, 1 for (1 + weight) * norm.
        residual: optional [..., D] added to x first (the pre-norm block's skip connection).
    Returns:
        (normalized [..., D] in x's dtype, promoted with weight's when offset is 0; h [..., D]).
    """
    h = x if residual is None else x + residual
    h32 = h.astype(jnp.float32)
    normed = h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + eps)
    if offset:
        return (normed * (offset + weight.astype(jnp.float32))).astype(h.dtype), h
    return weight * normed.astype(h.dtype), h
