"""The window compressor's spec: a prefill chunk's windows and a decode batch's one closing window, at a layer's
entry width, window length and layout."""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.calls import OpCall
from kernels_pallas.cases import Case, Random
from kernels_pallas.ops import OpSpec

PARAMS = {"Dh": "entry width", "m": "tokens per window (the compression rate)",
          "overlap": "windows of 2m tokens at a stride of m (CSA) rather than m (HCA)"}


def describe(p: dict) -> str:
    layout = f"overlapping windows of {2 * p['m']} at stride {p['m']}" if p["overlap"] else f"windows of {p['m']}"
    return f"gated pooling of {layout} tokens into entries of {p['Dh']}"


def cases(call: OpCall, dtype: str, scale: str, prefix: str, tp: int) -> list[Case]:
    Dh, m, overlap = call["Dh"], call["m"], call["overlap"]
    if scale == "tiny":
        Dh, m = min(Dh, 32), min(m, 8)
    # (label, B, C): the windows a prefill chunk closes, and one window per decode row.
    tokens = {"full": 2048, "startup": 256, "tiny": 64}[scale]
    shapes = [("prefill", 1, max(tokens // m, 1)), ("decode", {"full": 64, "startup": 4, "tiny": 2}[scale], 1)]
    return [Case("kv_compress", f"{prefix}{label} windows of {m}", dtype, dict(B=B, C=C, m=m, Dh=Dh, overlap=overlap))
            for label, B, C in shapes]


def build(rnd: Random, dtype, *, B, C, m, Dh, overlap):
    F, W = (2 * Dh, C + 1) if overlap else (Dh, C)
    valid = rnd.rng.random((B, W, m)) > 0.2
    valid[:, -1] = True  # every entry keeps tokens of its own window
    return ((rnd.normal((B, W, m, F), dtype), rnd.normal((B, W, m, F), dtype), rnd.normal((m, F), jnp.float32)),
            dict(overlap=overlap, valid=jnp.asarray(valid)))


SPEC = OpSpec("kv_compress", "kv compressor", PARAMS, describe, dict(Dh=512, m=4, overlap=True),
              api="kernels_pallas.kv_compress.api", cases=cases, build=build)
