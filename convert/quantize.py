"""Which weights a conversion stores quantized, and their arrays.

Two ways in: a source whose tensors are already quantized (GGUF Q8_0/Q4_0/Q4_1, FP8 with block scales) keeps them as
they are, block for block; `--quantize int8|int4|fp8|mxfp4|nvfp4` rounds a float source's weights to nearest with
one scale per group (nvfp4: and one global scale per weight, an experts' stack sharing one). MoE experts' stacked
weights are quantized too, each expert's [out, in] map on its own (a source's per-expert quantized tensors are
stacked as they are). What stays float, and why, is decided here for every family alike: norms, biases and MoE
routers are not linear maps the runtime applies through `Linear` (and are small); vision towers keep their float
weights (images are encoded once per request, and their accuracy is not measured quantized); a map whose kernel a
layer reads itself (`Linear.quantizable`, MLA's absorbed kv_b_proj); projections to fewer than 16 outputs (gates);
and a weight whose inputs the group does not divide. A quantized source tensor that feeds a float parameter (MLA's
kv_b_proj, DeepSeek-V3's FP8 checkpoints) is read dequantized, and counted. Token embeddings are int8 when the rest
is 4-bit (llama.cpp keeps them at 8 bits too: they are also the output projection of tied models).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np

from day0jax.core.errors import CheckpointError
from day0jax.core.hf_tensors import Source, same
from day0jax.layers.quantized import QuantSpec, quantizable
from kernels_pallas.quantized_linear.reference import MX_GROUP, NV_GROUP, quantize

KINDS = ("int8", "int4", "fp8", "mxfp4", "nvfp4")
DEFAULT_GROUP = {"int8": 32, "int4": 32, "fp8": 128, "mxfp4": MX_GROUP, "nvfp4": NV_GROUP}
FP4_KINDS = ("mxfp4", "nvfp4")  # one block size each, set by the format
VISION_MARKERS = ("vision", "visual", "multi_modal_projector", "merger", "mm_projector")
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
    experts: frozenset[str] = frozenset()  # the keys that are MoE experts' stacked weights

    def weight_paths(self, model) -> dict[str, str]:
        """Weight parameter path (`X.kernel`, `X.weight`, `X.experts.gate_proj`) -> its key in `specs`."""
        targets = quantizable(model)
        return {targets[key].param_path(key): key for key in self.specs}

    def summary(self) -> str:
        if not self.specs:
            return "no weights quantized"
        kinds = Counter(s.describe() for s in self.specs.values())
        kept = "; ".join(f"{n} {reason}" for reason, n in self.kept_float.items())
        return (f"quantized weights: {', '.join(f'{n} x {k}' for k, n in kinds.items())}"
                + (f"; kept in float: {kept}" if kept else ""))


def plan_quantization(abstract, plan: dict[str, Source], source, *, quantize_kind: str | None = None,
                      group: int | None = None, dequantize: bool = False) -> QuantPlan:
    """Decides, before anything is written, which weights are stored quantized and how.

    Args:
        abstract: the model built abstractly in float.
        plan: runtime parameter path -> its `Source` (`convert.convert.plan_sources`).
        source: the opened checkpoint (its `quant_spec` says which tensors are quantized).
        quantize_kind: `--quantize`: 'int8', 'int4', 'fp8', 'mxfp4', 'nvfp4' or None.
        group: `--group-size` (default per kind: 32, 32, 128; mxfp4 and nvfp4 take only their blocks, 32 and 16).
        dequantize: `--dequantize`: store the source's quantized tensors as float instead.
    Raises:
        CheckpointError: a quantized source tensor of a type the runtime does not keep, or whose groups do not
            divide its parameter's inputs, without --dequantize; --quantize on a quantized source; an unknown kind
            or a group that is not positive.
    """
    if quantize_kind is not None and quantize_kind not in KINDS:
        raise CheckpointError(f"--quantize {quantize_kind!r} is not one of {', '.join(KINDS)}")
    if group is not None and (group <= 0 or group % 2):
        raise CheckpointError(f"--group-size {group} must be a positive even number")
    if quantize_kind in FP4_KINDS and group not in (None, DEFAULT_GROUP[quantize_kind]):
        raise CheckpointError(f"--group-size {group}: {quantize_kind} shares one scale per block of "
                              f"{DEFAULT_GROUP[quantize_kind]} (its format's), so it takes no other group size")
    targets = quantizable(abstract)
    specs: dict[str, QuantSpec] = {}
    dequantized: Counter = Counter()
    if not dequantize:
        specs, dequantized = _kept_from_source(targets, plan, source)
        if specs and quantize_kind:
            raise CheckpointError(f"{source.path}: the source is already quantized ({len(specs)} weights); "
                                  "--quantize takes a float source (add --dequantize to re-quantize from float)")
    from_source = frozenset(specs)
    kept_float: Counter = dequantized
    if quantize_kind:
        for path, t in targets.items():
            if any(marker in path for marker in VISION_MARKERS):
                kept_float["vision tower weights"] += 1
                continue
            if not t.embedding and t.outputs < MIN_OUTPUTS:
                kept_float[f"projections to fewer than {MIN_OUTPUTS} outputs"] += 1
                continue
            kind = "int8" if t.embedding and quantize_kind in ("int4",) + FP4_KINDS else quantize_kind
            g = group or DEFAULT_GROUP[kind]
            if t.inputs % g:
                kept_float[f"weights whose inputs are not a multiple of {g}"] += 1
                continue
            scales = {"fp8": "float32", "mxfp4": "uint8", "nvfp4": "float8_e4m3fn"}
            specs[path] = QuantSpec(kind, g, offset=kind == "int4", scale_dtype=scales.get(kind, "bfloat16"))
    experts = frozenset(path for path in specs if targets[path].experts)
    return QuantPlan(specs, from_source, dict(kept_float), experts)


def _per_expert(t, src: Source) -> bool:
    """Whether an experts' weight comes from one [out, in] source tensor per expert (stacked as they are)."""
    E, I, O = t.float_shape
    return len(src.names) == E and all(tuple(shape) == (O, I) for shape in src.shapes)


