"""Time to first token and decode tokens/s of a one-image chat request: day0jax against transformers.

    .venv/bin/python bench/multimodal.py [--repeats 3] [--new-tokens 64] [--prompt-tokens 32]

The model: a random-weight LLaVA, SigLIP-base tower (224 pixels, 16-pixel patches: 196 image tokens) over a
SmolLM2-135M-sized Llama, float32 on the CPU, written once by transformers (bench/multimodal_hf.py make, seed 0) into
~/.cache/day0jax/bench/ and converted there by day0jax's converter; both reused when present. The request: a random
uint8 480x640 image, its 196 placeholder tokens after a few text tokens and before the rest (--prompt-tokens text
tokens in all, random ids), then N greedy new tokens, EOS ignored. Each round has a new image and new text, the same
for both systems (no prefix cache helps either).

Each system is a worker process that stays loaded: this script with --worker for day0jax (the engine driven
directly, step by step, as `Model.generate` does), bench/multimodal_hf.py serve in .venv-ref for transformers
(`generate` with a streamer, torch threads = CPU count); they take turns, round by round in a rotating order, after
a warm-up round of the same shapes. TTFT: from the raw image (preprocessing, image encoding, prefill) to the first
new token; decode rate = (N - 1) / (time of the N-th token - time of the first). Prints the best of the rounds,
the ratios, where TTFT goes (preprocessing and the vision tower + projector timed on their own), and how many greedy
tokens the two systems agree on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.decode import Worker  # noqa: E402

HEIGHT, WIDTH = 480, 640
BEFORE = 4  # text tokens before the image (a chat template's role header); the rest follow it


def worker(ckpt: str) -> None:
    """The day0jax side: one request at a time through the engine, with the protocol of bench/multimodal_hf.py."""
    reply = os.fdopen(os.dup(1), "w")  # the protocol owns the real stdout; library output goes to stderr
    os.dup2(2, 1)
    import numpy as np

    import day0jax
    from day0jax.engine.requests import SamplingParams

    model = day0jax.load(ckpt, dtype="float32")
    engine = model.engine
    print(json.dumps({"ready": True, "image_token_id": model.vision.image_token_id,
                      "tokens_per_image": model.vision.tokens_per_image}), file=reply, flush=True)
    for i, line in enumerate(sys.stdin):
        cmd = json.loads(line)
        image, prompt, n = np.load(cmd["image"]), cmd["prompt"], cmd["new_tokens"]
        if cmd.get("warmup"):  # compiles every program these shapes take, and the tower alone
            model.generate([prompt], n, ignore_eos=True, images=[[image]])
            model.images.encode(model.images.inputs([image]))
        rid, times, tokens, cached, done = f"bench-{i}", [], [], 0, False
        t0 = time.perf_counter()
        inputs = model.images.inputs([image])
        preprocess = time.perf_counter() - t0
        engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), images=inputs)
        while not done:
            for event in engine.step():
                if event.request_id == rid:
                    if event.token is not None:
                        times.append(time.perf_counter())
                        tokens.append(event.token)
                        cached = max(cached, event.num_cached_tokens)
                    done = done or event.finish_reason is not None
        while engine.has_work():
            engine.step()
        fresh = model.images.inputs([image])
        t1 = time.perf_counter()
        model.images.encode(fresh)
        encode = time.perf_counter() - t1
        print(json.dumps({"ttft": times[0] - t0, "last": times[-1] - t0, "preprocess": preprocess, "encode": encode,
                          "tokens": tokens, "cached": cached}), file=reply, flush=True)


def checkpoints() -> tuple[Path, Path]:
    """The Hugging Face folder and the day0jax checkpoint of the benchmark's model, made on first use."""
    from day0jax.core.paths import cache_root

    root = cache_root() / "bench"
    hf, ours = root / "llava-siglip-smollm2-hf", root / "llava-siglip-smollm2"
    if not (hf / "preprocessor_config.json").is_file():
        print(f"writing the random LLaVA into {hf}", file=sys.stderr, flush=True)
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(ROOT / ".venv-ref/bin/python"), "-P", str(ROOT / "bench/multimodal_hf.py"), "make",
                        str(hf)], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if not (ours / "preprocessor_config.json").is_file():
        from convert import convert_checkpoint

        print(convert_checkpoint(hf, ours, progress=True), file=sys.stderr)
    return hf, ours


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return f"unknown CPU, {os.cpu_count()} cores"


