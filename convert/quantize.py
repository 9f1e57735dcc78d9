"""Which weights a conversion stores quantized, and their arrays.

Two ways in: a source whose tensors are already quantized (GGUF Q8_0/Q4_0/Q4_1, FP8 with block scales) keeps them
as they are, block for block; `--quantize int8|int4|fp8` rounds a float source's weights to nearest with one scale
per group. What stays float, and why, is decided here for every family alike: norms, biases and MoE routers are not
linear maps the runtime applies through `Linear` (and are small); vision towers keep their float weights (images
are encoded once per request, and their accuracy is not measured quantized); a map whose kernel a layer reads
itself (`Linear.quantizable`, MLA's absorbed kv_b_proj); projections to fewer than 16 outputs (gates); and a weight
whose inputs the group does not divide.
Token embeddings are int8 when the rest is int4 (llama.cpp keeps them at 8 bits too: they are also the output
projection of tied models).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np

from day0jax.errors import CheckpointError
from day0jax.layers.linear import Embedding
from day0jax.layers.quantized import QuantSpec, quantizable
from day0jax.models.base import Source, same
from kernels_pallas.quantized_linear.reference import quantize

KINDS = ("int8", "int4", "fp8")
DEFAULT_GROUP = {"int8": 32, "int4": 32, "fp8": 128}
VISION_MARKERS = ("vision", "visual", "multi_modal_projector", "merger")
# Projections to fewer outputs stay float: gates such as Qwen's shared-expert gate (one output), whose few bytes
# are not worth a rounding error on a decision.
MIN_OUTPUTS = 16


@dataclasses.dataclass(frozen=True)
class QuantPlan:
    """`specs`: module path -> how its weight is stored; `from_source`: the modules whose source tensor is kept as
    it is (the others are quantized here); `kept_float`: reason -> number of quantizable modules left float."""

    specs: dict[str, QuantSpec]
    from_source: frozenset[str]
    kept_float: dict[str, int]

    def weight_paths(self, model) -> dict[str, str]:
        """Weight parameter path (`X.kernel`, `X.weight`) -> its module path, for the quantized modules."""
        modules = quantizable(model)
        return {weight_param(path, modules[path]): path for path in self.specs}

    def summary(self) -> str:
        if not self.specs:
            return "no weights quantized"
        kinds = Counter(s.describe() for s in self.specs.values())
        kept = "; ".join(f"{n} {reason}" for reason, n in self.kept_float.items())
        return (f"quantized weights: {', '.join(f'{n} x {k}' for k, n in kinds.items())}"
                + (f"; kept in float: {kept}" if kept else ""))


def weight_param(module_path: str, module) -> str:
    return f"{module_path}.{'weight' if isinstance(module, Embedding) else 'kernel'}"


def _float_shape(module) -> tuple[int, ...]:
    var = module.weight if isinstance(module, Embedding) else module.kernel
    return tuple(var.get_value().shape)


def _inputs(module) -> int:
    """The weight's inputs, its input dims flattened (groups run along them)."""
    shape = _float_shape(module)
    return shape[-1] if isinstance(module, Embedding) else math.prod(shape[len(shape) - len(module.in_shape):])


