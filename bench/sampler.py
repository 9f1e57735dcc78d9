"""What folding the sampler's variants into one program costs: per-call time of the one program (mode and logprobs
chosen at run time by `lax.switch`/`lax.cond`) against a program specialized for the batch's mode, and compile time
of the one program against the six specializations it replaces (three modes, with and without logprobs).

    .venv/bin/python bench/sampler.py [--rows 1,16] [--vocab 49152] [--calls 200] [--repeats 5]

Both run the same `day0jax.engine.sampling.sample`; the specialized one is that function with a static `mode` and
logprobs flag, as the engine compiled it before. Each timing is the median over `--repeats` rounds of `--calls`
back-to-back calls (each waited for, as the engine reads a step's tokens), the two programs alternating round by
round, after one warm-up round each. Printed as a table with ratios (one program / specialized).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from day0jax.engine.sampling import MODES, sample  # noqa: E402


def batch_rows(mode: str, B: int) -> tuple[jax.Array, ...]:
    """Per-row parameters whose cheapest mode is `mode` (half the rows greedy where the mode samples)."""
    sampled = np.arange(B) % 2 == 1 if B > 1 else np.ones(B, bool)
    temperature = np.where(sampled, 0.8, 0.0) if mode != "greedy" else np.zeros(B)
    top_p = np.where(sampled, 0.9, 1.0) if mode == "filtered" else np.ones(B)
    return (jnp.asarray(temperature, jnp.float32), jnp.zeros(B, jnp.int32), jnp.asarray(top_p, jnp.float32),
            jnp.zeros(B, jnp.float32))


def timed(fn, args, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t0) / calls


def compile_seconds(fn, args, **static) -> float:
    jax.clear_caches()  # else a second compile of the same computation is a lookup
    t0 = time.perf_counter()
    jax.jit(fn, static_argnames=tuple(static)).lower(*args, **static).compile()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary by default")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    def folded(logits, seeds, counters, *rows_and_flag):
        return sample(logits, seeds, counters, *rows_and_flag[:4], None, None, rows_and_flag[4])

    def specialized(logits, seeds, counters, *rows, mode, logprobs):
        return sample(logits, seeds, counters, *rows, None, None, logprobs, mode=mode)

    one = jax.jit(folded)
    static = jax.jit(specialized, static_argnames=("mode", "logprobs"))
    print(f"{jax.devices()[0].device_kind}, vocabulary {args.vocab}, {args.calls} calls x {args.repeats} rounds\n")
    print("| rows | mode | logprobs | specialized (ms/call) | one program (ms/call) | ratio |")
    print("|---:|---|---|---:|---:|---:|")
    for B in map(int, args.rows.split(",")):
        rng = np.random.default_rng(0)
        logits = jnp.asarray(rng.standard_normal((B, args.vocab)).astype(np.float32) * 3)
        seeds, counters = jnp.arange(B, dtype=jnp.uint32), jnp.zeros(B, jnp.int32)
        for mode in MODES:
            rows = batch_rows(mode, B)
            for logprobs in (False, True):
                fixed = lambda *a, m=mode, lp=logprobs: static(*a, mode=m, logprobs=lp)  # noqa: E731
                a_one = (logits, seeds, counters, *rows, jnp.asarray(logprobs))
                a_fixed = (logits, seeds, counters, *rows)
                np.testing.assert_array_equal(one(*a_one)["tokens"], fixed(*a_fixed)["tokens"])
                times = {"one": [], "fixed": []}
                for r in range(args.repeats + 1):
                    for name, fn, a in (("one", one, a_one), ("fixed", fixed, a_fixed))[::1 if r % 2 else -1]:
                        seconds = timed(fn, a, args.calls)
                        if r:  # round 0 warms up
                            times[name].append(seconds)
                s, o = statistics.median(times["fixed"]) * 1e3, statistics.median(times["one"]) * 1e3
                print(f"| {B} | {mode} | {'yes' if logprobs else 'no'} | {s:.3f} | {o:.3f} | {o / s:.2f} |")
    print("\nCompile time, rows " + args.rows)
    print("| rows | six specialized programs (s) | one program (s) | ratio |")
    print("|---:|---:|---:|---:|")
    for B in map(int, args.rows.split(",")):
        logits = jax.ShapeDtypeStruct((B, args.vocab), jnp.float32)
        seeds, counters = jnp.zeros(B, jnp.uint32), jnp.zeros(B, jnp.int32)
        rows = batch_rows("filtered", B)
        six = sum(compile_seconds(specialized, (logits, seeds, counters, *rows), mode=m, logprobs=lp)
                  for m in MODES for lp in (False, True))
        single = compile_seconds(folded, (logits, seeds, counters, *rows, jnp.asarray(False)))
        print(f"| {B} | {six:.2f} | {single:.2f} | {single / six:.2f} |")


if __name__ == "__main__":
    main()
