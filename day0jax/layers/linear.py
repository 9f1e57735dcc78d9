"""Linear maps and embeddings whose parameters carry logical axis names."""

from __future__ import annotations

import contextlib
import math
import string
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.layers.quantized import QuantizedKernel
from kernels_pallas import registry
from kernels_pallas.quantized_linear import cpu_ffi

# Up to this many rows (tokens), the CPU path computes kernel @ x (see `project`).
NARROW_ROWS = 64


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: Sequence[str | None], dtype, stddev: float,
          **metadata) -> nnx.Param:
    """A parameter drawn from N(0, stddev^2) (zeros for biases: stddev 0), its dims named by logical `axes`."""
    init = nnx.with_partitioning(nnx.initializers.normal(stddev), tuple(axes), **metadata)
    return nnx.Param(init(rngs.params(), shape, dtype))


def project(x: jax.Array, kernel: jax.Array, in_ndim: int) -> jax.Array:
    """x [..., *in] times kernel [*out, *in] -> [..., *out].

    Up to `cpu_ffi.DENSE_MAX_ROWS` rows (16 of float32, 8 of bfloat16) on the CPU take the C++ kernel quantized
    weights use, which streams the weight once per call (a chain of SmolLM2's 210 projections: 18.8 ms against XLA's
    22.5 at 1 row, 23.3 against 30.2 at 8), unless kernels are off (`kernels="reference"`) or the mesh has several
    devices; at one row only float32 weights up to 2 MiB do, as XLA streams larger ones as fast (SmolLM2's MLP and
    vocabulary projections: a decode step 24.4 ms this way, 26.2 with every weight in the kernel; at 8 rows 38.5
    against 42.5 the other way), while bfloat16 weights of any size do (XLA:CPU's bfloat16 matrix-vector product is
    10x slower than the kernel's). Otherwise XLA:CPU multiplies a few rows by a large weight twice as fast with the
    weight as left operand and the result as [*out, rows] (measured: 8 rows x 90 SmolLM2-sized weights, 35 ms against
    65 ms); the barrier keeps XLA from folding the transpose back into the dot. Prefill-sized inputs on the CPU take
    one 2-D product: written as a contraction over a kernel with heads as their own axes, XLA:CPU copied the kernel
    into its matmul layout on every call (a SigLIP-base tower 155 -> 130 ms, a 256-token SmolLM2 prefill with it
    520 -> 420 ms). Other backends take the plain contraction.
    """
    letters = string.ascii_lowercase
    o, i = letters[:kernel.ndim - in_ndim], letters[kernel.ndim - in_ndim:kernel.ndim]
    rows = math.prod(x.shape[:x.ndim - in_ndim])
    n_out, n_in = kernel.shape[:kernel.ndim - in_ndim], kernel.shape[kernel.ndim - in_ndim:]
    if _cpu_kernel_takes(rows, kernel):
        try:
            y = cpu_ffi.dense_matmul(x.reshape(rows, math.prod(n_in)), kernel.reshape(math.prod(n_out), -1))
            return y.astype(jnp.result_type(x, kernel)).reshape(*x.shape[:x.ndim - in_ndim], *n_out)
        except NotImplementedError:
            pass  # another dtype, too many rows, a mesh, no compiler: XLA's product below
    if jax.default_backend() == "cpu" and rows <= NARROW_ROWS:
        y = jax.lax.optimization_barrier(jnp.einsum(f"{o}{i},...{i}->{o}...", kernel, x))
        return jnp.moveaxis(y, tuple(range(len(o))), tuple(range(-len(o), 0)))
    if jax.default_backend() == "cpu":
        y = x.reshape(rows, math.prod(n_in)) @ kernel.reshape(math.prod(n_out), math.prod(n_in)).T
        return y.reshape(*x.shape[:x.ndim - in_ndim], *n_out)
    return jnp.einsum(f"...{i},{o}{i}->...{o}", x, kernel)


def _cpu_kernel_takes(rows: int, kernel: jax.Array) -> bool:
    """Whether `project` sends `rows` rows times `kernel` to the C++ kernel (when its checks pass; see `project`)."""
    return jax.default_backend() == "cpu" and registry.get_policy().mode != "reference" and (
        rows > 1 or kernel.dtype == jnp.bfloat16 or kernel.size * kernel.dtype.itemsize <= 2**21)


