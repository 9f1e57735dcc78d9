"""The candidate pool: each op's implementations and, per backend, the order in which to try them.

Each op's `api.py` declares `IMPLEMENTATIONS` (name -> callable, including "reference") and `CANDIDATES`
(backend -> names to try before the reference), and calls `dispatch`. With `implementation=None`, `dispatch`
tries the backend's candidates in order (a kernel raises `NotImplementedError` for inputs it cannot take) and
ends at the reference, which takes everything. A named implementation that cannot run raises
`KernelUnavailable`: the caller asked for it explicitly. Dispatch happens at trace time, so under `jax.jit`
it costs nothing per call.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import jax

log = logging.getLogger(__name__)

REFERENCE = "reference"


class KernelUnavailable(RuntimeError):
    """An explicitly named implementation cannot run on these inputs or this backend."""


def order(candidates: Mapping[str, Sequence[str]], backend: str | None = None) -> tuple[str, ...]:
    """The names `dispatch` tries on `backend` (default: JAX's default backend), the reference last."""
    backend = backend or jax.default_backend()
    return tuple(candidates.get(backend, ())) + (REFERENCE,)


def dispatch(op: str, implementations: Mapping[str, Callable[..., Any]], candidates: Mapping[str, Sequence[str]],
             implementation: str | None, *args: Any, **kwargs: Any) -> Any:
    """Runs `op` with the named implementation, or the first candidate that accepts the inputs.

    Args:
        op: the op's name, for messages.
        implementations: name -> callable, including `REFERENCE`.
        candidates: backend -> ordered names to try before the reference.
        implementation: a name to force, or None to choose.
    Returns:
        What the chosen implementation returns.
    Raises:
        KernelUnavailable: a named implementation is unknown or raised `NotImplementedError`.
    """
    if implementation is not None:
        if implementation not in implementations:
            raise KernelUnavailable(f"{op}: no implementation {implementation!r}; known: {sorted(implementations)}")
        try:
            return implementations[implementation](*args, **kwargs)
        except NotImplementedError as e:
            raise KernelUnavailable(f"{op}: implementation {implementation!r} cannot run these inputs: {e}") from e
    for name in order(candidates):
        fn = implementations.get(name)
        if fn is None:
            continue
        try:
            return fn(*args, **kwargs)
        except NotImplementedError as e:
            log.debug("%s: %s declined (%s), trying the next candidate", op, name, e)
    raise KernelUnavailable(f"{op}: no implementation accepted the inputs")  # unreachable: the reference takes all
