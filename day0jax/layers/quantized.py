"""Weights kept quantized in memory: a `Linear`'s kernel, an `Embedding`'s table or MoE experts' stacked weights as
codes with per-group scales.

A converted checkpoint's config.json names its quantized weights and their `QuantSpec` (`quantization_config`,
quant_method 'day0jax'); `quantize_modules` swaps each float parameter for a `QuantizedKernel` (or, for experts, a
`QuantizedExperts`) before the weights are restored, so every consumer (the loader, the memory planner, sharding)
sees the quantized parameters' own shapes and dtypes. The codes keep the float kernel's output dims and logical axes
and one flattened input dim (two 4-bit codes per byte), the scales one entry per group along it, so tensor
parallelism splits codes and scales alike."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from day0jax.core.errors import CheckpointError
from kernels_pallas.calls import OpCall
from kernels_pallas.quantized_linear import api as quantized_linear
from kernels_pallas.quantized_linear.reference import (CODE_DTYPES, KINDS, MX_GROUP, NV_GROUP, NVFP4_KINDS,
                                                       PACKED, QuantizedWeight, dequantize)

# uint8 scales are the E8M0 exponents of the MX formats (and only theirs); float8_e4m3fn NVFP4's block scales.
SCALE_DTYPES = ("float16", "bfloat16", "float32", "uint8", "float8_e4m3fn")
# The scale dtype and group each MX and NVFP4 kind requires (their formats fix both).
FIXED_FORMATS = {"mxfp4": ("uint8", MX_GROUP), "nvfp4": ("float8_e4m3fn", NV_GROUP),
                 "nvfp4_modelopt": ("float8_e4m3fn", NV_GROUP), "mxfp8_e4m3": ("uint8", MX_GROUP),
                 "mxfp8_e5m2": ("uint8", MX_GROUP)}
# config.json's `quantization_config.quant_method` of a converted checkpoint with quantized weights.
QUANT_METHOD = "day0jax"


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How one module's weight is stored: `kind` (one of `kernels_pallas.quantized_linear`'s KINDS), inputs per
    scale `group`, whether groups carry an `offset`, and the dtype of scales and offsets (uint8: E8M0 exponents)."""

    kind: str
    group: int
    offset: bool = False
    scale_dtype: str = "float16"

    def __post_init__(self):
        fixed = FIXED_FORMATS.get(self.kind)
        if self.kind not in KINDS or self.scale_dtype not in SCALE_DTYPES or self.group <= 0 \
                or (self.kind == "int4" and self.group % 2) \
                or (self.scale_dtype in ("uint8", "float8_e4m3fn")) != (fixed is not None) \
                or (fixed and ((self.scale_dtype, self.group) != fixed or self.offset)):
            raise CheckpointError(f"quantization {self.to_json()} is not a format day0jax knows (kinds: "
                                  f"{', '.join(KINDS)}; scale dtypes: {', '.join(SCALE_DTYPES)}; the MX kinds take "
                                  f"groups of {MX_GROUP} with uint8 E8M0 scales, the NVFP4 ones groups of {NV_GROUP} "
                                  "with float8_e4m3fn scales, none an offset)")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "QuantSpec":
        try:
            return cls(**d)
        except TypeError as e:
            raise CheckpointError(f"quantization entry {d} is malformed ({e})") from None

    def describe(self) -> str:
        return f"{self.kind}/{self.group}" + ("+offset" if self.offset else "")


