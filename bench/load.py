"""Checkpoint loading and conversion against what the storage delivers, on a synthetic multi-GB checkpoint.

    .venv/bin/python bench/load.py [--gb 3] [--repeats 3] [--workdir /tmp/day0jax-bench-load]

Makes a Llama-shaped day0jax checkpoint of random float32 weights (`--gb` of them) and its bfloat16 copy, then per
repeat and per case (float32 loaded as float32, bfloat16 as bfloat16, bfloat16 widened to float32):
- cold: the checkpoint's files dropped from the page cache (posix_fadvise DONTNEED on each file: no root needed),
  then a plain sequential read of the same files into one reused buffer; dropped again, then `loader.restore`
  (the model already prepared: config, plan and kernel self-test are not loading);
- warm: the same read and the same restore with the files in the page cache;
- peak host memory of the restore: the growth of the process's peak resident set (reset just before) over the
  parameters' bytes and the bytes in flight.
Then conversion: a bfloat16 safetensors source of the same size (bench/convert.py's), `python -m convert` in a
child process (cold), against a cold read of the source, a durable write (fdatasync) of as many bytes, and a durable
copy of the source files (read and written at once, as a conversion does: where reads and writes share one device,
the copy is what the storage gives both together). Its rate
is the converter's own time (from reading the source's headers to the final rename, as its summary line gives it);
the child's whole life, interpreter and imports included (a second or two whatever the size), is shown beside it.
Prints medians and the targets: cold load >= 0.8x the cold read, warm load >= 5 GB/s, peak growth <= (parameters +
in flight) x 1.1, conversion >= 0.7x the slower of the source's cold read and the durable write.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _bench_convert():
    spec = importlib.util.spec_from_file_location("bench_convert", ROOT / "bench" / "convert.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def llama_config(gb: float, itemsize: int = 4) -> dict:
    """A 2048-wide Llama with enough layers for `gb` gigabytes of parameters at `itemsize` bytes each."""
    D, F, V = 2048, 5632, 32000
    per_layer = (4 * D * D + 3 * D * F + 2 * D) * itemsize
    layers = max(1, round((gb * 1e9 - 2 * V * D * itemsize) / per_layer))
    return dict(model_type="llama", vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=layers,
                num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=256, rms_norm_eps=1e-5)


def make_checkpoint(hf: dict, dst: Path, dtype) -> None:
    from convert.writer import CheckpointWriter
    from day0jax import models

    rng = np.random.default_rng(0)
    config = models.config_from_hf(hf)
    with CheckpointWriter(dst, force=True) as writer:
        for info in models.param_infos(models.abstract_model(config)):
            writer.add(info.path, (rng.standard_normal(info.shape, dtype=np.float32) * 0.02).astype(dtype))
        writer.write_json("config.json", hf)
        writer.commit({"model_type": "llama", "dtype": np.dtype(dtype).name, "source": {"kind": "synthetic"}})


def data_files(folder: Path) -> list[Path]:
    return sorted(f for f in folder.rglob("*") if f.is_file())


def drop(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential_read(files: list[Path]) -> float:
    """GB/s of reading `files` in order into one reused 64 MB buffer."""
    buf = memoryview(bytearray(64 << 20))
    total, t0 = 0, time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    return total / 1e9 / (time.perf_counter() - t0)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(key)).split()[1]) << 10


def timed_restore(prepared, path: Path, stored: int) -> tuple[float, int, int, int]:
    """(GB/s of the restore in `stored` checkpoint bytes, peak resident growth, parameter bytes in memory, bytes in
    flight allowed)."""
    import jax
    from flax import nnx

    from day0jax import loader
    from day0jax.weights import stream

    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from the current resident set
    before = _status("VmRSS")
    concurrency = stream.default_concurrency()
    t0 = time.perf_counter()
    model = loader.restore(prepared, path)
    seconds = time.perf_counter() - t0
    growth = _status("VmHWM") - before
    nbytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.module)))
    del model
    return stored / 1e9 / seconds, growth, nbytes, concurrency


def load_cases(args, workdir: Path) -> list[tuple]:
    import ml_dtypes

    from day0jax import loader
    from day0jax.engine.config import EngineConfig

    hf = llama_config(args.gb)
    f32, bf16 = workdir / "float32", workdir / "bfloat16"
    for folder, dtype in ((f32, np.float32), (bf16, ml_dtypes.bfloat16)):
        if not (folder / "day0jax.json").is_file():
            print(f"writing {folder} ...", flush=True)
            make_checkpoint(hf, folder, dtype)
    rows = []
    for folder, load_dtype in ((f32, "float32"), (bf16, "bfloat16"), (bf16, "float32")):
        files = data_files(folder)
        size = sum(f.stat().st_size for f in files)
        prepared = loader.prepare(json.loads((folder / "config.json").read_text()), dtype=load_dtype,
                                  engine=EngineConfig(max_num_seqs=1, max_model_len=256), kernels="reference")
        cold_read, cold_load, warm_read, warm_load, growth = [], [], [], [], []
        for _ in range(args.repeats):
            drop(files)
            cold_read.append(sequential_read(files))
            drop(files)
            rate, grown, nbytes, concurrency = timed_restore(prepared, folder, size)
            cold_load.append(rate)
            warm_read.append(sequential_read(files))
            rate, grown_warm, _, _ = timed_restore(prepared, folder, size)
            warm_load.append(rate)
            growth.append(max(grown, grown_warm))
        med = statistics.median
        rows.append((f"{folder.name} as {load_dtype}", size, med(cold_read), med(cold_load), med(warm_read),
                     med(warm_load), max(growth), nbytes, concurrency))
    return rows


def conversion(args, workdir: Path) -> tuple:
    bc = _bench_convert()
    src, dst = workdir / "hf-bf16", workdir / "converted"
    if not (src / "model.safetensors.index.json").is_file():
        shutil.rmtree(src, ignore_errors=True)
        print(f"writing a {args.gb / 2:.1f} GB bf16 safetensors source into {src} ...", flush=True)
        bc.make_source(src, args.gb / 2)
    shards = sorted(src.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in shards)
    reads, writes, copies, converts, peaks, summaries = [], [], [], [], [], []
    for _ in range(args.repeats):
        drop(shards)
        reads.append(sequential_read(shards))
        writes.append(durable_write(workdir, size))
        drop(shards)
        copies.append(durable_copy(shards, workdir / "copy"))
        drop(shards)
        seconds, peak, summary = bc.convert_child(src, dst)
        own = float(re.search(r"MB out, ([0-9.]+) s,", summary).group(1))  # the converter's own time
        converts.append((size / 1e9 / own, size / 1e9 / seconds))
        peaks.append(peak)
        summaries.append(summary)
        shutil.rmtree(dst, ignore_errors=True)
    med = statistics.median
    median_run = sorted(range(args.repeats), key=converts.__getitem__)[args.repeats // 2]
    return size, med(reads), med(writes), med(copies), converts[median_run], max(peaks), summaries[median_run]


def durable_copy(files: list[Path], folder: Path) -> float:
    """GB/s of copying `files` into `folder` (16 MB reads and writes, each file fsynced), a thread per file: what the
    storage gives a job that reads and durably writes at once, as a conversion does."""
    import concurrent.futures

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)

    def copy(f: Path) -> None:
        with open(f, "rb", buffering=0) as src, open(folder / f.name, "wb", buffering=0) as dst:
            while block := src.read(16 << 20):
                dst.write(block)
            os.fsync(dst.fileno())

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(files)) as pool:
        list(pool.map(copy, files))
    seconds = time.perf_counter() - t0
    shutil.rmtree(folder, ignore_errors=True)
    return sum(f.stat().st_size for f in files) / 1e9 / seconds


def durable_write(folder: Path, nbytes: int) -> float:
    """GB/s of writing `nbytes` in 64 MB blocks and syncing them to the disk."""
    block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
    path = folder / "write-test.bin"
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
        os.fdatasync(f.fileno())
    seconds = time.perf_counter() - t0
    written = max(1, nbytes // len(block)) * len(block)
    path.unlink()
    return written / 1e9 / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=3.0, help="float32 checkpoint size (the bfloat16 copy is half)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/day0jax-bench-load"))
    ap.add_argument("--skip-conversion", action="store_true")
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING)
    args.workdir.mkdir(parents=True, exist_ok=True)
    # Conversion first: the child's ru_maxrss starts from this process's resident set at the fork, which the
    # loaded models would inflate.
    converted = None if args.skip_conversion else conversion(args, args.workdir)
    rows = load_cases(args, args.workdir)
    print(f"\nLoading, median of {args.repeats}; page cache dropped per file with posix_fadvise for the cold runs; "
          "GB/s of checkpoint bytes\n")
    print("| checkpoint | size GB | cold read GB/s | cold load GB/s | load/read | warm read GB/s | warm load GB/s "
          "| peak growth / (params + in flight) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, size, cr, cl, wr, wl, growth, nbytes, concurrency in rows:
        print(f"| {name} | {size / 1e9:.2f} | {cr:.2f} | {cl:.2f} | {cl / cr:.2f} (goal >= 0.8) | {wr:.2f} | "
              f"{wl:.2f} (goal >= 5) | {growth / (nbytes + concurrency):.2f} (goal <= 1.1) |")
    if converted is None:
        return
    size, read, write, copy, conv, peak, summary = converted
    bound = min(read, write)
    print(f"\nConversion of {size / 1e9:.2f} GB bf16 safetensors into bf16, median of {args.repeats}, cold\n")
    print("| source cold read GB/s | durable write GB/s | durable copy GB/s | convert GB/s | convert / slower of read "
          "and write | convert / durable copy | process start to exit GB/s | peak RSS GB |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {read:.2f} | {write:.2f} | {copy:.2f} | {conv[0]:.2f} | {conv[0] / bound:.2f} (goal >= 0.7) | "
          f"{conv[0] / copy:.2f} | {conv[1]:.2f} | {peak / 1e9:.2f} |")
    print(f"\nThe median conversion's own line: {summary}")


if __name__ == "__main__":
    main()
