"""RMSNorm as Hugging Face computes it, through the `kernels_pallas` rms_norm op."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas.calls import OpCall
from kernels_pallas.rms_norm import api as rms_norm_op


class LayerNorm(nnx.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis (torch.nn.LayerNorm), in float32.

    Args:
        dim: the weight's shape: D, or a tuple whose last entry is the normalized axis (Cohere's q/k norms, a
            weight per head and dim [N, H]).
        bias: False for a norm without one (Cohere's).
        axes: the weight's logical axes (default: "norm" for a 1-D weight).
    """

    def __init__(self, dim: int | tuple[int, ...], eps: float, *, bias: bool = True,
                 axes: tuple[str, ...] | None = None, dtype=jnp.float32, rngs: nnx.Rngs):
        shape = (dim,) if isinstance(dim, int) else tuple(dim)
        axes = ("norm",) if axes is None else axes
        self.weight = nnx.Param(nnx.with_partitioning(nnx.initializers.ones, axes)(rngs.params(), shape, dtype))
        self.bias = (nnx.Param(nnx.with_partitioning(nnx.initializers.zeros, axes)(rngs.params(), shape, dtype))
                     if bias else None)
        self.eps = eps

    @jax.named_scope("norm")
    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + self.eps)
        h = h * self.weight[...].astype(jnp.float32)
        return (h if self.bias is None else h + self.bias[...].astype(jnp.float32)).astype(x.dtype)

    def op_calls(self) -> list[OpCall]:
        return [OpCall.of("layer_norm", D=self.weight.shape[-1], eps=self.eps, bias=self.bias is not None)]


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
