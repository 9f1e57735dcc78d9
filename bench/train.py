"""LoRA fine-tuning of SmolLM2-135M in float32, day0jax against transformers + PEFT on the same batches: steady-state
tokens/s, peak resident memory and the loss after the last step.

    .venv/bin/python bench/train.py [--steps 100] [--warmup-steps 3] [--batch-size 4] [--seq-len 512] [--repeats 5]

The weights: the default model's Q4_1 GGUF, dequantized to float32 on both sides (day0jax: converted once into the
bench cache with `--dequantize`; transformers: `from_pretrained(..., gguf_file=...)`, which dequantizes the same
blocks). The adapters: rank 8, alpha 16 on q, k, v, o, gate, up and down projections; day0jax's `apply_lora` draws
them (A Kaiming-uniform, B zero, as PEFT does), `save_adapter` writes them and PEFT loads that folder
(`PeftModel.from_pretrained(..., is_trainable=True)`), so both start from the same adapters. AdamW, lr 1e-4, no
weight decay. The data: generated arithmetic sentences ("What is 12 plus 7? 12 plus 7 is 19.") tokenized once and
cut into --steps batches of --batch-size rows of --seq-len tokens, every next-token target counting; step i trains
on batch i on both sides. Both sides' loss on batch 0 before training is printed and must agree (the same float32
weights: the difference is summation order only).

Each system is a worker process that stays loaded (this script with --worker: `day0jax.train.train` fed by a batch
stream that times each step; bench/train_reference.py in .venv-ref: a PyTorch loop, torch threads = CPU count, as
many as XLA uses). The first --warmup-steps steps (compilation, allocator warm-up) are not timed; the rest run in
--repeats rounds, the systems taking turns in a rotating order. Tokens/s = batch * seq-len / the median step time;
peak memory = the worker's peak resident set (VmHWM: load, compilation and training; each system its own process);
the losses compared are those of the last step, after the same --steps updates from the same start.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.decode import Worker, float32_checkpoint  # noqa: E402
from bench.cpu_ceilings import cpu_name  # noqa: E402
from bench.long_context_worker import peak_mib  # noqa: E402

LEARNING_RATE = 1e-4
RANK, ALPHA = 8, 16.0
# The same float32 weights and data, summed in other orders: 7.0e-6 relative measured on batch 0 at 4 x 512, 5.9e-6 at
# 4 x 64.
INITIAL_LOSS_RTOL = 1e-4


def make_batches(ckpt: Path, steps: int, batch: int, seq_len: int) -> np.ndarray:
    """int32 [steps, batch, seq_len]: one stream of tokenized arithmetic sentences (seeded), cut into rows."""
    from day0jax.weights.tokenizer import Tokenizer

    tokenizer, rng = Tokenizer(ckpt), random.Random(0)
    ops = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}
    need, ids = steps * batch * seq_len, []
    while len(ids) < need:
        lines = []
        for _ in range(200):
            a, b, op = rng.randint(1, 99), rng.randint(1, 99), rng.choice(list(ops))
            lines.append(f"What is {a} {op} {b}? {a} {op} {b} is {ops[op](a, b)}.\n")
        ids += tokenizer.encode("".join(lines), add_special_tokens=False)
    return np.asarray(ids[:need], np.int32).reshape(steps, batch, seq_len)


def worker(ckpt: str, tokens_path: str, adapter: str) -> None:
    """The day0jax side: loads the checkpoint, applies and saves the initial adapters, then trains through
    `day0jax.train.train`, one JSON command line ({"steps": n}) at a time, answering each with the seconds of its
    steps (the last answer also with every step's loss and the peak resident MiB)."""
    reply = os.fdopen(os.dup(1), "w")  # the protocol owns the real stdout; library output goes to stderr
    os.dup2(2, 1)
    import day0jax
    from day0jax.train import Example, LoRAConfig, TrainConfig, apply_lora, collate, evaluate, save_adapter, train

    batches = [collate([Example(tuple(row.tolist())) for row in b]) for b in np.load(tokens_path)]
    # In float32, as `python -m day0jax.train --dtype float32` loads it and as the torch side trains.
    model = day0jax.load(ckpt, dtype="float32", kernels="reference")
    adapters = apply_lora(model.module, LoRAConfig(rank=RANK, alpha=ALPHA), seed=0)
    save_adapter(model.module, adapters, adapter, base_model=ckpt)
    trainable = sum(m.lora_a.size + m.lora_b.size for m in adapters.modules(model.module).values())
    print(json.dumps({"ready": True, "initial_loss": evaluate(model.module, batches[:1]), "trainable": trainable}),
          file=reply, flush=True)

    seconds: list[float] = []
    started = [0.0]

    def answer(**extra) -> None:
        print(json.dumps({"seconds": seconds, **extra}), file=reply, flush=True)

    def stream():
        """The batches, each pulled when the trainer starts a step (its previous step then done: `train` reads
        every step's loss back), so the time between pulls is one step, host work included."""
        left = 0
        for batch in batches:
            if started[0]:
                seconds.append(time.perf_counter() - started[0])
            if not left:  # between commands: answer the last one, wait for the next, off the clock
                if seconds:
                    answer()
                    seconds.clear()
                left = json.loads(sys.stdin.readline())["steps"]
            left -= 1
            started[0] = time.perf_counter()
            yield batch

    config = TrainConfig(iters=len(batches), learning_rate=LEARNING_RATE, optimizer="adamw", weight_decay=0.0,
                         steps_per_report=len(batches), dtype="float32")
    result = train(model.module, stream(), config, report=lambda line: None)
    seconds.append(time.perf_counter() - started[0])
    answer(losses=result.losses, peak_mib=peak_mib())
    sys.stdin.readline()  # the parent closes stdin when done


def run_bench(args: argparse.Namespace) -> None:
    from day0jax.core.paths import cache_root
    from day0jax.default_model import default_gguf

    if args.steps < 2 or args.warmup_steps < 1 or args.repeats < 1 or args.batch_size < 1 or args.seq_len < 2:
        raise SystemExit("--steps must be at least 2, --seq-len 2, --warmup-steps, --repeats and --batch-size 1")
    if args.warmup_steps >= args.steps:
        print(f"--steps {args.steps}: warm-up reduced to {args.steps - 1} step(s), one step timed", flush=True)
        args.warmup_steps = args.steps - 1
    timed = args.steps - args.warmup_steps
    args.repeats = min(args.repeats, timed)  # a round runs one step or more
    ckpt = float32_checkpoint()
    work = cache_root() / "bench" / "train"
    work.mkdir(parents=True, exist_ok=True)
    tokens_path, adapter = work / "tokens.npy", work / "initial-adapter"
    np.save(tokens_path, make_batches(ckpt, args.steps, args.batch_size, args.seq_len))

    workers = {"day0jax": Worker([str(ROOT / ".venv/bin/python"), "-P", str(Path(__file__).resolve()), "--worker",
                                  str(ckpt), str(tokens_path), str(adapter)], {"PYTHONPATH": str(ROOT)})}
    # Started after day0jax's worker has written the initial adapter it loads.
    workers["transformers + PEFT"] = Worker(
        [str(ROOT / ".venv-ref/bin/python"), "-P", str(ROOT / "bench/train_reference.py"), str(default_gguf()),
         str(tokens_path), str(adapter), str(LEARNING_RATE)],
        {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT)})
    names = list(workers)
    initial = {name: w.hello["initial_loss"] for name, w in workers.items()}
    trainable = {name: w.hello["trainable"] for name, w in workers.items()}
    rel = abs(initial["day0jax"] - initial[names[1]]) / abs(initial[names[1]])
    print(f"initial loss on batch 0: day0jax {initial['day0jax']:.7f}, transformers {initial[names[1]]:.7f} "
          f"({rel:.1e} relative); trainable parameters {trainable}", flush=True)
    if rel > INITIAL_LOSS_RTOL or len(set(trainable.values())) != 1:
        raise SystemExit("the two systems do not start from the same model and adapters")

    t0 = time.perf_counter()
    for w in workers.values():
        w.ask({"steps": args.warmup_steps})
    print(f"warm-up ({args.warmup_steps} steps each) {time.perf_counter() - t0:.0f} s", flush=True)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    final: dict[str, dict] = {}
    for r, n in enumerate(len(chunk) for chunk in np.array_split(np.arange(timed), args.repeats)):
        for name in names[r % len(names):] + names[:r % len(names)]:  # a fixed order favours one place in the turn
            answer = workers[name].ask({"steps": int(n)})
            seconds[name] += answer["seconds"]
            if "losses" in answer:
                final[name] = answer
        print(f"round {r + 1}/{args.repeats}: " + ", ".join(
            f"{name} {statistics.median(seconds[name][-n:]):.2f} s/step" for name in names), flush=True)
    for w in workers.values():
        w.close()

    tokens = args.batch_size * args.seq_len
    rate = {name: tokens / statistics.median(seconds[name]) for name in names}
    peak = {name: final[name]["peak_mib"] for name in names}
    loss = {name: final[name]["losses"][-1] for name in names}
    ours, ref = names
    print(f"\nLoRA fine-tuning, SmolLM2-135M float32, batch {args.batch_size} x {args.seq_len} tokens, {args.steps} "
          f"steps ({args.warmup_steps} warm-up, {timed} timed, median), {cpu_name()}, {os.cpu_count()} cores\n")
    print(f"| system | tokens/s | peak RSS (MiB) | loss after step {args.steps} |")
    print("|---|---:|---:|---:|")
    for name in names:
        print(f"| {name} | {rate[name]:.1f} | {peak[name]:.0f} | {loss[name]:.4f} |")
    print(f"| day0jax / transformers | {rate[ours] / rate[ref]:.2f}x | {peak[ours] / peak[ref]:.2f}x | "
          f"{100 * (loss[ours] - loss[ref]) / loss[ref]:+.2f}% |")
    every = max(1, args.steps // 10)
    print("\nloss by step: " + "; ".join(
        f"{i + 1}: " + " / ".join(f"{final[name]['losses'][i]:.4f}" for name in names)
        for i in list(range(0, args.steps, every)) + ([args.steps - 1] if (args.steps - 1) % every else [])))


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps on each side, warm-up included")
    ap.add_argument("--warmup-steps", type=int, default=3,
                    help="the first steps, not timed (compilation; PyTorch's first steps are slow too)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5,
                    help="rounds the timed steps are split into, taking turns (at most one per timed step)")
    ap.add_argument("--worker", nargs=3, metavar=("CKPT", "TOKENS", "ADAPTER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker)
    else:
        run_bench(args)


if __name__ == "__main__":
    main()
