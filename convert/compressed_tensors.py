"""compressed-tensors checkpoints (llm-compressor's `quantization_config.quant_method == "compressed-tensors"`):
weight-only integer quantization, read as the quantized blocks day0jax keeps.

Supported: `format` 'pack-quantized' (4-bit values, eight per int32 in `weight_packed`, the float shape in
`weight_shape`) and 'int-quantized' / 'naive-quantized' (8-bit values in an int8 `weight`); `strategy` 'group' or
'channel' (one group spanning the row); symmetric, or asymmetric with `weight_zero_point`. A signed 4-bit value v is
packed as v + 8, so w = (q - 8) * scale, day0jax's symmetric int4; zero points z give w = q * s + (-z * s).
FP8 weights ('float-quantized', `type` 'float', 8 bits: float8_e4m3fn in `weight`) with `strategy` 'tensor',
'channel', 'group' or 'block' (`block_structure`), w = code * scale: their activations, quantized dynamically or
with static `input_scale`s in the checkpoint, stay in float (weight-only FP8, as vLLM runs FP8 on GPUs without FP8
arithmetic; closer to the unquantized model). NVFP4 ('nvfp4-pack-quantized': FP4 e2m1 codes two per byte in
`weight_packed`, a float8_e4m3fn `weight_scale` per 16 inputs, a float32 `weight_global_scale` per tensor) is kept
as those three; its FP4 activations likewise stay in float (weight-only, as on hardware without FP4 arithmetic).
The MX formats ('mxfp8-quantized': float8 values in `weight`; 'mxfp4-pack-quantized': FP4 codes in `weight_packed`;
a uint8 E8M0 `weight_scale` per 32 inputs) are kept as they are, their activations in float likewise.
Quantized activations with integer weights (W8A8, W4A8), other bit widths and other strategies are refused by
name.
"""

from __future__ import annotations

from dataclasses import dataclass

import logging

import ml_dtypes
import numpy as np

from day0jax.core.errors import CheckpointError

PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx", "input_scale",
         "input_zero_point", "weight_global_scale", "input_global_scale")
FLOAT_STRATEGIES = ("tensor", "channel", "group", "block")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scheme:
    bits: int
    group: int | None  # None: one group per row (strategies 'channel' and 'tensor')
    symmetric: bool
    packed: bool  # weight_packed int32 words (else the values in `weight`)
    fp8: bool = False  # float8_e4m3fn values
    block: tuple[int, int] | None = None  # FP8 'block' strategy: one scale per [rows, columns] block
    fp4: bool = False  # NVFP4: e2m1 codes, e4m3 scales per 16, a float32 global scale
    mx: bool = False  # MXFP8 / MXFP4: float8 values or packed e2m1 codes, E8M0 scales per 32


def scheme(path, q: dict) -> Scheme:
    """The one weight scheme of a compressed-tensors config.

    Raises:
        CheckpointError: several or unsupported schemes, quantized activations, an unknown format; named.
    """
    groups = q.get("config_groups") or {}
    fmt = q.get("format")
    if len(groups) != 1:
        raise CheckpointError(f"{path}: compressed-tensors with {len(groups)} config groups; day0jax reads one")
    (name, group), = groups.items()
    w = group.get("weights") or {}
    if w.get("type") == "float" and fmt == "nvfp4-pack-quantized":
        return _nvfp4_scheme(path, name, group)
    if w.get("type") == "float" and fmt in ("mxfp8-quantized", "mxfp4-pack-quantized"):
        return _mx_scheme(path, name, group, fmt)
    if w.get("type") == "float":
        return _fp8_scheme(path, name, group, fmt)
    for side in ("input_activations", "output_activations"):
        if group.get(side):
            raise CheckpointError(f"{path}: compressed-tensors group {name!r} quantizes {side} ({group[side]}); "
                                  "day0jax keeps weight-only quantization")
    bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
    if kind != "int" or bits not in (4, 8) or strategy not in ("group", "channel") or w.get("actorder"):
        raise CheckpointError(f"{path}: compressed-tensors weights {w} are not supported (int, 4 or 8 bits, "
                              "strategy group or channel, no activation ordering)")
    packed = fmt == "pack-quantized"
    if fmt not in ("pack-quantized", "int-quantized", "naive-quantized") or (bits == 4) != packed:
        raise CheckpointError(f"{path}: compressed-tensors format {fmt!r} with {bits}-bit weights is not supported "
                              "('pack-quantized' 4-bit, 'int-quantized' 8-bit)")
    return Scheme(bits, w.get("group_size") if strategy == "group" else None, bool(w.get("symmetric", True)), packed)


