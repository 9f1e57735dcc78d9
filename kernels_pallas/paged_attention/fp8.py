"""FP8 KV pages: float8_e4m3fn codes with one float32 scale per token and kv head, written once with the token.

A scale per (token, head) rather than per page or per head: a page's scale would have to grow (and its earlier codes
be rewritten) when a later token's keys outgrow it, and one outlier token (attention sinks, the first tokens' large
keys) would flatten every other token's codes to a few levels; per token, each vector keeps e4m3's full 3-bit
mantissa relative to its own largest value. It costs 4 bytes per token and head beside H bytes of codes (64 or 128):
the cache is 0.53 or 0.52 of bfloat16's.

`QuantPages` stands where an array of pages [P, page, K, H] stands in the paged attention op: indexing it with page
ids gathers those pages' codes and scales and dequantizes only them, so a kernel walking key blocks widens one block
at a time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

CODE_DTYPE = jnp.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., H] -> (codes [..., H] float8_e4m3fn, scales [...] float32) with x ~= codes * scales[..., None]; a
    vector's largest magnitude maps to 448. An all-zero vector gets scale 1 (its codes are zeros)."""
    x = x.astype(jnp.float32)
    peak = jnp.max(jnp.abs(x), axis=-1)
    # times the reciprocal, as XLA would rewrite a division by the constant anyway: one rounding, the same everywhere
    scale = jnp.where(peak > 0, peak * jnp.float32(1 / E4M3_MAX), 1.0).astype(jnp.float32)
    return (x / scale[..., None]).astype(CODE_DTYPE), scale


def dequantize(codes: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """codes [..., H] and scales [...] -> values [..., H] in `dtype` (products formed in float32)."""
    return (codes.astype(jnp.float32) * scales[..., None]).astype(dtype)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantPages:
    """One pool of fp8 pages: codes [P, page, K, H] float8_e4m3fn, scales [P, page, K] float32. `dtype`: what the
    values read from it are (the model's compute dtype)."""

    codes: jax.Array
    scales: jax.Array
    dtype: str = dataclasses.field(default="float32", metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def __getitem__(self, ids) -> jax.Array:
        """The pages at `ids` (an index array or slice of the page axis), dequantized: [*ids.shape, page, K, H]."""
        return dequantize(self.codes[ids], self.scales[ids], self.dtype)

    def write(self, pages: jax.Array, slots: jax.Array, x: jax.Array) -> "QuantPages":
        """x [B, T, K, H] quantized into (pages, slots) [B, T]; out-of-range pages drop the write."""
        codes, scales = quantize(x)
        return dataclasses.replace(self, codes=self.codes.at[pages, slots].set(codes, mode="drop"),
                                   scales=self.scales.at[pages, slots].set(scales, mode="drop"))

    @classmethod
    def zeros(cls, shape: tuple[int, ...], dtype, make=jnp.zeros) -> "QuantPages":
        """An empty pool of `shape` [P, page, K, H] whose reads come out in `dtype`; `make(shape, dtype)` allocates
        each array (for placing them on a mesh)."""
        return cls(make(shape, CODE_DTYPE), make(shape[:-1], jnp.float32), jnp.dtype(dtype).name)


def is_quantized(pages) -> bool:
    return isinstance(pages, QuantPages)
