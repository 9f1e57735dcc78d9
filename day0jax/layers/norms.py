"""RMSNorm as Hugging Face computes it, through the `kernels_pallas` rms_norm op."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas.calls import OpCall
from kernels_pallas.rms_norm import api as rms_norm_op


class RMSNorm(nnx.Module):
    """x / rms(x) * weight, or * (1 + weight) for Gemma-style norms (`offset=1.0`)."""

    def __init__(self, dim: int, eps: float, *, offset: float = 0.0, dtype=jnp.float32, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.constant(1.0 - offset), ("norm",))
        self.weight = nnx.Param(init(rngs.params(), (dim,), dtype))
        self.eps, self.offset = eps, offset

    def __call__(self, x: jax.Array, residual: jax.Array | None = None):
        """norm(x), or (norm(x + residual), x + residual) when a residual is given (the fused form)."""
        normed, h = rms_norm_op.rms_norm(x, self.weight[...], eps=self.eps, offset=self.offset, residual=residual)
        return normed if residual is None else (normed, h)

    def op_calls(self) -> list[OpCall]:
        return [OpCall.of("rms_norm", D=self.weight.shape[0], eps=self.eps, offset=self.offset)]
