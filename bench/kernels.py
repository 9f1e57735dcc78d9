"""Kernel benchmark: each op's implementations on real layer shapes, against the chip's measured ceilings.

    python bench/kernels.py [--json PATH] [--jsonl PATH] [--budget-s S] [--markdown] [--iters N] [--tune] [--only OP]
    python bench/kernels.py --cpu-smoke      # tiny shapes on the CPU: checks the script itself, times nothing real

Each row is appended to `--jsonl` and flushed as soon as it is measured, and a case that fails is a row saying why,
never the end of the run; past `--budget-s` seconds the cases left are rows marked "skipped: budget", so a run killed
or cut short keeps every row it finished.

Ceilings, measured in the same run: streaming bandwidth (y = x + 1 over 4 GiB of bf16, bytes read plus written)
and the bf16 matmul rate (8192^3 on random data, float32 accumulation). Every implementation that accepts a shape
(Llama-3-8B, Qwen3-30B-A3B and DeepSeek-V3 layers) is checked against the reference, then timed: the median over
`--iters` runs, after a warm-up, of the device time of every kernel it launches, from CUPTI hardware timestamps
(else wall clock around block_until_ready, as the 'timer' column says). Inputs are random (never zeros) and larger
than the 60 MB L2 wherever the op streams memory.

Figures: prefill attention and MoE prefill in TFLOP/s (causal attention counts half the score matrix) as a share of
the matmul rate; paged decode, MoE decode and RMSNorm in GB/s (each input read once, each output written once) as a
share of the copy bandwidth; speed-ups over the reference (XLA) and cuDNN / ragged_dot. Quantized linear maps
(int4, int8, FP8 weights at Llama-3-8B's gate shape, 1 and 16 rows) in GB/s of the bytes they must read, beside a
bfloat16 dense product of the same shape ("bfloat16 dense", the last column's comparison for these rows). The gated
delta rule (Qwen3-Next's prefill) in TFLOP/s of the recurrent form's four state products per token and value head.
jax's own Mosaic GPU kernels shipped in its wheel (attention_mgpu, ragged_dot_mgpu: `baselines.py`) are rows too.
Targets (H100/H200): paged decode >= 60% of copy bandwidth, prefill attention >= 50% of the matmul rate, MoE grouped
matmul >= 45%. `--tune` sweeps each Pallas kernel's block sizes and prints entries for its `TABLE`, to paste.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, no install needed
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from baselines import BASELINES  # noqa: E402
from kernels_pallas import cases, ops, platform, registry  # noqa: E402
from kernels_pallas.attention import pallas_mgpu as attention_mgpu  # noqa: E402
from kernels_pallas.moe import pallas_mgpu as moe_mgpu  # noqa: E402
from kernels_pallas.paged_attention import pallas_mgpu as paged_mgpu  # noqa: E402
from kernels_pallas.rms_norm import pallas_mgpu as rms_mgpu  # noqa: E402

TARGETS = {"attention": ("matmul", 0.50), "paged_attention": ("copy", 0.60), "moe": ("matmul", 0.45)}


@dataclasses.dataclass
class Bench:
    """One op on one shape. work(args, kwargs) -> (useful FLOPs, minimum bytes) of the inputs built (lengths and
    group sizes are random); `compute_bound` picks the ceiling: the matmul rate (FLOPs) or the copy bandwidth."""

    op: str
    name: str
    case: cases.Case
    work: Callable[[tuple, dict], tuple[float, float]]
    compute_bound: bool


def flagship_call(family: str, op: str):
    """The flagship's first op call of `op` (its global attention layers' for attention ops)."""
    calls = [c for c in cases.flagships()[family] if c.op == op]
    return next((c for c in calls if c.get("window") is None), calls[0])


def attention_bench(family: str, B: int, T: int, dtype: str, S: int | None = None) -> Bench:
    """A prefill of T tokens; with S > T, a chunk of T tokens after S - T already cached (the last T positions)."""
    d = flagship_call(family, "attention")
    S = S or T
    spec = dict(B=B, T=T, S=S, N=d["N"], K=d["K"], H=d["H"], scale=d["scale"], window=None, softcap=None,
                sinks=d["sinks"], offsets=False)
    flops = 4.0 * B * d["N"] * (T * S - T * T / 2) * d["H"]  # QK^T and PV over the keys each query sees (causal)
    name = f"{family} prefill B={B} T={T}" if S == T else f"{family} prefill chunk B={B} T={T} after {S - T}"
    return Bench("attention", name, cases.Case("attention", family, dtype, spec), lambda args, kwargs: (flops, 0.0),
                 True)


def paged_bench(family: str, B: int, length: int, dtype: str, page: int = 16) -> Bench:
    d = flagship_call(family, "paged_attention")
    spec = dict(B=B, T=1, N=d["N"], K=d["K"], H=d["H"], page=page, max_len=length, scale=d["scale"], window=None,
                softcap=None, sinks=d["sinks"])
    itemsize = jnp.dtype(dtype).itemsize

    def work(args, kwargs):  # the cached keys and values of every row, read once (lengths are random)
        return 0.0, float(jnp.sum(args[4])) * d["K"] * d["H"] * 2 * itemsize

    return Bench("paged_attention", f"{family} decode B={B} len<={length}",
                 cases.Case("paged_attention", family, dtype, spec), work, False)


def moe_bench(family: str, tokens: int, dtype: str, proj: str = "gate/up", **tiny: int) -> Bench:
    """`tiny` (E, D, F) overrides the flagship's sizes (--cpu-smoke)."""
    m = {**dict(flagship_call(family, "moe").params), **tiny}
    D, F = (m["D"], m["F"]) if proj == "gate/up" else (m["F"], m["D"])
    M = tokens * m["k"]
    spec = dict(M=M, G=m["E"], D=D, F=F, k=m["k"])
    itemsize = jnp.dtype(dtype).itemsize

    def work(args, kwargs):  # rows in, the weights of the experts that got rows, rows out
        active = int(jnp.sum(args[2] > 0))
        return 2.0 * M * D * F, float(M * D + active * D * F + M * F) * itemsize

    decode = tokens <= 64  # a few rows per expert: streaming the weights is the cost
    return Bench("moe", f"{family} {proj} {'decode' if decode else 'prefill'} tokens={tokens}",
                 cases.Case("moe", family, dtype, spec), work, not decode)


