"""The candidate pool: each op's implementations and, per backend, the order in which to try them.

Each op's `api.py` (named by its spec, `ops.py`) declares its pool (`IMPLEMENTATIONS`, `CANDIDATES`, `PALLAS`,
`INTERPRET`; docs/adding_a_kernel.md) and calls `dispatch`: the candidates in order (a kernel declines inputs with `NotImplementedError`), then the
reference, which takes everything. Dispatch and the process-wide `Policy` (normally set by the startup self-test)
act at trace time: nothing per call under `jax.jit`, and a policy governs what is traced after it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np

from kernels_pallas import ops

log = logging.getLogger(__name__)

REFERENCE = "reference"
MODES = ("auto", "strict", "reference")


class KernelUnavailable(RuntimeError):
    """An explicitly named implementation cannot run on these inputs or this backend."""


class KernelMismatch(RuntimeError):
    """A kernel's output disagrees with its reference beyond the dtype's tolerance (strict self-test)."""


@dataclass(frozen=True)
class Policy:
    """How `dispatch` chooses when no implementation is named: `mode` 'auto' or 'strict' (the self-test raises on
    disagreement) tries the candidates in order, 'reference' only references; `disabled` (op, implementation) pairs,
    which disagreed with their reference, are never chosen."""

    mode: str = "auto"
    disabled: frozenset[tuple[str, str]] = field(default_factory=frozenset)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"kernels mode {self.mode!r} is not one of {', '.join(MODES)}")

    def without(self, op: str, implementation: str) -> "Policy":
        """This policy with `implementation` of `op` disabled."""
        return Policy(self.mode, self.disabled | {(op, implementation)})


_policy = Policy()


def get_policy() -> Policy:
    return _policy


def set_policy(policy: Policy) -> Policy:
    """Makes `policy` the process-wide choice rule; returns the previous one."""
    global _policy
    previous, _policy = _policy, policy
    return previous


@contextlib.contextmanager
def use_policy(policy: Policy) -> Iterator[Policy]:
    """`set_policy` for the duration of a block (tests, benchmarks)."""
    previous = set_policy(policy)
    try:
        yield policy
    finally:
        set_policy(previous)


def api(op: str) -> ModuleType:
    """The api module of `op` (its `IMPLEMENTATIONS`, `CANDIDATES` and the op function).

    Raises:
        KeyError: no op of that name, or one the layers write in plain jax.numpy (no pool).
    """
    module = ops.spec(op).api
    if module is None:
        raise KeyError(f"op {op!r} is plain jax.numpy: it has no candidate pool")
    return importlib.import_module(module)


def order(candidates: Mapping[str, Sequence[str]], backend: str | None = None, *, op: str | None = None,
          policy: Policy | None = None) -> tuple[str, ...]:
    """The names `dispatch` tries on `backend` (default: JAX's), reference last; with `op`, as `policy` allows."""
    backend = backend or jax.default_backend()
    names = tuple(candidates.get(backend, ()))
    if op is not None:
        policy = policy or _policy
        if policy.mode == "reference":
            names = ()
        names = tuple(n for n in names if (op, n) not in policy.disabled)
    return names + (REFERENCE,)


def dispatch(op: str, implementations: Mapping[str, Callable[..., Any]], candidates: Mapping[str, Sequence[str]],
             implementation: str | None, *args: Any, **kwargs: Any) -> Any:
    """Runs `op` with the named implementation, or the first candidate that accepts the inputs.

    Args:
        op: the op's name, for messages and the policy.
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
    for name in order(candidates, op=op):
        fn = implementations.get(name)
        if fn is None:
            continue
        try:
            return fn(*args, **kwargs)
        except NotImplementedError as e:
            log.debug("%s: %s declined (%s), trying the next candidate", op, name, e)
    raise KernelUnavailable(f"{op}: no implementation accepted the inputs")  # unreachable: the reference takes all


def accepts(op: str, implementation: str, *args: Any, **kwargs: Any) -> str | None:
    """None if `implementation` of `op` takes these inputs (traced abstractly, nothing runs), else the reason."""
    call, arrays = split_arrays(api(op).IMPLEMENTATIONS[implementation], args, kwargs)
    try:
        jax.eval_shape(call, *arrays)
    except NotImplementedError as e:
        return str(e) or type(e).__name__
    return None


def split_arrays(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Callable[..., Any], list]:
    """fn(*args, **kwargs) as a function of its array leaves only, and those leaves: other leaves (flags, windows,
    scales) stay the Python values implementations branch on, so the result can be jitted, exported or traced."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    is_array = [isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) for x in leaves]

    def call(*arrays):
        it = iter(arrays)
        a, k = jax.tree.unflatten(tree, [next(it) if arr else x for x, arr in zip(leaves, is_array)])
        return fn(*a, **k)

    return call, [x for x, arr in zip(leaves, is_array) if arr]


def chosen(op: str, *args: Any, policy: Policy | None = None, **kwargs: Any) -> str:
    """The implementation `dispatch` would run for these inputs under `policy` (default: the current one)."""
    mod = api(op)
    for name in order(mod.CANDIDATES, op=op, policy=policy):
        if name in mod.IMPLEMENTATIONS and accepts(op, name, *args, **kwargs) is None:
            return name
    return REFERENCE
