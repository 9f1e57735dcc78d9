"""Converter throughput and memory on a synthetic multi-GB checkpoint, next to a plain sequential read.

    .venv/bin/python bench/convert.py [--gb 4] [--repeats 3] [--workdir /tmp/day0jax-bench-convert]

Writes a Llama-shaped Hugging Face folder of random bf16 tensors (~1 GB shards with an index, ~200 MB a layer),
then per repeat: a sequential read of the shards (page cache dropped where the OS allows, else warm for both), a
sequential 1 GB write ending in fdatasync (the converter syncs its output before the final rename), and a
conversion in a child process (peak RSS from os.wait4's rusage). Prints medians: MB/s of all three, convert/read
(goal >= 0.5), convert/write, and the converter's peak RSS (goal < 1.5 GB).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def make_source(folder: Path, gb: float) -> None:
    """A Llama config with 4096-wide layers, enough of them for `gb` gigabytes of bf16, in ~1 GB shards."""
    from safetensors.numpy import save_file

    D, F, V, N, K = 4096, 11008, 32000, 32, 8
    per_layer = 2 * (2 * D * D + 2 * D * (D // N) * K + 3 * D * F + 2 * D)  # bytes of one bf16 layer
    layers = max(1, math.ceil((gb * 1e9 - 2 * 2 * V * D) / per_layer))
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": V, "hidden_size": D,
              "intermediate_size": F, "num_hidden_layers": layers, "num_attention_heads": N,
              "num_key_value_heads": K, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)

    def rand(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    shards, current, size, weight_map = [], {}, 0, {}

    def flush():
        nonlocal current, size
        if current:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(current, str(folder / name))
            weight_map.update({k: name for k in current})
            shards.append(name)
            current, size = {}, 0

    def add(name, array):
        nonlocal size
        current[name] = array
        size += array.nbytes
        if size >= 1e9:
            flush()

    add("model.embed_tokens.weight", rand(V, D))
    for i in range(layers):
        p = f"model.layers.{i}."
        add(p + "input_layernorm.weight", np.ones(D, ml_dtypes.bfloat16))
        add(p + "post_attention_layernorm.weight", np.ones(D, ml_dtypes.bfloat16))
        add(p + "self_attn.q_proj.weight", rand(D, D))
        add(p + "self_attn.k_proj.weight", rand(K * D // N, D))
        add(p + "self_attn.v_proj.weight", rand(K * D // N, D))
        add(p + "self_attn.o_proj.weight", rand(D, D))
        add(p + "mlp.gate_proj.weight", rand(F, D))
        add(p + "mlp.up_proj.weight", rand(F, D))
        add(p + "mlp.down_proj.weight", rand(D, F))
    add("model.norm.weight", np.ones(D, ml_dtypes.bfloat16))
    add("lm_head.weight", rand(V, D))
    flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def sequential_read(folder: Path) -> tuple[float, int]:
    total, t0 = 0, time.perf_counter()
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(64 << 20):
                total += len(chunk)
    return time.perf_counter() - t0, total


def sequential_write(folder: Path, nbytes: int = 1 << 30) -> float:
    """MB/s of writing `nbytes` in 64 MB blocks and syncing them to the disk."""
    block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
    path = folder / "write-test.bin"
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(nbytes // len(block)):
            f.write(block)
        os.fdatasync(f.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return nbytes / 1e6 / seconds


def convert_child(src: Path, dst: Path) -> tuple[float, int, str]:
    """Seconds, peak RSS (bytes) and the summary line (with where the time went) of `python -m convert src dst` in a
    child process."""
    shutil.rmtree(dst, ignore_errors=True)
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "convert", "--quiet", str(src), str(dst)], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
    summary = child.stdout.read().strip()  # the one line it prints at the end
    _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage, not the max over all children
    seconds = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"conversion failed with status {os.waitstatus_to_exitcode(status)}")
    return seconds, usage.ru_maxrss * 1024, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/day0jax-bench-convert"))
    args = ap.parse_args()
    src, dst = args.workdir / "src", args.workdir / "dst"
    if not (src / "model.safetensors.index.json").is_file():
        shutil.rmtree(src, ignore_errors=True)
        print(f"writing a {args.gb:.1f} GB synthetic checkpoint into {src} ...", flush=True)
        make_source(src, args.gb)
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    cold = drop_caches()
    reads, writes, converts, peaks = [], [], [], []
    for _ in range(args.repeats):
        drop_caches()
        seconds, total = sequential_read(src)
        reads.append(total / 1e6 / seconds)
        writes.append(sequential_write(args.workdir))
        drop_caches()
        seconds, peak, _ = convert_child(src, dst)
        converts.append(size / 1e6 / seconds)
        peaks.append(peak)
    read, write, conv = statistics.median(reads), statistics.median(writes), statistics.median(converts)
    print(f"\nConversion of {size / 1e9:.2f} GB bf16 (safetensors, {len(list(src.glob('*.safetensors')))} shards), "
          f"median of {args.repeats}, page cache {'dropped' if cold else 'warm (could not drop)'} before each run\n")
    print("| measure | value |\n|---|---|")
    print(f"| sequential read | {read:.0f} MB/s |")
    print(f"| sequential write + fdatasync | {write:.0f} MB/s |")
    print(f"| convert | {conv:.0f} MB/s |")
    print(f"| convert / read | {conv / read:.2f} (goal >= 0.5) |")
    print(f"| convert / write | {conv / write:.2f} |")
    print(f"| converter peak RSS | {max(peaks) / 1e9:.2f} GB, the largest of {args.repeats} runs (goal < 1.5 GB) |")


if __name__ == "__main__":
    main()