def rms_bench(family: str, rows: int, dtype: str) -> Bench:
    norm = max((c for c in cases.flagships()[family] if c.op == "rms_norm"), key=lambda c: c["D"])  # the hidden size
    D = norm["D"]
    spec = dict(M=rows, D=D, eps=norm["eps"], offset=norm["offset"])
    nbytes = 4.0 * rows * D * jnp.dtype(dtype).itemsize  # x, residual in; normed, h out
    return Bench("rms_norm", f"{family} rows={rows}", cases.Case("rms_norm", family, dtype, spec),
                 lambda args, kwargs: (0.0, nbytes), False)


def quantized_bench(fmt: str, rows: int, dtype: str, O: int = 14336, I: int = 4096) -> Bench:
    """A linear map with quantized weights at Llama-3-8B's gate/up shape ([14336, 4096]), `fmt` as 'int4/128+offset'
    (scales float16; fp8's float32): a decode step's rows. Timed beside a bfloat16 dense product of the same shape
    (`DENSE`), the figure a quantized format must beat."""
    kind, _, rest = fmt.partition("/")
    group, offset = int(rest.split("+")[0]), rest.endswith("+offset")
    scale_dtype = "float32" if kind == "fp8" else "float16"
    spec = dict(R=rows, O=O, I=I, kind=kind, group=group, offset=offset, scale_dtype=scale_dtype)
    code_bytes = O * I // 2 if kind == "int4" else O * I
    side = O * (I // group) * jnp.dtype(scale_dtype).itemsize * (2 if offset else 1)
    nbytes = float(code_bytes + side + (rows * I + rows * O) * jnp.dtype(dtype).itemsize)
    return Bench("quantized_linear", f"llama-3-8b gate [{O} x {I}] {fmt} x {rows} rows",
                 cases.Case("quantized_linear", "llama-3-8b", dtype, spec), lambda args, kwargs: (0.0, nbytes), False)


def gated_delta_bench(family: str, B: int, T: int, dtype: str) -> Bench:
    g = flagship_call(family, "gated_delta_rule")
    spec = dict(B=B, T=T, Nk=g["Nk"], Nv=g["Nv"], Hk=g["Hk"], Hv=g["Hv"], decay=g["decay"])
    flops = 8.0 * B * T * g["Nv"] * g["Hk"] * g["Hv"]  # q.S, k.S, the rank-1 update, the decay: 2 FLOPs each
    return Bench("gated_delta_rule", f"{family} prefill B={B} T={T} {g['decay']} decay",
                 cases.Case("gated_delta_rule", family, dtype, spec), lambda args, kwargs: (flops, 0.0), True)


DENSE = "bfloat16 dense"  # the row quantized benches add: x @ W.T with W in bfloat16, float32 accumulation


def benches(dtype: str, tiny: bool = False) -> list[Bench]:
    if tiny:  # --cpu-smoke: exercise every path with toy sizes
        return [attention_bench("llama-3-8b", 1, 128, dtype), attention_bench("llama-3-8b", 1, 64, dtype, S=128),
                paged_bench("llama-3-8b", 2, 128, dtype),
                moe_bench("qwen3-30b-a3b", 16, dtype, E=8, D=128, F=128), rms_bench("llama-3-8b", 64, dtype),
                quantized_bench("int4/32+offset", 2, dtype, O=256, I=512),
                gated_delta_bench("qwen3-next-80b-a3b", 1, 80, dtype)]
    return [  # in order of value: a run cut short by its budget has the first ones
        paged_bench("llama-3-8b", 64, 1024, dtype),
        paged_bench("llama-3-8b", 64, 8192, dtype),
        paged_bench("llama-3-8b", 8, 32768, dtype),
        attention_bench("llama-3-8b", 4, 256, dtype, S=4096),
        attention_bench("llama-3-8b", 2, 2048, dtype, S=8192),
        attention_bench("llama-3-8b", 4, 4096, dtype),
        moe_bench("qwen3-30b-a3b", 4096, dtype),
        moe_bench("qwen3-30b-a3b", 32, dtype),
        moe_bench("deepseek-v3", 4096, dtype),
        moe_bench("deepseek-v3", 32, dtype),
        *[quantized_bench(fmt, rows, dtype) for fmt in ("int4/128+offset", "int8/128", "fp8/128") for rows in (1, 16)],
        gated_delta_bench("qwen3-next-80b-a3b", 2, 4096, dtype),
        paged_bench("qwen3-30b-a3b", 64, 8192, dtype),
        attention_bench("qwen3-30b-a3b", 4, 4096, dtype),
        attention_bench("deepseek-v3", 1, 4096, dtype),
        moe_bench("qwen3-30b-a3b", 4096, dtype, "down"),
        rms_bench("llama-3-8b", 16384, dtype),
        rms_bench("deepseek-v3", 8192, dtype),
    ]


def jitted(fn: Callable, args: tuple, kwargs: dict) -> tuple[Callable, list]:
    """fn as a jitted function of its array arguments only (flags and sizes static)."""
    call, arrays = registry.split_arrays(fn, args, kwargs)
    return jax.jit(call), arrays


def time_ms(f: Callable, arrays: list, iters: int) -> tuple[float, str]:
    """Median device milliseconds of f(*arrays) over `iters` runs after warm-up, and the timer used."""
    jax.block_until_ready(f(*arrays))  # compile and warm up
    if jax.default_backend() == "gpu":
        try:
            from jax.experimental.mosaic.gpu import profiler

            _, per_iter = profiler.measure(f, iterations=iters)(*arrays)
            if per_iter:
                return statistics.median(per_iter if isinstance(per_iter, list) else [per_iter]), "cupti"
        except Exception as e:  # CUPTI may be unavailable in a sandbox: fall back, and say so
            print(f"  (CUPTI unavailable: {type(e).__name__}: {e}; using wall clock)", file=sys.stderr)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*arrays))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), "wall"


