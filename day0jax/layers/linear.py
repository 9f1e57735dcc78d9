"""Linear maps and embeddings whose parameters carry logical axis names."""

from __future__ import annotations

import contextlib
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.layers.quantized import QuantizedKernel
from kernels_pallas.calls import OpCall
from kernels_pallas.linear import api as linear_op


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: Sequence[str | None], dtype, stddev: float,
          **metadata) -> nnx.Param:
    """A parameter drawn from N(0, stddev^2) (zeros for biases: stddev 0), its dims named by logical `axes`."""
    init = nnx.with_partitioning(nnx.initializers.normal(stddev), tuple(axes), **metadata)
    return nnx.Param(init(rngs.params(), shape, dtype))


def project_together(x: jax.Array, linears: Sequence[Linear]) -> list[jax.Array]:
    """[linear(x) for linear in linears], for `Linear`s of the same input (a layer's q, k and v; gate and up).

    Float maps go to the `linear` op in one call, which takes them together where it can (the CPU kernel streams all
    their weights in one call: a SmolLM2 decode step's q, k and v took 61, 25 and 22 us as three calls;
    bench/RESULTS.md has the whole step before and after); quantized ones, or maps of other inputs, each take their
    own path.
    """
    n_in = linears[0].in_shape
    kernels = [linear.kernel for linear in linears]
    # Subclasses (a LoRA adapter's `layers.lora.LoRALinear`) add to the product: each runs its own call.
    if any(linear.in_shape != n_in or isinstance(k, QuantizedKernel) or type(linear) is not Linear
           for linear, k in zip(linears, kernels)):
        return [linear(x) for linear in linears]
    with jax.named_scope("projection"):
        ys = linear_op.linear(x, [k[...] for k in kernels], len(n_in))
    return [y if linear.bias is None else y + linear.bias[...] for linear, y in zip(linears, ys)]


def exact_float32(dtype):
    """A context for tracing a model of `dtype`: float32 models multiply in true float32 (on GPUs, XLA's
    default for float32 matrix products is TF32, about 1e-3 relative); other dtypes keep the backend's default."""
    return jax.default_matmul_precision("highest") if jnp.dtype(dtype) == jnp.float32 else contextlib.nullcontext()


class Linear(nnx.Module):
    """y = x @ kernel.T (+ bias), contracting x's trailing `in_shape` dims into `out_shape`.

    `axes` names the dims in_shape + out_shape, as callers think of the map; the kernel is stored out_shape +
    in_shape, HF's [out, in] with heads as their own axes, so conversion is a reshape of HF's `weight` and the
    kernel can be the matmul's left operand (fast CPU decoding, see `kernels_pallas.linear.reference`).
    """

    def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], axes: Sequence[str | None], *,
                 use_bias: bool = False, dtype=jnp.float32, rngs: nnx.Rngs):
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        n_in = len(self.in_shape)
        assert len(axes) == n_in + len(self.out_shape), (axes, in_shape, out_shape)
        kernel_axes = tuple(axes[n_in:]) + tuple(axes[:n_in])
        # `in_ndim` tells the converter where the input dims start.
        self.kernel = param(rngs, self.out_shape + self.in_shape, kernel_axes, dtype,
                            1 / math.sqrt(math.prod(in_shape)), in_ndim=n_in)
        self.bias = param(rngs, self.out_shape, axes[n_in:], dtype, 0.0) if use_bias else None
        self.quantizable = True  # False where a layer reads the kernel itself instead of calling the map

    @jax.named_scope("projection")
    def __call__(self, x: jax.Array) -> jax.Array:
        if isinstance(self.kernel, QuantizedKernel):
            y = self.kernel.matmul(x)
        else:
            y = linear_op.linear(x, [self.kernel[...]], len(self.in_shape))[0]
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
        return linear_op.linear(x, [self.weight[...]])[0]

    def attend_calls(self) -> list[OpCall]:
        """`attend`'s op call, for tied embeddings: a float table's; none for a quantized table, which reports with
        every quantized weight (`quantized.quantized_op_calls`)."""
        if isinstance(self.weight, QuantizedKernel):
            return []
        V, D = self.weight.shape
        return [OpCall.of("linear", O=V, I=D)]


def linear_op_calls(model: nnx.Module) -> list[tuple[int | None, OpCall]]:
    """(layer index, call) of every float `Linear` a language model applies (None: outside the decoder layers, as
    the output projection); quantized ones report through `quantized.quantized_op_calls`, and maps whose kernel a
    layer reads itself (`quantizable` False) run no op."""
    out = []
    for path, m in nnx.iter_modules(model):
        if isinstance(m, Linear) and m.quantizable and not isinstance(m.kernel, QuantizedKernel):
            layer = path[2] if tuple(path[:2]) == ("model", "layers") else None
            out.append((layer, OpCall.of("linear", O=math.prod(m.out_shape), I=math.prod(m.in_shape))))
    return out
