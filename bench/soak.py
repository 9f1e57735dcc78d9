"""A bounded soak of the server: a fixed number of mixed requests, a fifth of the streaming clients hanging up
early, some bad requests, then SIGTERM; does the server stay healthy, free every KV block and keep its memory?

    .venv/bin/python bench/soak.py [--requests 600] [--concurrency 12] [--model PATH] [-- extra serve flags]

Mixed: chat and completions, streamed and not, greedy and sampled, some with a JSON schema, some with n=2; one in
ten is bad or hostile (malformed JSON, out-of-range values, a lone surrogate, an unimplemented field; deep nesting
in a body, in tool-call arguments and in a schema, malformed and oversized schemas, a huge choice list, a grammar
the offered tools forbid, a NUL in a media URL, images to a text model). Reported: requests served, responses by
status code (5xx must be 0), streams dropped on purpose, the good requests' latency and their streams' inter-token
latency (median and p99), KV blocks in use once idle (must be 0), the server's resident memory after warm-up (the
first tenth of the requests) and at the end (growth under 5%), and the exit code of the drain after SIGTERM (must be
0).
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
import numpy as np  # noqa: E402

from launch import ServerProcess  # noqa: E402

BAD = [b'{"model": "M", "prompt": ', b'{"model": "M", "prompt": "x", "top_p": 9}',
       b'{"model": "M", "prompt": "x\\ud800"}', b'{"model": "M", "prompt": "x", "suffix": "y"}',
       b'{"model": "M", "prompt": "x", "guided_regex": "("}']


def chat_body(**fields) -> bytes:
    return json.dumps({"model": "M", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def _called_with(arguments: str) -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "x"}]


def _tools(parameters) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


HOSTILE = [chat_body(chat_template_kwargs={"x": json.loads("[" * 500 + "]" * 500)}),
           chat_body(messages=_called_with("[" * 20000)),
           chat_body(guided_json=json.loads('{"items": ' * 300 + "{}" + "}" * 300)),
           chat_body(tools=_tools({"type": "object", "properties": 5})),
           chat_body(guided_json={"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(400)}}),
           chat_body(guided_choice=[str(i) for i in range(5000)]),
           chat_body(tools=_tools({"type": "object"}), guided_regex="a+"),
           chat_body(messages=[{"role": "user", "content": [
               {"type": "image_url", "image_url": {"url": "file:///tmp/a\u0000.png"}}]}]),
           chat_body(messages=[{"role": "user", "content": [
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}])]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


async def one(http: httpx.AsyncClient, url: str, model: str, i: int, rng: random.Random,
              latency: dict[str, list[float]]) -> tuple[int | str, bool]:
    """One request; returns (status code, dropped on purpose); a good one's latency (whole, and between its stream's
    chunks) goes into `latency`."""
    if i % 10 == 9:
        path, body = rng.choice([("/v1/completions", b) for b in BAD] + [("/v1/chat/completions", b) for b in HOSTILE])
        r = await http.post(url + path, headers={"Content-Type": "application/json"},
                            content=body.replace(b'"M"', json.dumps(model).encode()))
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
    start = time.perf_counter()
    if not body["stream"]:
        r = await http.post(url + path, json=body)
        latency["request"].append(time.perf_counter() - start)
        return r.status_code, False
    drop = rng.random() < 0.2
    async with http.stream("POST", url + path, json=body) as r:
        chunks, last = 0, None
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                now = time.perf_counter()
                if last is not None:
                    latency["inter-token"].append(now - last)
                chunks, last = chunks + 1, now
                if drop and chunks == 2:
                    return r.status_code, True
        latency["request"].append(time.perf_counter() - start)
        return r.status_code, False


async def soak(url: str, model: str, n: int, concurrency: int, pid: int) -> dict:
    rng = random.Random(0)
    statuses: collections.Counter = collections.Counter()
    dropped = 0
    rss_warm = None
    queue = list(range(n))
    latency: dict[str, list[float]] = {"request": [], "inter-token": []}

    async def worker(http):
        nonlocal dropped, rss_warm
        while queue:
            i = queue.pop(0)
            try:
                status, was_dropped = await one(http, url, model, i, rng, latency)
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
            "rss_warm": rss_warm, "rss_end": rss_bytes(pid), "latency": latency}


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
    for name, values in result["latency"].items():
        p50, p99 = np.percentile(values, [50, 99]) * 1000 if values else (float("nan"),) * 2
        print(f"| good requests' {name} latency, median / p99 | {p50:.0f} / {p99:.0f} ms | |")
    print(f"| KV blocks in use once idle | {result['kv_blocks_idle']:.0f} | 0 |")
    print(f"| server RSS after warm-up / at the end | {result['rss_warm'] / 2**20:.0f} / "
          f"{result['rss_end'] / 2**20:.0f} MiB ({growth:+.1%}) | < +5% |")
    print(f"| exit code of the drain after SIGTERM | {code} | 0 |")


if __name__ == "__main__":
    main()
