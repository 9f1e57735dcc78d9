"""Low-rank adapters (LoRA) on a `Linear`: y = base(x) + scale * (x A^T) B^T, as PEFT's `lora.Linear` computes it
(no dropout), with A [r, in] and B [out, r] in PEFT's layouts (the map's input and output dims flattened)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.layers.linear import Linear


class LoRAParam(nnx.Param):
    """A trainable adapter matrix: its own variable type, so that training splits adapters from the frozen base."""


class LoRALinear(Linear):
    """A `Linear` with its base kernel and bias (shared, frozen by the trainer) plus `lora_a` [r, I] and `lora_b`
    [O, r] (I, O: the products of the input and output dims), scaled by `alpha / r`.

    Initialised as PEFT initialises LoRA: A Kaiming-uniform (torch's `kaiming_uniform_(a=sqrt(5))`: U(-1/sqrt(I),
    1/sqrt(I))), B zero, so that the adapted map starts equal to the base.
    """

    def __init__(self, base: Linear, rank: int, alpha: float, *, rngs: nnx.Rngs):
        self.in_shape, self.out_shape = base.in_shape, base.out_shape
        self.kernel, self.bias, self.quantizable = base.kernel, base.bias, base.quantizable
        I, O = math.prod(self.in_shape), math.prod(self.out_shape)
        bound = 1.0 / math.sqrt(I)
        a = jax.random.uniform(rngs.params(), (rank, I), jnp.float32, -bound, bound)
        self.lora_a = LoRAParam(a)
        self.lora_b = LoRAParam(jnp.zeros((O, rank), jnp.float32))
        self.rank, self.alpha = rank, float(alpha)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def __call__(self, x: jax.Array) -> jax.Array:
        y = super().__call__(x)
        lead = x.shape[: x.ndim - len(self.in_shape)]
        flat = x.reshape(*lead, -1).astype(self.lora_a.dtype)
        delta = (flat @ self.lora_a[...].T) @ self.lora_b[...].T * self.scale
        return y + delta.reshape(*lead, *self.out_shape).astype(y.dtype)
