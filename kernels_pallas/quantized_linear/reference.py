"""The definition of correct quantized linear maps: weights kept as integer (or FP8) codes with one scale, and
optionally one offset, per group of consecutive inputs, dequantized exactly and multiplied in float32.

Formats (`QuantizedWeight.kind`), each covering the checkpoint formats named beside it:
- `int8`: int8 codes, w = code * scale (+ offset). GGUF Q8_0 (groups of 32, float16 scales); `--quantize int8`.
- `int4`: two unsigned 4-bit codes per byte, w = code * scale + offset, or (code - 8) * scale without offsets.
  GGUF Q4_1 (with offsets, its "min") and Q4_0 (without); `--quantize int4`. Within each group, byte b holds code b
  in its low nibble and code b + group/2 in its high nibble, GGUF's own layout, so its blocks are kept as they are.
- `fp8`: float8_e4m3fn codes, w = code * scale. DeepSeek-V3-style block scales become one scale per row and block
  of columns; per-tensor and per-channel scales one per row and group.
- `mxfp4`: OCP Microscaling MXFP4: two FP4 (e2m1) codes per byte, element 2i in the low nibble of byte i and 2i + 1
  in the high one (gpt-oss's `*_blocks` as they ship), and one E8M0 scale byte per group of 32, w = e2m1(code) *
  2^(scale - 127) (scale 255 is NaN). Kept as the bytes of the source's blocks and scales.
- `nvfp4`: NVIDIA's NVFP4: FP4 (e2m1) codes packed as mxfp4's, one float8_e4m3fn scale per group of 16, and one
  float32 global scale per tensor (held once per row), w = e2m1(code) * (scale / global_scale) in float32:
  compressed-tensors' `weight_global_scale` as it is, and its dequantizer's order of operations (run in float32
  rather than its default bfloat16).
- `mxfp8_e4m3`, `mxfp8_e5m2`: OCP MXFP8: one float8 code per element (e4m3 or e5m2) and one E8M0 scale byte per
  32, w = code * 2^(scale - 127). compressed-tensors' 'mxfp8-quantized' as it ships.
- `nvfp4_modelopt`: the same codes and scales as NVIDIA ModelOpt exports them (`quant_algo` NVFP4), whose per-tensor
  `weight_scale_2` multiplies: w = e2m1(code) * (scale * weight_scale_2) in float32.
Scales and offsets keep the dtype that holds them exactly (float16 for GGUF, float32 when products were needed,
uint8 E8M0 exponents for MX formats).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

KINDS = ("int8", "int4", "fp8", "mxfp4", "nvfp4", "nvfp4_modelopt", "mxfp8_e4m3", "mxfp8_e5m2")
MXFP8_KINDS = ("mxfp8_e4m3", "mxfp8_e5m2")
MX_KINDS = ("mxfp4",) + MXFP8_KINDS  # E8M0 scales per 32
NVFP4_KINDS = ("nvfp4", "nvfp4_modelopt")  # with a per-tensor global scale
CODE_DTYPES = {"int8": np.dtype(np.int8), "int4": np.dtype(np.uint8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn),
               "mxfp4": np.dtype(np.uint8), "nvfp4": np.dtype(np.uint8), "nvfp4_modelopt": np.dtype(np.uint8),
               "mxfp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn), "mxfp8_e5m2": np.dtype(ml_dtypes.float8_e5m2)}
# The largest exponent of each MX element format: the shared exponent is floor(log2(max |v|)) minus it.
MX_EMAX = {"mxfp4": 2, "mxfp8_e4m3": 8, "mxfp8_e5m2": 15}
PACKED = ("int4", "mxfp4") + NVFP4_KINDS  # two 4-bit codes per byte
NV_GROUP = 16  # NVFP4's block: one float8_e4m3fn scale per 16 elements
FP4_MAX = 6.0
MX_GROUP = 32  # the OCP MX block size: one shared E8M0 scale per 32 elements
FP8_MAX = 448.0
# The 16 values of an FP4 (e2m1) code, by code: sign bit 3, exponent bits 1..2 (bias 1), mantissa bit 0.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A weight [O, I] as codes and per-group parameters.

    Attributes:
        codes: [O, I] (int8, fp8) or [O, I/2] uint8 (int4).
        scale: [O, I/group].
        offset: [O, I/group] or None.
        kind: one of KINDS (mxfp4: codes [O, I/2] uint8, scale [O, I/32] uint8 E8M0 exponents; nvfp4: codes
            [O, I/2] uint8, scale [O, I/16] float8_e4m3fn).
        group: inputs per scale; divides I.
        global_scale: NVFP4's float32 global scale [O, 1] (the tensor's, on every row; nvfp4 divides by it,
            nvfp4_modelopt multiplies); None for other kinds.
    """

    codes: jax.Array
    scale: jax.Array
    offset: jax.Array | None
    kind: str = dataclasses.field(metadata=dict(static=True))
    group: int = dataclasses.field(metadata=dict(static=True))
    global_scale: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """The float weight's [O, I]."""
        O, n = self.codes.shape
        return O, n * 2 if self.kind in PACKED else n


