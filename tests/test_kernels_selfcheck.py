"""`python -m kernels_pallas.selfcheck` and the kernels hook of `day0jax.load`.

The CLI runs as users run it (a subprocess, JSON on stdout), on one family and one op to stay cheap: the
interpreter run (on the CPU platform on every machine, where no Hopper GPU is the target) must compare the Mosaic
GPU kernel with the reference and pass; on a Hopper GPU the compiled kernel must pass too; the CUDA lowering run
must lower it. `day0jax.load(..., kernels=...)` installs the self-test's policy and reports it on the model.
"""

import json
import os
import subprocess
import sys

import pytest

import day0jax
from conftest import needs_hopper
from kernels_pallas import registry


def selfcheck(*args, env: dict[str, str] | None = None):
    proc = subprocess.run([sys.executable, "-m", "kernels_pallas.selfcheck", *args], capture_output=True,
                          text=True, timeout=900, env=dict(os.environ, **(env or {})))
    return proc.returncode, proc.stdout, proc.stderr


def test_interpret_json_rows():
    rc, out, err = selfcheck("--interpret", "--json", "--family", "gpt-oss-20b", "--op", "rms_norm",
                             env={"JAX_PLATFORMS": "cpu"})
    assert rc == 0, err
    rows = json.loads(out)
    assert {r["implementation"] for r in rows} == {"mosaic_gpu", "mosaic_gpu_interpret"}
    for row in rows:
        assert {"op", "implementation", "ok", "max_rel_error", "tolerance", "case"} <= set(row)
    interp = [r for r in rows if r["implementation"] == "mosaic_gpu_interpret"]
    assert interp and all(r["ok"] is True and r["max_rel_error"] <= r["tolerance"] for r in interp), interp
    native = [r for r in rows if r["implementation"] == "mosaic_gpu"]  # the CPU is no Hopper GPU: unavailable
    assert native and all(r["ok"] is None and "Hopper" in r["detail"] for r in native), native


@needs_hopper
def test_compiled_kernel_rows_on_hopper():
    rc, out, err = selfcheck("--json", "--family", "llama-3-8b", "--op", "rms_norm")
    assert rc == 0, err
    native = [r for r in json.loads(out) if r["implementation"] == "mosaic_gpu"]
    assert native and all(r["ok"] is True and r["max_rel_error"] <= r["tolerance"] for r in native), native


def test_lower_cuda_table():
    rc, out, err = selfcheck("--lower", "cuda", "--family", "llama-3-8b", "--op", "rms_norm")
    assert rc == 0, err
    assert "rms_norm" in out and "mosaic_gpu" in out and "1 ok, 0 failed" in out, out


def test_load_runs_the_kernel_selftest(converted):
    # `load(kernels=...)` sets the process-wide policy (earlier tests in this process may have left 'reference'):
    # inside the block it is load's, after it the one before.
    before = registry.get_policy()
    with registry.use_policy(registry.Policy()):
        model = day0jax.load(converted["llama"], kernels="reference")
        assert registry.get_policy().mode == "reference"
        assert model.kernel_report.mode == "reference"
        assert set(model.kernel_report.chosen) >= {"attention", "rms_norm"}
        model = day0jax.load(converted["llama"])
        assert model.kernel_report.mode == "auto"
        with pytest.raises(ValueError, match="kernels='fastest'"):
            day0jax.load(converted["llama"], kernels="fastest")
    assert registry.get_policy() == before


def test_rows_past_the_deadline_are_skipped_and_each_row_is_emitted():
    from kernels_pallas import cases, selfcheck

    case_list = cases.flagship_cases(("llama-3-8b",), scale="tiny", ops=("rms_norm",))
    emitted = []
    rows = selfcheck.run_rows(case_list, interpret=True, seed=0, emit=emitted.append, deadline=float("-inf"))
    assert rows and emitted == rows
    assert all(r["ok"] is None and r["detail"] == "skipped: budget" for r in rows), rows
