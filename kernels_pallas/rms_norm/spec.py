"""The RMSNorm op's spec: a norm over the hidden size with the residual add fused in."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.calls import OpCall
from kernels_pallas.cases import Case, Random
from kernels_pallas.ops import OpSpec

PARAMS = {"D": "the normed size", "eps": "epsilon", "offset": "1.0 for Gemma-style 1 + w, else 0.0"}


def describe(p: dict) -> str:
    return f"RMSNorm over {p['D']}, eps {p['eps']:g}{' (1 + w)' if p['offset'] else ''}"


def cases(call: OpCall, dtype: str, scale: str, prefix: str, tp: int) -> list[Case]:
    rows = {"full": 2048, "startup": 64, "tiny": 12}[scale]
    D = 256 if scale == "tiny" else call["D"]
    return [Case("rms_norm", f"{prefix}residual {call['D']}", dtype,
                 dict(M=rows, D=D, eps=call["eps"], offset=call["offset"]))]


def build(rnd: Random, dtype, *, M, D, eps, offset):
    x = rnd.normal((M, D), dtype)
    residual = rnd.normal((M, D), dtype)
    weight = jax.ShapeDtypeStruct((D,), dtype) if rnd.abstract else jnp.asarray(
        (1.0 - offset + 0.1 * rnd.rng.standard_normal(D)).astype(dtype))
    return (x, weight), dict(eps=eps, offset=offset, residual=residual)


SPEC = OpSpec("rms_norm", "rms_norm", PARAMS, describe, dict(D=256, eps=1e-6, offset=1.0),
              api="kernels_pallas.rms_norm.api", cases=cases, build=build,
              torch_patterns=("RMSNorm", "UnweightedRMSNorm", "WeightlessRMSNorm", "fn:rms_norm"))
