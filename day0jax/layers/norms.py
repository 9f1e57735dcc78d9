"""RMSNorm as Hugging Face computes it: statistics in float32, scale applied in the input dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    """x / rms(x) * weight, or * (1 + weight) for Gemma-style norms (`offset=1.0`)."""

    def __init__(self, dim: int, eps: float, *, offset: float = 0.0, dtype=jnp.float32, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.constant(1.0 - offset), ("norm",))
        self.weight = nnx.Param(init(rngs.params(), (dim,), dtype))
        self.eps, self.offset = eps, offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        weight = self.weight[...]
        if self.offset:
            # Gemma scales in float32 before casting back; Llama casts first. Both match HF that way.
            return (normed * (self.offset + weight.astype(jnp.float32))).astype(x.dtype)
        return weight * normed.astype(x.dtype)
