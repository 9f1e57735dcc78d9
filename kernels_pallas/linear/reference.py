"""The definition of a linear map with a float weight, in plain jax.numpy; also the fallback on every backend, in
the layout XLA runs fastest on each.

x [..., *in] times a weight [*out, *in] (HF's [out, in], heads as their own axes) -> [..., *out] in their result
dtype. Float32 products are exact where the caller traces under `jax.default_matmul_precision("highest")` (the
layers' `exact_float32`, for float32 models); elsewhere they take the backend's default (TF32 on GPUs).
"""

from __future__ import annotations

import math
import string
from typing import Sequence

import jax
import jax.numpy as jnp

# Up to this many rows (tokens), the CPU computes weight @ x (see `product`).
NARROW_ROWS = 64


def product(x: jax.Array, kernel: jax.Array, in_ndim: int = 1) -> jax.Array:
    """x [..., *in] times kernel [*out, *in] -> [..., *out]; `in_ndim` counts the input dims.

    XLA:CPU multiplies a few rows by a large weight twice as fast with the weight as left operand and the result as
    [*out, rows] (measured: 8 rows x 90 SmolLM2-sized weights, 35 ms against 65 ms); the barrier keeps XLA from
    folding the transpose back into the dot. Prefill-sized inputs on the CPU take one 2-D product: written as a
    contraction over a kernel with heads as their own axes, XLA:CPU copied the kernel into its matmul layout on every
    call (a SigLIP-base tower 155 -> 130 ms, a 256-token SmolLM2 prefill with it 520 -> 420 ms). Other backends take
    the plain contraction.
    """
    letters = string.ascii_lowercase
    o, i = letters[:kernel.ndim - in_ndim], letters[kernel.ndim - in_ndim:kernel.ndim]
    rows = math.prod(x.shape[:x.ndim - in_ndim])
    n_out, n_in = kernel.shape[:kernel.ndim - in_ndim], kernel.shape[kernel.ndim - in_ndim:]
    if jax.default_backend() == "cpu" and rows <= NARROW_ROWS:
        y = jax.lax.optimization_barrier(jnp.einsum(f"{o}{i},...{i}->{o}...", kernel, x))
        return jnp.moveaxis(y, tuple(range(len(o))), tuple(range(-len(o), 0)))
    if jax.default_backend() == "cpu":
        y = x.reshape(rows, math.prod(n_in)) @ kernel.reshape(math.prod(n_out), math.prod(n_in)).T
        return y.reshape(*x.shape[:x.ndim - in_ndim], *n_out)
    return jnp.einsum(f"...{i},{o}{i}->...{o}", x, kernel)


def linear(x: jax.Array, kernels: Sequence[jax.Array], in_ndim: int = 1) -> list[jax.Array]:
    """[`product`(x, kernel) for each of `kernels`]: the maps of one input (a layer's q, k and v; gate and up) as
    the op takes them.

    Args:
        x: [..., *in].
        kernels: weights [*out_k, *in], float.
        in_ndim: how many trailing dims of x (and of each weight) are inputs.
    Returns:
        [..., *out_k] per weight, in the result dtype of x and that weight.
    """
    return [product(x, kernel, in_ndim) for kernel in kernels]