def _fp8_scheme(path, name: str, group: dict, fmt) -> Scheme:
    """An FP8 weight scheme; quantized input activations (FP8 too) are left in float, and said so."""
    w = group["weights"]
    strategy, block = w.get("strategy"), w.get("block_structure")
    if w.get("num_bits") != 8 or strategy not in FLOAT_STRATEGIES or not w.get("symmetric", True) \
            or fmt not in ("float-quantized", "naive-quantized") \
            or (strategy == "block" and not (isinstance(block, list) and len(block) == 2)):
        raise CheckpointError(f"{path}: compressed-tensors format {fmt!r} with float weights {w} is not supported "
                              f"('float-quantized' 8-bit symmetric, strategy one of {', '.join(FLOAT_STRATEGIES)})")
    _weight_only(path, name, group, " to FP8", "the FP8 weights (weight-only FP8)")
    return Scheme(8, w.get("group_size") if strategy == "group" else None, True, False, fp8=True,
                  block=tuple(block) if strategy == "block" else None)


def _weight_only(path, name: str, group: dict, to: str, weights: str) -> None:
    """Refuses quantized output activations; says that quantized input activations (quantized `to` a format) stay
    in float, multiplied by `weights`.

    Raises:
        CheckpointError: the group quantizes output_activations.
    """
    if group.get("output_activations"):
        raise CheckpointError(f"{path}: compressed-tensors group {name!r} quantizes output_activations; day0jax "
                              "keeps weight-only quantization")
    if group.get("input_activations"):
        log.warning("%s: the checkpoint quantizes input activations%s (%s); they stay in float, multiplied by %s",
                    path, to, group["input_activations"], weights)


def _nvfp4_scheme(path, name: str, group: dict) -> Scheme:
    """NVFP4 weights; FP4 input activations are left in float, and said so."""
    w = group["weights"]
    if w.get("num_bits") != 4 or w.get("group_size") != 16 or not w.get("symmetric", True) \
            or w.get("strategy") not in ("tensor_group", "group"):
        raise CheckpointError(f"{path}: compressed-tensors 'nvfp4-pack-quantized' with weights {w} is not supported "
                              "(4-bit float, symmetric, groups of 16)")
    _weight_only(path, name, group, " to FP4",
                 "the NVFP4 weights (weight-only, as on hardware without FP4 arithmetic)")
    return Scheme(4, 16, True, True, fp4=True)


def _mx_scheme(path, name: str, group: dict, fmt: str) -> Scheme:
    """MXFP8 or MXFP4 weights; quantized input activations are left in float, and said so."""
    w, bits = group["weights"], 4 if fmt == "mxfp4-pack-quantized" else 8
    if w.get("num_bits") != bits or w.get("group_size") != 32 or not w.get("symmetric", True):
        raise CheckpointError(f"{path}: compressed-tensors {fmt!r} with weights {w} is not supported ({bits}-bit "
                              "float, symmetric, groups of 32)")
    _weight_only(path, name, group, "",
                 "the MX weights (weight-only, as on hardware without FP4 or FP8 arithmetic)")
    return Scheme(bits, 32, True, bits == 4, mx=True)


