"""`bench/gpu.sh`, the one script a lent GPU runs, kept working between device runs.

`--cpu-smoke` runs its steps end to end on the CPU at tiny shapes (the Pallas kernels in the interpreter); the
others check what makes a short device run keep its results: a failing step does not stop the next, a step past the
budget is cut and the steps left are marked skipped, and every row is on disk as JSON lines. `bench/kernels.py
--tune` runs to its end (its table lines), ops without block sizes to sweep included.
"""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["facts", "kernels", "selfcheck", "kernel_tests"]


def run_script(out: Path, *args: str, python: str = sys.executable, timeout: int = 900):
    env = {**os.environ, "OUT": str(out), "PYTHON": python}
    return subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def step_lines(out: Path) -> dict[str, str]:
    lines = (out / "status.txt").read_text().splitlines()
    return {line.split()[0]: line for line in lines if line.split()[0] in STEPS}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_smoke")
    return out, run_script(out, "--cpu-smoke")


def test_cpu_smoke_runs_every_step(smoke):
    out, proc = smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = step_lines(out)
    assert list(lines) == STEPS and all(" rc=0 " in line for line in lines.values()), lines


def test_cpu_smoke_writes_facts_and_rows(smoke):
    out, _ = smoke
    facts = json.loads((out / "facts.json").read_text())
    assert facts["backend"] == "cpu" and facts["ragged_dot"]["temp_bytes"] is not None
    rows = read_jsonl(out / "kernels.jsonl")
    assert "ceilings" in rows[0]
    by_impl = {(r["op"], r["implementation"]): r for r in rows[1:]}
    ops = {op for op, _ in by_impl}
    assert {"attention", "paged_attention", "moe", "rms_norm", "quantized_linear", "gated_delta_rule"} <= ops
    for op in ops:  # every op's reference was timed and agrees with itself
        assert by_impl[(op, "reference")]["ms"] is not None, by_impl[(op, "reference")]
    for baseline in ("jax attention_mgpu", "jax ragged_dot_mgpu", "bfloat16 dense"):
        assert any(impl == baseline for _, impl in by_impl), baseline
    checked = read_jsonl(out / "selfcheck.jsonl")
    interpreted = [r for r in checked if r["implementation"].endswith("_interpret")]
    assert all(r["ok"] is not False for r in checked), [r for r in checked if r["ok"] is False]
    assert {r["op"] for r in interpreted if r["ok"]} == {"paged_attention", "moe", "gated_delta_rule"}, interpreted


def test_a_failing_step_does_not_stop_the_others(tmp_path):
    proc = run_script(tmp_path, "--cpu-smoke", python="false", timeout=60)
    assert proc.returncode == 1
    lines = step_lines(tmp_path)
    assert list(lines) == STEPS and all(" rc=1 " in line for line in lines.values()), lines


def test_a_step_past_the_budget_is_cut_and_the_rest_skipped(tmp_path):
    hang = tmp_path / "hang"
    hang.write_text("#!/bin/sh\nexec sleep 600\n")
    hang.chmod(hang.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    proc = run_script(out, "--cpu-smoke", "--budget-s", "8", python=str(hang), timeout=120)
    assert proc.returncode == 1
    lines = step_lines(out)
    assert " rc=124 " in lines["facts"] and "timed out" in lines["facts"], lines
    assert all(lines[s].endswith("skipped: budget") for s in STEPS[1:]), lines


def test_tune_runs_to_its_end():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels.py"), "--tune", "--cpu-smoke", "--iters", "1"],
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # On the CPU no compiled kernel runs, so every swept shape says so; the ops without a sweep are passed over.
    assert "moe: qwen3-30b-a3b gate/up decode tokens=16: no configuration ran" in proc.stdout, proc.stdout
    assert "quantized_linear" not in proc.stdout and "gated_delta_rule" not in proc.stdout


def test_kernel_bench_past_its_budget_writes_skipped_rows(tmp_path):
    rows_path = tmp_path / "rows.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels.py"), "--cpu-smoke", "--iters", "1",
                           "--only", "rms_norm", "--budget-s", "0", "--jsonl", str(rows_path)],
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(rows_path)[1:]
    assert rows and all(r["detail"] == "skipped: budget" and r["ms"] is None for r in rows), rows


def test_the_device_selfcheck_covers_every_family():
    import re

    from kernels_pallas import cases

    script = (ROOT / "bench" / "gpu.sh").read_text()
    listed = re.search(r"for family in ([^;]*); do", script).group(1).replace("\\\n", " ").split()
    assert sorted(listed) == sorted(cases.families())
