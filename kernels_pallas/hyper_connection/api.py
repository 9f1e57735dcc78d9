"""Hyper-connections as the layers see them: the reference everywhere (a small map of the streams and a few
reductions over n, which XLA fuses with their neighbours); the pool is where a kernel would go."""

from __future__ import annotations

import jax

from kernels_pallas import registry
from kernels_pallas.hyper_connection import reference
from kernels_pallas.hyper_connection.reference import expand, head, sinkhorn

__all__ = ["hyper_connection", "expand", "head", "sinkhorn"]

IMPLEMENTATIONS = {registry.REFERENCE: reference.hyper_connection}
CANDIDATES: dict[str, tuple[str, ...]] = {}
PALLAS: dict[str, str] = {}
INTERPRET: dict[str, str] = {}


@jax.named_scope("hyper_connection")
def hyper_connection(x: jax.Array, *weights: jax.Array, form: str, norm_eps: float, eps: float = 0.0,
                     post_scale: float = 2.0, sinkhorn_iters: int = 20, implementation: str | None = None
                     ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """See `reference.hyper_connection`; `implementation` forces one candidate by name.

    Raises:
        registry.KernelUnavailable: the named implementation cannot take these inputs.
    """
    return registry.dispatch("hyper_connection", IMPLEMENTATIONS, CANDIDATES, implementation, x, *weights,
                             form=form, norm_eps=norm_eps, eps=eps, post_scale=post_scale,
                             sinkhorn_iters=sinkhorn_iters)
