"""The startup self-test: before a model serves, each kernel `dispatch` would choose runs once on the model's own
shapes (short sequences) and is compared with the reference.

Mode 'auto' (default) logs a kernel that disagrees (or fails to compile or run), disables it in the policy and
checks the next candidate the same way, down to the reference; 'strict' raises `KernelMismatch` instead;
'reference' runs no kernel. The policy is installed with `registry.set_policy`, governing all traced afterwards.
Where the backend has no candidates (the CPU), nothing runs and every op reports 'reference'.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import jax

from kernels_pallas import cases as cases_lib
from kernels_pallas import registry
from kernels_pallas.calls import OpCall

log = logging.getLogger(__name__)


@dataclass
class Report:
    """What the self-test chose and measured."""

    mode: str  # the policy mode
    chosen: dict[str, list[str]] = field(default_factory=dict)  # op -> implementations chosen (usually one)
    rows: list[dict[str, Any]] = field(default_factory=list)  # one `check` row per check
    disabled: list[tuple[str, str]] = field(default_factory=list)  # (op, implementation) pairs that disagreed

    def summary(self) -> str:
        ops = " ".join(f"{op}={'+'.join(names)}" for op, names in sorted(self.chosen.items()))
        off = f"; disabled after disagreeing: {', '.join(f'{o}.{i}' for o, i in self.disabled)}" if self.disabled \
            else ""
        return f"kernels ({self.mode}): {ops}{off}"


def run(fn, args: tuple, kwargs: dict) -> Any:
    """fn(*args, **kwargs) under `jax.jit`, arrays as arguments and everything else static; blocks until done."""
    call, arrays = registry.split_arrays(fn, args, kwargs)
    return jax.block_until_ready(jax.jit(call)(*arrays))


def check(case: cases_lib.Case, implementation: str, args: tuple, kwargs: dict, reference_out: Any) -> dict[str, Any]:
    """Runs one implementation on one case and compares it with the reference's output `reference_out`.

    Returns:
        A row: op, case, implementation, dtype, quantized (the case's weights are quantized), max_rel_error,
        tolerance, ok, seconds, detail.
    """
    impls = registry.api(case.op).IMPLEMENTATIONS
    row = dict(op=case.op, case=case.name, implementation=implementation, dtype=case.dtype, tolerance=case.tolerance,
               quantized=case.op == "quantized_linear" or bool(case.spec.get("quantized")))
    t0 = time.perf_counter()
    try:
        out = run(impls[implementation], args, kwargs)
        err = cases_lib.max_relative_error(out, reference_out)
        row.update(max_rel_error=err, ok=bool(err <= case.tolerance), detail="")
    except NotImplementedError as e:
        row.update(max_rel_error=None, ok=None, detail=f"unavailable: {e}")
    except Exception as e:  # a kernel that fails to compile or run is as unusable as a wrong one
        row.update(max_rel_error=math.inf, ok=False, detail=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    row["seconds"] = round(time.perf_counter() - t0, 3)
    return row


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
    for i, case in enumerate(todo):
        mod = registry.api(case.op)
        if registry.order(mod.CANDIDATES, op=case.op, policy=policy) == (registry.REFERENCE,):
            _note(report, case.op, registry.REFERENCE)  # nothing but the reference could run: nothing to test
            continue
        args, kwargs = case.build(seed * 1000 + i)
        reference_out = None
        while True:
            name = registry.chosen(case.op, *args, policy=policy, **kwargs)
            if name == registry.REFERENCE:
                _note(report, case.op, name)
                break
            if reference_out is None:
                reference_out = run(mod.IMPLEMENTATIONS[registry.REFERENCE], args, kwargs)
            row = check(case, name, args, kwargs, reference_out)
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
