"""Startup benchmark: process start to the first completed chat request, with an empty and with a filled cache.

    .venv/bin/python bench/startup.py [--runs 3] [--model PATH] [--dtype float32] [--first-use]
                                      [-- extra serve flags, e.g. --warmup all]

Each run launches `python -m day0jax.serve` (default: the embedded SmolLM2-135M-Instruct, float32, default engine
flags and `--warmup ready`), waits for /health, sends one chat request (16 tokens, greedy), then 16 concurrent
requests of mixed lengths while the other programs still compile in the background (every one must succeed), and
waits until no program is pending; it reads the startup phases from /metrics. Cold runs start from an empty cache
folder, each warm run reuses the one the cold run before it filled; they alternate so background load affects both
alike. `--first-use` points DAY0JAX_CACHE at an empty folder for the cold runs, so the default model is converted
too, as on a fresh machine. Reported: medians of the total and each phase, the programs by source, the time until
every program is ready, and warm / cold.
"""

from __future__ import annotations

import argparse
import asyncio
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
sys.path.insert(0, str(ROOT / "tests"))  # the server launcher the tests use

import httpx  # noqa: E402

from launch import ServerProcess  # noqa: E402

PHASES = ("python start", "server imports", "imports", "default model", "compile cache", "read config", "build model",
          "restore parameters", "kernel self-test", "build engine", "compile", "warm-up")


async def burst(url: str, model: str) -> list[int]:
    """16 concurrent chat requests of mixed prompt and output lengths, some sampled; their status codes."""
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(i: int) -> int:
            words = " ".join(["word"] * (8 + 40 * (i % 4)))
            r = await client.post(url + "/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": f"Repeat after me: {words}"}],
                "max_tokens": 8 + 8 * (i % 5), "temperature": 0.0 if i % 2 else 0.7, "seed": i})
            return r.status_code
        return list(await asyncio.gather(*(one(i) for i in range(16))))


def pending(metrics: str) -> int:
    m = re.search(r"^day0jax_programs_pending ([0-9.e+-]+)$", metrics, re.M)
    return int(float(m.group(1))) if m else 0


def one_run(cache: Path, args: argparse.Namespace, first_use: Path | None = None) -> dict:
    """Starts a server on `cache`, times it to the first completed chat request, stops it."""
    flags = ["--compile-cache", str(cache), "--dtype", args.dtype, *args.serve_args]
    if args.model:
        flags = ["--model", args.model, *flags]
    env = {"JAX_PLATFORMS": args.platform} if args.platform else {}
    if first_use is not None:
        env["DAY0JAX_CACHE"] = str(first_use)
    t0 = time.perf_counter()
    server = ServerProcess(flags, env=env or None)
    try:
        server.wait_ready(3600)
        t_ready = time.perf_counter() - t0
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        r = httpx.post(server.url + "/v1/chat/completions", timeout=600, json={
            "model": model, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 16,
            "temperature": 0})
        r.raise_for_status()
        t_first = time.perf_counter() - t0
        statuses = asyncio.run(burst(server.url, model))
        t_burst = time.perf_counter() - t0
        while pending(httpx.get(server.url + "/metrics").text):
            time.sleep(0.5)
        t_all = time.perf_counter() - t0
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
    late = {m.group(1): int(float(m.group(2))) for m in
            re.finditer(r'^day0jax_compiles_after_ready_total\{kind="compile",path="([a-z]+)"\} ([0-9.e+-]+)$',
                        metrics, re.M)}
    if any(code != 200 for code in statuses):
        raise RuntimeError(f"requests sent at ready failed: {statuses}")
    return dict(first_request=t_first, ready=t_ready, burst=t_burst, all_ready=t_all, phases=phases,
                programs=programs, late=late)


def median(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def report(cold: list[dict], warm: list[dict]) -> str:
    lines = ["| | cold (empty cache) | warm (filled cache) |", "| --- | ---: | ---: |"]

    def row(label, get, fmt="{:.1f} s"):
        c, w = (median(get(r) for r in runs) for runs in (cold, warm))
        # A phase a run does not have (the first-use conversion when warm): a dash, not nan.
        lines.append(f"| {label} | " + " | ".join("-" if v != v else fmt.format(v) for v in (c, w)) + " |")

    row("**process start to first completed chat request**", lambda r: r["first_request"])
    row("process start to /health 200", lambda r: r["ready"])
    row("16 concurrent requests at ready, all done", lambda r: r["burst"])
    row("every program ready (background compile done)", lambda r: r["all_ready"])
    row("compiles after ready: background", lambda r: r["late"].get("background", 0), "{:.0f}")
    row("compiles after ready: on a request's path", lambda r: r["late"].get("request", 0), "{:.0f}")
    for phase in PHASES:
        if any(phase in r["phases"] for r in cold + warm):
            row(f"phase: {phase}", lambda r, p=phase: r["phases"].get(p))
    for source in ("program-store", "xla-cache", "compiled"):
        row(f"programs: {source}", lambda r, s=source: r["programs"].get(s, 0), "{:.0f}")
    ratio = median(r["first_request"] for r in warm) / median(r["first_request"] for r in cold)
    lines.append("")
    lines.append(f"warm / cold = {ratio:.3f}; runs: "
                 + ", ".join(f"cold {r['first_request']:.1f}s" for r in cold) + "; "
                 + ", ".join(f"warm {r['first_request']:.1f}s" for r in warm))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--model", help="checkpoint folder (default: the embedded default model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--platform", default="cpu", help="JAX_PLATFORMS for the server ('' for JAX's choice)")
    p.add_argument("--first-use", action="store_true",
                   help="cold runs convert the default model too (DAY0JAX_CACHE at an empty folder)")
    p.add_argument("serve_args", nargs="*", help="extra flags for day0jax.serve (after --)")
    args = p.parse_args()
    cold, warm = [], []
    work = Path(tempfile.mkdtemp(prefix="day0jax-startup-bench-"))
    try:
        for i in range(args.runs):
            cache = work / f"cache-{i}"
            fresh = work / f"first-use-{i}" if args.first_use else None
            for label, runs in (("cold", cold), ("warm", warm)):
                load = os.getloadavg()[0]
                runs.append(one_run(cache, args, fresh))
                print(f"run {i + 1}: {label} {runs[-1]['first_request']:.1f}s (load average {load:.1f})", flush=True)
            shutil.rmtree(cache)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(report(cold, warm))
    return 0


if __name__ == "__main__":
    sys.exit(main())