def plan_quantization(abstract, plan: dict[str, Source], source, *, quantize_kind: str | None = None,
                      group: int | None = None, dequantize: bool = False) -> QuantPlan:
    """Decides, before anything is written, which weights are stored quantized and how.

    Args:
        abstract: the model built abstractly in float.
        plan: runtime parameter path -> its `Source` (`convert.convert.plan_sources`).
        source: the opened checkpoint (its `quant_spec` says which tensors are quantized).
        quantize_kind: `--quantize`: 'int8', 'int4', 'fp8' or None.
        group: `--group-size` (default per kind: 32, 32, 128).
        dequantize: `--dequantize`: store the source's quantized tensors as float instead.
    Raises:
        CheckpointError: a quantized source tensor that cannot be kept (an unsupported type, a tensor combined with
            others or feeding a parameter kept in float) without --dequantize; --quantize on a quantized source;
            an unknown kind or a group that is not positive.
    """
    if quantize_kind is not None and quantize_kind not in KINDS:
        raise CheckpointError(f"--quantize {quantize_kind!r} is not one of {', '.join(KINDS)}")
    if group is not None and (group <= 0 or group % 2):
        raise CheckpointError(f"--group-size {group} must be a positive even number")
    modules = quantizable(abstract)
    specs: dict[str, QuantSpec] = {}
    if not dequantize:
        specs = _kept_from_source(modules, plan, source)
        if specs and quantize_kind:
            raise CheckpointError(f"{source.path}: the source is already quantized ({len(specs)} weights); "
                                  "--quantize takes a float source (add --dequantize to re-quantize from float)")
    from_source = frozenset(specs)
    kept_float: Counter = Counter()
    if quantize_kind:
        for path, m in modules.items():
            if any(marker in path for marker in VISION_MARKERS):
                kept_float["vision tower weights"] += 1
                continue
            shape = _float_shape(m)
            if not isinstance(m, Embedding) and math.prod(shape[:len(shape) - len(m.in_shape)]) < MIN_OUTPUTS:
                kept_float[f"projections to fewer than {MIN_OUTPUTS} outputs"] += 1
                continue
            kind = "int8" if isinstance(m, Embedding) and quantize_kind == "int4" else quantize_kind
            g = group or DEFAULT_GROUP[kind]
            if _inputs(m) % g:
                kept_float[f"weights whose inputs are not a multiple of {g}"] += 1
                continue
            specs[path] = QuantSpec(kind, g, offset=kind == "int4",
                                    scale_dtype="float32" if kind == "fp8" else "bfloat16")
    return QuantPlan(specs, from_source, dict(kept_float))


def _kept_from_source(modules: dict, plan: dict[str, Source], source) -> dict[str, QuantSpec]:
    """The modules whose one source tensor is quantized, with its format; refuses quantized tensors elsewhere."""
    if not hasattr(source, "quant_spec"):
        return {}
    specs, covered = {}, set()
    for path, m in modules.items():
        param = weight_param(path, m)
        src = plan[param]
        found = [(n, source.quant_spec(n)) for n in src.names]
        quantized = [(n, s) for n, s in found if s is not None]
        if not quantized:
            continue
        name, spec = quantized[0]
        if len(src.names) != 1 or src.combine is not same:
            raise CheckpointError(f"{source.path}: quantized tensor {name!r} is combined with others into parameter "
                                  f"{param}, which day0jax cannot do on quantized blocks; convert with --dequantize")
        if _inputs(m) % spec.group:
            raise CheckpointError(f"{source.path}: quantized tensor {name!r} has groups of {spec.group} that do not "
                                  f"divide the inputs of parameter {param} {_float_shape(m)}; convert with "
                                  "--dequantize")
        specs[path] = spec
        covered.add(param)
    for param, src in plan.items():
        if param in covered:
            continue
        for n in src.names:
            if source.quant_spec(n) is not None:
                raise CheckpointError(f"{source.path}: tensor {n!r} is quantized, but the runtime keeps parameter "
                                      f"{param} in float (norms, routers, experts' stacked weights and kernels that "
                                      "layers read themselves are float); convert with --dequantize")
    return specs


def quantized_arrays(path: str, float_shape: tuple[int, ...], spec: QuantSpec, src: Source, source,
                     from_source: bool, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """The stored arrays of one quantized weight: `{path}.codes`, `.scale` and (with offsets) `.offset`.

    Args:
        path: the weight's parameter path (`X.kernel`).
        float_shape: its float shape.
        spec: how it is stored.
        src: its `Source`; source: the opened checkpoint.
        from_source: keep the source's blocks (else read float and quantize).
        shapes: the quantized model's parameter shapes by path.
    """
    if from_source:
        w = source.read_quantized(src.names[0])
    else:
        dense = np.asarray(src.combine([source.read(n) for n in src.names], float_shape), np.float32)
        rows = math.prod(shapes[f"{path}.scale"][:-1])
        w = quantize(dense.reshape(rows, -1), spec.kind, spec.group, offsets=spec.offset, scale_dtype=spec.scale_dtype)
    out = {f"{path}.codes": w.codes, f"{path}.scale": w.scale}
    if spec.offset:
        out[f"{path}.offset"] = w.offset
    for name, array in out.items():
        want = shapes[name]
        if array.size != math.prod(want):
            raise CheckpointError(f"parameter {name}: {array.shape} from the source does not fit {want}")
        out[name] = np.ascontiguousarray(array).reshape(want)
    return out
