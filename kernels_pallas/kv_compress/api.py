"""The window compressor as the layers see it: the reference everywhere (XLA fuses the softmax over a window's
tokens with the weighted sum); the pool is where a kernel goes."""

from __future__ import annotations

import jax

from kernels_pallas import registry
from kernels_pallas.kv_compress import reference

IMPLEMENTATIONS = {registry.REFERENCE: reference.kv_compress}
CANDIDATES: dict[str, tuple[str, ...]] = {}
PALLAS: dict[str, str] = {}
INTERPRET: dict[str, str] = {}


@jax.named_scope("kv_compress")
def kv_compress(kv: jax.Array, gate: jax.Array, position_bias: jax.Array, *, overlap: bool,
                valid: jax.Array | None = None, implementation: str | None = None) -> jax.Array:
    """See `reference.kv_compress`; `implementation` forces one candidate by name.

    Raises:
        registry.KernelUnavailable: the named implementation cannot take these inputs.
    """
    return registry.dispatch("kv_compress", IMPLEMENTATIONS, CANDIDATES, implementation, kv, gate, position_bias,
                             overlap=overlap, valid=valid)