def ceilings(iters: int, tiny: bool) -> dict[str, float]:
    """Measured streaming bandwidth (bytes/s, read + write) and bf16 matmul rate (FLOP/s) of this device."""
    n = (1 << 20) if tiny else (1 << 31)  # 4 GiB of bf16: far past the L2
    x = jax.random.normal(jax.random.key(1), (n,), jnp.bfloat16)
    ms, _ = time_ms(jax.jit(lambda x: x + jnp.bfloat16(1)), [x], iters)
    copy = 2 * n * 2 / (ms / 1e3)
    del x
    m = 512 if tiny else 8192
    a = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(3), (m, m), jnp.bfloat16)
    ms, _ = time_ms(jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)), [a, b], iters)
    return {"copy": copy, "matmul": 2 * m ** 3 / (ms / 1e3)}


Emit = Callable[[dict], None]


def new_row(bench: Bench, name: str, detail: str = "") -> dict[str, Any]:
    return dict(op=bench.op, shape=bench.name, implementation=name, ms=None, timer="", rate=None, unit="",
                fraction=None, max_rel_error=None, detail=detail)


def first_line(e: Exception, width: int = 160) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:width]}"


def measure(row: dict, bench: Bench, fn: Callable, arrays: list, ref_out, work: tuple[float, float],
            ceil: dict[str, float], iters: int) -> None:
    """Checks fn(*arrays) against the reference's output, then times it; fills row (or its detail, on failure)."""
    try:
        out = jax.block_until_ready(fn(*arrays))
        if ref_out is not None:
            row["max_rel_error"] = cases.max_relative_error(out, ref_out)
        ms, timer = time_ms(fn, arrays, iters)
    except Exception as e:
        row["detail"] = first_line(e)
        return
    flops, nbytes = work
    amount, ceiling, scale, unit = (flops, "matmul", 1e12, "TFLOP/s") if bench.compute_bound else \
        (nbytes, "copy", 1e9, "GB/s")
    rate = amount / (ms / 1e3)
    row.update(ms=ms, timer=timer, rate=rate / scale, unit=unit, fraction=rate / ceil[ceiling])


