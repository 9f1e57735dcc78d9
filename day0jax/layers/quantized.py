"""Weights kept quantized in memory: a `Linear`'s kernel or an `Embedding`'s table as codes with per-group scales.

A converted checkpoint's config.json names its quantized modules and their `QuantSpec` (`quantization_config`,
quant_method 'day0jax'); `quantize_modules` swaps those modules' float parameter for a `QuantizedKernel` before the
weights are restored, so every consumer (the loader, the memory planner, sharding) sees the quantized parameters'
own shapes and dtypes. The codes keep the float kernel's output dims and logical axes and one flattened input dim
(two 4-bit codes per byte), the scales one entry per group along it, so tensor parallelism splits codes and scales
alike.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from day0jax.errors import CheckpointError
from kernels_pallas.calls import OpCall
from kernels_pallas.quantized_linear import api as quantized_linear
from kernels_pallas.quantized_linear.reference import CODE_DTYPES, KINDS, QuantizedWeight, dequantize

SCALE_DTYPES = ("float16", "bfloat16", "float32")
# config.json's `quantization_config.quant_method` of a converted checkpoint with quantized weights.
QUANT_METHOD = "day0jax"


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How one module's weight is stored: `kind` ('int8', 'int4', 'fp8', as `kernels_pallas.quantized_linear`),
    inputs per scale `group`, whether groups carry an `offset`, and the dtype of scales and offsets."""

    kind: str
    group: int
    offset: bool = False
    scale_dtype: str = "float16"

    def __post_init__(self):
        if self.kind not in KINDS or self.scale_dtype not in SCALE_DTYPES or self.group <= 0 \
                or (self.kind == "int4" and self.group % 2):
            raise CheckpointError(f"quantization {self.to_json()} is not a format day0jax knows (kinds: "
                                  f"{', '.join(KINDS)}; scale dtypes: {', '.join(SCALE_DTYPES)})")

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
        self.codes = _param((*out_shape, inputs // 2 if spec.kind == "int4" else inputs), flat_axes,
                            CODE_DTYPES[spec.kind], meta)
        self.scale = _param((*out_shape, inputs // spec.group), flat_axes, np.dtype(spec.scale_dtype), meta)
        self.offset = _param((*out_shape, inputs // spec.group), flat_axes, np.dtype(spec.scale_dtype), meta) \
            if spec.offset else None

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
        return QuantizedWeight(self.codes[...].reshape(O, -1), self.scale[...].reshape(O, -1), offset,
                               self.spec.kind, self.spec.group)

    def matmul(self, x: jax.Array) -> jax.Array:
        """x [..., *in] -> [..., *out], in x's dtype."""
        n_out = len(self.shape) - self.in_ndim
        lead = x.shape[:x.ndim - self.in_ndim]
        x2 = x.reshape(math.prod(lead), -1)
        y = quantized_linear.quantized_matmul(x2.astype(jnp.float32), self.weight())
        return y.astype(x.dtype).reshape(*lead, *self.shape[:n_out])

    def rows_of(self, index: jax.Array, dtype) -> jax.Array:
        """Rows `index` (any shape) of an [N, D] table, dequantized: [*index.shape, D] (embedding lookups)."""
        w = self.weight()
        picked = QuantizedWeight(jnp.take(w.codes, index.reshape(-1), axis=0),
                                 jnp.take(w.scale, index.reshape(-1), axis=0),
                                 None if w.offset is None else jnp.take(w.offset, index.reshape(-1), axis=0),
                                 w.kind, w.group)
        return dequantize(picked).astype(dtype).reshape(*index.shape, -1)


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
    quantized = sum(math.prod(m.shape) for _, m in nnx.iter_modules(model) if isinstance(m, QuantizedKernel))
    plain = sum(math.prod(v.get_value().shape) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
                if not v.get_metadata().get("quantized"))
    return quantized + plain


def _param(shape, axes, dtype, meta) -> nnx.Param:
    init = nnx.with_partitioning(nnx.initializers.zeros_init(), tuple(axes), **meta)
    return nnx.Param(init(jax.random.key(0), shape, dtype))


def quantizable(model: nnx.Module) -> dict[str, nnx.Module]:
    """The modules whose weight can be kept quantized, by dotted path: every `Linear` that layers apply as a map
    (not those whose kernel a layer reads itself, `Linear.quantizable`), and token embedding tables."""
    from day0jax.layers.linear import Embedding, Linear

    out = {}
    for path, m in nnx.iter_modules(model):
        name = ".".join(map(str, path))
        if (isinstance(m, Linear) and m.quantizable) or (isinstance(m, Embedding) and name.endswith("embed_tokens")):
            out[name] = m
    return out


def quantize_modules(model: nnx.Module, specs: dict[str, QuantSpec]) -> nnx.Module:
    """Replaces the weight of each module named in `specs` by a `QuantizedKernel` (in place; returns `model`).

    Raises:
        CheckpointError: a named module is not a Linear or Embedding of the model, or its shape cannot be grouped.
    """
    from day0jax.layers.linear import Embedding

    modules = quantizable(model)
    for path, spec in specs.items():
        if path not in modules:
            raise CheckpointError(f"quantized module {path} is not a linear map or embedding of this model")
        m = modules[path]
        name = "weight" if isinstance(m, Embedding) else "kernel"
        var = getattr(m, name)
        if isinstance(var, QuantizedKernel):
            raise CheckpointError(f"module {path} is quantized twice")
        shape = tuple(var.get_value().shape)
        axes = tuple(var.get_metadata().get("out_sharding") or (None,) * len(shape))
        setattr(m, name, QuantizedKernel(shape, axes, 1 if name == "weight" else len(m.in_shape), spec))
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
