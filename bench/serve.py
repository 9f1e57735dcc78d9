"""Load test of `python -m day0jax.serve` against transformers, measured in the same run.

    .venv/bin/python bench/serve.py [--streams 16] [--repeats 3] [--precision float32|q4_1] [--skip-reference]
        [--baseline DIR]

The server (the embedded SmolLM2-135M-Instruct on loopback: by default its GGUF dequantized to float32, the weights
transformers runs; `--precision q4_1` serves the embedded checkpoint as shipped, 4-bit) takes N concurrent
streaming clients with mixed
prompt and output lengths (token ids, greedy, EOS ignored so each request yields exactly its output length):
tokens/s, time to first token and inter-token latency p50/p99, and batch-1 / batch-8 decode of one fixed prompt.
transformers (bench/serve_reference.py in .venv-ref) runs the N requests as one left-padded `generate` batch
(counting only requested tokens) and the same decodes. --baseline DIR adds a server from an earlier revision's
checkout. The sides take turns run by run (never at once, so changes in the machine's load hit all alike); each
figure is the median of --repeats runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the server launcher the tests use

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from bench.decode import Worker  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while seven curious owls watch from an old oak tree near "
         "the river bank where children play and merchants sell bread cheese apples and warm tea").split()


def workload(tokenizer, n: int, seed: int = 0):
    """n (prompt ids, output length) pairs: prompts of 16-256 tokens, outputs of 32-160 tokens, mixed."""
    rng = np.random.default_rng(seed)
    prompt_lens = [16, 48, 96, 160, 256, 32, 64, 128]
    out_lens = [32, 64, 96, 128, 160, 48, 80, 112]
    requests = []
    for i in range(n):
        target = prompt_lens[i % len(prompt_lens)]
        ids: list[int] = []
        while len(ids) < target:
            ids += tokenizer.encode(" ".join(rng.choice(WORDS, 16)) + ".")
        requests.append((ids[:target], out_lens[(i * 3) % len(out_lens)]))
    return requests


async def one_stream(http: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    stamps = []
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"] is not None:
                    stamps.append(time.perf_counter())
    return t0, stamps


async def run_streams(url, model, requests):
    limits = httpx.Limits(max_connections=len(requests) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(http, url, model, p, n) for p, n in requests))
        return time.perf_counter() - t0, results


def measure_mixed(url, model, requests):
    wall, results = asyncio.run(run_streams(url, model, requests))
    ttft = [stamps[0] - t0 for t0, stamps in results]
    itl = [b - a for _, stamps in results for a, b in zip(stamps, stamps[1:])]
    return dict(tokens_per_s=sum(n for _, n in requests) / wall, wall=wall, ttft=ttft, itl=itl)


def measure_decode(url, model, prompt, n_tokens, batch):
    _, results = asyncio.run(run_streams(url, model, [(prompt, n_tokens)] * batch))
    # Decode rate: the chunks after each stream's first, over the window where all streams were decoding.
    start = max(stamps[0] for _, stamps in results)
    end = min(stamps[-1] for _, stamps in results)
    counted = sum(sum(1 for s in stamps if start < s <= end) for _, stamps in results)
    return counted / (end - start)


def pct(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024, help="server's --max-model-len (fewer shapes)")
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--server-args", default="", help="extra arguments for the server")
    ap.add_argument("--baseline", metavar="DIR", help="also serve from this checkout of an earlier revision, taking "
                                                      "turns with this tree's server")
    ap.add_argument("--precision", choices=("float32", "q4_1"), default="float32",
                    help="float32: the GGUF dequantized, as transformers runs it (like with like); q4_1: the embedded "
                         "checkpoint as shipped")
    args = ap.parse_args()

    from bench.decode import float32_checkpoint
    from day0jax.default_model import NAME, default_checkpoint, default_gguf
    from day0jax.weights.tokenizer import Tokenizer
    from launch import ServerProcess

    ckpt = float32_checkpoint() if args.precision == "float32" else default_checkpoint()
    tok = Tokenizer(ckpt)
    requests = workload(tok, args.streams)
    decode_prompt = requests[1][0][:48]

    ref_worker = None
    if not args.skip_reference:
        print("transformers: loading the reference worker ...", flush=True)
        ref_worker = Worker([str(ROOT / ".venv-ref/bin/python"), "-P", str(ROOT / "bench/serve_reference.py"),
                             str(default_gguf())], {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})

    def measure(url):
        mixed = measure_mixed(url, NAME, requests)
        return dict(batch=mixed["tokens_per_s"], mixed=mixed,
                    **{f"d{b}": measure_decode(url, NAME, decode_prompt, args.decode_tokens, b) for b in (1, 8)})

    def measure_reference():
        useful = sum(n for _, n in requests)
        batch = ref_worker.ask({"op": "batch", "prompts": [p for p, _ in requests],
                                "outputs": [n for _, n in requests]})
        return dict(batch=useful / batch["seconds"],
                    **{f"d{b}": ref_worker.ask({"op": "decode", "batch": b, "prompt": decode_prompt,
                                                "tokens": args.decode_tokens})["tokens_per_s"] for b in (1, 8)})

    def medians(runs):
        return {k: statistics.median(r[k] for r in runs) for k in ("batch", "d1", "d8")}

    server_args = ["--model", str(ckpt), "--served-model-name", NAME, "--max-num-seqs", str(max(16, args.streams)),
                   "--max-model-len", str(args.max_model_len), *args.server_args.split()]
    t0 = time.perf_counter()
    server = ServerProcess(server_args)
    server.wait_ready(1800)
    startup = time.perf_counter() - t0
    baseline = ServerProcess(server_args, cwd=Path(args.baseline).resolve()).wait_ready(1800) if args.baseline \
        else None
    ours, base, ref = [], [], []
    try:
        for r in range(args.repeats):
            print(f"run {r + 1}/{args.repeats}", flush=True)
            ours.append(measure(server.url))
            if baseline:
                base.append(measure(baseline.url))
            if ref_worker:
                ref.append(measure_reference())
    finally:
        code = server.terminate()
        if baseline:
            baseline.terminate()
        if ref_worker:
            ref_worker.close()
    best = sorted((r["mixed"] for r in ours), key=lambda m: m["tokens_per_s"])[len(ours) // 2]
    ours, ref = medians(ours), medians(ref) if ref_worker else None
    rows = [(f"{args.streams} concurrent streams, mixed lengths (tokens/s)", ours["batch"],
             ref and ref["batch"]),
            ("batch-1 decode (tokens/s)", ours["d1"], ref and ref["d1"]),
            ("batch-8 decode (tokens/s)", ours["d8"], ref and ref["d8"])]
    print(f"\nserver start (load + warm-up): {startup:.0f}s; exit code after SIGTERM: {code}")
    if baseline:
        print("| measure | day0jax.serve | baseline | ratio |\n| --- | ---: | ---: | ---: |")
        for (name, a, _), b in zip(rows, medians(base).values()):
            print(f"| {name} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
        print()
    print(f"| measure | day0jax.serve ({args.precision}) | transformers (float32) | ratio |\n"
          "| --- | ---: | ---: | ---: |")
    for name, a, b in rows:
        print(f"| {name} | {a:.1f} | {b:.1f} | {a / b:.2f}x |" if b else f"| {name} | {a:.1f} | - | - |")
    print(f"\nlatency, {args.streams} streams (median run): TTFT p50 {pct(best['ttft'], 50) * 1000:.0f} ms, "
          f"p99 {pct(best['ttft'], 99) * 1000:.0f} ms; ITL p50 {pct(best['itl'], 50) * 1000:.0f} ms, "
          f"p99 {pct(best['itl'], 99) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