def unpack_int4(codes: jax.Array, group: int) -> jax.Array:
    """[O, I/2] packed bytes -> [O, I] codes 0..15 (int32), GGUF's nibble order within each group."""
    O, n = codes.shape
    blocks = codes.reshape(O, n * 2 // group, group // 2).astype(jnp.int32)
    return jnp.concatenate([blocks & 15, blocks >> 4], axis=-1).reshape(O, n * 2)


def unpack_fp4(codes: jax.Array) -> jax.Array:
    """[O, I/2] packed bytes -> [O, I] e2m1 codes 0..15 (int32): byte i holds element 2i low, 2i + 1 high."""
    b = codes.astype(jnp.int32)
    return jnp.stack([b & 15, b >> 4], axis=-1).reshape(codes.shape[0], -1)


def e8m0_to_float(scale: jax.Array) -> jax.Array:
    """E8M0 exponent bytes -> float32 2^(s - 127), exactly: built from its bits (s << 23 is the normal float
    2^(s - 127); s = 0 is the subnormal 2^-127; 255 is the format's NaN)."""
    s = scale.astype(jnp.int32)
    bits = jnp.where(s == 0, 1 << 22, jnp.where(s == 255, 0x7FC00000, s << 23))
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def dequantize(w: QuantizedWeight) -> jax.Array:
    """The float32 weight [O, I] that `w` encodes, exactly."""
    O, I = w.shape
    G = I // w.group
    if w.kind in MXFP8_KINDS:  # float8 codes times the block's power of two (exact in float32)
        q = w.codes.astype(jnp.float32).reshape(O, G, w.group)
        return (q * e8m0_to_float(w.scale)[..., None]).reshape(O, I)
    if w.kind in ("mxfp4",) + NVFP4_KINDS:  # a 16-entry lookup, times the group's scale (exact in float32)
        q = jnp.take(jnp.asarray(E2M1), unpack_fp4(w.codes), axis=0).reshape(O, G, w.group)
        if w.kind == "mxfp4":
            return (q * e8m0_to_float(w.scale)[..., None]).reshape(O, I)
        glob = w.global_scale.astype(jnp.float32).reshape(O, 1)
        step = w.scale.astype(jnp.float32) / glob if w.kind == "nvfp4" else w.scale.astype(jnp.float32) * glob
        out = q * step[..., None]
        return out.reshape(O, I)
    if w.kind == "int4":
        q = unpack_int4(w.codes, w.group).astype(jnp.float32)
        if w.offset is None:
            q = q - 8.0
    else:
        q = w.codes.astype(jnp.float32)
    out = q.reshape(O, G, w.group) * w.scale.astype(jnp.float32)[..., None]
    if w.offset is not None:
        out = out + w.offset.astype(jnp.float32)[..., None]
    return out.reshape(O, I)


def quantized_matmul(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [R, I] times the weight's transpose: [R, O] in float32."""
    return jnp.matmul(x.astype(jnp.float32), dequantize(w).T, precision=jax.lax.Precision.HIGHEST)


def quantize(w: np.ndarray, kind: str, group: int, *, offsets: bool | None = None,
             scale_dtype: str = "bfloat16") -> QuantizedWeight:
    """Round-to-nearest weight-only quantization of a float [O, I] weight, one scale per `group` inputs.

    int8 is symmetric (codes -127..127); int4 uses offsets by default (the group's minimum, codes 0..15, as GGUF
    Q4_1), or (code - 8) * scale with `offsets=False` (as Q4_0); fp8 scales each group's largest magnitude to 448.
    Scales and offsets are stored as `scale_dtype` (bfloat16 by default: float32's range, so no group's scale
    underflows) and codes are rounded against them as stored.

    The MX kinds follow the OCP MX rule instead (`quantize_mxfp4`, `quantize_mxfp8`: power-of-two scales kept as
    E8M0 bytes), nvfp4 llm-compressor's (`quantize_nvfp4`); nvfp4_modelopt has no quantizer here (its checkpoints
    are kept as they ship).

    Raises:
        ValueError: unknown kind, nvfp4_modelopt, or a group that does not divide the inputs (or is odd for int4;
            not the format's block for the MX and NVFP4 kinds).
    """
    if kind not in KINDS or kind == "nvfp4_modelopt":
        raise ValueError(f"quantization kind {kind!r} is not one of {', '.join(KINDS)}")
    w = np.asarray(w, np.float32)
    O, I = w.shape
    if kind == "mxfp4":
        if group != MX_GROUP or I % group:
            raise ValueError(f"mxfp4 takes groups of {MX_GROUP} that divide the inputs; got {group} for a "
                             f"[{O}, {I}] weight")
        return quantize_mxfp4(w)
    if kind in MXFP8_KINDS:
        if group != MX_GROUP or I % group:
            raise ValueError(f"{kind} takes groups of {MX_GROUP} that divide the inputs; got {group} for a "
                             f"[{O}, {I}] weight")
        return quantize_mxfp8(w, kind)
    if kind == "nvfp4":
        if group != NV_GROUP or I % group:
            raise ValueError(f"nvfp4 takes groups of {NV_GROUP} that divide the inputs; got {group} for a "
                             f"[{O}, {I}] weight")
        return quantize_nvfp4(w)
    if group <= 0 or I % group or (kind == "int4" and group % 2):
        raise ValueError(f"group size {group} does not divide the {I} inputs of a [{O}, {I}] weight")
    blocks = w.reshape(O, I // group, group)
    dtype = np.dtype(ml_dtypes.bfloat16) if scale_dtype == "bfloat16" else np.dtype(scale_dtype)
    offsets = kind == "int4" if offsets is None else offsets
    if kind == "int4" and offsets:
        low, high = blocks.min(-1), blocks.max(-1)
        scale, offset = (high - low) / 15, low
        scale, offset = scale.astype(dtype), offset.astype(dtype)
        safe = np.where(scale == 0, 1, scale).astype(np.float32)
        q = np.clip(np.rint((blocks - offset.astype(np.float32)[..., None]) / safe[..., None]), 0, 15)
    else:
        if kind == "int4":  # as GGUF Q4_0: the largest magnitude maps exactly to code 0, (0 - 8) * scale
            extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0]
            scale, offset = extreme / -8, None
        else:
            scale, offset = np.abs(blocks).max(-1) / (127 if kind == "int8" else FP8_MAX), None
        scale = scale.astype(dtype)
        safe = np.where(scale == 0, 1, scale).astype(np.float32)
        scaled = blocks / safe[..., None]
        if kind == "fp8":
            q = np.clip(scaled, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
        else:
            q = np.clip(np.rint(scaled), -127, 127) if kind == "int8" else np.clip(np.rint(scaled) + 8, 0, 15)
    codes = q.reshape(O, I).astype(CODE_DTYPES[kind]) if kind != "int4" else pack_int4(q.reshape(O, I), group)
    return QuantizedWeight(codes, scale, offset, kind, group)


def pack_int4(q: np.ndarray, group: int) -> np.ndarray:
    """[O, I] codes 0..15 -> [O, I/2] bytes in `unpack_int4`'s layout."""
    O, I = q.shape
    blocks = q.reshape(O, I // group, group).astype(np.uint8)
    half = group // 2
    return (blocks[..., :half] | (blocks[..., half:] << 4)).reshape(O, I // 2)


def quantize_mxfp4(w: np.ndarray) -> QuantizedWeight:
    """A float [O, I] weight as MXFP4 by the OCP MX v1.0 rule: each block of 32 shares the exponent
    X = floor(log2(max |v|)) - 2 (2 being e2m1's largest exponent; a block of zeros takes the smallest, -127),
    clamped to E8M0's [-127, 127]; each v / 2^X is rounded to the nearest e2m1 value (ties to even), magnitudes past
    6 saturating to 6."""
    w = np.asarray(w, np.float32)
    O, I = w.shape
    blocks = w.reshape(O, I // MX_GROUP, MX_GROUP)
    amax = np.abs(blocks).max(-1)
    _, e = np.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): floor(log2(amax)) = e - 1, exactly
    X = np.clip(np.where(amax > 0, e - 1 - 2, -127), -127, 127).astype(np.int32)
    scaled = np.ldexp(blocks, -X[..., None])
    codes = np.clip(scaled, -6.0, 6.0).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 15
    pairs = codes.reshape(O, I // 2, 2)
    return QuantizedWeight(pairs[..., 0] | (pairs[..., 1] << 4), (X + 127).astype(np.uint8), None, "mxfp4", MX_GROUP)


def quantize_nvfp4(w: np.ndarray) -> QuantizedWeight:
    """A float [O, I] weight as NVFP4, as llm-compressor makes it: global scale 448 * 6 / max |w| over the tensor
    (float32), each block of 16's scale max |v| / 6 * global rounded to float8_e4m3fn, each v divided by
    scale / global (float32) and rounded to the nearest e2m1 (ties to even, saturating at 6)."""
    w = np.asarray(w, np.float32)
    O, I = w.shape
    amax = np.float32(np.abs(w).max())
    g = np.float32(FP8_MAX * FP4_MAX) / amax if amax > 0 else np.float32(1.0)
    blocks = w.reshape(O, I // NV_GROUP, NV_GROUP)
    scale = (np.abs(blocks).max(-1) / np.float32(FP4_MAX) * g).astype(ml_dtypes.float8_e4m3fn)
    step = scale.astype(np.float32) / g
    scaled = blocks / np.where(step == 0, np.float32(1), step)[..., None]
    codes = np.clip(scaled, -FP4_MAX, FP4_MAX).astype(ml_dtypes.float4_e2m1fn).view(np.uint8).reshape(O, I) & 15
    pairs = codes.reshape(O, I // 2, 2)
    return QuantizedWeight(pairs[..., 0] | (pairs[..., 1] << 4), scale, None, "nvfp4", NV_GROUP,
                           np.full((O, 1), g, np.float32))


def quantize_mxfp8(w: np.ndarray, kind: str) -> QuantizedWeight:
    """A float [O, I] weight as MXFP8 by the OCP MX v1.0 rule: per block of 32, X = floor(log2(max |v|)) - emax
    (8 for e4m3, 15 for e5m2; -127 for a block of zeros), clamped to [-127, 127]; each v / 2^X rounded to the
    element format (to nearest even), magnitudes past its largest normal saturating to it."""
    w = np.asarray(w, np.float32)
    O, I = w.shape
    blocks = w.reshape(O, I // MX_GROUP, MX_GROUP)
    amax = np.abs(blocks).max(-1)
    _, e = np.frexp(amax)
    X = np.clip(np.where(amax > 0, e - 1 - MX_EMAX[kind], -127), -127, 127).astype(np.int32)
    dtype = CODE_DTYPES[kind]
    top = float(ml_dtypes.finfo(dtype).max)
    codes = np.clip(np.ldexp(blocks, -X[..., None]), -top, top).astype(dtype).reshape(O, I)
    return QuantizedWeight(codes, (X + 127).astype(np.uint8), None, kind, MX_GROUP)
