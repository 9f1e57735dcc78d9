"""What this CPU can do at most, for the figures bench/RESULTS.md compares decode steps against.

    .venv/bin/python bench/cpu_ceilings.py [--mib 400] [--repeats 20] [--size 8192]

1. Read bandwidth: a C loop of vector loads summing a buffer of --mib MiB (far past the L3), built here with
   `gcc -O2 -march=native -fopenmp`, with 1 thread and with every core: the rate at which a decode step can stream
   its weights, whatever reads them.
2. Matrix-vector products of a --size x --size weight, as a decode step multiplies one row (`jax.jit`, best of
   --repeats): float32 through XLA (`W @ x`), and int8, int4 and fp8 codes through the quantized linear op (the CPU
   kernel): milliseconds, GB/s of weight bytes and GMAC/s.
3. The float32 matrix-matrix rate (GFLOP/s of a --size^3 product): what prefill chunks and vision towers are bound by.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

READ_LOOP = r"""
#include <stdio.h>
#include <stdlib.h>
#include <omp.h>
#include <time.h>
/* Sums a buffer with four independent 64-byte vector accumulators (GCC vector extensions: AVX-512 or two AVX2
   registers each, as -march=native allows), so loads, not additions, bound the loop. */
typedef float v16 __attribute__((vector_size(64)));
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char **argv) {
    size_t n = (size_t)atol(argv[1]) * (1 << 20) / sizeof(v16);
    int repeats = atoi(argv[2]);
    v16 *a = aligned_alloc(64, n * sizeof(v16));
    #pragma omp parallel for
    for (size_t i = 0; i < n; i++) a[i] = (v16){0} + (float)(i & 7);
    double best = 1e30, sink = 0;
    for (int r = 0; r < repeats; r++) {
        double t0 = now(), total = 0;
        #pragma omp parallel reduction(+:total)
        {
            v16 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
            #pragma omp for
            for (size_t i = 0; i < n; i += 4) { s0 += a[i]; s1 += a[i + 1]; s2 += a[i + 2]; s3 += a[i + 3]; }
            v16 s = s0 + s1 + s2 + s3;
            for (int j = 0; j < 16; j++) total += s[j];
        }
        double t = now() - t0;
        sink += total;
        if (t < best) best = t;
    }
    printf("%.3f %g\n", n * sizeof(v16) / best / 1e9, sink);
    return 0;
}
"""


def read_bandwidth(mib: int, repeats: int) -> dict[int, float]:
    """GB/s of the C read loop, per thread count (1 and every core)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "read.c", Path(tmp) / "read"
        src.write_text(READ_LOOP)
        subprocess.run(["gcc", "-O2", "-march=native", "-fopenmp", str(src), "-o", str(exe)], check=True)
        out = {}
        for threads in sorted({1, os.cpu_count() or 1}):
            proc = subprocess.run([str(exe), str(mib), str(repeats)], capture_output=True, text=True, check=True,
                                  env={**os.environ, "OMP_NUM_THREADS": str(threads)})
            out[threads] = float(proc.stdout.split()[0])
        return out


def best_ms(fn, *args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compiles
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def matvec_rows(size: int, repeats: int) -> list[tuple[str, float, float, float]]:
    """(format, ms, GB/s of weight bytes, GMAC/s) of one row times a size x size weight."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas.quantized_linear import api, reference

    rng = np.random.default_rng(0)
    w = rng.standard_normal((size, size), np.float32)
    x = jnp.asarray(rng.standard_normal((1, size), np.float32))
    rows = []
    dense = jnp.asarray(w)
    ms = best_ms(jax.jit(lambda w, x: (w @ x[0])[None]), dense, x, repeats=repeats)
    rows.append(("float32", ms, w.nbytes / ms / 1e6, size * size / ms / 1e6))
    for kind, group in (("int8", 32), ("int4", 32), ("fp8", 128)):
        q = reference.quantize(w, kind, group)
        nbytes = sum(int(a.nbytes) for a in (q.codes, q.scale, q.offset) if a is not None)
        ms = best_ms(jax.jit(api.quantized_matmul), x, q, repeats=repeats)
        rows.append((kind, ms, nbytes / ms / 1e6, size * size / ms / 1e6))
    return rows


def matmul_gflops(size: int, repeats: int) -> float:
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (size, size), jnp.float32)
    ms = best_ms(jax.jit(jnp.dot), a, b, repeats=max(3, repeats // 5))
    return 2 * size ** 3 / ms / 1e6


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=400, help="read-loop buffer (MiB)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--size", type=int, default=8192, help="weight side of the products")
    args = ap.parse_args(argv)
    print(f"{cpu_name()}, {os.cpu_count()} cores\n")
    print("| read loop (C, vector loads) | GB/s |\n| --- | ---: |")
    for threads, gbs in read_bandwidth(args.mib, args.repeats).items():
        print(f"| {threads} thread{'s' if threads > 1 else ''}, {args.mib} MiB | {gbs:.1f} |")
    print(f"\n| {args.size}x{args.size} weight x 1 row | ms | GB/s of weights | GMAC/s |\n| --- | ---: | ---: | ---: |")
    for name, ms, gbs, gmacs in matvec_rows(args.size, args.repeats):
        print(f"| {name} | {ms:.2f} | {gbs:.1f} | {gmacs:.1f} |")
    print(f"\nfloat32 {args.size}^3 matrix product: {matmul_gflops(args.size, args.repeats):.0f} GFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
