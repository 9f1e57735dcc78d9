"""Startup benchmark: process start to the first completed chat request, with an empty and with a filled cache.

    .venv/bin/python bench/startup.py [--runs 3] [--model PATH] [--dtype float32] [-- extra serve flags]

Each run launches `python -m day0jax.serve` (default: the embedded SmolLM2-135M-Instruct, float32, default engine
flags, so all default programs compile before /health turns 200), waits for /health, sends one chat request (16
tokens, greedy) and reads the startup phases from /metrics. Cold runs start from an empty cache folder, each warm
run reuses the one the cold run before it filled; they alternate so background load affects both alike. Reported:
medians of the total and each phase, the programs by source, and warm / cold (goal: at most 0.3).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from day0jax.serve.launch import ServerProcess  # noqa: E402

PHASES = ("python start", "server imports", "imports", "default model", "compile cache", "read config", "build model",
          "restore parameters", "kernel self-test", "build engine", "compile", "warm-up")


def one_run(cache: Path, args: argparse.Namespace) -> dict:
    """Starts a server on `cache`, times it to the first completed chat request, stops it."""
    flags = ["--compile-cache", str(cache), "--dtype", args.dtype, *args.serve_args]
    if args.model:
        flags = ["--model", args.model, *flags]
    t0 = time.perf_counter()
    server = ServerProcess(flags, env={"JAX_PLATFORMS": args.platform} if args.platform else None)
    try:
        server.wait_ready(3600)
        t_ready = time.perf_counter() - t0
        r = httpx.post(server.url + "/v1/chat/completions", timeout=600, json={
            "model": httpx.get(server.url + "/v1/models").json()["data"][0]["id"],
            "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 16, "temperature": 0})
        r.raise_for_status()
        t_first = time.perf_counter() - t0
        metrics = httpx.get(server.url + "/metrics").text
    finally:
        code = server.terminate()
    if code != 0:
        raise RuntimeError(f"the server exited {code}:\n{server.log_text()[-3000:]}")
    phases = {m.group(1): float(m.group(2)) for m in
              re.finditer(r'^day0jax_startup_phase_seconds\{phase="([^"]+)"\} ([0-9.e+-]+)$', metrics, re.M)}
    programs = {m.group(1): int(float(m.group(2))) for m in
                re.finditer(r'^day0jax_startup_programs_total\{cache="[a-z]+",source="([^"]+)"\} ([0-9.e+-]+)$',
                            metrics, re.M)}
    return dict(first_request=t_first, ready=t_ready, phases=phases, programs=programs)


def median(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def report(cold: list[dict], warm: list[dict]) -> str:
    lines = ["| | cold (empty cache) | warm (filled cache) |", "| --- | ---: | ---: |"]

    def row(label, get, fmt="{:.1f} s"):
        c, w = median(get(r) for r in cold), median(get(r) for r in warm)
        lines.append(f"| {label} | {fmt.format(c)} | {fmt.format(w)} |")

    row("**process start to first completed chat request**", lambda r: r["first_request"])
    row("process start to /health 200", lambda r: r["ready"])
    for phase in PHASES:
        if any(phase in r["phases"] for r in cold + warm):
            row(f"phase: {phase}", lambda r, p=phase: r["phases"].get(p))
    for source in ("program-store", "xla-cache", "compiled"):
        row(f"programs: {source}", lambda r, s=source: r["programs"].get(s, 0), "{:.0f}")
    ratio = median(r["first_request"] for r in warm) / median(r["first_request"] for r in cold)
    lines.append("")
    lines.append(f"warm / cold = {ratio:.3f} (goal: at most 0.3); runs: "
                 + ", ".join(f"cold {r['first_request']:.1f}s" for r in cold) + "; "
                 + ", ".join(f"warm {r['first_request']:.1f}s" for r in warm))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--model", help="checkpoint folder (default: the embedded default model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--platform", default="cpu", help="JAX_PLATFORMS for the server ('' for JAX's choice)")
    p.add_argument("serve_args", nargs="*", help="extra flags for day0jax.serve (after --)")
    args = p.parse_args()
    cold, warm = [], []
    work = Path(tempfile.mkdtemp(prefix="day0jax-startup-bench-"))
    try:
        for i in range(args.runs):
            cache = work / f"cache-{i}"
            for label, runs in (("cold", cold), ("warm", warm)):
                load = os.getloadavg()[0]
                runs.append(one_run(cache, args))
                print(f"run {i + 1}: {label} {runs[-1]['first_request']:.1f}s (load average {load:.1f})", flush=True)
            shutil.rmtree(cache)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(report(cold, warm))
    return 0


if __name__ == "__main__":
    sys.exit(main())
