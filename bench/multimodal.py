"""Time to first token and decode tokens/s of a one-image chat request, day0jax against transformers, for three
vision-language families; and the vision tower's achieved FLOP/s against this machine's float32 matmul peak.

    .venv/bin/python bench/multimodal.py [--models llava,kimi_k25,mistral3] [--repeats 3] [--new-tokens 64]
                                         [--prompt-tokens 32] [--peak-size 4096]

The models (bench/multimodal_hf.py `MODELS`: one description each, the config transformers builds, its image
processor's config, the image's size and how its placeholders look), random weights, float32 on the CPU:
- llava: LLaVA, SigLIP-base tower (224 pixels, 16-pixel patches: 196 image tokens) over a SmolLM2-135M-shaped Llama;
- kimi_k25: Kimi K2.5, MoonViT at its published widths (1152, 16 heads, MLP 4304, 14-pixel patches, 2x2 merge),
  2 layers, over a small DeepSeek-V3 MoE (576 wide, 8 layers);
- mistral3: Mistral Small 3.1, Pixtral at its published widths (1024, 16 heads, gated MLP 4096, 14-pixel patches,
  2x2 merge), 2 layers, over an 8-layer SmolLM2-135M-shaped Mistral.
Each is written once by transformers (bench/multimodal_hf.py make, seed 0) into ~/.cache/day0jax/bench/ and
converted there by day0jax's converter; both reused when present. The request: a random uint8 480x640 image, which
each family's own processor resizes (LLaVA: 224 square; Kimi K2.5 and Pixtral: its own size, padded to 28-pixel
multiples, 36 x 46 patches), its placeholder tokens (with the family's start, end and row-break tokens) after a few
text tokens and before the rest (--prompt-tokens text tokens in all, random ids), then N greedy new tokens, EOS
ignored. Each round has a new image and new text, the same for both systems (no prefix cache helps either).

Each system is a worker process that stays loaded: this script with --worker for day0jax (the engine driven
directly, step by step, as `Model.generate` does), bench/multimodal_hf.py serve in .venv-ref for transformers
(`generate` with a streamer, torch threads = CPU count); they take turns, round by round in a rotating order, after
a warm-up round of the same shapes. TTFT: from the raw image (preprocessing, image encoding, prefill) to the first
new token; decode rate = (N - 1) / (time of the N-th token - time of the first). Prints, per model, the best of the
rounds and the ratios, where TTFT goes (preprocessing and the vision tower + projector timed on their own), how many
greedy tokens the two systems agree on, and the tower's matrix products (`tower_flops`, counted for the image's own
patches) over each system's best encode time, as GFLOP/s and as a fraction of the float32 matmul peak measured in
the run (bench/cpu_ceilings.py's `matmul_gflops`: a jitted --peak-size cube, best of 5, measured before each model
and at the end, the best of those taken: a shared machine's busy moments understate it): where both
systems run at the peak, their ratio says nothing, the fraction does. day0jax runs an image of its own size padded
to a bucket of patches (one compiled program per bucket): its products on the padding are shown apart.
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
from bench.cpu_ceilings import cpu_name, matmul_gflops  # noqa: E402
from bench.decode import Worker  # noqa: E402
from bench.multimodal_hf import MODELS, BenchModel  # noqa: E402

BEFORE = 4  # text tokens before the image (a chat template's role header); the rest follow it
TEXT_IDS = (3, 49000)  # random text ids: below every special id of the models (bench/multimodal_hf.py)


def worker(ckpt: str) -> None:
    """The day0jax side: one request at a time through the engine, with the protocol of bench/multimodal_hf.py,
    plus "padded": the patches the tower ran (its program's bucket; None for towers of one image size)."""
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
        # Another image of the same size: the engine's feature cache holds the request's own image's features.
        fresh = model.images.inputs([255 - image])
        t1 = time.perf_counter()
        model.images.encode(fresh)
        encode = time.perf_counter() - t1
        key = model.images.spec.encoder_calls(fresh.pixels, fresh.grids)[0][0]
        print(json.dumps({"ttft": times[0] - t0, "last": times[-1] - t0, "preprocess": preprocess, "encode": encode,
                          "tokens": tokens, "cached": cached, "padded": key[0] if key else None}),
              file=reply, flush=True)


def checkpoints(name: str) -> tuple[Path, Path]:
    """The Hugging Face folder and the day0jax checkpoint of the benchmark's model `name`, made on first use."""
    from day0jax.core.paths import cache_root

    root = cache_root() / "bench"
    ours = root / MODELS[name].folder
    hf = ours.with_name(ours.name + "-hf")
    if not (hf / "preprocessor_config.json").is_file():
        print(f"writing the random {name} model into {hf}", file=sys.stderr, flush=True)
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(ROOT / ".venv-ref/bin/python"), "-P", str(ROOT / "bench/multimodal_hf.py"), "make",
                        name, str(hf)], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if not (ours / "preprocessor_config.json").is_file():
        from convert import convert_checkpoint

        print(convert_checkpoint(hf, ours, progress=True), file=sys.stderr)
    return hf, ours