class QuantizedKernel(nnx.Module):
    """A float weight [*out, *in] (HF's [out, in] with heads as their own dims) kept as `codes` [*out, I'], `scale`
    and optionally `offset` [*out, I / group], the input dims flattened (groups may span heads, as in the source's
    [out, in] layout) and named by the first input dim's logical axis; `shape` is the float weight's."""

    def __init__(self, shape: tuple[int, ...], axes: tuple[str | None, ...], in_ndim: int, spec: QuantSpec):
        self.shape, self.in_ndim, self.spec = tuple(shape), in_ndim, spec
        n_out = len(self.shape) - in_ndim
        out_shape, inputs = self.shape[:n_out], math.prod(self.shape[n_out:])
        if inputs % spec.group:
            raise CheckpointError(f"a weight of shape {self.shape} cannot take groups of {spec.group}: its "
                                  f"{inputs} inputs are not a multiple")
        flat_axes = tuple(axes[:n_out]) + (axes[n_out],)
        meta = dict(quantized=spec.kind, in_ndim=1)
        self.codes = _param((*out_shape, inputs // 2 if spec.kind in PACKED else inputs), flat_axes,
                            CODE_DTYPES[spec.kind], meta)
        self.scale = _param((*out_shape, inputs // spec.group), flat_axes, scale_dtype(spec), meta)
        self.offset = _param((*out_shape, inputs // spec.group), flat_axes, np.dtype(spec.scale_dtype), meta) \
            if spec.offset else None
        # NVFP4's per-tensor global scale, once per row so that it splits with the rows.
        self.global_scale = _param((*out_shape, 1), flat_axes[:-1] + (None,), np.dtype(np.float32), meta) \
            if spec.kind in NVFP4_KINDS else None

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:len(self.shape) - self.in_ndim])

    def op_call(self) -> OpCall:
        return OpCall.of("quantized_linear", O=self.rows, I=math.prod(self.shape) // self.rows, kind=self.spec.kind,
                         group=self.spec.group, offset=self.spec.offset, scale_dtype=self.spec.scale_dtype)

    def weight(self) -> QuantizedWeight:
        """As the op takes it: [O, I] codes and [O, groups] scales."""
        O = self.rows
        offset = None if self.offset is None else self.offset[...].reshape(O, -1)
        glob = None if self.global_scale is None else self.global_scale[...].reshape(O, 1)
        return QuantizedWeight(self.codes[...].reshape(O, -1), self.scale[...].reshape(O, -1), offset,
                               self.spec.kind, self.spec.group, glob)

    def matmul(self, x: jax.Array) -> jax.Array:
        """x [..., *in] -> [..., *out], in x's dtype."""
        n_out = len(self.shape) - self.in_ndim
        lead = x.shape[:x.ndim - self.in_ndim]
        x2 = x.reshape(math.prod(lead), -1)
        y = quantized_linear.quantized_matmul(x2, self.weight())  # float32 out; x's dtype picks the candidate
        return y.astype(x.dtype).reshape(*lead, *self.shape[:n_out])

    def rows_of(self, index: jax.Array, dtype) -> jax.Array:
        """Rows `index` (any shape) of an [N, D] table, dequantized: [*index.shape, D] (embedding lookups)."""
        w = self.weight()
        picked = QuantizedWeight(jnp.take(w.codes, index.reshape(-1), axis=0),
                                 jnp.take(w.scale, index.reshape(-1), axis=0),
                                 None if w.offset is None else jnp.take(w.offset, index.reshape(-1), axis=0),
                                 w.kind, w.group,
                                 None if w.global_scale is None else jnp.take(w.global_scale, index.reshape(-1), 0))
        return dequantize(picked).astype(dtype).reshape(*index.shape, -1)


class QuantizedExperts(nnx.Module):
    """MoE experts' stacked weight [E, I, O] (the `Experts` layout, x @ W) kept as each expert's [O, I] map, as
    checkpoints store them: `codes` [E, O, I'], `scale` and optionally `offset` [E, O, I / group], logical axes
    those of the float weight's expert, output and input dims; `shape` is the float weight's."""

    def __init__(self, shape: tuple[int, int, int], axes: tuple[str | None, ...], spec: QuantSpec):
        E, I, O = shape
        self.shape, self.spec = tuple(shape), spec
        if I % spec.group:
            raise CheckpointError(f"experts' weight of shape {self.shape} cannot take groups of {spec.group}: its "
                                  f"{I} inputs are not a multiple")
        stored_axes = (axes[0], axes[2], axes[1])
        meta = dict(quantized=spec.kind, in_ndim=1)
        self.codes = _param((E, O, I // 2 if spec.kind in PACKED else I), stored_axes, CODE_DTYPES[spec.kind], meta)
        self.scale = _param((E, O, I // spec.group), stored_axes, scale_dtype(spec), meta)
        self.offset = _param((E, O, I // spec.group), stored_axes, np.dtype(spec.scale_dtype), meta) \
            if spec.offset else None
        self.global_scale = _param((E, O, 1), stored_axes[:-1] + (None,), np.dtype(np.float32), meta) \
            if spec.kind in NVFP4_KINDS else None

    def weight(self) -> QuantizedWeight:
        """As the grouped matmul takes it: codes [E, O, I'], scales [E, O, groups]."""
        return QuantizedWeight(self.codes[...], self.scale[...], None if self.offset is None else self.offset[...],
                               self.spec.kind, self.spec.group,
                               None if self.global_scale is None else self.global_scale[...])


def quantized_op_calls(model: nnx.Module) -> list[tuple[int | None, OpCall]]:
    """(layer index, call) of every quantized weight of a language model (None: outside the decoder layers, as the
    embeddings and the output projection)."""
    out = []
    for path, m in nnx.iter_modules(model):
        if isinstance(m, QuantizedKernel):
            layer = path[2] if tuple(path[:2]) == ("model", "layers") else None
            out.append((layer, m.op_call()))
    return out


def parameter_count(model: nnx.Module) -> int:
    """The model's parameters as weights, not stored elements: a quantized weight counts its float shape."""
    quantized = sum(math.prod(m.shape) for _, m in nnx.iter_modules(model)
                    if isinstance(m, (QuantizedKernel, QuantizedExperts)))
    plain = sum(math.prod(v.get_value().shape) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
                if not v.get_metadata().get("quantized"))
    return quantized + plain


def scale_dtype(spec: QuantSpec) -> np.dtype:
    """The stored dtype of a spec's scales."""
    return np.dtype(ml_dtypes.float8_e4m3fn) if spec.scale_dtype == "float8_e4m3fn" else np.dtype(spec.scale_dtype)


def _param(shape, axes, dtype, meta) -> nnx.Param:
    init = nnx.with_partitioning(nnx.initializers.zeros_init(), tuple(axes), **meta)
    return nnx.Param(init(jax.random.key(0), shape, dtype))


EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class QuantTarget:
    """A weight that can be kept quantized: attribute `attr` of `module`, the `kernel` of a Linear, the `weight` of
    an embedding table, or one of MoE `Experts`' stacked weights (`gate_proj`, `up_proj`, `down_proj`)."""

    module: nnx.Module
    attr: str

    @property
    def experts(self) -> bool:
        return self.attr in EXPERT_WEIGHTS

    @property
    def embedding(self) -> bool:
        return self.attr == "weight"

    @property
    def float_shape(self) -> tuple[int, ...]:
        return tuple(getattr(self.module, self.attr).get_value().shape)

    @property
    def inputs(self) -> int:
        """The inputs one output sums over (groups run along them; an expert's own)."""
        shape = self.float_shape
        if self.embedding:
            return shape[-1]
        if self.experts:
            return shape[1]
        return math.prod(shape[len(shape) - len(self.module.in_shape):])

    @property
    def outputs(self) -> int:
        """Output rows (an expert's own)."""
        shape = self.float_shape
        if self.embedding:
            return shape[0]
        return shape[2] if self.experts else math.prod(shape[:len(shape) - len(self.module.in_shape)])

    def param_path(self, key: str) -> str:
        """The weight's parameter path, from its key in `quantizable()` (a module's, or for experts the weight's)."""
        return key if self.experts else f"{key}.{self.attr}"


def quantizable(model: nnx.Module) -> dict[str, QuantTarget]:
    """The weights that can be kept quantized, by key: the path of every `Linear` that layers apply as a map (not
    those whose kernel a layer reads itself, `Linear.quantizable`) and of token embedding tables, and the parameter
    path of MoE experts' stacked weights (`...experts.gate_proj`)."""
    from day0jax.layers.linear import Embedding, Linear
    from day0jax.layers.moe import Experts

    out = {}
    for path, m in nnx.iter_modules(model):
        name = ".".join(map(str, path))
        if isinstance(m, Linear) and m.quantizable:
            out[name] = QuantTarget(m, "kernel")
        elif isinstance(m, Embedding) and name.endswith("embed_tokens"):
            out[name] = QuantTarget(m, "weight")
        elif isinstance(m, Experts):
            out.update({f"{name}.{w}": QuantTarget(m, w) for w in EXPERT_WEIGHTS if getattr(m, w) is not None})
    return out


def quantize_modules(model: nnx.Module, specs: dict[str, QuantSpec]) -> nnx.Module:
    """Replaces each weight named in `specs` (keys as `quantizable`'s) by a `QuantizedKernel` or `QuantizedExperts`
    (in place; returns `model`).

    Raises:
        CheckpointError: a named weight is not quantizable in this model, or its shape cannot be grouped.
    """
    targets = quantizable(model)
    for key, spec in specs.items():
        if key not in targets:
            raise CheckpointError(f"quantized module {key} is not a linear map, embedding or experts' weight of "
                                  "this model")
        t = targets[key]
        var = getattr(t.module, t.attr)
        if isinstance(var, (QuantizedKernel, QuantizedExperts)):
            raise CheckpointError(f"module {key} is quantized twice")
        shape = tuple(var.get_value().shape)
        axes = tuple(var.get_metadata().get("out_sharding") or (None,) * len(shape))
        if t.experts:
            setattr(t.module, t.attr, QuantizedExperts(shape, axes, spec))
        else:
            in_ndim = 1 if t.embedding else len(t.module.in_shape)
            setattr(t.module, t.attr, QuantizedKernel(shape, axes, in_ndim, spec))
    return model


def specs_from_config(hf: dict[str, Any]) -> dict[str, QuantSpec]:
    """The quantized modules a converted checkpoint's config.json names (none for a float checkpoint).

    Raises:
        CheckpointError: a quantization_config that is not day0jax's (an unconverted quantized checkpoint).
    """
    q = hf.get("quantization_config")
    if not q:
        return {}
    if q.get("quant_method") != QUANT_METHOD:
        raise CheckpointError(f"config.json's quantization_config (quant_method {q.get('quant_method')!r}) is a "
                              "source checkpoint's; convert it with `python -m convert` first")
    return {path: QuantSpec.from_json(s) for path, s in (q.get("modules") or {}).items()}


def specs_to_json(specs: dict[str, QuantSpec]) -> dict[str, Any]:
    return {path: s.to_json() for path, s in specs.items()}
