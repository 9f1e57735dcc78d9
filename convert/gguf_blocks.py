"""GGUF's quantized blocks as day0jax's quantized formats: codes and one scale (and offset) per group of inputs.

Q8_0, Q4_0 and Q4_1 are kept block for block (float16 scales over 32 values). The others are re-blocked without a
wider float than the source encodes: a K-quant's sub-block scale is the product of its super-block's float16 scale
and a 4- to 8-bit integer, exact in float32, so its groups carry float32 scales; the integer codes are kept as they
are (Q2_K's, Q3_K's and Q4_K's as 4-bit codes, the 5- and 6-bit ones as int8). Dequantized, every value is bitwise
the `gguf` package's (tests/test_kernels_quantized_linear.py): the same float32 products and sums. Layouts follow
the `gguf` package's `quants.py` (llama.cpp's ggml-quants.c).

| GGUF | values per block, bytes | kept as |
|---|---|---|
| Q8_0 | 32, 34 | int8, float16 scale per 32 |
| Q4_0 / Q4_1 | 32, 18 / 20 | int4 (GGUF's nibble order), float16 scale (and min) per 32 |
| Q5_0 / Q5_1 | 32, 22 / 24 | int8 (q - 16 / q), float16 scale (and min) per 32 |
| Q4_K | 256, 144 | int4, float32 scale and offset per 32 |
| Q5_K | 256, 176 | int8 (0..31), float32 scale and offset per 32 |
| Q6_K | 256, 210 | int8 (q - 32), float32 scale per 16 |
| Q3_K | 256, 110 | int4 (q + 8, day0jax's symmetric codes), float32 scale per 16 |
| Q2_K | 256, 84 | int4 (0..3), float32 scale and offset per 16 |
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kernels_pallas.quantized_linear.reference import pack_int4


class Format(NamedTuple):
    """How one GGML type is kept: `kind` and `group` of the quantized op, offsets or not, the scales' dtype, and the
    bytes of one GGUF block of `block` values."""

    kind: str
    group: int
    offset: bool
    scale_dtype: str
    block: int
    block_bytes: int


# GGML type id -> its kept format.
FORMATS = {8: Format("int8", 32, False, "float16", 32, 34), 2: Format("int4", 32, False, "float16", 32, 18),
           3: Format("int4", 32, True, "float16", 32, 20), 6: Format("int8", 32, False, "float16", 32, 22),
           7: Format("int8", 32, True, "float16", 32, 24), 12: Format("int4", 32, True, "float32", 256, 144),
           13: Format("int8", 32, True, "float32", 256, 176), 14: Format("int8", 16, False, "float32", 256, 210),
           11: Format("int4", 16, False, "float32", 256, 110), 10: Format("int4", 16, True, "float32", 256, 84)}


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float16 values as float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes per super-block -> eight 6-bit sub-block scales and eight 6-bit mins, [n, 8] each."""
    d, m, hi = scales.reshape(-1, 3, 4).transpose(1, 0, 2)
    sc = np.concatenate([d & 0x3F, (hi & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (hi >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mins.astype(np.float32)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """Bytes [n, k * run] holding runs of `run` low nibbles then `run` high nibbles -> [n, 2 * k * run] values."""
    n = qs.shape[0]
    return ((qs.reshape(n, -1, 1, run) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, -1)


def reblock(type_id: int, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """One tensor's GGUF blocks as (codes, scale, offset) of its kept format: `raw` is [rows, bytes] (a GGUF row
    each); codes [rows, inputs] (int4: packed [rows, inputs / 2]), scale and offset [rows, inputs / group]."""
    fmt = FORMATS[type_id]
    rows = raw.shape[0]
    b = np.asarray(raw).reshape(-1, fmt.block_bytes)  # one GGUF block per row of b
    n = b.shape[0]
    offset = None
    if type_id == 8:  # Q8_0: d, int8 q[32]
        scale, codes = _f16(b[:, 0:2]), b[:, 2:].copy().view(np.int8)
    elif type_id in (2, 3):  # Q4_0 / Q4_1: d, (m,) nibbles in GGUF's order, which is the int4 format's own
        scale = _f16(b[:, 0:2])
        if type_id == 3:
            offset = _f16(b[:, 2:4])
        packed = b[:, 4 if type_id == 3 else 2:]
        return (np.ascontiguousarray(packed.reshape(rows, -1)), scale.reshape(rows, -1).astype(np.float16),
                None if offset is None else offset.reshape(rows, -1).astype(np.float16))
    elif type_id in (6, 7):  # Q5_0 / Q5_1: d, (m,) 32 high bits, 16 bytes of low nibbles
        at = 4 if type_id == 7 else 2
        scale = _f16(b[:, 0:2])
        high = (b[:, at:at + 4].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
        q = _nibbles(b[:, at + 4:], 16) | (high.astype(np.uint8) << 4)
        if type_id == 7:
            offset, codes = _f16(b[:, 2:4]), q.astype(np.int8)
        else:
            codes = (q.astype(np.int16) - 16).astype(np.int8)
    elif type_id in (12, 13):  # Q4_K / Q5_K: d, dmin, 12 bytes of scales and mins, (32 bytes of high bits,) nibbles
        d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
        sc, mins = _k_scales(b[:, 4:16])
        scale, offset = d * sc, -(dmin * mins)
        if type_id == 12:
            codes = _nibbles(b[:, 16:], 32)
        else:  # bit j of high byte i belongs to sub-block j's value i
            bits = (b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
            codes = (_nibbles(b[:, 48:], 32) | (bits.reshape(n, 256) << 4)).astype(np.int8)
    elif type_id == 11:  # Q3_K: 32 bytes of high bits, 64 of 2-bit low parts, 12 bytes of 6-bit scales, d
        low = (b[:, 32:96].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        high = (b[:, :32].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        q = low.reshape(n, 256).astype(np.int16) - ((high.reshape(n, 256) ^ 1) << 2)  # -4..3: a set bit adds 0
        codes = (q + 8).astype(np.uint8)
        packed = b[:, 96:108]
        lo = ((packed[:, :8].reshape(n, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)) & 0x0F).reshape(n, 16)
        hi = ((packed[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)) & 3).reshape(n, 16)
        scale = _f16(b[:, 108:110])[:, None] * ((lo | (hi << 4)).astype(np.float32) - 32)
    elif type_id == 10:  # Q2_K: 16 bytes of 4-bit scales and mins, 64 of 2-bit values, d, dmin
        sc = b[:, :16]
        d, dmin = _f16(b[:, 80:82])[:, None], _f16(b[:, 82:84])[:, None]
        scale, offset = d * (sc & 0x0F).astype(np.float32), -(dmin * (sc >> 4).astype(np.float32))
        codes = ((b[:, 16:80].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1))
                 & 3).reshape(n, 256)
    else:  # Q6_K: 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales, d
        low = _nibbles(b[:, :128], 64)
        high = (b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        q = low | (high.reshape(n, 256) << 4)
        codes = (q.astype(np.int16) - 32).astype(np.int8)
        scale = _f16(b[:, 208:210])[:, None] * b[:, 192:208].copy().view(np.int8).astype(np.float32)
    codes = codes.reshape(rows, -1)
    if fmt.kind == "int4":
        codes = pack_int4(codes.astype(np.uint8), fmt.group)
    dtype = np.dtype(fmt.scale_dtype)
    return (np.ascontiguousarray(codes), scale.reshape(rows, -1).astype(dtype),
            None if offset is None else offset.reshape(rows, -1).astype(dtype))
