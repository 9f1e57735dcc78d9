"""`python -m kernels_pallas.selfcheck [--interpret] [--lower cuda] [--json]`: every candidate of every op on the
supported families' shapes, compared with the reference.

The cases are each op spec's own, made from the flagship models' op calls (or a model's). By default every
implementation (Pallas and C++ kernels, cuDNN, `ragged_dot`) runs on each case with fresh random inputs and is
compared with the reference (as the startup self-test does, through `selftest.Trial`); those that cannot take a case (no Hopper GPU here, a head dim a kernel lacks) are
listed as unavailable, with why. `--lower cuda` traces as if for an H100 and runs nothing: a GPU-less machine's
check of the GPU build. `--json` rows have at least op, implementation, ok (true, false, or null for unavailable);
the exit status is 1 if any row has ok false. `--jsonl PATH` appends each row as it is checked and `--budget-s S`
skips what is left after S seconds (a short device loan keeps what it did).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax

from kernels_pallas import cases as cases_lib
from kernels_pallas import ops, platform, registry, selftest
from kernels_pallas.calls import OpCall


def run_rows(case_list: list[cases_lib.Case], interpret: bool, seed: int,
             emit: Callable[[dict], None] = lambda row: None, deadline: float = math.inf) -> list[dict[str, Any]]:
    """Every implementation of each case's op (the interpreter variants only with `interpret`) against the reference.

    Args:
        emit: called with each row as soon as it is checked (a run cut short keeps what it did).
        deadline: a `time.monotonic()` past which the implementations left are skipped, each a row saying so.
    Returns:
        `selftest.Trial` rows; ok None (with why) for an implementation that declines the case or was skipped.
    """
    rows = []
    for trial in selftest.trials(case_list, seed):
        mod = registry.api(trial.case.op)
        interpreted = set(mod.INTERPRET.values())
        for name in mod.IMPLEMENTATIONS:
            if name == registry.REFERENCE or (name in interpreted and not interpret):
                continue
            if time.monotonic() > deadline:
                row = trial.row(name, max_rel_error=None, ok=None, seconds=0.0, detail="skipped: budget")
            elif (reason := trial.accepts(name)) is None:
                row = trial.check(name)
            else:
                row = trial.row(name, max_rel_error=None, ok=None, seconds=0.0, detail=f"unavailable: {reason}")
            rows.append(row)
            emit(row)
    return rows


def jsonl_writer(path: str | None) -> Callable[[dict], None]:
    """Appends each row to `path` as one JSON line, written out at once."""
    def emit(row: dict) -> None:
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(finite(row)) + "\n")

    return emit


def finite(row: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def lower_rows(case_list: list[cases_lib.Case], target_platform: str = "cuda") -> list[dict[str, Any]]:
    """Lowers each Pallas implementation of each case's op for `target_platform` with `jax.export`, and the XLA
    programs an op names for that platform in `LOWERED` (they can fail to lower too).

    Returns:
        Rows: op, case, implementation, ok (None when the kernel declines the case), seconds, detail.
    """
    rows = []
    for case in case_list:
        mod = registry.api(case.op)
        lowered = {**mod.PALLAS, **getattr(mod, "LOWERED", {})}
        for name, plat in lowered.items():
            if plat != target_platform:
                continue
            args, kwargs = case.build(0, abstract=True)
            row = dict(op=case.op, case=case.name, implementation=name, dtype=case.dtype, mode=f"lower-{plat}")
            t0 = time.perf_counter()
            try:
                call, arrays = registry.split_arrays(mod.IMPLEMENTATIONS[name], args, kwargs)
                specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays]
                with platform.assume(platform.HOPPER):
                    jax.export.export(jax.jit(call), platforms=(target_platform,))(*specs)
                row.update(ok=True, detail="")
            except NotImplementedError as e:
                row.update(ok=None, detail=f"unavailable: {e}")
            except Exception as e:
                row.update(ok=False, detail=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            row["seconds"] = round(time.perf_counter() - t0, 3)
            rows.append(row)
    return rows


def read_calls(path: str) -> list[OpCall]:
    """Op calls from a JSON file: a `day0jax.check --json` report (its "op_calls") or a list of op calls."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        data = data.get("op_calls", [])
    return [OpCall.from_dict(d) for d in data]


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a plain-text table."""
    head = ("op", "case", "implementation", "max rel err", "tol", "ok", "s", "detail")

    def cell(value, spec):
        return "-" if value is None else format(value, spec)

    body = [(r["op"], r["case"], r["implementation"], cell(r.get("max_rel_error"), ".2e"),
             cell(r.get("tolerance"), "g"), {True: "ok", False: "FAIL", None: "n/a"}[r.get("ok")],
             f"{r.get('seconds', 0):.1f}", r.get("detail", "")[:90]) for r in rows]
    widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head, *body]]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels_pallas.selfcheck", description=__doc__.split("\n\n")[0])
    p.add_argument("--interpret", action="store_true", help="also run the Pallas kernels in the CPU interpreter")
    p.add_argument("--lower", choices=["cuda"], help="only lower the Pallas kernels (and XLA programs ops name) for it")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--save", metavar="PATH", help="also write the rows as JSON to PATH")
    p.add_argument("--jsonl", metavar="PATH", help="append each row to PATH as one JSON line, as it is checked")
    p.add_argument("--budget-s", type=float, default=math.inf,
                   help="past this many seconds, skip the checks left (each a row saying so)")
    p.add_argument("--family", action="append", choices=sorted(cases_lib.families()),
                   help=f"flagship models whose shapes to use (repeatable; default "
                        f"{', '.join(cases_lib.DEFAULT_FLAGSHIPS)})")
    p.add_argument("--calls", metavar="FILE", help="a model's op calls instead: `python -m day0jax.check --json` "
                                                   "output, or a JSON list of op calls")
    p.add_argument("--op", action="append", choices=ops.kernel_ops(), help="ops to check (repeatable)")
    p.add_argument("--scale", choices=cases_lib.SCALES,
                   help="case sizes (default: full on a GPU and for --lower, tiny otherwise)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(cases_lib.TOLERANCE))
    p.add_argument("--seed", type=int, default=None, help="input seed (default: fresh per run)")
    a = p.parse_args(argv)
    deadline = time.monotonic() + a.budget_s
    only = tuple(a.op) if a.op else None
    scale = a.scale or ("full" if a.lower or (jax.default_backend() == "gpu" and not a.interpret) else "tiny")
    if a.calls:
        case_list = cases_lib.cases_from_calls(read_calls(a.calls), a.dtype, scale=scale, name=Path(a.calls).stem,
                                               ops=only)
    else:
        case_list = cases_lib.flagship_cases(tuple(a.family or cases_lib.DEFAULT_FLAGSHIPS), a.dtype, scale=scale,
                                             ops=only)
    if a.lower:
        rows = lower_rows(case_list, a.lower)
    else:
        seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(4), "little")
        rows = run_rows(case_list, a.interpret, seed, jsonl_writer(a.jsonl), deadline)
    as_json = json.dumps([finite(r) for r in rows], indent=1)
    if a.save:
        with open(a.save, "w") as f:
            f.write(as_json + "\n")
    failed = sum(r.get("ok") is False for r in rows)
    if a.json:
        print(as_json)
    else:
        target = platform.HOPPER if a.lower else platform.current()
        print(f"kernels_pallas selfcheck: {'lower ' + a.lower if a.lower else 'run'} on {target.device_kind}, "
              f"scale {scale}, {a.dtype}")
        print(format_table(rows))
        passed = sum(r.get("ok") is True for r in rows)
        print(f"{passed} ok, {failed} failed, {len(rows) - passed - failed} unavailable")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
