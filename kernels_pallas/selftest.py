"""The startup self-test: before a model serves, each kernel `dispatch` would choose runs once on the model's own
shapes (short sequences) and is compared with the reference.

Mode 'auto' (default) logs a kernel that disagrees (or fails to compile or run), disables it in the policy and
checks the next candidate the same way, down to the reference; 'strict' raises `KernelMismatch` instead;
'reference' runs no kernel. The policy is installed with `registry.set_policy`, governing all traced afterwards.
An op with no candidates on the backend runs nothing and reports 'reference'. The cases are the op specs' own
(`cases.cases_from_calls` at 'startup' scale), run through `Trial`, which `selfcheck` shares.
"""

from __future__ import annotations

import functools
import logging
import math
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import jax

from kernels_pallas import cases as cases_lib
from kernels_pallas import ops, registry
from kernels_pallas.calls import OpCall

log = logging.getLogger(__name__)


@dataclass
class Report:
    """What the self-test chose and measured."""

    mode: str  # the policy mode
    chosen: dict[str, list[str]] = field(default_factory=dict)  # op -> implementations chosen (usually one)
    rows: list[dict[str, Any]] = field(default_factory=list)  # one `Trial.check` row per check
    disabled: list[tuple[str, str]] = field(default_factory=list)  # (op, implementation) pairs that disagreed

    def summary(self) -> str:
        chosen = " ".join(f"{op}={'+'.join(names)}" for op, names in sorted(self.chosen.items()))
        off = f"; disabled after disagreeing: {', '.join(f'{o}.{i}' for o, i in self.disabled)}" if self.disabled \
            else ""
        return f"kernels ({self.mode}): {chosen}{off}"


def run(fn, args: tuple, kwargs: dict) -> Any:
    """fn(*args, **kwargs) under `jax.jit`, arrays as arguments and everything else static; blocks until done."""
    call, arrays = registry.split_arrays(fn, args, kwargs)
    return jax.block_until_ready(jax.jit(call)(*arrays))


@dataclass
class Trial:
    """One case run against its reference: its inputs built once from `seed` and the reference's output computed
    once, when first needed. The startup self-test and `selfcheck` both compare implementations through it."""

    case: cases_lib.Case
    seed: int

    @functools.cached_property
    def inputs(self) -> tuple[tuple, dict]:
        return self.case.build(self.seed)

    @functools.cached_property
    def reference(self) -> Any:
        args, kwargs = self.inputs
        return run(registry.api(self.case.op).IMPLEMENTATIONS[registry.REFERENCE], args, kwargs)

    def row(self, implementation: str, **result: Any) -> dict[str, Any]:
        """A `check` row: op, case, implementation, dtype, tolerance, quantized (the case's weights are), and
        `result` (max_rel_error, ok, seconds, detail)."""
        case = self.case
        quantized = ops.spec(case.op).quantized or bool(case.spec.get("quantized"))
        return dict(op=case.op, case=case.name, implementation=implementation, dtype=case.dtype,
                    tolerance=case.tolerance, quantized=quantized, **result)

    def accepts(self, implementation: str) -> str | None:
        """None if `implementation` takes the inputs (traced abstractly), else why not."""
        args, kwargs = self.inputs
        return registry.accepts(self.case.op, implementation, *args, **kwargs)

    def check(self, implementation: str) -> dict[str, Any]:
        """Runs `implementation` on the inputs and compares it with the reference.

        Returns:
            A row (`row`): ok None and the reason in detail where it declined; ok False where it disagreed, failed
            to compile or failed to run.
        """
        args, kwargs = self.inputs
        reference = self.reference  # before the clock starts: a row times its implementation only
        t0 = time.perf_counter()
        try:
            out = run(registry.api(self.case.op).IMPLEMENTATIONS[implementation], args, kwargs)
            err = cases_lib.max_relative_error(out, reference)
            result = dict(max_rel_error=err, ok=bool(err <= self.case.tolerance), detail="")
        except NotImplementedError as e:
            result = dict(max_rel_error=None, ok=None, detail=f"unavailable: {e}")
        except Exception as e:  # a kernel that fails to compile or run is as unusable as a wrong one
            detail = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            result = dict(max_rel_error=math.inf, ok=False, detail=detail)
        return self.row(implementation, **result, seconds=round(time.perf_counter() - t0, 3))