def project_together(x: jax.Array, linears: Sequence[Linear]) -> list[jax.Array]:
    """[linear(x) for linear in linears], for `Linear`s of the same input (a layer's q, k and v; gate and up).

    Where `project` would send each of them to the CPU's C++ kernel, one call streams all their weights (a SmolLM2
    decode step on a 2-core Zen 4: q, k and v took 61, 25 and 22 us as three calls; bench/RESULTS.md has the whole
    step before and after); otherwise each takes its own path.
    """
    n_in = linears[0].in_shape
    rows = math.prod(x.shape[:x.ndim - len(n_in)])
    kernels = [linear.kernel for linear in linears]
    if all(linear.in_shape == n_in and not isinstance(k, QuantizedKernel) and _cpu_kernel_takes(rows, k[...])
           for linear, k in zip(linears, kernels)):
        flat = [k[...].reshape(-1, math.prod(n_in)) for k in kernels]
        try:
            with jax.named_scope("projection"):
                ys = cpu_ffi.dense_matmul_many(x.reshape(rows, math.prod(n_in)), flat)
        except NotImplementedError:
            pass  # as in `project`: XLA's products, one by one
        else:
            out = []
            for linear, k, y in zip(linears, flat, ys):
                y = y.astype(jnp.result_type(x, k)).reshape(*x.shape[:x.ndim - len(n_in)], *linear.out_shape)
                out.append(y if linear.bias is None else y + linear.bias[...])
            return out
    return [linear(x) for linear in linears]


def exact_float32(dtype):
    """A context for tracing a model of `dtype`: float32 models multiply in true float32 (on GPUs, XLA's
    default for float32 matrix products is TF32, about 1e-3 relative); other dtypes keep the backend's default."""
    return jax.default_matmul_precision("highest") if jnp.dtype(dtype) == jnp.float32 else contextlib.nullcontext()


class Linear(nnx.Module):
    """y = x @ kernel.T (+ bias), contracting x's trailing `in_shape` dims into `out_shape`.

    `axes` names the dims in_shape + out_shape, as callers think of the map; the kernel is stored out_shape +
    in_shape, HF's [out, in] with heads as their own axes, so conversion is a reshape of HF's `weight` and the
    kernel can be the matmul's left operand (fast CPU decoding, see `project`).
    """

    def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], axes: Sequence[str | None], *,
                 use_bias: bool = False, dtype=jnp.float32, rngs: nnx.Rngs):
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        n_in = len(self.in_shape)
        assert len(axes) == n_in + len(self.out_shape), (axes, in_shape, out_shape)
        kernel_axes = tuple(axes[n_in:]) + tuple(axes[:n_in])
        # `in_ndim` tells the converter and `project` where the input dims start.
        self.kernel = param(rngs, self.out_shape + self.in_shape, kernel_axes, dtype,
                            1 / math.sqrt(math.prod(in_shape)), in_ndim=n_in)
        self.bias = param(rngs, self.out_shape, axes[n_in:], dtype, 0.0) if use_bias else None
        self.quantizable = True  # False where a layer reads the kernel itself instead of calling the map

    @jax.named_scope("projection")
    def __call__(self, x: jax.Array) -> jax.Array:
        if isinstance(self.kernel, QuantizedKernel):
            y = self.kernel.matmul(x)
        else:
            y = project(x, self.kernel[...], len(self.in_shape))
        return y if self.bias is None else y + self.bias[...]


class Embedding(nnx.Module):
    """Token embeddings [V, D]; `attend` reuses them as the output projection when embeddings are tied."""

    def __init__(self, vocab_size: int, dim: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.weight = param(rngs, (vocab_size, dim), ("vocab", "embed"), dtype, 1.0)
        self.dtype = dtype  # of looked-up rows when the table is kept quantized

    def __call__(self, tokens: jax.Array) -> jax.Array:
        if isinstance(self.weight, QuantizedKernel):
            return self.weight.rows_of(tokens, self.dtype)
        return jnp.take(self.weight[...], tokens, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        if isinstance(self.weight, QuantizedKernel):
            return self.weight.matmul(x)
        return project(x, self.weight[...], 1)
