"""Greedy decode tokens/s: day0jax's `Model.generate` against transformers, same SmolLM2 weights, float32, CPU.

    .venv/bin/python bench/decode.py [--repeats 5] [--new-tokens 64] [--batches 1,8]

Both run in this one process tree, alternately (day0jax, then transformers, per repeat), after a warm-up that
compiles day0jax's programs; transformers runs in the reference venv as a worker that stays loaded. Decode
rate = batch * (N - 1) / (time for N tokens - time for 1 token), so prompt processing is taken out the same way
on both sides. Prints a table of medians with the ratio; the issue's target is day0jax >= 1.5x at batch 1 and 8.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PROMPT = "Once upon a time, in a small village at the edge of a great forest, there lived"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    import day0jax
    from day0jax.weights.default_model import default_checkpoint, default_gguf

    model = day0jax.load(default_checkpoint())
    prompt = model.tokenizer.encode(PROMPT)
    # -P: bench/ must not be on the worker's path (transformers would import bench/kernels.py as `kernels`).
    ref = subprocess.Popen([str(ROOT / ".venv-ref/bin/python"), "-P", str(ROOT / "bench/decode_reference.py"),
                            str(default_gguf())], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert json.loads(ref.stdout.readline())["ready"]

    def ours(batch, n):
        t0 = time.perf_counter()
        out = model.generate([prompt] * batch, n, ignore_eos=True)
        return time.perf_counter() - t0, out[0]

    def theirs(batch, n):
        ref.stdin.write(json.dumps({"batch": batch, "prompt": prompt, "new_tokens": n}) + "\n")
        ref.stdin.flush()
        r = json.loads(ref.stdout.readline())
        return r["full"], r["first"], r["tokens"]

    n = args.new_tokens
    rates: dict[tuple[str, int], list[float]] = {}
    for batch in batches:  # warm-up: compile every program this batch size uses, and warm torch
        ours(batch, n), ours(batch, 1), theirs(batch, 2)
    for _ in range(args.repeats):
        for batch in batches:
            (full, tokens), (first, _) = ours(batch, n), ours(batch, 1)
            rates.setdefault(("day0jax", batch), []).append(batch * (n - 1) / (full - first))
            ref_full, ref_first, ref_tokens = theirs(batch, n)
            rates.setdefault(("transformers", batch), []).append(batch * (n - 1) / (ref_full - ref_first))
            assert tokens == ref_tokens, "day0jax and transformers disagree on the greedy tokens"
    ref.stdin.close()
    ref.wait()

    print(f"\nGreedy decode, SmolLM2-135M float32, {n} new tokens, median of {args.repeats} (tokens/s)\n")
    print(f"| batch | day0jax | transformers | ratio |\n|---|---|---|---|")
    for batch in batches:
        a, b = statistics.median(rates[("day0jax", batch)]), statistics.median(rates[("transformers", batch)])
        print(f"| {batch} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