def _identity(case: cases_lib.Case) -> str:
    return f"{case.op} {case.dtype} {sorted(case.spec.items())!r}"


def trials(case_list: list[cases_lib.Case], seed: int) -> Iterator[Trial]:
    """A `Trial` per case, its seed derived from `seed` and what the case is (op, dtype, spec): the same case gets
    the same inputs in whichever model's list it appears."""
    return (Trial(case, seed * 1000 + zlib.crc32(_identity(case).encode()) % 1000) for case in case_list)


# The checks made in this process, by all that decides their outcome: the case, its seed and the implementation's
# function. A process that loads several models one after another (a test session, a notebook) checks a kernel on
# shapes it has checked before once; tiny models share most of their shapes.
_CHECKED: dict[tuple, dict[str, Any]] = {}


def _check_once(trial: Trial, implementation: str) -> dict[str, Any]:
    key = (_identity(trial.case), trial.seed, registry.api(trial.case.op).IMPLEMENTATIONS[implementation])
    if key not in _CHECKED:
        _CHECKED[key] = trial.check(implementation)
    return dict(_CHECKED[key], case=trial.case.name)


def startup(op_calls: list[OpCall], *, dtype: Any, mode: str = "auto", tp: int = 1, seed: int = 0,
            install: bool = True, case_list: list[cases_lib.Case] | None = None) -> Report:
    """Checks the kernels a model will use on its shapes and installs the resulting policy.

    Args:
        op_calls: the model's op calls (its `op_calls()`).
        dtype: the compute dtype (name or jnp dtype).
        mode: 'auto', 'strict' or 'reference'.
        tp: tensor-parallel size (heads per shard).
        seed: of the random inputs.
        install: make the resulting policy the process-wide one (`registry.set_policy`).
        case_list: the cases to check instead of the config's (tests).
    Returns:
        The `Report`; `summary()` is one line for the log.
    Raises:
        ValueError: `mode` is not one of registry.MODES (the `kernels` argument of `day0jax.load`).
        registry.KernelMismatch: mode 'strict' and a kernel disagrees with its reference.
    """
    if mode not in registry.MODES:
        raise ValueError(f"kernels={mode!r}: must be one of {', '.join(registry.MODES)}")
    policy = registry.Policy(mode)
    report = Report(mode)
    dtype_name = jax.numpy.dtype(dtype).name
    todo = case_list if case_list is not None else cases_lib.cases_from_calls(op_calls, dtype_name, scale="startup",
                                                                              tp=tp)
    for trial in trials(todo, seed):
        case = trial.case
        if registry.order(registry.api(case.op).CANDIDATES, op=case.op, policy=policy) == (registry.REFERENCE,):
            _note(report, case.op, registry.REFERENCE)  # nothing but the reference could run: nothing to test
            continue
        args, kwargs = trial.inputs
        while True:
            name = registry.chosen(case.op, *args, policy=policy, **kwargs)
            if name == registry.REFERENCE:
                _note(report, case.op, name)
                break
            row = _check_once(trial, name)
            report.rows.append(row)
            if row["ok"]:
                _note(report, case.op, name)
                break
            message = (f"kernel self-test: {case.op}.{name} on {case.name} ({case.describe()}): "
                       f"max relative error {row['max_rel_error']} > {case.tolerance} {row['detail']}")
            if mode == "strict":
                raise registry.KernelMismatch(message + " (kernels='strict'; use 'auto' to fall back)")
            log.warning("%s; disabled, trying the next candidate", message)
            policy = policy.without(case.op, name)
            report.disabled.append((case.op, name))
    if install:
        registry.set_policy(policy)
    log.info("%s", report.summary())
    return report


def _note(report: Report, op: str, name: str) -> None:
    names = report.chosen.setdefault(op, [])
    if name not in names:
        names.append(name)
