"""Quantized weights on the CPU: parameter bytes in memory and greedy decode tokens/s of day0jax in float32, int8,
int4, MXFP4 and NVFP4 against llama.cpp on F32, Q8_0 and Q4_1 GGUFs of the same weights.

    .venv/bin/python bench/quant.py [--repeats 5] [--new-tokens 64] [--batches 1,8]
                                    [--formats float32,int8,int4,mxfp4,nvfp4] [--no-llama-cpp] [--baseline DIR]

The default model's Q4_1 GGUF is the int4 side as it ships: day0jax keeps its blocks (Q4_1, embeddings Q8_0),
llama.cpp reads the file itself. The Q8_0 GGUF is written from its dequantized weights with the `gguf` package and
converted by day0jax keeping those blocks; the F32 GGUF and day0jax's float32 conversion hold the dequantized
weights. So each pair runs the very same weights. The MXFP4 and NVFP4 checkpoints are `--quantize mxfp4|nvfp4
--dequantize` conversions of the Q4_1 GGUF (its dequantized weights re-quantized; embeddings int8): llama.cpp has no
GGUF of those, so their llama.cpp columns are empty. `--no-llama-cpp` leaves llama.cpp out altogether (it needs
llama-cpp-python built into .venv-ref). `--baseline DIR` also runs the quantized formats with DIR, a checkout of an
earlier day0jax revision, on the same checkpoints (a second table: this tree's speed against it). Workers stay loaded
and take turns in a rotating order after a warm-up of the same shapes (bench/decode.py's method: decode rate =
batch * (N - 1) / (time for N - time for 1)). llama.cpp runs batch 1 only. Prints the CPU and its load average, and
a table of medians with the ratios the targets are stated in.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.decode import PROMPT, Worker, f32_gguf, float32_checkpoint  # noqa: E402

FORMATS = ("float32", "int8", "int4", "mxfp4", "nvfp4")
GGUF_TYPE = {"float32": "F32", "int8": "Q8_0", "int4": "Q4_1"}  # the formats llama.cpp runs too
FP4 = ("mxfp4", "nvfp4")  # `--quantize` conversions, day0jax only


def checkpoints(source: Path, folder: Path, formats: list[str], llama_cpp: bool) -> dict[str, tuple[Path, Path]]:
    """format -> (day0jax checkpoint, GGUF llama.cpp reads, or None); converted and written on first use."""
    import subprocess

    from convert.convert import Options, convert_checkpoint

    ggufs = {"float32": f32_gguf() if llama_cpp else None, "int8": folder / "SmolLM2-135M-Instruct.Q8_0.gguf",
             "int4": source}
    ggufs = {fmt: path for fmt, path in ggufs.items() if fmt in formats and path is not None}
    for fmt, path in ggufs.items():
        if not path.is_file():  # written by the llama.cpp worker's writer, in the reference venv (gguf package)
            code = ("import sys; from pathlib import Path; sys.path.insert(0, 'bench'); "
                    "from decode_llamacpp import write_gguf; write_gguf(Path(sys.argv[1]), Path(sys.argv[2]), "
                    "sys.argv[3])")
            subprocess.run([str(ROOT / ".venv-ref/bin/python"), "-c", code, str(source), str(path), GGUF_TYPE[fmt]],
                           check=True, cwd=ROOT)
    out = {"float32": (float32_checkpoint(), ggufs.get("float32"))} if "float32" in formats else {}
    for fmt in formats:
        dst = folder / f"day0jax-{fmt}"
        if fmt in ("int8", "int4") and not (dst / "day0jax.json").is_file():
            convert_checkpoint(ggufs[fmt], dst, force=dst.exists(), progress=False, options=Options(dtype="float32"))
        elif fmt in FP4 and not (dst / "day0jax.json").is_file():
            convert_checkpoint(source, dst, force=dst.exists(), progress=False,
                               options=Options(dtype="float32", quantize=fmt, dequantize=True))
        if fmt != "float32":
            out[fmt] = (dst, ggufs.get(fmt))
    return out


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def load_average() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def tensor_bytes(gguf: Path) -> int:
    from convert.gguf_source import read_header

    return sum(t.n_bytes for t in read_header(gguf)[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--formats", default=",".join(FORMATS), help="rows to run (default: all)")
    ap.add_argument("--no-llama-cpp", action="store_true", help="day0jax only (no llama-cpp-python build)")
    ap.add_argument("--baseline", metavar="DIR", help="a checkout of an earlier day0jax revision: the quantized "
                    "formats run with it too, on the same checkpoints")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    formats = [f for f in FORMATS if f in args.formats.split(",")]
    if "float32" not in formats or len(formats) != len(args.formats.split(",")):
        ap.error(f"--formats: a comma-separated list of {', '.join(FORMATS)} holding float32 (the ratios' base)")
    llama = not args.no_llama_cpp

    from day0jax.core.paths import cache_root
    from day0jax.default_model import default_gguf
    from day0jax.weights.tokenizer import Tokenizer

    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; load average at the start {load_average()}", flush=True)
    source = default_gguf()
    pairs = checkpoints(source, cache_root() / "bench", formats, llama)
    prompt = Tokenizer(pairs["float32"][0]).encode(PROMPT)
    python, ref = str(ROOT / ".venv/bin/python"), str(ROOT / ".venv-ref/bin/python")
    workers, llama_cpp, before = {}, {}, {}
    for fmt, (ckpt, gguf) in pairs.items():
        workers[f"day0jax {fmt}"] = Worker([python, "-P", str(ROOT / "bench/decode_worker.py"), str(ckpt)],
                                           {"PYTHONPATH": str(ROOT)})
        if args.baseline and fmt != "float32":
            before[fmt] = f"baseline {fmt}"
            baseline = str(Path(args.baseline).resolve())
            workers[before[fmt]] = Worker([python, "-P", str(ROOT / "bench/decode_worker.py"), str(ckpt)],
                                          {"PYTHONPATH": baseline})
            assert workers[before[fmt]].hello["from"] == baseline, workers[before[fmt]].hello
        if llama and fmt in GGUF_TYPE:
            name = f"llama.cpp {GGUF_TYPE[fmt]}"
            llama_cpp[name] = [ref, "-P", str(ROOT / "bench/decode_llamacpp.py"), str(source), str(gguf),
                               GGUF_TYPE[fmt]]
            workers[name] = Worker(llama_cpp[name], {})
    n = args.new_tokens

    def takes(name: str, batch: int) -> bool:
        return not name.startswith("llama.cpp") or batch == 1

    crashed, notes = {}, []
    for batch in batches:  # warm-up: every program these shapes use
        for name, w in list(workers.items()):
            if not takes(name, batch):
                continue
            try:
                w.ask({"batch": batch, "prompt": prompt, "new_tokens": n})
            except RuntimeError as e:
                if not name.startswith("llama.cpp"):
                    raise
                print(f"{name}: {e}; again with one prompt token per batch", file=sys.stderr)
                try:  # its many-row (prompt) kernels crash on some machines; decode steps take one row anyway
                    workers[name] = Worker(llama_cpp[name] + ["1"], {})
                    workers[name].ask({"batch": batch, "prompt": prompt, "new_tokens": n})
                    notes.append(f"{name} crashed evaluating the prompt in one batch ({e}); its figures are with "
                                 "one prompt token per batch, the same decode steps")
                except RuntimeError as again:
                    crashed[name] = str(again)  # reported in the table; day0jax's figures still count
                    del workers[name]
                    print(f"{name}: {again}", file=sys.stderr)
    rates: dict[tuple[str, int], list[float]] = {}
    tokens: dict[str, list[int]] = {}
    for repeat in range(args.repeats):
        order = list(workers)[repeat % len(workers):] + list(workers)[:repeat % len(workers)]
        for batch in batches:
            for name in (x for x in order if takes(x, batch)):
                r = workers[name].ask({"batch": batch, "prompt": prompt, "new_tokens": n})
                tokens[name] = r["tokens"]
                rates.setdefault((name, batch), []).append(batch * (n - 1) / (r["full"] - r["first"]))
    param_bytes = {fmt: workers[f"day0jax {fmt}"].hello["param_bytes"] for fmt in formats}
    rates.update({(name, 1): [math.nan] for name in crashed})
    for w in workers.values():
        w.close()

    def med(name, batch):
        return statistics.median(rates[(name, batch)])

    print(f"\nSmolLM2-135M, greedy decode of {n} tokens, median of {args.repeats} (tokens/s); parameter bytes in "
          f"memory against the GGUF's tensor bytes; load average at the end {load_average()}\n")
    bases = ["float32"] + (["int4"] if "int4" in formats else [])  # the ratio columns' formats
    print("| format | day0jax MB | GGUF MB | ratio | " + " | ".join(f"day0jax b{b}" for b in batches)
          + " | llama.cpp b1 | day0jax / llama.cpp b1 | "
          + " | ".join(f"day0jax / day0jax {base} b{b}" for base in bases for b in batches) + " |")
    print("|---" * (6 + len(batches) + len(bases) * len(batches)) + "|")
    for fmt in formats:
        ours = f"day0jax {fmt}"
        theirs = f"llama.cpp {GGUF_TYPE[fmt]}" if fmt in GGUF_TYPE else None
        if theirs is not None and (theirs, 1) in rates:
            gguf_bytes = tensor_bytes(pairs[fmt][1])
            gguf = f"{gguf_bytes / 1e6:.1f} | {param_bytes[fmt] / gguf_bytes:.2f}x"
            them = f"{med(theirs, 1):.1f} | {med(ours, 1) / med(theirs, 1):.2f}x"
        else:
            gguf, them = "- | -", "- | -"
        label = f"{fmt} ({GGUF_TYPE[fmt]})" if fmt in GGUF_TYPE else fmt
        print(f"| {label} | {param_bytes[fmt] / 1e6:.1f} | {gguf} | "
              + " | ".join(f"{med(ours, b):.1f}" for b in batches) + f" | {them} | "
              + " | ".join(f"{med(ours, b) / med(f'day0jax {base}', b):.2f}x" for base in bases for b in batches)
              + " |")
    if before:
        print(f"\nthis tree against the baseline {args.baseline} on the same checkpoints (tokens/s)\n")
        print("| format | " + " | ".join(f"b{b} this tree | b{b} baseline | b{b} ratio" for b in batches) + " |")
        print("|---" * (1 + 3 * len(batches)) + "|")
        for fmt, name in before.items():
            print(f"| {fmt} | " + " | ".join(f"{med(f'day0jax {fmt}', b):.1f} | {med(name, b):.1f} | "
                                            f"{med(f'day0jax {fmt}', b) / med(name, b):.2f}x" for b in batches) + " |")
    for name, why in crashed.items():
        print(f"\n{name} crashed in its warm-up ({why}): its columns read nan")
    for note in notes:
        print(f"\n{note}")
    print("\ngreedy tokens, first 16 of each batch-1 run:")
    for name, t in tokens.items():
        print(f"  {name:<20} {t[:16]}")


if __name__ == "__main__":
    main()
