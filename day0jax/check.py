"""`python -m day0jax.check PATH [--mesh SPEC] [--json]`: the day-0 readiness report.

Says, before a single weight is read, whether a model will run and how: the family that implements it, every
config.json key (used, ignored as harmless, or unknown and refused), the operators it needs with the
implementation each takes on this backend (a kernel or the reference fallback, found by tracing the op on the
model's shapes), the parameter count and bytes per dtype, whether the checkpoint's tensors map onto the model,
and the memory per device for the weights plus the KV cache at a stated batch and context.

PATH is a Hugging Face folder (config.json and safetensors headers), a day0jax checkpoint folder (config.json and
its manifest) or a GGUF file (its header and metadata; the tensor data is memory-mapped, never read).
Exit status: 0 when the model will run, 2 when it will not, 1 on a usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

from day0jax.weights import hf_config as config_lib
from day0jax.errors import Day0Error

RUNS, WONT_RUN = 0, 2


@dataclasses.dataclass
class Report:
    """Everything `check` found; `to_dict()` is the `--json` output."""

    path: str
    source: str = ""                  # "safetensors", "day0jax", "gguf"
    model_type: str | None = None
    family: str | None = None         # module implementing it
    supported: bool = False
    reasons: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    keys: list[dict] = dataclasses.field(default_factory=list)
    ops: list[dict] = dataclasses.field(default_factory=list)
    parameters: dict = dataclasses.field(default_factory=dict)
    memory: dict = dataclasses.field(default_factory=dict)
    backend: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --- reading the checkpoint (headers only) ---------------------------------------------------------------------

def _open(path: Path, report: Report) -> tuple[dict, Any]:
    """(config.json dict, a tensor source or a manifest) without reading tensor data."""
    from convert.sources import open_source
    from day0jax.weights import checkpoint

    if path.is_dir() and (path / checkpoint.MANIFEST).is_file():
        report.source = "day0jax"
        return config_lib.read_config_json(path / "config.json"), checkpoint.read_manifest(path)
    if path.is_dir() and (path / "config.json").is_file() and not any(path.glob("*.safetensors")):
        # A config alone (weights not downloaded yet) still says whether the architecture will run.
        report.source = "config.json only"
        report.notes.append("no weights next to config.json: the checkpoint's tensors were not checked")
        return config_lib.read_config_json(path / "config.json"), None
    source = open_source(path)  # safetensors: headers parsed; GGUF: header validated, data memory-mapped
    report.source = source.kind
    return source.hf_config(), source


def _checkpoint_tensors(source: Any) -> tuple[int, dict[str, int]]:
    """(element count, bytes per dtype) of what the checkpoint stores."""
    if source is None:
        return 0, {}
    if isinstance(source, dict):  # a day0jax manifest
        count, by_dtype = 0, Counter()
        for p in source.get("params", {}).values():
            n = math.prod(p["shape"])
            count += n
            by_dtype[p["dtype"]] += n * _itemsize(p["dtype"])
        return count, dict(by_dtype)
    if source.kind == "safetensors":
        count, by_dtype = 0, Counter()
        for f in source.files:
            for t in f.tensors.values():
                count += math.prod(t.shape)
                by_dtype[str(t.dtype)] += t.nbytes
        return count, dict(by_dtype)
    from convert.gguf_source import SUPPORTED_TYPES

    count, by_dtype = 0, Counter()
    for h in source.headers:
        count += math.prod(h.dims)
    for name in source.tensor_names():
        t = source._tensors[name]
        by_dtype[SUPPORTED_TYPES.get(int(t.tensor_type), str(t.tensor_type))] += int(t.n_bytes)
    return count, dict(by_dtype)


def _itemsize(dtype: str) -> int:
    import jax.numpy as jnp
    import numpy as np

    return np.dtype(jnp.dtype(dtype)).itemsize


# --- the config ------------------------------------------------------------------------------------------------

def _key_table(hf: dict, fam) -> list[dict]:
    fields = {f.name for f in dataclasses.fields(fam.Config)}
    aliases = getattr(fam.Config, "ALIASES", {})
    rows = []
    for key in sorted(hf):
        value = hf[key]
        if key in fields:
            status, note = "used", ""
        elif key in aliases:
            status, note = "used", f"read as {aliases[key]}"
        elif key in config_lib.IGNORED_KEYS:
            status, note = "ignored", "does not change the forward pass"
        else:
            status, note = "unknown", "not implemented: refused, it may change the math"
        rows.append({"key": key, "value": _short(value), "status": status, "note": note})
    return rows


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


# --- operators ---------------------------------------------------------------------------------------------------

def _probe(api, *args, **kwargs) -> tuple[str, list[str]]:
    """The implementation `api`'s dispatch would take for these (abstract) inputs, and why others declined.

    Traces each candidate with `jax.eval_shape` (no computation), in the registry's order for this backend.
    """
    import jax

    from kernels_pallas import registry

    notes = []
    for name in registry.order(api.CANDIDATES):
        fn = api.IMPLEMENTATIONS.get(name)
        if fn is None:
            notes.append(f"{name}: not available")
            continue
        arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.ShapeDtypeStruct)}
        static = {k: v for k, v in kwargs.items() if k not in arrays}
        try:
            jax.eval_shape(partial(fn, **static), *args, **arrays)
            return name, notes
        except NotImplementedError as e:
            notes.append(f"{name} declined: {e}")
    return "none", notes


def _shape(param) -> tuple[int, ...]:
    """Shape of a parameter of a real or abstract (`nnx.eval_shape`) model."""
    value = param.get_value() if hasattr(param, "get_value") else param.value
    return tuple(value.shape)


def _impl_text(name: str, notes: list[str]) -> str:
    """'name (kernel)', 'reference (fallback)' or, for ops that are plain jax.numpy, the name as given."""
    from kernels_pallas import registry

    if name == registry.REFERENCE:
        text = "reference (fallback: no kernel takes it here)"
    elif name.startswith("jax.numpy") or name == "-":
        text = name
    else:
        text = f"{name} (kernel)"
    return text + (f"; {'; '.join(notes)}" if notes else "")


def _layer_ranges(layers: list[int]) -> str:
    out, start = [], None
    for i, n in enumerate(layers):
        if start is None:
            start = n
        if i + 1 == len(layers) or layers[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ",".join(out)


def _ops(model, dtype) -> list[dict]:
    """One row per distinct (operator, variant), with the layers that use it and the implementation chosen."""
    import jax
    import jax.numpy as jnp

    from day0jax.layers.attention import Attention
    from day0jax.layers.mla import MLAttention
    from day0jax.layers.mlp import GatedMLP
    from day0jax.layers.moe import MoE
    from kernels_pallas.attention import api as attention_api
    from kernels_pallas.moe import api as moe_api
    from kernels_pallas.paged_attention import api as paged_api
    from kernels_pallas.rms_norm import api as norm_api

    S = jax.ShapeDtypeStruct
    rows: dict[tuple, dict] = {}

    def add(op, variant, layer, probe):
        key = (op, variant)
        if key not in rows:
            rows[key] = {"op": op, "variant": variant, "layers": [], "implementation": _impl_text(*probe())}
        rows[key]["layers"].append(layer)

    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if isinstance(attn, MLAttention):
            R, P, C, U = attn.dims
            N, Kh, H = attn.kv_b_proj.out_shape[0], 1, R + P
            variant = (f"MLA (absorbed): {N} heads over one latent of {R}+{P} dims, q "
                       f"{'low-rank' if attn.q_proj is None else 'full-rank'}, value {U} dims")
            kw = dict(scale=attn.scale)
        elif isinstance(attn, Attention):
            N, H = attn.q_proj.out_shape
            Kh = attn.k_proj.out_shape[0]
            kind = "MHA" if N == Kh else "MQA" if Kh == 1 else "GQA"
            parts = [f"{kind} {N}q/{Kh}kv heads x {H}"]
            if attn.sliding_window is not None:
                parts.append(f"sliding window {attn.sliding_window}")
            if attn.logit_softcap is not None:
                parts.append(f"score soft-cap {attn.logit_softcap}")
            if attn.sinks is not None:
                parts.append("sinks")
            if attn.q_norm is not None:
                parts.append(f"q/k RMSNorm over {'each head' if attn.qk_norm_over == 'head' else 'all heads'}")
            if attn.scale is not None:
                parts.append(f"scale {attn.scale:.4g}")
            variant = ", ".join(parts)
            kw = dict(sliding_window=attn.sliding_window, logit_softcap=attn.logit_softcap, scale=attn.scale,
                      sinks=None if attn.sinks is None else S((N,), dtype))
        else:
            variant, kw, N, Kh, H = type(attn).__name__, {}, None, None, None
        if N is not None:
            q, kv, pos = S((1, 16, N, H), dtype), S((1, 16, Kh, H), dtype), S((1, 16), jnp.int32)
            add("attention (prefill, dense cache)", variant, i,
                lambda: _probe(attention_api, q, kv, kv, q_positions=pos, **kw))
            pages, table = S((4, 16, Kh, H), dtype), S((1, 4), jnp.int32)
            q1, lens, pos1 = S((1, 1, N, H), dtype), S((1,), jnp.int32), S((1, 1), jnp.int32)
            add("paged attention (decode)", variant, i,
                lambda: _probe(paged_api, q1, pages, pages, table, lens, pos1, **kw))
        rope = getattr(attn, "rope", None)
        if rope is None:
            add("rope", "none (NoPE layer)", i, lambda: ("-", []))
        else:
            p = rope.params
            extra = f", {rope.rotary_dim} of {rope.head_dim} dims" if rope.rotary_dim != rope.head_dim else ""
            factor = f", factor {p['factor']:g}" if p.get("factor") else ""
            add("rope", f"{p['rope_type']} (theta {p['rope_theta']:g}{factor}{extra})", i,
                lambda: ("jax.numpy (no kernel op)", []))
        mlp = layer.mlp
        D = model.config.hidden_size
        if isinstance(mlp, MoE):
            router = getattr(mlp, mlp.router_name)
            E, _, F = _shape(mlp.experts.gate_proj)
            shared = f", shared {mlp.shared_name}{' (gated)' if mlp.has_shared_gate else ''}" if mlp.has_shared else ""
            variant = f"MoE {E} experts x {F}, top-{router.top_k} {router.routing}{shared}"
            k = router.top_k
            add("moe grouped matmul", variant, i, lambda: _probe(
                moe_api, S((16 * k, D), dtype), S((E, D, F), dtype), S((E,), jnp.int32)))
        elif isinstance(mlp, GatedMLP):
            add("mlp", f"gated MLP x {mlp.gate_proj.out_shape[0]}", i, lambda: ("jax.numpy (XLA dots)", []))
        norms = [n for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                             "post_feedforward_layernorm") if getattr(layer, n, None) is not None]
        offset = getattr(layer, norms[0]).offset
        add("rms_norm", f"{type(layer).__name__}: {', '.join(norms)}{' (1 + w)' if offset else ''}", i,
            lambda: _probe(norm_api, S((1, 16, D), dtype), S((D,), dtype), eps=1e-6, offset=offset))
    out = []
    for row in rows.values():
        row["layers"] = _layer_ranges(row["layers"])
        out.append(row)
    return out


# --- the report ------------------------------------------------------------------------------------------------

def check(path: str | Path, *, mesh: str | None = None, batch: int = 1, context: int | None = None,
          dtype: str | None = None) -> Report:
    """Builds the readiness report for `path` (see the module docstring). Never reads tensor data.

    Args:
        path: HF folder, day0jax checkpoint folder or GGUF file.
        mesh: SPEC such as 'tp=4' to plan memory for (it may ask for more devices than are visible);
            default: the visible devices, arranged as `--mesh auto` would.
        batch: sequences whose KV cache is planned for.
        context: cached positions per sequence (default: the model's context length).
        dtype: parameter and cache dtype (default: the runtime's default for this backend).
    Returns:
        A `Report`; `report.supported` is whether the model will run.
    """
    import jax

    from day0jax import models
    from day0jax.layers.rope import context_length
    from day0jax.weights.loader import DTYPES, default_dtype

    path = Path(path)
    report = Report(path=str(path), backend=jax.default_backend())
    try:
        hf, source = _open(path, report)
    except Day0Error as e:
        report.reasons.append(str(e))
        return report
    report.model_type = hf.get("model_type")
    try:
        fam = models.family(report.model_type)
    except Day0Error as e:
        report.reasons.append(str(e))
        return report
    report.family = fam.__name__
    report.keys = _key_table(hf, fam)
    unknown = [r for r in report.keys if r["status"] == "unknown"]
    if unknown:
        report.reasons.append("config key(s) the family does not implement: "
                              + ", ".join(f"{r['key']}={r['value']}" for r in unknown))
    try:
        config = fam.Config.from_hf(hf, strict=False)
    except Day0Error as e:
        report.reasons.append(str(e))
        for row in report.keys:  # the value named by the refusal (`config KEY=VALUE ...`, or a rope sub-key)
            k = row["key"]
            if str(e).startswith((f"config {k}=", f"config {k}.", f"{k}.", f"{k}=", f"{k} key")):
                row["status"], row["note"] = "refused", "value not implemented (see above)"
        return report

    dtype = dtype or default_dtype()
    if dtype not in DTYPES:
        report.reasons.append(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        return report
    abstract = models.abstract_model(config, DTYPES[dtype])
    infos = models.param_infos(abstract)
    report.ops = _ops(abstract, DTYPES[dtype])
    count, by_dtype = _checkpoint_tensors(source)
    report.parameters = {"model": sum(math.prod(i.shape) for i in infos), "checkpoint_elements": count,
                         "checkpoint_bytes_by_dtype": by_dtype, "runtime_dtype": dtype}
    report.reasons += _mapping_problems(fam, config, infos, source)
    report.memory = _memory(abstract, infos, config, mesh, batch, context, DTYPES[dtype], report,
                            context_length(config.rope, config.max_position_embeddings))
    report.supported = not report.reasons
    return report


def _mapping_problems(fam, config, infos, source) -> list[str]:
    """Whether every runtime parameter finds its tensor (right shape) and every tensor is used, from headers."""
    if source is None:
        return []
    if isinstance(source, dict):
        params = source.get("params", {})
        problems = [f"checkpoint lacks parameter {i.path}" for i in infos if i.path not in params]
        problems += [f"checkpoint parameter {i.path} has shape {tuple(params[i.path]['shape'])}, the model "
                     f"expects {i.shape}" for i in infos if i.path in params and tuple(params[i.path]["shape"])
                     != i.shape]
        return problems[:5]
    from convert.convert import plan_sources

    try:
        plan_sources(fam, config, infos, source)
    except Day0Error as e:
        return [str(e)]
    return []


def _memory(abstract, infos, config, mesh_spec, batch, context, dtype, report, full_context) -> dict:
    import jax

    from day0jax.engine.generator import bucket
    from sharding import mesh as mesh_lib
    from sharding import plan as plan_lib

    devices = jax.devices()
    try:
        sizes = mesh_lib.parse_spec(mesh_spec) if mesh_spec and mesh_spec != "auto" else \
            mesh_lib.auto_sizes(len(devices), infos)
    except Day0Error as e:
        report.reasons.append(str(e))
        return {}
    bad = mesh_lib.problems(sizes, infos)
    if bad:
        report.reasons.append(f"mesh {mesh_lib.format_spec(sizes)}: " + "; ".join(bad))
    shape = plan_lib.ModelShape.from_model(abstract, full_context)
    context = min(context or full_context, full_context)
    p = plan_lib.plan(shape, sizes, batch=bucket(batch, sizes["dp"] * sizes["ep"]), context=bucket(context, 64),
                      dtype=dtype, available=plan_lib.device_memory(devices))
    if not p.fits:
        try:
            plan_lib.require_fit(p, shape, n_devices=len(devices))
        except Day0Error as e:
            report.reasons.append(str(e))
    out = p.to_dict()
    out["summary"] = p.summary()
    out["visible_devices"] = f"{len(devices)} {devices[0].platform}"
    return out


# --- output ----------------------------------------------------------------------------------------------------

def _table(rows: list[dict], cols: list[str]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    line = lambda r: "  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols).rstrip()  # noqa: E731
    return "\n".join([line({c: c for c in cols}), line({c: "-" * widths[c] for c in cols})] + [line(r) for r in rows])


def render(report: Report) -> str:
    """The human-readable report."""
    from sharding.plan import fmt_bytes

    out = [f"day0jax check: {report.path} ({report.source or 'unreadable'}, backend {report.backend})"]
    verdict = "SUPPORTED: the model will run" if report.supported else "NOT SUPPORTED"
    out.append(f"{verdict}; model_type {report.model_type!r}" + (f" -> {report.family}" if report.family else ""))
    out += [f"  - {r}" for r in report.reasons]
    out += [f"  note: {n}" for n in report.notes]
    if report.keys:
        out += ["", "config.json keys:", _table(report.keys, ["key", "value", "status", "note"])]
    if report.ops:
        out += ["", f"operators on {report.backend}:", _table(report.ops, ["op", "variant", "layers",
                                                                          "implementation"])]
    if report.parameters:
        p = report.parameters
        out += ["", f"parameters: {p['model']:,} in the model ({p['model'] / 1e6:.2f}M), "
                    f"{p['checkpoint_elements']:,} elements stored; runtime dtype {p['runtime_dtype']}"]
        out += [f"  {k}: {fmt_bytes(v)}" for k, v in sorted(p["checkpoint_bytes_by_dtype"].items())]
    if report.memory:
        m = report.memory
        out += ["", f"memory per device ({m['visible_devices']} device(s) visible): {m['summary']}"]
        out += [f"  note: {n}" for n in m.get("notes", ())]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m day0jax.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="Hugging Face folder, day0jax checkpoint folder or .gguf file")
    parser.add_argument("--mesh", default=None, help="SPEC such as 'dp=2,tp=4' (default: the visible devices)")
    parser.add_argument("--batch", type=int, default=1, help="sequences to plan the KV cache for (default 1)")
    parser.add_argument("--context", type=int, default=None, help="cached positions per sequence "
                        "(default: the model's context length)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: per backend)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = check(args.path, mesh=args.mesh, batch=args.batch, context=args.context, dtype=args.dtype)
    print(json.dumps(report.to_dict(), indent=2) if args.json else render(report))
    return RUNS if report.supported else WONT_RUN


if __name__ == "__main__":
    sys.exit(main())