def _kept_from_source(targets: dict, plan: dict[str, Source], source) -> tuple[dict[str, QuantSpec], Counter]:
    """The weights whose source tensor is quantized (an experts' weight: every expert's, in one format), with its
    format; and, by reason, how many quantized source tensors are read dequantized instead: those feeding a
    parameter the runtime keeps in float (routers, kernels a layer reads itself, as MLA's kv_b_proj) or combined
    with others into one parameter. Their dequantization is the format's exact math, in float32 before the
    checkpoint's dtype."""
    if not hasattr(source, "quant_spec"):
        return {}, Counter()
    specs, covered, dequantized = {}, set(), Counter()
    for path, t in targets.items():
        param = t.param_path(path)
        src = plan[param]
        found = [(n, source.quant_spec(n)) for n in src.names]
        quantized = [(n, s) for n, s in found if s is not None]
        if not quantized:
            continue
        name, spec = quantized[0]
        stacked = t.experts and _per_expert(t, src) and len(quantized) == len(found) \
            and all(s == spec for _, s in quantized)
        if not stacked and (len(src.names) != 1 or (src.combine is not same and src.quantized is None)):
            continue  # combined with other tensors: read dequantized (counted below)
        if t.inputs % spec.group:
            raise CheckpointError(f"{source.path}: quantized tensor {name!r} has groups of {spec.group} that do not "
                                  f"divide the inputs of parameter {param} {t.float_shape}; convert with "
                                  "--dequantize")
        specs[path] = spec
        covered.add(param)
    for param, src in plan.items():
        if param not in covered:
            n = sum(source.quant_spec(name) is not None for name in src.names)
            if n:
                why = "combined into one parameter" if len(src.names) > 1 else "the runtime keeps them in float"
                dequantized[f"quantized source tensors read dequantized ({why})"] += n
    return specs, dequantized


def quantized_arrays(path: str, float_shape: tuple[int, ...], spec: QuantSpec, src: Source, source,
                     from_source: bool, shapes: dict[str, tuple[int, ...]], experts: bool = False
                     ) -> dict[str, np.ndarray]:
    """The stored arrays of one quantized weight: `{path}.codes`, `.scale` and (with offsets) `.offset`.

    Args:
        path: the weight's parameter path (`X.kernel`, `X.experts.gate_proj`).
        float_shape: its float shape.
        spec: how it is stored.
        src: its `Source`; source: the opened checkpoint.
        from_source: keep the source's blocks (else read float and quantize).
        shapes: the quantized model's parameter shapes by path.
        experts: an MoE experts' stacked weight [E, in, out], stored as each expert's [out, in] map.
    """
    if from_source:
        parts = [source.read_quantized(n) for n in src.names]  # one per expert, or the one tensor
        w = parts[0]
        if src.quantized is not None and len(parts) == 1:  # rows picked from the source's (gate and up of gate_up)
            w = src.quantized(w)
        if len(parts) > 1:
            stack = lambda f: np.stack([np.asarray(getattr(x, f)) for x in parts])  # noqa: E731
            w = dataclasses.replace(w, codes=stack("codes"), scale=stack("scale"),
                                    offset=stack("offset") if w.offset is not None else None,
                                    global_scale=stack("global_scale") if w.global_scale is not None else None)
    else:
        dense = np.asarray(src.combine([source.read(n) for n in src.names], float_shape), np.float32)
        if experts:
            dense = np.swapaxes(dense, 1, 2)
        rows = math.prod(shapes[f"{path}.scale"][:-1])
        w = quantize(dense.reshape(rows, -1), spec.kind, spec.group, offsets=spec.offset, scale_dtype=spec.scale_dtype)
    out = {f"{path}.codes": w.codes, f"{path}.scale": w.scale}
    if spec.offset:
        out[f"{path}.offset"] = w.offset
    if w.global_scale is not None:  # NVFP4's
        out[f"{path}.global_scale"] = w.global_scale
    for name, array in out.items():
        want = shapes[name]
        if array.size != math.prod(want):
            raise CheckpointError(f"parameter {name}: {array.shape} from the source does not fit {want}")
        out[name] = np.ascontiguousarray(array).reshape(want)
    return out
