"""Linear maps and embeddings whose parameters carry logical axis names.

A `Linear` kernel has shape in_shape + out_shape (for q_proj: [D, N, H]); the HF `weight` [out, in] becomes
`weight.T.reshape(in_shape + out_shape)` on conversion, so the runtime never transposes at load time.
"""

from __future__ import annotations

import math
import string
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: Sequence[str | None], dtype, stddev: float,
           **metadata) -> nnx.Param:
    init = nnx.with_partitioning(nnx.initializers.normal(stddev), tuple(axes), **metadata)
    return nnx.Param(init(rngs.params(), shape, dtype))


class Linear(nnx.Module):
    """y = x @ kernel (+ bias), contracting x's trailing `in_shape` dims into `out_shape`."""

    def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], axes: Sequence[str | None], *,
                 use_bias: bool = False, dtype=jnp.float32, rngs: nnx.Rngs):
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        assert len(axes) == len(self.in_shape) + len(self.out_shape), (axes, in_shape, out_shape)
        # `in_ndim` tells the converter how to fold an HF [out, in] weight into this kernel.
        self.kernel = _param(rngs, self.in_shape + self.out_shape, axes, dtype, 1 / math.sqrt(math.prod(in_shape)),
                             in_ndim=len(self.in_shape))
        self.bias = _param(rngs, self.out_shape, axes[len(self.in_shape):], dtype, 0.0) if use_bias else None
        letters = string.ascii_lowercase
        i, o = letters[:len(self.in_shape)], letters[len(self.in_shape):len(axes)]
        self._eq = f"...{i},{i}{o}->...{o}"

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.einsum(self._eq, x, self.kernel[...])
        return y if self.bias is None else y + self.bias[...]


class Embedding(nnx.Module):
    """Token embeddings [V, D]; `attend` reuses them as the output projection when embeddings are tied."""

    def __init__(self, vocab_size: int, dim: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.weight = _param(rngs, (vocab_size, dim), ("vocab", "embed"), dtype, 1.0)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], tokens, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("...d,vd->...v", x, self.weight[...])