def run_bench(bench: Bench, ceil: dict[str, float], iters: int, seed: int, emit: Emit,
              deadline: float = math.inf) -> list[dict[str, Any]]:
    """Every implementation of bench's op (and jax's baseline kernel for it), each row passed to `emit` when done;
    past `deadline` (time.monotonic()) the implementations left are skipped."""
    mod = registry.api(bench.op)
    interpreted = set(mod.INTERPRET.values())
    args, kwargs = bench.case.build(seed)
    work = bench.work(args, kwargs)
    ref_fn, arrays = jitted(mod.IMPLEMENTATIONS[registry.REFERENCE], args, kwargs)
    try:
        ref_out, ref_error = jax.block_until_ready(ref_fn(*arrays)), ""
    except Exception as e:  # the reference may not fit (huge score matrices): time the others anyway
        ref_out, ref_error = None, first_line(e, 120)
    rows = []

    def done(row):
        rows.append(row)
        emit(row)

    for name in mod.IMPLEMENTATIONS:
        if name in interpreted:
            continue
        row = new_row(bench, name)
        if time.monotonic() > deadline:
            row["detail"] = "skipped: budget"
        elif (reason := registry.accepts(bench.op, name, *args, **kwargs)) is not None:
            row["detail"] = f"unavailable: {reason[:100]}"
        elif name == registry.REFERENCE and ref_out is None:
            row["detail"] = f"reference failed: {ref_error}"
        else:
            try:
                fn, arrs = jitted(mod.IMPLEMENTATIONS[name], args, kwargs)
            except Exception as e:
                row["detail"] = first_line(e)
            else:
                measure(row, bench, fn, arrs, ref_out, work, ceil, iters)
        done(row)
    if bench.op in BASELINES:
        done(baseline_row(bench, args, kwargs, ref_out, work, ceil, iters, deadline))
    if bench.op == "quantized_linear":
        done(dense_row(bench, args, ceil, iters) if time.monotonic() <= deadline else
             new_row(bench, DENSE, "skipped: budget"))
    compare(rows)
    return rows


def compare(rows: list[dict[str, Any]]) -> None:
    """Speed-ups of each timed row of one bench over the reference, the vendor's program and jax's kernel."""
    by_name = {r["implementation"]: r["ms"] for r in rows if r["ms"]}
    jax_kernel = next((by_name.get(name) for name, _ in BASELINES.values() if by_name.get(name)), None)
    for r in rows:
        if r["ms"]:
            r["vs_reference"] = by_name[registry.REFERENCE] / r["ms"] if by_name.get(registry.REFERENCE) else None
            vendor = by_name.get("cudnn") or by_name.get("xla_ragged_dot") or by_name.get(DENSE)
            r["vs_vendor"] = vendor / r["ms"] if vendor else None
            r["vs_jax"] = jax_kernel / r["ms"] if jax_kernel else None


def baseline_row(bench: Bench, args: tuple, kwargs: dict, ref_out, work: tuple[float, float],
                 ceil: dict[str, float], iters: int, deadline: float) -> dict[str, Any]:
    """jax's own Mosaic GPU kernel for bench's op, checked and timed like ours."""
    name, baseline = BASELINES[bench.op]
    row = new_row(bench, name)
    if time.monotonic() > deadline:
        row["detail"] = "skipped: budget"
    elif jax.default_backend() != "gpu":
        row["detail"] = "unavailable: a compiled Mosaic GPU kernel, needs a GPU"
    else:
        try:
            fn, arrays = baseline(args, kwargs)
        except NotImplementedError as e:
            row["detail"] = f"unavailable: {e}"
        else:
            measure(row, bench, fn, arrays, ref_out, work, ceil, iters)
    return row


