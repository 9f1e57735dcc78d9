"""The causal convolution as layers see it: the reference everywhere (a handful of fused multiply-adds per element,
which XLA fuses with its neighbours); the pool is where a kernel would go."""

from __future__ import annotations

import jax

from kernels_pallas import registry
from kernels_pallas.causal_conv1d import reference

IMPLEMENTATIONS = {registry.REFERENCE: reference.causal_conv1d}
CANDIDATES: dict[str, tuple[str, ...]] = {}
PALLAS: dict[str, str] = {}
INTERPRET: dict[str, str] = {}


def causal_conv1d(x: jax.Array, weight: jax.Array, state: jax.Array | None = None, *,
                  valid: jax.Array | None = None, bias: jax.Array | None = None, activation: str | None = "silu",
                  implementation: str | None = None) -> tuple[jax.Array, jax.Array]:
    """See `reference.causal_conv1d` (the contract: module docstring there); `implementation` forces one by name.

    Args:
        x: [B, T, C]; weight: [C, W]; state: [B, W - 1, C] or None (zeros: a sequence start).
        valid: [B] real tokens per row (None: all T): padding past them does not enter the new state.
        bias: [C] or None; activation: "silu" or None.
        implementation: a name from `IMPLEMENTATIONS`, or None to choose.
    Returns:
        (out [B, T, C], new state [B, W - 1, C]), both in x's dtype.
    Raises:
        registry.KernelUnavailable: the named implementation cannot take these inputs.
        ValueError: inconsistent shapes.
    """
    return registry.dispatch("causal_conv1d", IMPLEMENTATIONS, CANDIDATES, implementation, x, weight, state,
                             valid=valid, bias=bias, activation=activation)