def placeholders(desc: BenchModel, grid: tuple | None, per_image: int | None, image_token: int) -> list[int]:
    """An image's placeholder tokens: `per_image` of them (towers of one image size), else one per merge block of
    its grid, row by row ended by `row_end` where the family lays them out so (Pixtral), within `around`."""
    before, after = (list(ids) for ids in desc.around)
    if grid is None:
        return before + [image_token] * per_image + after
    t, h, w = grid
    rows, cols = t * h // desc.merge, w // desc.merge
    body = [image_token] * (rows * cols) if desc.row_end is None else \
        (([image_token] * cols + [desc.row_end]) * rows)[:-1]  # the last row's end is `around`'s
    return before + body + after


def tower_patches(desc: BenchModel, grid: tuple | None) -> int:
    """The patches the tower itself runs for an image of processor grid `grid` (None: a tower of one image size)."""
    v = desc.config["vision_config"]
    if grid is None:
        return (v["image_size"] // v["patch_size"]) ** 2
    tokens = grid[0] * grid[1] * grid[2] // desc.merge ** 2
    return tokens * merge_of(desc) ** 2


def merge_of(desc: BenchModel) -> int:
    """Tower patches per side of one image token (1: every patch is a token)."""
    c = desc.config
    return c.get("spatial_merge_size") or c["vision_config"].get("merge_kernel_size", [1])[0]


def tower_flops(desc: BenchModel, patches: int) -> dict[str, float]:
    """FLOPs of the vision tower's and projector's matrix products for one image of `patches` tower patches, by
    part. Each product of an [m, k] by a [k, n] matrix counts 2*m*n*k; with P patches, D the tower's width, F its
    MLP's, L its layers, p the patch side, M = P / merge^2 image tokens and Dt the language model's width:
      patch embedding   2 * P * (3 p^2) * D              (the patch convolution as one product)
      q, k, v, o        L * 4 * 2 * P * D * D
      attention         L * 2 * (2 * P * P * D)          (QK^T and PV over all heads: N * head_dim = D)
      MLP               L * g * 2 * P * D * F            (g products: 2, or 3 for a gated MLP, Pixtral's)
      projector         LLaVA: 2 P D Dt + 2 P Dt Dt (linear_1, linear_2);
                        Kimi K2.5: 2 M (4D)(4D) + 2 M (4D) Dt (in_proj, out_proj over each 2x2 block, 4D wide);
                        Mistral 3: 2 M (4D) D + 2 M D Dt + 2 M Dt Dt (patch merger, linear_1, linear_2).
    Norms, activations, the rotary, softmax and gathers are left out (a few percent of the time, none of it
    matrix products)."""
    v, Dt = desc.config["vision_config"], desc.config["text_config"]["hidden_size"]
    P, D, F, L, p = patches, v["hidden_size"], v["intermediate_size"], v["num_hidden_layers"], v["patch_size"]
    M, gated = P // merge_of(desc) ** 2, 3 if desc.family == "mistral3" else 2
    projector = {"llava": 2 * P * D * Dt + 2 * P * Dt * Dt,
                 "kimi_k25": 2 * M * (4 * D) ** 2 + 2 * M * 4 * D * Dt,
                 "mistral3": 2 * M * 4 * D * D + 2 * M * D * Dt + 2 * M * Dt * Dt}[desc.family]
    return {"patch embedding": 2 * P * 3 * p * p * D, "q, k, v, o": L * 8 * P * D * D,
            "attention": L * 4 * P * P * D, "MLP": L * gated * 2 * P * D * F, "projector": projector}


def agreement(a: list[int], b: list[int]) -> tuple[int, int]:
    """(positions where the two token lists agree, the length of their common prefix)."""
    same = [x == y for x, y in zip(a, b)]
    return sum(same), next((i for i, s in enumerate(same) if not s), len(same))


def run_model(name: str, args, peaks: list[float]) -> dict[str, dict]:
    """Runs one model's rounds and prints its tables (fractions of the best matmul peak measured so far, `peaks`);
    returns each system's best figures."""
    peak = max(peaks)
    import numpy as np

    from day0jax.vision.processors import image_processor

    desc = MODELS[name]
    hf, ours = checkpoints(name)
    processor = image_processor(ours)
    workers = {"day0jax": Worker([str(ROOT / ".venv/bin/python"), "-P", str(Path(__file__).resolve()),
                                  "--worker", str(ours)], {"PYTHONPATH": str(ROOT)}),
               "transformers": Worker([str(ROOT / ".venv-ref/bin/python"), "-P",
                                       str(ROOT / "bench/multimodal_hf.py"), "serve", name, str(hf)],
                                      {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})}
    image_token, per_image = workers["day0jax"].hello["image_token_id"], workers["day0jax"].hello["tokens_per_image"]
    n, rng = args.new_tokens, np.random.default_rng(0)
    results: dict[str, list[dict]] = {w: [] for w in workers}
    agree = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats + 1):  # round 0 warms up (compiles) and is not counted
            path = os.path.join(tmp, f"image{repeat}.npy")
            image = rng.integers(0, 256, (*desc.image, 3), dtype=np.uint8)
            np.save(path, image)
            grid = processor.preprocess(image).grid_thw
            text = [int(t) for t in rng.integers(*TEXT_IDS, args.prompt_tokens)]
            image_ids = placeholders(desc, grid, per_image, image_token)
            prompt = text[:BEFORE] + image_ids + text[BEFORE:]
            cmd = {"image": path, "prompt": prompt, "new_tokens": n, "warmup": repeat == 0}
            # The order rotates: with a fixed one, identical code measured apart by its place in the turn.
            order = list(workers)[repeat % len(workers):] + list(workers)[:repeat % len(workers)]
            tokens = {}
            for w in order:
                r = workers[w].ask(cmd)
                # The warm-up's timed request follows its generate of the same prompt: only that one may hit the cache.
                assert len(r["tokens"]) == n and (not repeat or not r.get("cached")), (w, r.get("cached"))
                tokens[w] = r["tokens"]
                if repeat:
                    results[w].append(dict(r, grid=grid))
            if repeat:
                agree.append(agreement(tokens["day0jax"], tokens["transformers"]))
    for w in workers.values():
        w.close()

    best = {w: dict(ttft=min(r["ttft"] for r in rs), rate=max((n - 1) / (r["last"] - r["ttft"]) for r in rs),
                    preprocess=min(r["preprocess"] for r in rs), encode=min(r["encode"] for r in rs))
            for w, rs in results.items()}
    d, t = best["day0jax"], best["transformers"]
    grid, padded = results["day0jax"][0]["grid"], results["day0jax"][0]["padded"]
    image_tokens = image_ids.count(image_token)
    print(f"\n## {name}: {desc.summary}\n\nfloat32, a {desc.image[0]}x{desc.image[1]} image ({image_tokens} image "
          f"tokens, {len(prompt)} prompt tokens in all with {args.prompt_tokens} of text), {n} greedy new tokens, "
          f"best of {args.repeats}; load average {os.getloadavg()[0]:.1f} at the end\n")
    print("| system | TTFT (ms) | decode (tokens/s) |\n|---|---:|---:|")
    for w, b in best.items():
        print(f"| {w} | {b['ttft'] * 1e3:.0f} | {b['rate']:.1f} |")
    print(f"| day0jax / transformers | {t['ttft'] / d['ttft']:.2f}x faster | {d['rate'] / t['rate']:.2f}x |")
    print("\nWhere TTFT goes (ms, best of the rounds; the rest is the language model's prefill and the first token)\n")
    print("| system | preprocessing | vision tower + projector | rest |\n|---|---:|---:|---:|")
    for w, b in best.items():
        rest = b["ttft"] - b["preprocess"] - b["encode"]
        print(f"| {w} | {b['preprocess'] * 1e3:.0f} | {b['encode'] * 1e3:.0f} | {rest * 1e3:.0f} |")
    print(f"\nGreedy tokens equal between the systems, per round (of {n}): "
          + ", ".join(f"{same} (first {prefix} identical)" for same, prefix in agree))

    patches = tower_patches(desc, grid)
    parts = tower_flops(desc, patches)
    flops = sum(parts.values())
    print(f"\nVision tower + projector products: {flops / 1e9:.1f} GFLOP for the image's {patches} patches ("
          + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in parts.items())
          + f"); float32 matmul peak so far {peak:.0f} GFLOP/s\n")
    print("| system | encode (ms) | GFLOP/s | fraction of peak |\n|---|---:|---:|---:|")
    for w, b in best.items():
        rate = flops / b["encode"] / 1e9
        print(f"| {w} | {b['encode'] * 1e3:.0f} | {rate:.0f} | {rate / peak:.0%} |")
    if padded and padded != patches:
        run = sum(tower_flops(desc, padded).values())
        rate = run / d["encode"] / 1e9
        print(f"\nday0jax runs this image padded to its {padded}-patch bucket: {run / 1e9:.1f} GFLOP of products, "
              f"{rate:.0f} GFLOP/s executed ({rate / peak:.0%} of peak)")
    return dict(best, flops=flops)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32, help="text tokens around the image's placeholders")
    ap.add_argument("--peak-size", type=int, default=4096, help="side of the float32 matmul that measures the peak")
    ap.add_argument("--worker", metavar="CKPT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown or not names:
        ap.error(f"--models {args.models!r}: unknown {', '.join(unknown) or 'empty list'}; "
                 f"choose from {', '.join(MODELS)}")
    for name in names:  # every checkpoint first, so that their writing stays out of the timed part
        checkpoints(name)
    load = os.getloadavg()[0]
    print(f"# One-image chat requests, day0jax against transformers\n\nCPU: {cpu_name()}, {os.cpu_count()} cores; "
          f"load average {load:.1f} at the start")
    # The peak is measured before each model and at the end, the best taken: on a shared machine one measurement
    # can land on a busy moment and understate it.
    peaks, best = [], {}
    for name in names:
        peaks.append(matmul_gflops(args.peak_size, 25))  # best of 5 (cpu_ceilings takes repeats // 5)
        best[name] = run_model(name, args, peaks)
    peaks.append(matmul_gflops(args.peak_size, 25))
    peak = max(peaks)
    print(f"\nfloat32 matmul peak ({args.peak_size}^3 under jax, best of 5, before each model and at the end): "
          + ", ".join(f"{p:.0f}" for p in peaks) + f" GFLOP/s; the fractions below take the best, {peak:.0f}")
    print(f"\n## All models (best of {args.repeats}; load average {os.getloadavg()[0]:.1f} at the end)\n")
    print("| model | system | TTFT (ms) | decode (tokens/s) | tower GFLOP/s | of peak |\n|---|---|---:|---:|---:|---:|")
    for name, b in best.items():
        for w in ("day0jax", "transformers"):
            rate = b["flops"] / b[w]["encode"] / 1e9
            print(f"| {name} | {w} | {b[w]['ttft'] * 1e3:.0f} | {b[w]['rate']:.1f} | {rate:.0f} | {rate / peak:.0%} |")
        d, t = b["day0jax"], b["transformers"]
        print(f"| {name} | day0jax / transformers | {t['ttft'] / d['ttft']:.2f}x faster | {d['rate'] / t['rate']:.2f}x "
              f"| {t['encode'] / d['encode']:.2f}x | |")


if __name__ == "__main__":
    main()
