"""The quantized linear op's spec: a linear map whose weight stays quantized. Its random quantized weights serve
the MoE op's quantized experts too (`moe/spec.py`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.calls import OpCall
from kernels_pallas.cases import Case, Random
from kernels_pallas.ops import OpSpec
from kernels_pallas.quantized_linear.reference import (CODE_DTYPES, MX_KINDS, MXFP8_KINDS, NVFP4_KINDS, PACKED,
                                                       QuantizedWeight)

PARAMS = {"O": "outputs", "I": "inputs", "kind": "'int8', 'int4', 'fp8', 'mxfp4' or 'nvfp4'",
          "group": "inputs per scale",
          "offset": "groups carry an offset (bool)", "scale_dtype": "dtype of scales and offsets"}


def describe(p: dict) -> str:
    offset = " with offsets" if p["offset"] else ""
    return f"{p['kind']} weights [{p['O']} x {p['I']}], groups of {p['group']}{offset} ({p['scale_dtype']} scales)"


def cases(call: OpCall, dtype: str, scale: str, prefix: str, tp: int) -> list[Case]:
    O, I, group = call["O"], call["I"], call["group"]
    fmt = dict(kind=call["kind"], group=group, offset=call["offset"], scale_dtype=call["scale_dtype"])
    label = f"{call['kind']}/{group}{'+offset' if call['offset'] else ''} {call['scale_dtype']} scales"
    if scale != "full":  # one case per format, whatever the weight's shape: the kernel's arithmetic is per group
        O, I = min(O, 96), group * max(1, min(I // group, 256 // group))
    else:
        label += f" [{O} x {I}]"
    # A decode step of one row and one of a small batch (the rows one pass over the codes serves).
    rows = (1, 16) if scale == "full" else (1, 5)
    return [Case("quantized_linear", f"{prefix}{label} x {R} rows", dtype, dict(fmt, O=O, I=I, R=R)) for R in rows]


# The scale dtype each FP4 kind has (E8M0 exponents as uint8; NVFP4's float8_e4m3fn).
SCALE_DTYPES = {"mxfp4": "uint8", "nvfp4": "float8_e4m3fn", "nvfp4_modelopt": "float8_e4m3fn", "mxfp8_e4m3": "uint8",
                "mxfp8_e5m2": "uint8"}


def quantized_weight(rnd: Random, lead: tuple[int, ...], I: int, *, kind, group, offset, scale_dtype):
    """Random quantized maps [*lead, I] in `kind` (abstract: shapes only), scaled for unit-scale outputs."""
    G, width = I // group, I // 2 if kind in PACKED else I
    if rnd.abstract:
        s = jax.ShapeDtypeStruct
        return QuantizedWeight(s((*lead, width), CODE_DTYPES[kind]), s((*lead, G), jnp.dtype(scale_dtype)),
                               s((*lead, G), jnp.dtype(scale_dtype)) if offset else None, kind, group,
                               s((*lead, 1), jnp.float32) if kind in NVFP4_KINDS else None)
    if kind in ("fp8",) + MXFP8_KINDS:  # random finite float8 codes: normal values cast
        codes = jnp.asarray(rnd.rng.standard_normal((*lead, width)).astype(CODE_DTYPES[kind]))
    else:
        low, high = (-127, 128) if kind == "int8" else (0, 256)
        codes = jnp.asarray(rnd.integers(low, high, (*lead, width)).astype(CODE_DTYPES[kind]))
    scale_type = jnp.dtype(scale_dtype)
    if kind in MX_KINDS:  # E8M0 exponents near 2^-(log2(sqrt(I)) + 3): unit-scale outputs, as below
        center = 127 - 3 - round(math.log2(math.sqrt(I)))
        return QuantizedWeight(codes, jnp.asarray(rnd.integers(center - 2, center + 1, (*lead, G)).astype(scale_type)),
                               None, kind, group)
    if kind in NVFP4_KINDS:  # e4m3 block scales near 1, and a global scale for unit-scale outputs
        scales = jnp.asarray((np.abs(rnd.rng.standard_normal((*lead, G))) + 0.5).astype(scale_type))
        glob = 8 * math.sqrt(I) if kind == "nvfp4" else 1 / (8 * math.sqrt(I))
        glob = jnp.asarray(np.full((*lead, 1), glob, np.float32))
        return QuantizedWeight(codes, scales, None, kind, group, glob)
    scales = jnp.asarray(np.abs(rnd.rng.standard_normal((*lead, G)) / math.sqrt(I) / 8).astype(scale_type))
    offsets = jnp.asarray((rnd.rng.standard_normal((*lead, G)) / math.sqrt(I)).astype(scale_type)) if offset else None
    return QuantizedWeight(codes, scales, offsets, kind, group)


def build(rnd: Random, dtype, *, R, O, I, kind, group, offset, scale_dtype):
    w = quantized_weight(rnd, (O,), I, kind=kind, group=group, offset=offset, scale_dtype=scale_dtype)
    return (rnd.normal((R, I), dtype), w), {}


SPEC = OpSpec("quantized_linear", "quantized_linear", PARAMS, describe,
              dict(O=96, I=256, kind="int4", group=32, offset=True, scale_dtype="float16"),
              api="kernels_pallas.quantized_linear.api", cases=cases, build=build, quantized=True)
