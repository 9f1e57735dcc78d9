"""Greedy decode tokens/s of `Model.generate` against transformers (and an earlier day0jax with --baseline).

    .venv/bin/python bench/decode.py [--repeats 5] [--new-tokens 64] [--batches 1,8] [--baseline DIR]

Same SmolLM2 weights, float32, CPU. Each system is a worker process that stays loaded (bench/decode_worker.py for
this tree and the --baseline checkout, bench/decode_reference.py in .venv-ref for transformers); they take turns,
batch by batch and repeat by repeat in a rotating order, after a warm-up of the same shapes. Decode rate =
batch * (N - 1) / (time for N tokens - time for 1 token), taking prompt processing out alike on every side; all
must produce the same greedy tokens (asserted). Prints a table of medians with ratios. Two workers of identical
code have measured 4-6% apart on a 2-core VM: smaller differences are not resolved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PROMPT = "Once upon a time, in a small village at the edge of a great forest, there lived"


class Worker:
    """A worker process that keeps a model loaded and answers each JSON command line with one JSON line."""

    def __init__(self, cmd: list[str], env: dict):
        # -P keeps bench/ off the worker's path (transformers would import bench/kernels.py as `kernels`).
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **env})
        self.hello = json.loads(self.proc.stdout.readline())
        assert self.hello["ready"]

    def ask(self, command: dict) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--baseline", metavar="DIR", help="a checkout of an earlier day0jax revision to run beside")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    from day0jax.weights.default_model import default_checkpoint, default_gguf
    from day0jax.weights.tokenizer import Tokenizer

    ckpt = default_checkpoint()
    prompt = Tokenizer(ckpt).encode(PROMPT)
    python = str(ROOT / ".venv/bin/python")
    workers = {"day0jax": Worker([python, "-P", str(ROOT / "bench/decode_worker.py"), str(ckpt)],
                                 {"PYTHONPATH": str(ROOT)})}
    if args.baseline:
        workers["baseline"] = Worker([python, "-P", str(ROOT / "bench/decode_worker.py"), str(ckpt)],
                                     {"PYTHONPATH": str(Path(args.baseline).resolve())})
        assert workers["baseline"].hello["from"] == str(Path(args.baseline).resolve()), workers["baseline"].hello
    workers["transformers"] = Worker([str(ROOT / ".venv-ref/bin/python"), "-P",
                                      str(ROOT / "bench/decode_reference.py"), str(default_gguf())],
                                     {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    n = args.new_tokens
    for batch in batches:  # warm-up: every program and kernel these shapes use
        for w in workers.values():
            w.ask({"batch": batch, "prompt": prompt, "new_tokens": n})
    rates: dict[tuple[str, int], list[float]] = {}
    for repeat in range(args.repeats):
        # The order rotates: with a fixed one, identical code measured 6% apart by its place in the turn.
        order = list(workers)[repeat % len(workers):] + list(workers)[:repeat % len(workers)]
        for batch in batches:
            tokens = {}
            for name in order:
                r = workers[name].ask({"batch": batch, "prompt": prompt, "new_tokens": n})
                tokens[name] = r["tokens"]
                rates.setdefault((name, batch), []).append(batch * (n - 1) / (r["full"] - r["first"]))
            assert len({tuple(t) for t in tokens.values()}) == 1, f"greedy tokens differ: {tokens}"
    for w in workers.values():
        w.close()

    names = list(workers)
    print(f"\nGreedy decode, SmolLM2-135M float32, {n} new tokens, median of {args.repeats} (tokens/s)\n")
    ratios = [("day0jax", "transformers")] + ([("day0jax", "baseline")] if args.baseline else [])
    print("| batch | " + " | ".join(names) + " | " + " | ".join(f"{a} / {b}" for a, b in ratios) + " |")
    print("|---" * (1 + len(names) + len(ratios)) + "|")
    for batch in batches:
        med = {name: statistics.median(rates[(name, batch)]) for name in names}
        print(f"| {batch} | " + " | ".join(f"{med[x]:.1f}" for x in names) + " | "
              + " | ".join(f"{med[a] / med[b]:.2f}x" for a, b in ratios) + " |")


if __name__ == "__main__":
    main()
