"""RMSNorm as Hugging Face computes it, through the `kernels_pallas` rms_norm op."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas.calls import OpCall
from kernels_pallas.rms_norm import api as rms_norm_op


class LayerNorm(nnx.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis (torch.nn.LayerNorm), in float32."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.weight = nnx.Param(nnx.with_partitioning(nnx.initializers.ones, ("norm",))(rngs.params(), (dim,), dtype))
        self.bias = nnx.Param(nnx.with_partitioning(nnx.initializers.zeros, ("norm",))(rngs.params(), (dim,), dtype))
        self.eps = eps

    @jax.named_scope("norm")
    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + self.eps)
        return (h * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """x / rms(x) * weight, or * (1 + weight) for Gemma-style norms (`offset=1.0`)."""

    def __init__(self, dim: int, eps: float, *, offset: float = 0.0, dtype=jnp.float32, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.constant(1.0 - offset), ("norm",))
        self.weight = nnx.Param(init(rngs.params(), (dim,), dtype))
        self.eps, self.offset = eps, offset

    @jax.named_scope("norm")
    def __call__(self, x: jax.Array, residual: jax.Array | None = None):
        """norm(x), or (norm(x + residual), x + residual) when a residual is given (the fused form)."""
        normed, h = rms_norm_op.rms_norm(x, self.weight[...], eps=self.eps, offset=self.offset, residual=residual)
        return normed if residual is None else (normed, h)

    def op_calls(self) -> list[OpCall]:
        return [OpCall.of("rms_norm", D=self.weight.shape[0], eps=self.eps, offset=self.offset)]


class L2Norm(nnx.Module):
    """x / rms(x) with no weight (Llama 4's q/k norm): the rms_norm op with a unit weight, so no parameter."""

    def __init__(self, dim: int, eps: float):
        self.dim, self.eps = dim, eps

    @jax.named_scope("norm")
    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm_op.rms_norm(x, jnp.ones((self.dim,), x.dtype), eps=self.eps)[0]

    def op_calls(self) -> list[OpCall]:
        return [OpCall.of("rms_norm", D=self.dim, eps=self.eps, offset=0.0)]
