"""Greedy decode tokens/s of `Model.generate` against transformers, llama.cpp (--llama-cpp) and an earlier day0jax
(--baseline); time to first token for long prompts (--prefill).

    .venv/bin/python bench/decode.py [--repeats 5] [--new-tokens 64] [--batches 1,8] [--baseline DIR]
                                     [--llama-cpp] [--bfloat16] [--prefill 128,512,2048]

Same SmolLM2 weights, float32, CPU. Each system is a worker process that stays loaded (bench/decode_worker.py for
this tree and the --baseline checkout, bench/decode_reference.py in .venv-ref for transformers); they take turns,
batch by batch and repeat by repeat in a rotating order, after a warm-up of the same shapes. Decode rate =
batch * (N - 1) / (time for N tokens - time for 1 token), taking prompt processing out alike on every side; all
must produce the same greedy tokens (asserted; llama.cpp, at batch 1 only, sums in another order, so its agreement is
reported instead; so for `--bfloat16`, day0jax loaded in bfloat16, whose rounding may pick other tokens).
`--llama-cpp` builds llama-cpp-python into .venv-ref if it is missing and runs it on an F32
GGUF written from the default model's GGUF (bench/decode_llamacpp.py). `--prefill` times a one-token generation
of random prompts of those lengths (a new prompt each time: no prefix cache helps). Prints tables of medians. Two
workers of identical code have measured 4-6% apart on a 2-core VM: smaller differences are not resolved.
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
        """The worker's answer to `command`.

        Raises:
            RuntimeError: the worker exited (a crash: its exit status says how).
        """
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker exited with status {self.proc.wait()}")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def f32_gguf() -> Path:
    """Where the F32 GGUF of the default model lives (written by the llama.cpp worker on first use); installs
    llama-cpp-python (built from source for this CPU) into .venv-ref if it is missing."""
    from day0jax.core.paths import cache_root

    ref = str(ROOT / ".venv-ref/bin/python")
    if subprocess.run([ref, "-c", "import llama_cpp"], capture_output=True).returncode != 0:
        print("building llama-cpp-python 0.3.36 into .venv-ref (a few minutes)", file=sys.stderr, flush=True)
        subprocess.run([ref, "-m", "pip", "install", "-q", "--no-binary", "llama-cpp-python",
                        "llama-cpp-python==0.3.36"], check=True,
                       env={**os.environ, "CMAKE_ARGS": "-DGGML_NATIVE=ON -DLLAMA_CURL=OFF"})
    folder = cache_root() / "bench"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "SmolLM2-135M-Instruct.F32.gguf"


def float32_checkpoint() -> Path:
    """The default model converted to float32 (its GGUF blocks dequantized), the weights transformers and the F32
    GGUF hold; converted into the bench cache on first use."""
    from convert.convert import Options, convert_checkpoint
    from day0jax.core.paths import cache_root
    from day0jax.default_model import default_gguf

    dst = cache_root() / "bench" / "day0jax-float32"
    if not (dst / "day0jax.json").is_file():
        convert_checkpoint(default_gguf(), dst, force=dst.exists(), progress=False,
                           options=Options(dtype="float32", dequantize=True))
    return dst


def prefill_times(workers: dict, lengths: list[int], repeats: int) -> dict[int, dict[str, float]]:
    """Median seconds to the first token per prompt length and system; each timed prompt is new (random ids)."""
    rng = random.Random(0)
    times: dict[int, dict[str, list[float]]] = {}
    for length in lengths:
        for repeat in range(repeats + 1):  # the first round warms up (compiles) and is not counted
            order = list(workers)[repeat % len(workers):] + list(workers)[:repeat % len(workers)]
            prompt = [rng.randrange(1000, 40000) for _ in range(length)]
            for name in order:
                r = workers[name].ask({"batch": 1, "prompt": prompt, "new_tokens": 1})
                if repeat:
                    times.setdefault(length, {}).setdefault(name, []).append(r["full"])
    return {length: {name: statistics.median(t) for name, t in per.items()} for length, per in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--baseline", metavar="DIR", help="a checkout of an earlier day0jax revision to run beside")
    ap.add_argument("--llama-cpp", action="store_true", help="llama.cpp (F32 GGUF) as a reference at batch 1")
    ap.add_argument("--bfloat16", action="store_true", help="day0jax in bfloat16 beside its float32")
    ap.add_argument("--prefill", default="", help="prompt lengths to time the first token of, e.g. 128,512,2048")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    from day0jax.default_model import default_gguf
    from day0jax.weights.tokenizer import Tokenizer

    ckpt = float32_checkpoint()
    prompt = Tokenizer(ckpt).encode(PROMPT)
    python = str(ROOT / ".venv/bin/python")
    workers = {"day0jax": Worker([python, "-P", str(ROOT / "bench/decode_worker.py"), str(ckpt)],
                                 {"PYTHONPATH": str(ROOT)})}
    if args.bfloat16:
        workers["day0jax bf16"] = Worker([python, "-P", str(ROOT / "bench/decode_worker.py"), str(ckpt), "bfloat16"],
                                         {"PYTHONPATH": str(ROOT)})
    if args.baseline:
        workers["baseline"] = Worker([python, "-P", str(ROOT / "bench/decode_worker.py"), str(ckpt)],
                                     {"PYTHONPATH": str(Path(args.baseline).resolve())})
        assert workers["baseline"].hello["from"] == str(Path(args.baseline).resolve()), workers["baseline"].hello
    workers["transformers"] = Worker([str(ROOT / ".venv-ref/bin/python"), "-P",
                                      str(ROOT / "bench/decode_reference.py"), str(default_gguf())],
                                     {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    if args.llama_cpp:
        workers["llama.cpp"] = Worker([str(ROOT / ".venv-ref/bin/python"), "-P", str(ROOT / "bench/decode_llamacpp.py"),
                                       str(default_gguf()), str(f32_gguf())], {})
    n = args.new_tokens

    def takes(name: str, batch: int) -> bool:
        return name != "llama.cpp" or batch == 1

    for batch in batches:  # warm-up: every program and kernel these shapes use
        for name, w in workers.items():
            if takes(name, batch):
                w.ask({"batch": batch, "prompt": prompt, "new_tokens": n})
    rates: dict[tuple[str, int], list[float]] = {}
    agree: dict[str, int] = {}  # how many of llama.cpp's (bfloat16's) first tokens equal day0jax's
    for repeat in range(args.repeats):
        # The order rotates: with a fixed one, identical code measured 6% apart by its place in the turn.
        order = list(workers)[repeat % len(workers):] + list(workers)[:repeat % len(workers)]
        for batch in batches:
            tokens = {}
            for name in (x for x in order if takes(x, batch)):
                r = workers[name].ask({"batch": batch, "prompt": prompt, "new_tokens": n})
                tokens[name] = r["tokens"]
                rates.setdefault((name, batch), []).append(batch * (n - 1) / (r["full"] - r["first"]))
            others = {x: tokens.pop(x) for x in ("llama.cpp", "day0jax bf16") if x in tokens}
            assert len({tuple(t) for t in tokens.values()}) == 1, f"greedy tokens differ: {tokens}"
            for x, theirs in others.items():
                same = next((i for i, (a, b) in enumerate(zip(theirs, tokens["day0jax"])) if a != b), len(theirs))
                agree[x] = min(agree.get(x, same), same)
    prefill = prefill_times(workers, [int(x) for x in args.prefill.split(",") if x], args.repeats)
    for w in workers.values():
        w.close()

    names = list(workers)
    print(f"\nGreedy decode, SmolLM2-135M float32, {n} new tokens, median of {args.repeats} (tokens/s)\n")
    ratios = [("day0jax", other) for other in ("transformers", "llama.cpp", "baseline") if other in workers]
    if "day0jax bf16" in workers:
        ratios.append(("day0jax bf16", "day0jax"))
    print("| batch | " + " | ".join(names) + " | " + " | ".join(f"{a} / {b}" for a, b in ratios) + " |")
    print("|---" * (1 + len(names) + len(ratios)) + "|")
    for batch in batches:
        med = {name: statistics.median(rates[(name, batch)]) if (name, batch) in rates else None for name in names}
        print(f"| {batch} | " + " | ".join("-" if med[x] is None else f"{med[x]:.1f}" for x in names) + " | "
              + " | ".join("-" if med[b] is None else f"{med[a] / med[b]:.2f}x" for a, b in ratios) + " |")
    for x, same in agree.items():
        print(f"\n{x}'s greedy tokens equal day0jax's (float32) for the first {same} of {n} (at every batch)")
    if prefill:
        print(f"\nTime to first token, batch 1, random prompts, median of {args.repeats} (ms)\n")
        print("| prompt tokens | " + " | ".join(names) + " | "
              + " | ".join(f"{b} / {a}" for a, b in ratios) + " |")
        print("|---" * (1 + len(names) + len(ratios)) + "|")
        for length, med in prefill.items():
            print(f"| {length} | " + " | ".join(f"{med[x] * 1e3:.0f}" for x in names) + " | "
                  + " | ".join(f"{med[b] / med[a]:.2f}x" for a, b in ratios) + " |")


if __name__ == "__main__":
    main()
