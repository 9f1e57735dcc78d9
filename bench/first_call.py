"""First-call latency: `python -m day0jax.generate` on the default model in a fresh process, with an empty
compilation cache (cold) and again with the cache it left (warm), against the same generation once the process is
warm (steady state, measured in-process by `model.generate` a second time).

    .venv/bin/python bench/first_call.py [--tokens 96] [--repeats 2] [--trees DIR[,DIR]]

`--trees` runs the CLI from other checkouts too (for example a worktree of an earlier commit), alternated with this
one, each with its own cache folder; the table has a row per tree and run. Times are the CLI's own: loading (weights
restored, nothing compiled) and generating (compiles included, which is what a first call pays).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Once upon a time,"


def run_cli(tree: Path, cache: Path, tokens: int) -> dict[str, float]:
    """One `day0jax.generate` process: its load and generate seconds and the wall time."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "day0jax.generate", "--prompt", PROMPT, "--max-tokens", str(tokens),
                           "--compile-cache", str(cache)], cwd=tree, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}: generate failed:\n{proc.stderr[-2000:]}")
    m = re.search(r"load ([0-9.]+)s, generate ([0-9.]+)s", proc.stderr)
    return {"load": float(m.group(1)), "generate": float(m.group(2)), "wall": wall}


def steady(tokens: int) -> float:
    """Seconds for the same generation in a process that has run it once already."""
    code = ("import time, day0jax\nfrom day0jax.default_model import default_checkpoint\n"
            "m = day0jax.load(default_checkpoint(), dtype='float32')\nids = m.tokenizer.encode(%r)\n"
            "m.generate([ids], %d)\nt = time.perf_counter(); m.generate([ids], %d)\n"
            "print(time.perf_counter() - t)\n") % (PROMPT, tokens, tokens)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--trees", default="", help="other checkouts to run alternately with this one")
    args = ap.parse_args()
    trees = [ROOT] + [Path(t) for t in args.trees.split(",") if t]
    print(f"`python -m day0jax.generate --max-tokens {args.tokens}`, default model (its Q4_1 weights kept "
          "quantized, float32 activations); seconds")
    print("| tree | run | cache | load | generate | process wall |")
    print("|---|---:|---|---:|---:|---:|")
    for run in range(args.repeats):
        for tree in trees:
            with tempfile.TemporaryDirectory(prefix="day0jax-first-call-") as cache:
                for state in ("cold", "warm"):
                    t = run_cli(tree, Path(cache), args.tokens)
                    print(f"| {tree} | {run + 1} | {state} | {t['load']:.1f} | {t['generate']:.2f} | "
                          f"{t['wall']:.1f} |", flush=True)
    print(f"\nsteady state (same generation, second call in one process): {steady(args.tokens):.2f} s")


if __name__ == "__main__":
    main()