class CompressedTensors:
    """The quantized weights of an opened HF folder, each seen as its float `X.weight` (shape, float read) or its
    blocks (`quant_spec`, `read_quantized`). `read_part(name)` reads a stored tensor; `has(name)` asks for one."""

    PARTS = PARTS  # the stored tensors of one weight, by suffix

    def __init__(self, path, q: dict, names: list[str], read_part, dtype_of, shape_of):
        self.path, self.scheme, self._read, self._dtype_of = path, scheme(path, q), read_part, dtype_of
        self.weights: dict[str, tuple[int, int]] = {}  # X.weight -> float shape [O, I]
        present = set(names)
        for n in names:
            if n.endswith(".weight_scale"):
                base = n[: -len("_scale")]
                if self.scheme.mx and dtype_of(n) != np.dtype(np.uint8):
                    raise CheckpointError(f"{path}: {n!r} is {dtype_of(n)}; MX scales are uint8 E8M0 exponents")
                if self.scheme.mx and self.scheme.bits == 8:
                    if dtype_of(base) not in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)):
                        raise CheckpointError(f"{path}: {base!r} is {dtype_of(base)}; MXFP8 weights are "
                                              "float8_e4m3fn or float8_e5m2")
                    shape = tuple(shape_of(base))
                elif self.scheme.mx:
                    O, half = shape_of(base + "_packed")
                    shape = (int(O), 2 * int(half))
                elif self.scheme.fp4:  # uint8 [O, I/2]: the shape is the packed one's, its inputs doubled
                    if dtype_of(base + "_packed") != np.dtype(np.uint8) or base + "_global_scale" not in present:
                        raise CheckpointError(f"{path}: NVFP4 weight {base!r} needs a uint8 {base + '_packed'!r} "
                                              f"and a {base + '_global_scale'!r}")
                    O, half = shape_of(base + "_packed")
                    shape = (int(O), 2 * int(half))
                elif self.scheme.packed:
                    shape = tuple(int(v) for v in np.asarray(read_part(base + "_shape")).reshape(-1))
                else:
                    want = np.dtype(ml_dtypes.float8_e4m3fn) if self.scheme.fp8 else np.dtype(np.int8)
                    if dtype_of(base) != want:
                        raise CheckpointError(f"{path}: {base!r} is {dtype_of(base)}; these 8-bit "
                                              f"compressed-tensors weights are {want}")
                    shape = tuple(shape_of(base))
                self.weights[base] = shape
        self._parts = {f"{w[: -len('weight')]}{p}" for w in self.weights for p in PARTS}

    def hides(self, name: str) -> bool:
        """A stored part (packed words, scales, zero points) that the `X.weight` view stands for."""
        return name in self._parts and not name.endswith(".weight")

    def spec(self, name: str):
        from day0jax.layers.quantized import QuantSpec

        if name not in self.weights:
            return None
        O, I = self.weights[name]
        group = self.scheme.block[1] if self.scheme.block else self.scheme.group or I
        if I % group or group % (16 if self.scheme.fp8 else 2):
            raise CheckpointError(f"{self.path}: {name!r} has groups of {group} over {I} inputs, which day0jax "
                                  "does not keep; convert with --dequantize")
        if self.scheme.fp4:
            return QuantSpec("nvfp4", group, offset=False, scale_dtype="float8_e4m3fn")
        if self.scheme.mx:
            e5m2 = self.scheme.bits == 8 and self._dtype_of(name) == np.dtype(ml_dtypes.float8_e5m2)
            kind = "mxfp4" if self.scheme.bits == 4 else "mxfp8_e5m2" if e5m2 else "mxfp8_e4m3"
            return QuantSpec(kind, group, offset=False, scale_dtype="uint8")
        if self.scheme.fp8:
            return QuantSpec("fp8", group, offset=False, scale_dtype="float32")
        return QuantSpec("int4" if self.scheme.bits == 4 else "int8", group, offset=not self.scheme.symmetric,
                         scale_dtype=self._scale_dtype(name))

    def _scale_dtype(self, name: str) -> str:
        if not self.scheme.symmetric:
            return "float32"  # offsets -z * s: exact in float32, not always in the scales' 16 bits
        dtype = np.asarray(self._read(name + "_scale")).dtype
        return {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32"}.get(dtype, "bfloat16")

    def read_quantized(self, name: str):
        """Tensor `name`'s blocks as a `QuantizedWeight` of numpy arrays, in day0jax's layouts."""
        from kernels_pallas.quantized_linear.reference import QuantizedWeight, pack_int4

        spec = self.spec(name)
        O, I = self.weights[name]
        G = I // spec.group
        if self.scheme.mx:
            scale = np.asarray(self._read(name + "_scale"))
            codes = np.asarray(self._read(name + ("_packed" if self.scheme.bits == 4 else "")))
            if scale.shape != (O, G):
                raise CheckpointError(f"{self.path}: {name + '_scale'!r} has shape {scale.shape}; [{O}, {G}] (one "
                                      "E8M0 scale per 32 inputs) is the MX format's")
            return QuantizedWeight(np.ascontiguousarray(codes), np.ascontiguousarray(scale), None, spec.kind,
                                   spec.group)
        if self.scheme.fp4:
            scale = np.asarray(self._read(name + "_scale"))
            glob = np.asarray(self._read(name + "_global_scale"))
            if scale.dtype != np.dtype(ml_dtypes.float8_e4m3fn) or scale.shape != (O, G) or glob.size != 1:
                raise CheckpointError(f"{self.path}: NVFP4 weight {name!r} has scales {scale.dtype} {scale.shape} "
                                      f"and a global scale of {glob.size} elements (float8_e4m3fn [{O}, {G}] and "
                                      "one are its format)")
            return QuantizedWeight(np.ascontiguousarray(self._read(name + "_packed")), np.ascontiguousarray(scale),
                                   None, spec.kind, spec.group, np.full((O, 1), glob.reshape(()), np.float32))
        if self.scheme.fp8:
            return QuantizedWeight(np.ascontiguousarray(self._values(name)), self._fp8_scales(name, O, G), None,
                                   spec.kind, spec.group)
        scale = np.asarray(self._read(name + "_scale")).reshape(O, G)
        q = self._values(name)  # [O, I], unsigned 4-bit values, or int8 values
        offset = None
        if not self.scheme.symmetric:
            zero = self._zero_points(name, O, G).astype(np.float32)
            scale = scale.astype(np.float32)
            offset = -zero * scale
        # 4-bit values are stored as v + 8: day0jax's symmetric codes as they are, and with zero points (stored
        # as z + 8 too) w = (q - z) s = q s + (-z s) on the unsigned values.
        codes = pack_int4(q, spec.group) if spec.kind == "int4" else q.astype(np.int8)
        return QuantizedWeight(np.ascontiguousarray(codes), np.ascontiguousarray(scale.astype(spec.scale_dtype)),
                               offset, spec.kind, spec.group)

    def dequantize(self, name: str) -> np.ndarray:
        """The float32 weight (for --dequantize, or where the runtime keeps the parameter float)."""
        from kernels_pallas.quantized_linear.reference import dequantize

        return np.asarray(dequantize(self.read_quantized(name)))

    def _fp8_scales(self, name: str, O: int, G: int) -> np.ndarray:
        """float32 [O, G]: an FP8 weight's scales per row and group, from one per tensor, row, group or block.

        Raises:
            CheckpointError: a scale tensor whose size fits none of these.
        """
        scale = np.asarray(self._read(name + "_scale")).astype(np.float32)
        if self.scheme.block:
            bm = self.scheme.block[0]
            if scale.shape == (-(-O // bm), G):
                return np.repeat(scale, bm, axis=0)[:O]
        elif scale.size == O * G:
            return scale.reshape(O, G)
        elif scale.size == 1:
            return np.full((O, G), scale.reshape(()))
        raise CheckpointError(f"{self.path}: {name + '_scale'!r} has shape {scale.shape}, which does not fit "
                              f"{self.weights[name]} weights with {G} groups per row"
                              + (f" and blocks of {self.scheme.block}" if self.scheme.block else ""))

    def _values(self, name: str) -> np.ndarray:
        O, I = self.weights[name]
        if not self.scheme.packed:
            return np.asarray(self._read(name))
        words = np.asarray(self._read(name + "_packed")).astype(np.uint32)  # [O, ceil(I / 8)]
        shifts = np.arange(8, dtype=np.uint32) * 4
        return ((words[..., None] >> shifts) & 15).astype(np.uint8).reshape(O, -1)[:, :I]

    def _zero_points(self, name: str, O: int, G: int) -> np.ndarray:
        z = np.asarray(self._read(name + "_zero_point"))
        if self.scheme.packed:  # eight 4-bit zero points per int32 along the rows: [ceil(O / 8), G]
            shifts = np.arange(8, dtype=np.uint32) * 4
            z = ((z.astype(np.uint32)[:, None, :] >> shifts[None, :, None]) & 15).reshape(-1, G)[:O]
        return z.reshape(O, G)