def dense_row(bench: Bench, args: tuple, ceil: dict[str, float], iters: int) -> dict[str, Any]:
    """The bfloat16 dense product of a quantized bench's shape: its bytes are the bfloat16 weight's."""
    x, q = args
    O, I = q.shape
    w = jax.random.normal(jax.random.key(4), (O, I), jnp.bfloat16)
    fn = jax.jit(lambda x, w: jax.lax.dot_general(x.astype(jnp.bfloat16), w, (((1,), (1,)), ((), ())),
                                                  preferred_element_type=jnp.float32))
    ms, timer = time_ms(fn, [x, w], iters)
    rate = (2.0 * O * I + x.size * x.dtype.itemsize + 4 * x.shape[0] * O) / (ms / 1e3)
    return dict(op=bench.op, shape=bench.name, implementation=DENSE, ms=ms, timer=timer, rate=rate / 1e9,
                unit="GB/s", fraction=rate / ceil["copy"], max_rel_error=None, detail="baseline")


def tune(dtype: str, iters: int, tiny: bool = False, only: list[str] | None = None,
         deadline: float = math.inf) -> list[str]:
    """Sweeps each Pallas kernel's blocks on the bench shapes (those with a sweep below); prints each table-entry
    line for the best as soon as a shape's sweep ends, and returns them all."""
    kind = platform.current().kind
    today = datetime.date.today().isoformat()
    sweeps = {  # op -> (kernel, block configurations, shape class of a case spec)
        "attention": (attention_mgpu.attention,
                      [attention_mgpu.Blocks(64, kv, st) for kv in (64, 128) for st in (2, 3)],
                      lambda s: attention_mgpu.shape_class(s["H"])),
        "paged_attention": (paged_mgpu.paged_attention,
                            [paged_mgpu.Blocks(kv, st, 16) for kv in (64, 128, 256) for st in (2, 3, 4)],
                            lambda s: paged_mgpu.shape_class(s["H"], s["page"])),
        "moe": (moe_mgpu.grouped_matmul, [moe_mgpu.Blocks(bm, bn, 64, st) for bm in (64, 128) for bn in (128, 256)
                                          for st in (3, 4, 5)], lambda s: moe_mgpu.shape_class(s["M"], s["G"])),
        "rms_norm": (rms_mgpu.rms_norm, [rms_mgpu.Blocks(r) for r in (1, 2, 4, 8)],
                     lambda s: rms_mgpu.shape_class(s["D"])),
    }
    lines = []
    for bench in benches(dtype, tiny):
        if bench.op not in sweeps or (only and bench.op not in only):
            continue  # no block sizes to sweep (XLA programs), or not asked for
        fn, configs, cls = sweeps[bench.op]
        args, kwargs = bench.case.build(0)
        best = None
        for cfg in configs:
            if time.monotonic() > deadline:
                print(f"  {bench.name} {cfg}: skipped: budget", file=sys.stderr)
                continue
            try:
                f, arrays = jitted(lambda *a, **k: fn(*a, blocks=cfg, **k), args, kwargs)
                ms, _ = time_ms(f, arrays, iters)
            except Exception as e:  # a config that does not fit (shared memory, registers) is skipped
                print(f"  {bench.name} {cfg}: {type(e).__name__}", file=sys.stderr)
                continue
            print(f"  {bench.name} {cfg}: {ms:.3f} ms", file=sys.stderr)
            if best is None or ms < best[0]:
                best = (ms, cfg)
        if best:
            lines.append(f'{bench.op}: ("{kind}", "{cls(bench.case.spec)}"): tuning.Entry({best[1]!r}, '
                         f'"measured {today} {best[0]:.3f} ms on {bench.name}"),')
            print(lines[-1], flush=True)
        else:
            print(f"{bench.op}: {bench.name}: no configuration ran", flush=True)
    return lines


