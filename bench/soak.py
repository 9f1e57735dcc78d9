"""A bounded soak of the server: a fixed number of mixed requests, a fifth of the streaming clients hanging up
early, some bad requests, then SIGTERM; does the server stay healthy, free every KV block and keep its memory?

    .venv/bin/python bench/soak.py [--requests 600] [--concurrency 12] [--model PATH] [-- extra serve flags]

Mixed: chat and completions, streamed and not, greedy and sampled, some with a JSON schema, some with n=2; one in
ten is bad (malformed JSON, out-of-range values, a lone surrogate, an unimplemented field). Reported: requests
served, responses by status code (5xx must be 0), streams dropped on purpose, KV blocks in use once idle (must be
0), the server's resident memory after warm-up (the first tenth of the requests) and at the end (growth under 5%),
and the exit code of the drain after SIGTERM (must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the server launcher the tests use

import httpx  # noqa: E402

from launch import ServerProcess  # noqa: E402

BAD = [b'{"model": "M", "prompt": ', b'{"model": "M", "prompt": "x", "top_p": 9}',
       b'{"model": "M", "prompt": "x\\ud800"}', b'{"model": "M", "prompt": "x", "suffix": "y"}',
       b'{"model": "M", "prompt": "x", "guided_regex": "("}']
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


async def one(http: httpx.AsyncClient, url: str, model: str, i: int, rng: random.Random) -> tuple[int | str, bool]:
    """One request; returns (status code, dropped on purpose)."""
    if i % 10 == 9:
        r = await http.post(url + "/v1/completions", headers={"Content-Type": "application/json"},
                            content=rng.choice(BAD).replace(b'"M"', json.dumps(model).encode()))
        return r.status_code, False
    chat = i % 2 == 0
    body = {"model": model, "max_tokens": rng.choice([8, 16, 32, 64]), "temperature": rng.choice([0.0, 0.8]),
            "seed": i, "stream": i % 3 != 0}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Tell me something about the number {i}."}]
        if i % 7 == 0:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    else:
        body["prompt"] = f"Item {i}: " + "word " * rng.randint(1, 120)
        body["n"] = 2 if i % 11 == 0 else 1
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not body["stream"]:
        r = await http.post(url + path, json=body)
        return r.status_code, False
    drop = rng.random() < 0.2
    async with http.stream("POST", url + path, json=body) as r:
        chunks = 0
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunks += 1
                if drop and chunks == 2:
                    return r.status_code, True
        return r.status_code, False


async def soak(url: str, model: str, n: int, concurrency: int, pid: int) -> dict:
    rng = random.Random(0)
    statuses: collections.Counter = collections.Counter()
    dropped = 0
    rss_warm = None
    queue = list(range(n))

    async def worker(http):
        nonlocal dropped, rss_warm
        while queue:
            i = queue.pop(0)
            try:
                status, was_dropped = await one(http, url, model, i, rng)
            except httpx.HTTPError as e:
                status, was_dropped = type(e).__name__, False
            statuses[status] += 1
            dropped += was_dropped
            if i == n // 10 and rss_warm is None:
                rss_warm = rss_bytes(pid)

    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        deadline = time.time() + 60
        while time.time() < deadline:  # idle: the running and waiting gauges settle once every abort is applied
            text = (await http.get(url + "/metrics")).text
            if metric(text, "day0jax_num_requests_running") == 0 and metric(text, "day0jax_kv_blocks_used") == 0:
                break
            await asyncio.sleep(0.5)
    return {"statuses": dict(statuses), "dropped": dropped, "kv_blocks_idle": metric(text, "day0jax_kv_blocks_used"),
            "rss_warm": rss_warm, "rss_end": rss_bytes(pid)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--model", help="checkpoint (default: the embedded default model)")
    ap.add_argument("serve_args", nargs="*", help="extra serve flags, after --")
    args = ap.parse_args()
    flags = (["--model", args.model] if args.model else []) + ["--dtype", "float32", "--warmup", "all",
                                                                "--max-model-len", "1024", *args.serve_args]
    proc = ServerProcess(flags)
    t0 = time.perf_counter()
    try:
        proc.wait_ready(1800)
        model = httpx.get(proc.url + "/v1/models").json()["data"][0]["id"]
        result = asyncio.run(soak(proc.url, model, args.requests, args.concurrency, proc.proc.pid))
    finally:
        code = proc.terminate()
    seconds = time.perf_counter() - t0
    served = sum(v for k, v in result["statuses"].items() if k == 200)
    errors = {k: v for k, v in sorted(result["statuses"].items(), key=str) if k != 200}
    growth = result["rss_end"] / result["rss_warm"] - 1
    print("| measure | value | target |\n|---|---:|---:|")
    print(f"| requests sent | {args.requests} ({args.concurrency} clients, {seconds:.0f} s in all) | |")
    print(f"| served (200) | {served} | |")
    print(f"| other responses by status | {errors} | no 5xx |")
    print(f"| streams dropped by their client | {result['dropped']} | |")
    print(f"| KV blocks in use once idle | {result['kv_blocks_idle']:.0f} | 0 |")
    print(f"| server RSS after warm-up / at the end | {result['rss_warm'] / 2**20:.0f} / "
          f"{result['rss_end'] / 2**20:.0f} MiB ({growth:+.1%}) | < +5% |")
    print(f"| exit code of the drain after SIGTERM | {code} | 0 |")


if __name__ == "__main__":
    main()