def agreement(a: list[int], b: list[int]) -> tuple[int, int]:
    """(positions where the two token lists agree, the length of their common prefix)."""
    same = [x == y for x, y in zip(a, b)]
    return sum(same), next((i for i, s in enumerate(same) if not s), len(same))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32, help="text tokens around the image's placeholders")
    ap.add_argument("--worker", metavar="CKPT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    import numpy as np

    hf, ours = checkpoints()
    load = os.getloadavg()[0]
    workers = {"day0jax": Worker([str(ROOT / ".venv/bin/python"), "-P", str(Path(__file__).resolve()),
                                  "--worker", str(ours)], {"PYTHONPATH": str(ROOT)}),
               "transformers": Worker([str(ROOT / ".venv-ref/bin/python"), "-P",
                                       str(ROOT / "bench/multimodal_hf.py"), "serve", str(hf)],
                                      {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})}
    image_token, per_image = workers["day0jax"].hello["image_token_id"], workers["day0jax"].hello["tokens_per_image"]
    n, rng = args.new_tokens, np.random.default_rng(0)
    results: dict[str, list[dict]] = {name: [] for name in workers}
    agree = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats + 1):  # round 0 warms up (compiles) and is not counted
            path = os.path.join(tmp, f"image{repeat}.npy")
            np.save(path, rng.integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8))
            text = [int(t) for t in rng.integers(3, 49000, args.prompt_tokens)]
            prompt = text[:BEFORE] + [image_token] * per_image + text[BEFORE:]
            assert image_token not in text
            cmd = {"image": path, "prompt": prompt, "new_tokens": n, "warmup": repeat == 0}
            # The order rotates: with a fixed one, identical code measured apart by its place in the turn.
            order = list(workers)[repeat % len(workers):] + list(workers)[:repeat % len(workers)]
            tokens = {}
            for name in order:
                r = workers[name].ask(cmd)
                # The warm-up's timed request follows its generate of the same prompt: only that one may hit the cache.
                assert len(r["tokens"]) == n and (not repeat or not r.get("cached")), (name, r.get("cached"))
                tokens[name] = r["tokens"]
                if repeat:
                    results[name].append(r)
            if repeat:
                agree.append(agreement(tokens["day0jax"], tokens["transformers"]))
    for w in workers.values():
        w.close()

    best = {name: dict(ttft=min(r["ttft"] for r in rs), rate=max((n - 1) / (r["last"] - r["ttft"]) for r in rs),
                       preprocess=min(r["preprocess"] for r in rs), encode=min(r["encode"] for r in rs))
            for name, rs in results.items()}
    d, t = best["day0jax"], best["transformers"]
    print(f"\nOne-image chat request: LLaVA (SigLIP-base 224/16 over a SmolLM2-135M-sized Llama, random weights), "
          f"float32, {args.prompt_tokens} text + {per_image} image tokens, {n} greedy new tokens, best of "
          f"{args.repeats}\nCPU: {cpu_model()}; load average {load:.1f} before, {os.getloadavg()[0]:.1f} after\n")
    print("| system | TTFT (ms) | decode (tokens/s) |\n|---|---:|---:|")
    for name, b in best.items():
        print(f"| {name} | {b['ttft'] * 1e3:.0f} | {b['rate']:.1f} |")
    print(f"| day0jax / transformers | {t['ttft'] / d['ttft']:.2f}x faster | {d['rate'] / t['rate']:.2f}x |")
    print("\nWhere TTFT goes (ms, best of the rounds; the rest is the language model's prefill and the first token)\n")
    print("| system | preprocessing | vision tower + projector | rest |\n|---|---:|---:|---:|")
    for name, b in best.items():
        rest = b["ttft"] - b["preprocess"] - b["encode"]
        print(f"| {name} | {b['preprocess'] * 1e3:.0f} | {b['encode'] * 1e3:.0f} | {rest * 1e3:.0f} |")
    print(f"\nGreedy tokens equal between the systems, per round (of {n}): "
          + ", ".join(f"{same} (first {prefix} identical)" for same, prefix in agree))


if __name__ == "__main__":
    main()