def format_rows(rows: list[dict[str, Any]], ceil: dict[str, float], markdown: bool) -> str:
    head = ["op", "shape", "implementation", "ms", "rate", "of ceiling", "vs XLA ref", "vs cuDNN/ragged_dot/bf16 dense",
            "vs jax kernel", "max rel err", "note"]

    def cell(value, spec, suffix=""):
        return "-" if value is None else format(value, spec) + suffix

    body = [[r["op"], r["shape"], r["implementation"], cell(r["ms"], ".3f"), cell(r["rate"], ".1f", " " + r["unit"]),
             "-" if r["fraction"] is None else f"{100 * r['fraction']:.0f}%", cell(r.get("vs_reference"), ".2f", "x"),
             cell(r.get("vs_vendor"), ".2f", "x"), cell(r.get("vs_jax"), ".2f", "x"), cell(r["max_rel_error"], ".1e"),
             (r["timer"] + " " + r["detail"]).strip()[:70]] for r in rows]
    lines = [f"ceilings: copy {ceil['copy'] / 1e9:.0f} GB/s (read+write), bf16 matmul {ceil['matmul'] / 1e12:.0f} "
             f"TFLOP/s"]
    if markdown:
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(map(str, b)) + " |" for b in body]
    else:
        widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(len(head))]
        lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in [head, *body]]
    for op, (which, target) in TARGETS.items():
        best = [r for r in rows if r["op"] == op and r["implementation"].startswith("mosaic_gpu") and r["fraction"]]
        if best:
            got = max(r["fraction"] for r in best)
            lines.append(f"target {op}: >= {100 * target:.0f}% of {which}: best mosaic_gpu {100 * got:.0f}% "
                         f"({'met' if got >= target else 'NOT met'})")
    return "\n".join(lines)


def jsonl_writer(path: Path | None) -> Emit:
    """Appends each row to `path` as one JSON line, flushed at once (a killed run keeps what it measured)."""
    if path is None:
        return lambda row: None
    path.parent.mkdir(parents=True, exist_ok=True)

    def emit(row: dict) -> None:
        with path.open("a") as f:
            f.write(json.dumps(row, default=plain) + "\n")

    return emit


def plain(value):
    return None if isinstance(value, float) and not math.isfinite(value) else str(value)


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--only", action="append", choices=ops.kernel_ops())
    p.add_argument("--json", type=Path, help="write the rows and ceilings here at the end")
    p.add_argument("--jsonl", type=Path, help="append each row here as it is measured (and the ceilings first)")
    p.add_argument("--budget-s", type=float, default=math.inf, help="past this many seconds, skip what is left")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown (for bench/RESULTS.md)")
    p.add_argument("--tune", action="store_true", help="sweep block sizes and print tuning-table entries")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU: check the script runs")
    a = p.parse_args(argv)
    deadline = started + a.budget_s
    if jax.default_backend() != "gpu" and not a.cpu_smoke:
        print("bench/kernels.py needs a GPU (jax.default_backend() is "
              f"{jax.default_backend()!r}); --cpu-smoke runs toy shapes to check the script.", file=sys.stderr)
        return 2
    target = platform.current()
    print(f"device: {target.device_kind} ({target.num_cores} SMs), jax {jax.__version__}, "
          f"{datetime.date.today().isoformat()}", flush=True)
    if a.tune:
        tune(a.dtype, a.iters, a.cpu_smoke, a.only, deadline)
        return 0
    emit = jsonl_writer(a.jsonl)
    ceil = ceilings(a.iters, a.cpu_smoke)
    emit({"ceilings": ceil, "device": target.device_kind, "date": datetime.date.today().isoformat()})
    rows = []
    for i, bench in enumerate(benches(a.dtype, a.cpu_smoke)):
        if a.only and bench.op not in a.only:
            continue
        print(f"... {bench.op}: {bench.name}", file=sys.stderr, flush=True)
        try:
            rows += run_bench(bench, ceil, a.iters, i, emit, deadline)
        except Exception as e:  # building the inputs or the reference: this case fails, the others still run
            row = new_row(bench, registry.REFERENCE, f"case failed: {first_line(e)}")
            emit(row)
            rows.append(row)
    print(format_rows(rows, ceil, a.markdown))
    if a.json:
        a.json.write_text(json.dumps({"device": target.device_kind, "date": datetime.date.today().isoformat(),
                                      "ceilings": ceil, "rows": rows}, default=plain, indent=1))
    bad = [r for r in rows if r["max_rel_error"] is not None and r["max_rel_error"] > cases.TOLERANCE[a.dtype]]
    for r in bad:
        print(f"WRONG: {r['op']} {r['implementation']} on {r['shape']}: max rel error {r['max_rel_error']:.2e}",
              file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
