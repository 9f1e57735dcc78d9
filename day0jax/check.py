"""`python -m day0jax.check PATH [--mesh SPEC] [--json] [--quantize KIND] [--probe]
[--hosts N --devices-per-host M --device-memory SIZE] [--graph [--torch-python PATH]] [--train ...]`: the day-0
readiness report.

Says, before a weight is read, whether a model will run and how: its family, every config.json key (used, ignored
as harmless, or unknown and refused), each operator and the implementation it takes on this backend (a kernel or
the reference, found by tracing the op on the model's shapes), parameter count and bytes per dtype, whether the
checkpoint's tensors map onto the model, and the memory per device: the plan `load` and `serve` make with the same
mesh and engine flags. PATH is a Hugging Face folder, a day0jax checkpoint folder or a GGUF file (headers only), or
a folder with config.json alone. With --hosts, --devices-per-host and --device-memory it plans a cluster that is
not here instead: memory per device on the best placed mesh that fits, which mesh axes cross hosts, the bytes
each axis moves per token, and the meshes that fit. --probe measures the mesh's collectives on the devices present.
--graph is the checklist for a model_type day0jax does not implement: it traces one forward pass of the model's
`transformers` code (the config alone, random weights) in another Python (--torch-python, default the reference
venv), and lists what day0jax covers and what it lacks, with costs, the nearest family and a verdict
(`day0jax.graph`). --train plans a fine-tuning run instead of serving (`day0jax.train_plan`, the plan the trainer
checks before its first step): per device, the parameters, trainable ones, gradients, optimizer state and activations,
whether they fit the device (or --device-memory), and what would fit when they do not. Exit status: 0 when the model
will run, 2 when it will not, 1 on a usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from day0jax import cli
from day0jax.core import hf_config as config_lib
from day0jax.core.errors import CheckpointError, Day0Error, UnsupportedArchitecture
from sharding import mesh as mesh_lib

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
    layers: list[dict] = dataclasses.field(default_factory=list)  # token mixer kinds and what each caches
    op_calls: list[dict] = dataclasses.field(default_factory=list)  # the model's own description of its ops
    parameters: dict = dataclasses.field(default_factory=dict)
    vision: dict = dataclasses.field(default_factory=dict)  # a vision-language model's tower and image tokens
    mtp: dict = dataclasses.field(default_factory=dict)  # multi-token-prediction layers the checkpoint ships
    adapters: dict = dataclasses.field(default_factory=dict)  # LoRA adapters to serve (--lora-modules)
    quantization: str = ""            # which weights stay quantized in memory, and how
    memory: dict = dataclasses.field(default_factory=dict)
    cluster: dict = dataclasses.field(default_factory=dict)  # a described cluster: placement, traffic, fitting meshes
    probe: dict = dataclasses.field(default_factory=dict)  # measured collectives per mesh axis, time per decode step
    load: dict = dataclasses.field(default_factory=dict)  # a day0jax checkpoint's bytes and estimated load time
    training: dict = dataclasses.field(default_factory=dict)  # --train: the fine-tuning memory plan, what would fit
    backend: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


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
    try:
        source = open_source(path)  # safetensors: headers parsed; GGUF: header validated, data memory-mapped
    except CheckpointError as e:
        if not (path.is_dir() and (path / "config.json").is_file()):
            raise
        # One unreadable shard must not hide the rest of the report: go on from config.json and what is readable.
        report.reasons.append(f"unreadable weights: {e}")
        report.source = "safetensors, partly unreadable"
        return config_lib.read_config_json(path / "config.json"), _ReadableShards(path)
    report.source = source.kind
    return source.hf_config(), source


class _ReadableShards:
    """The safetensors files of a folder whose headers parse (for the parameter count when another one does not)."""

    kind = "safetensors"

    def __init__(self, path: Path):
        from convert.safetensors_file import SafetensorsFile

        self.files = []
        for f in sorted(path.glob("*.safetensors")):
            try:
                self.files.append(SafetensorsFile(f))
            except (CheckpointError, OSError):
                continue


def _checkpoint_tensors(source: Any) -> tuple[int, dict[str, int]]:
    """(element count, bytes per dtype) of what the checkpoint stores."""
    if source is None:
        stored = []
    elif isinstance(source, dict):  # a day0jax manifest
        import jax.numpy as jnp

        stored = [(math.prod(p["shape"]), p["dtype"], math.prod(p["shape"]) * jnp.dtype(p["dtype"]).itemsize)
                  for p in source.get("params", {}).values()]
    elif source.kind == "safetensors":
        stored = [(math.prod(t.shape), str(t.dtype), t.nbytes) for f in source.files for t in f.tensors.values()]
    else:  # GGUF: the GGML type names (F32, Q4_1, ...)
        stored = [(t.n_elements, t.type_name, t.n_bytes) for t in source.tensors]
    by_dtype = Counter()
    for _, dtype, nbytes in stored:
        by_dtype[dtype] += nbytes
    return sum(n for n, _, _ in stored), dict(by_dtype)


def _key_table(hf: dict, fam) -> list[dict]:
    """One row per config.json key; a vision-language config's `text_config` and `vision_config` key by key."""
    if hf.get("model_type") in getattr(fam.config, "COMPOSITE", ()) and isinstance(hf.get("text_config"), dict):
        # The language model of a multimodal checkpoint: its keys are text_config's; the others describe the vision
        # side, which conversion drops (tie_word_embeddings, also read from the outer config, is a field).
        outer = {k: v for k, v in hf.items() if k != "text_config"}
        rows = [dict(row, status="ignored", note="the vision side (dropped)") if row["status"] == "unknown" else row
                for row in _keys(outer, fam.config)]
        return rows + _keys(hf["text_config"], fam.config, "text_config.")
    rows = _keys(hf, fam.config)
    nested = getattr(fam.config, "VISION_CONFIG", None)
    if nested is not None:
        from day0jax import models

        text = hf.get("text_config") or {}
        try:
            text_config = models.family(text.get("model_type", fam.config.DEFAULT_TEXT_TYPE)).config
        except Day0Error:
            text_config = None  # refused with its reason by the config
        for name, cls, sub in (("text_config", text_config, text), ("vision_config", nested,
                                                                    hf.get("vision_config") or {})):
            if cls is not None and isinstance(sub, dict):
                rows += _keys(sub, cls, f"{name}.")
    return rows


def _keys(hf: dict, cls, prefix: str = "") -> list[dict]:
    fields = {f.name for f in dataclasses.fields(cls)}
    aliases = getattr(cls, "ALIASES", {})
    rows = []
    for key in sorted(hf):
        if key in fields:
            status, note = "used", ""
        elif key in aliases:
            status, note = "used", f"read as {aliases[key]}"
        elif key in config_lib.IGNORED_KEYS:
            status, note = "ignored", "does not change the forward pass"
        else:
            status, note = "unknown", "not implemented: refused, it may change the math"
        rows.append({"key": prefix + key, "value": _short(hf[key]), "status": status, "note": note})
    return rows


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _implementation(call, dtype, tp: int) -> str:
    """The implementation the op's dispatch takes for this call's shapes here, and why others declined (each
    candidate traced on abstract inputs in the registry's order: nothing runs), per phase where the op's spec splits
    them (paged attention: decode steps and prefill chunks)."""
    from kernels_pallas import cases, ops

    spec = ops.spec(call.op)
    if spec.api is None:
        return "jax.numpy (no kernel op)"
    case = cases.cases_from_calls([call], dtype, scale="startup", tp=tp)[0]
    if spec.phases is None:
        return _chosen(case)
    return " | ".join(f"{label}: {_chosen(phase)}" for label, phase in spec.phases(call, case))


def _chosen(case) -> str:
    """The implementation the registry's order picks for `case`, and why the ones before it declined."""
    from kernels_pallas import registry

    args, kwargs = case.build(0, abstract=True)
    api, notes = registry.api(case.op), []
    for name in registry.order(api.CANDIDATES):
        if name == registry.REFERENCE:
            text = "reference (fallback: no kernel takes it here)"
            break
        if name not in api.IMPLEMENTATIONS:
            notes.append(f"{name}: not available")
            continue
        reason = registry.accepts(case.op, name, *args, **kwargs)
        if reason is None:
            text = f"{name} (kernel)"
            break
        notes.append(f"{name} declined: {reason}")
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


def _ops(op_calls, dtype, tp: int) -> list[dict]:
    """One row per distinct op call, with the layers that make it and the implementation it takes."""
    from kernels_pallas import ops

    rows: dict[object, dict] = {}
    for layer, call in op_calls:
        if call not in rows:
            rows[call] = {"op": ops.spec(call.op).title, "variant": call.describe(), "layers": [],
                          "implementation": _implementation(call, dtype, tp)}
        rows[call]["layers"].append("final" if layer is None else layer)
    for row in rows.values():
        numbered = sorted({n for n in row["layers"] if isinstance(n, int)})
        named = list(dict.fromkeys(n for n in row["layers"] if not isinstance(n, int)))  # "final", "vision"
        row["layers"] = ",".join(filter(None, [_layer_ranges(numbered)] + named))
    return list(rows.values())


def _layers(abstract, op_calls, itemsize: int) -> list[dict]:
    """One row per kind of token mixer: its layers and what the engine keeps for each (KV per token, or a fixed
    state per sequence)."""
    from day0jax.core.cache_layout import SharedKV, StateLayer
    from sharding.plan import fmt_bytes

    attention = {layer: call for layer, call in op_calls if call.op in (
        "paged_attention", "sparse_attention", "compressed_attention", "block_sparse_attention")}
    rows: dict[tuple[str, str], list[int]] = {}
    for i, entry in enumerate(abstract.cache_layout()):
        if entry is None:
            key = ("MLP or MoE only (no token mixer)", "none")
        elif isinstance(entry, StateLayer):
            key = (entry.kind, f"state {fmt_bytes(entry.bytes_per_sequence)} per sequence")
            if entry.kv is not None:  # attention beside the state mixer (Falcon-H1), or over a window (DeepSeek-V4)
                window = entry.kv.window
                key = (f"{entry.kind} + " + (f"sliding attention (window {window})" if window else "full attention"),
                       f"{key[1]}, KV {fmt_bytes(entry.kv.token_elements * itemsize)} per token")
            c = entry.compressed
            if c is not None:  # compressed entries (and index keys) per block of positions
                index = f" + index key {fmt_bytes(c.index_dim * itemsize)}" if c.index_dim else ""
                key = (key[0], f"{key[1]}, entry {fmt_bytes(c.dim * itemsize)}{index} per {c.ratio} positions")
        else:
            call = attention.get(i)
            window = call.get("window") if call is not None else None
            if call is not None and call.op == "sparse_attention":
                kind = f"sparse attention (top-{call['topk']} keys{'' if call['indexer'] else ', shared'})"
            elif call is not None and call.op == "block_sparse_attention":
                kind = f"block-sparse attention (top-{call['topk']} blocks of {call['block']} keys"
                pool = call.get("pool", "max")
                kind += (f", {pool}-pooled" + ("" if call.get("indexer", True) else ", shared") if pool != "max"
                         else "") + ")"
            else:
                kind = ("MLA" if call is not None and call.get("latent") else "sliding attention" if window
                        else "full attention") + (f" (window {window})" if window else "")
                if call is not None and call.get("chunk"):  # Llama 4's local layers
                    kind = f"chunked attention (chunk {call['chunk']})"
            if isinstance(entry, SharedKV):
                own = f"indexer keys {fmt_bytes(entry.index_dim * itemsize)} per token" if entry.index_dim else "none"
                key = (kind, f"{own}: reads layer {entry.source}'s KV")
            else:
                key = (kind, f"KV {fmt_bytes(entry.token_elements * itemsize)} per token")
        rows.setdefault(key, []).append(i)
    return [{"kind": kind, "layers": _layer_ranges(layers), "cache": cache} for (kind, cache), layers in rows.items()]


def check(path: str | Path, *, mesh: str | None = None, engine=None, dtype: str | None = None,
          cluster=None, quantize: str | None = None, probe: bool = False, train=None,
          device_memory: int | None = None) -> Report:
    """Returns the readiness `Report` for `path` (`.supported`: whether the model will run); reads no tensor data
    but, of a day0jax checkpoint, a sample of at most 64 MB to time the storage (`Report.load`).

    Args:
        path: HF folder, day0jax checkpoint folder or GGUF file.
        mesh: SPEC such as 'tp=4' (may name more devices than are visible), 'auto' (as `load` chooses) or None
            for one device, as `load` and the server take it.
        engine: the `EngineConfig` to plan for (default `EngineConfig()`, as `load` and the server use).
        dtype: parameter and cache dtype (default: the runtime's default for this backend; bfloat16 for a cluster).
        cluster: a `sharding.cluster.Cluster` to plan for instead of the devices present (mesh None or 'auto': the
            best placed mesh over all of its devices that fits).
        quantize: plan the weights as `convert --quantize` would store them ('int8', 'int4', 'fp8').
        probe: measure all-reduce and all-gather over each axis of the mesh on the devices present, and estimate
            the communication time of a decode step from them.
        train: a `day0jax.train_plan.TrainSetup`: plan that fine-tuning run on one device (in its precision,
            `TrainSetup.dtype`, as the trainer runs it) in `Report.training`, in place of serving's memory plan.
        device_memory: with `train`, the bytes the device may use (default: its free memory, or the host's).
    """
    import jax
    import jax.numpy as jnp

    from day0jax import models
    from convert.quantize import QuantPlan
    from day0jax.layers.quantized import parameter_count, specs_from_config
    from day0jax.engine.config import EngineConfig
    from day0jax.loader import DTYPES, default_dtype

    path = Path(path)
    report = Report(path=str(path), backend=jax.default_backend())
    try:
        hf, source = _open(path, report)
        report.model_type = hf.get("model_type")
        fam = models.family(report.model_type)
    except UnsupportedArchitecture as e:
        report.reasons.append(f"{e}. `python -m day0jax.check {path} --graph` traces its modeling code and lists "
                              "what day0jax lacks for it")
        return report
    except Day0Error as e:
        report.reasons.append(str(e))
        return report
    report.family = models.FAMILIES[report.model_type]
    report.keys = _key_table(hf, fam)
    unknown = [r for r in report.keys if r["status"] == "unknown"]
    if unknown:
        report.reasons.append("config key(s) the family does not implement: "
                              + ", ".join(f"{r['key']}={r['value']}" for r in unknown))
    try:
        config = fam.config.from_hf(hf, strict=False)
    except Day0Error as e:
        report.reasons.append(str(e))
        for row in report.keys:  # the value named by the refusal (`config KEY=VALUE ...`, or a rope sub-key)
            k = row["key"]
            if str(e).startswith((f"config {k}=", f"config {k}.", f"{k}.", f"{k}=", f"{k} key")):
                row["status"], row["note"] = "refused", "value not implemented (see above)"
        return report

    dtype = dtype or ("bfloat16" if cluster else default_dtype())
    if dtype not in DTYPES:
        report.reasons.append(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        return report
    # A converted checkpoint stores its quantized weights as such (its config.json names them); a source is mapped
    # in float, then planned as the conversion would store it.
    try:
        stored_specs = specs_from_config(hf) if isinstance(source, dict) else {}
    except Day0Error as e:
        report.reasons.append(str(e))
        stored_specs = {}
    from sharding.plan import param_itemsize

    # Multi-token-prediction layers the checkpoint ships are listed (operators, parameters), and planned where the
    # engine speculates with them.
    mtp = _mtp_shipped(config, source)
    abstract = models.abstract_model(config, DTYPES[dtype], quantization=stored_specs, mtp=mtp)
    infos = models.param_infos(abstract)
    tp = mesh_lib.parse_spec(mesh)["tp"] if mesh and mesh != "auto" else 1
    _report_ops(report, abstract, DTYPES[dtype], tp)
    count, by_dtype = _checkpoint_tensors(source)
    report.parameters = {"model": parameter_count(abstract), "checkpoint_elements": count,
                         "checkpoint_bytes_by_dtype": by_dtype, "runtime_dtype": dtype}
    report.vision = _vision(abstract, infos, jnp.dtype(DTYPES[dtype]).itemsize)
    if isinstance(source, dict):
        report.load = _load_estimate(path, source)
    mapping = _mapping_problems(fam, config, infos, source)
    report.reasons += mapping
    if stored_specs:
        report.quantization = QuantPlan(stored_specs, frozenset(), {}).summary()
        if quantize:
            report.reasons.append(f"--quantize {quantize}: the checkpoint is converted already; its weights are "
                                  "stored as its config.json says")
    elif not mapping:  # (a source whose tensors do not map has nothing to plan)
        try:
            quantization = _source_quantization(fam, config, abstract, infos, source, quantize, hf)
        except Day0Error as e:
            report.reasons.append(str(e))
            quantization = None
        if quantization and quantization.specs:
            report.quantization = quantization.summary()
            stored_specs = quantization.specs
            abstract = models.abstract_model(config, DTYPES[dtype], quantization=stored_specs, mtp=mtp)
            infos = models.param_infos(abstract)
            _report_ops(report, abstract, DTYPES[dtype], tp)  # with the quantized linear maps the weights will take
        elif source is None and hf.get("quantization_config") and not quantize:
            method = hf["quantization_config"].get("quant_method", "?")
            report.notes.append(f"config.json names {method} quantization; without the weights' headers the plan "
                                f"counts every weight in {dtype} (--quantize KIND plans them quantized)")
    engine = engine or EngineConfig()
    if mtp:
        mtp_infos = [i for i in infos if i.path.startswith(models.MTP_PREFIX)]
        report.mtp = {"layers": abstract.mtp_layers, "parameters": sum(math.prod(i.shape) for i in mtp_infos),
                      "bytes": sum(math.prod(i.shape) * param_itemsize(i, DTYPES[dtype]) for i in mtp_infos),
                      "kv_per_token": sum(x.token_elements for x in abstract.mtp_cache_layout())}
        if engine.speculative is None or engine.speculative.method != "mtp":  # planned without them
            abstract = models.abstract_model(config, DTYPES[dtype], quantization=stored_specs)
            infos = models.param_infos(abstract)
    if engine.lora_modules:
        report.adapters = _adapters(abstract, engine, jnp.dtype(DTYPES[dtype]).itemsize, report)
    if train is not None:
        report.training = _training(abstract, train, device_memory, report)
    else:
        report.memory = _memory(abstract, infos, config, mesh, engine, dtype, report, cluster, probe)
    report.supported = not report.reasons
    return report


def _adapters(abstract, engine, itemsize: int, report: Report) -> dict:
    """The LoRA adapters `--lora-modules` names, checked against the model as the server checks them (their
    configs and tensor headers, no tensor read): names, ranks, modules, and the bytes every device holds."""
    from day0jax.adapters import ServedAdapters

    try:
        served = ServedAdapters(engine.lora_modules, abstract, engine.max_loras, engine.max_lora_rank)
    except Day0Error as e:
        report.reasons.append(str(e))
        return {}
    return {"adapters": [{"name": a.name, "rank": a.config.rank, "modules": len(a.shapes)} for a in served.adapters],
            "padded_rank": served.rank, "modules": len(served.modules), "bytes": served.nbytes(abstract, itemsize)}


def _training(abstract, setup, device_memory: int | None, report: Report) -> dict:
    """The fine-tuning plan (`day0jax.train_plan`) of `setup` on the visible device or `device_memory`; a run that
    does not fit goes to `report.reasons` with what would."""
    from day0jax import train_plan

    try:
        shape = train_plan.TrainShape.of(abstract, setup)
        p = train_plan.plan(shape, setup, train_plan.available_memory(device_memory))
    except Day0Error as e:
        report.reasons.append(str(e))
        return {}
    refusal = train_plan.refusal(shape, p)
    if refusal:
        report.reasons.append(refusal)
    return dict(p.to_dict(), rows=p.rows(), summary=p.summary(), would_fit=train_plan.suggestions(shape, p))


def _mtp_shipped(config, source) -> bool:
    """Whether the checkpoint holds multi-token-prediction layers the family builds (a converted checkpoint's
    optional part, or a source's tensors)."""
    from day0jax import models

    pattern = models.mtp_tensors(config)
    import re

    if not pattern or source is None or isinstance(source, _ReadableShards):
        return False
    if isinstance(source, dict):
        return any(name.startswith(models.MTP_PREFIX) for name in source.get("params", {}))
    return any(re.fullmatch(pattern, name) for name in source.tensor_names())


def _report_ops(report: Report, abstract, dtype, tp: int) -> None:
    """The model's op calls, the operators table and the layer table (computing in `dtype`), into `report`."""
    import jax.numpy as jnp

    op_calls = abstract.op_calls()
    report.op_calls = [call.to_dict() for call in dict.fromkeys(call for _, call in op_calls)]
    report.ops = _ops(op_calls, dtype, tp)
    report.layers = _layers(abstract, op_calls, jnp.dtype(dtype).itemsize)


def _vision(abstract, infos, itemsize: int) -> dict:
    """A vision-language model's images: its tower, the tokens and preprocessed shape of one image, and the vision
    side's parameters (everything outside the language model)."""
    spec = getattr(abstract, "vision_spec", None)
    if spec is None:
        return {}
    v = abstract.config.vision
    count = sum(math.prod(i.shape) for i in infos if not i.path.startswith("language_model."))
    layers = getattr(v, "num_hidden_layers", getattr(v, "depth", "?"))
    tower = f"{getattr(v, 'name', v.model_type)} ({layers} layers x {v.hidden_size})"
    return {"tower": tower, "tokens_per_image": spec.tokens_per_image,
            "pixels": None if spec.pixel_shape is None else list(spec.pixel_shape), "merge": spec.merge,
            "multimodal_rope": spec.mrope is not None, "deepstack_layers": spec.deepstack,
            "image_tokens_attend_both_ways": spec.bidirectional, "parameters": count,
            "parameter_bytes": count * itemsize}


def _source_quantization(fam, config, abstract, infos, source, quantize: str | None = None, hf: dict | None = None):
    """What converting `source` (with `--quantize quantize`) would keep quantized (a `convert.quantize.QuantPlan`),
    planned on the float model `abstract` with parameters `infos`; None for a converted checkpoint or an unreadable
    source. A config.json alone (`hf`) is planned as its compressed-tensors quantization says, else as a float
    source.

    Raises:
        Day0Error: a quantization the runtime does not keep (named), or a malformed one.
    """
    from convert.quantize import plan_quantization

    if source is None:
        if quantize:
            return plan_quantization(abstract, {}, None, quantize_kind=quantize)
        return _config_quantization(fam, config, abstract, infos, (hf or {}).get("quantization_config") or {})
    if isinstance(source, (dict, _ReadableShards)):
        return None
    from convert.convert import plan_sources
    from convert.sources import RenamedSource

    source = RenamedSource(source, fam.renames) if fam.renames else source
    return plan_quantization(abstract, plan_sources(fam, config, infos, source), source, quantize_kind=quantize)


def _config_quantization(fam, config, abstract, infos, q: dict):
    """What a compressed-tensors checkpoint stores quantized, from its config.json alone (its weights not here):
    every weight its scheme targets and its `ignore` list does not name, the vision side left float (those
    checkpoints quantize the language model only); for an MXFP4 one, its MoE experts; None for other quantization
    methods.

    Raises:
        Day0Error: a scheme the runtime does not keep (named).
    """
    import re

    from convert.compressed_tensors import scheme
    from convert.quantize import VISION_MARKERS, QuantPlan, quantizable
    from day0jax.core.hf_tensors import default_source
    from day0jax.layers.quantized import QuantSpec

    if q.get("quant_method") == "mxfp4":  # MXFP4 releases (gpt-oss) quantize the MoE experts and nothing else
        from kernels_pallas.quantized_linear.reference import MX_GROUP

        targets = quantizable(abstract)
        specs = {k: QuantSpec("mxfp4", MX_GROUP, False, "uint8") for k, t in targets.items()
                 if t.experts and not t.inputs % MX_GROUP}
        kept = {"not quantized by the checkpoint": len(targets) - len(specs)} if len(targets) > len(specs) else {}
        return QuantPlan(specs, frozenset(specs), kept, frozenset(specs))
    if q.get("quant_method") != "compressed-tensors":
        return None
    s = scheme("config.json", q)
    if s.fp8 or "Linear" not in next(iter(q["config_groups"].values())).get("targets", ["Linear"]):
        return None
    ignore = q.get("ignore") or []

    def ignored(module: str) -> bool:
        for entry in ignore:
            if entry.startswith("re:") and re.match(entry[3:], module):
                return True
            if not entry.startswith("re:") and (module == entry or module.endswith("." + entry)):
                return True
        return False
    by_path = {i.path: i for i in infos}
    specs, kept = {}, {}
    targets = quantizable(abstract)  # one walk of the module tree (a 1T model has ~270k modules)
    for key, t in targets.items():
        info = by_path[t.param_path(key)]
        src = fam.hf_source(config, info.path, info.shape, info.metadata) or default_source(info.path, info.shape,
                                                                                          info.metadata)
        modules = [n.removesuffix(".weight") for n in src.names]
        if t.embedding or any(m in key for m in VISION_MARKERS) or any(ignored(m) for m in modules):
            kept["not quantized by the checkpoint"] = kept.get("not quantized by the checkpoint", 0) + 1
            continue
        group = s.group or t.inputs
        specs[key] = QuantSpec("int4" if s.bits == 4 else "int8", group, offset=not s.symmetric,
                               scale_dtype="bfloat16" if s.symmetric else "float32")
    experts = frozenset(k for k in specs if targets[k].experts)
    return QuantPlan(specs, frozenset(specs), kept, experts)


def _mapping_problems(fam, config, infos, source) -> list[str]:
    """Whether every runtime parameter finds its tensor (right shape) and every tensor is used, from headers."""
    if source is None or isinstance(source, _ReadableShards):  # (an unreadable shard is reported already)
        return []
    if isinstance(source, dict):
        from day0jax.weights.restore import manifest_problems

        return manifest_problems(source, infos)[:5]
    from convert.convert import plan_sources
    from convert.sources import RenamedSource

    try:
        plan_sources(fam, config, infos, RenamedSource(source, fam.renames) if fam.renames else source)
    except Day0Error as e:
        return [str(e)]
    return []


def _memory(abstract, infos, config, mesh_spec, engine, dtype: str, report: Report, cluster=None,
            probe: bool = False) -> dict:
    """The memory plan `load` would make for these flags, on the visible devices, the mesh described or `cluster`
    (and with `probe`, the measured collectives of that mesh in `report.probe`)."""
    import jax

    from day0jax.loader import EnginePlanInputs
    from sharding import plan as plan_lib
    from sharding.cluster import ranked_meshes

    devices = jax.devices()
    available = cluster.available if cluster else plan_lib.device_memory(devices)
    try:
        inputs = EnginePlanInputs.of(abstract, config, engine)
        plan_of = lambda s: inputs.plan(s, dtype, available)  # noqa: E731
        # A cluster's meshes over all its devices, best placed first, each with its plan (choice and report).
        ranked = [(s, plan_of(s)) for s in ranked_meshes(cluster, infos)] if cluster else []
        if cluster and mesh_spec in (None, mesh_lib.AUTO):
            sizes = _cluster_mesh(cluster, infos, ranked)
        elif mesh_spec == mesh_lib.AUTO:
            sizes = mesh_lib.auto_sizes(len(devices), infos, lambda s: plan_of(s).fits,
                                        mesh_lib.host_ordered(devices)[1])
        else:
            sizes = mesh_lib.parse_spec(mesh_spec)
    except Day0Error as e:
        report.reasons.append(str(e))
        return {}
    bad = mesh_lib.problems(sizes, infos)
    if sizes.get("pp", 1) > 1:
        from day0jax.engine.stages import pipeline_refusal

        bad += [r for r in [pipeline_refusal(abstract)] if r]
    if bad:
        report.reasons.append(f"mesh {mesh_lib.format_spec(sizes)}: " + "; ".join(bad))
    try:
        p = inputs.plan(sizes, dtype, available)
    except Day0Error as e:  # a mesh the model cannot be planned on at all (more stages than layers)
        report.reasons.append(str(e))
        return {}
    if cluster:
        report.cluster = _cluster_report(cluster, inputs, sizes, p, ranked, dtype, report)
    else:
        try:
            inputs.require_fit(p, n_devices=len(devices))
        except Day0Error as e:
            report.reasons.append(str(e))
    if probe:
        report.probe = _probe(inputs, sizes, infos, dtype, report) if not cluster else {}
        if cluster:
            report.notes.append("--probe measures the devices present; a described cluster has none here")
    out = p.to_dict()
    out["summary"] = p.summary()
    out["visible_devices"] = cluster.describe() if cluster else f"{len(devices)} {devices[0].platform}"
    return out


def _probe(inputs, sizes, infos, dtype: str, report: Report) -> dict:
    """Collectives measured on the mesh over the devices present, and the communication time of a decode step."""
    from sharding.probe import decode_step_time, probe

    if math.prod(sizes.values()) == 1:
        report.notes.append("--probe: the mesh is one device, there are no collectives to measure (give --mesh)")
        return {}
    try:
        mesh = mesh_lib.make_mesh(sizes, infos=infos)
    except Day0Error as e:
        report.notes.append(f"--probe: {e}")
        return {}
    links = probe(mesh)
    rows = inputs.workload.max_num_seqs
    step = decode_step_time(inputs.shape, sizes, dtype, rows, links)
    return {"mesh": mesh_lib.describe(mesh), "links": [link.to_dict() for link in links], "rows": rows,
            "decode_step_seconds": step}


def _cluster_mesh(cluster, infos, ranked) -> dict[str, int]:
    """The best placed mesh over all of `cluster`'s devices that fits, else the one needing the least memory per
    device (reported as not fitting); `ranked`: (sizes, memory `Plan`) of each, best placed first.

    Raises:
        MeshError: no mesh over the cluster divides the model.
    """
    if not ranked:
        raise mesh_lib.MeshError(f"no mesh over the cluster's {cluster.devices} devices divides this model: "
                                 + "; ".join(mesh_lib.problems({"tp": cluster.devices}, infos)))
    return next((s for s, p in ranked if p.fits), min(ranked, key=lambda sp: sp[1].total_bytes)[0])


def _cluster_report(cluster, inputs, sizes, p, ranked, dtype: str, report: Report) -> dict:
    """Placement, traffic and the meshes that fit (of `ranked`, as `_cluster_mesh` takes it) for a described
    cluster; refusals go to `report.reasons`."""
    from sharding import plan as plan_lib
    from sharding.cluster import traffic

    used = math.prod(sizes.values())
    if used != cluster.devices:
        report.reasons.append(f"mesh {mesh_lib.format_spec(sizes)} uses {used} device(s); the cluster has "
                              f"{cluster.devices}: give a mesh over all of them")
    fitting = [mesh_lib.format_spec(s) for s, q in ranked if q.fits]
    if not p.fits:
        would = (f"meshes over the cluster that fit, best placed first: {'; '.join(fitting[:6])}" if fitting else
                 "no mesh over the cluster fits: " + "; ".join(
                     plan_lib.suggestions(p, inputs.shape, inputs.workload, inputs.workload_for,
                                          n_devices=cluster.devices)))
        report.reasons.append(f"the model will not fit {cluster.describe()}: {p.summary()}. {would}")
    cross = mesh_lib.crossing(sizes, cluster.devices_per_host)
    return {"hosts": cluster.hosts, "devices_per_host": cluster.devices_per_host,
            "device_memory": cluster.device_memory, "mesh": mesh_lib.format_spec(sizes), "fits": p.fits,
            "axes_crossing_hosts": [a for a in mesh_lib.AXES if cross[a] and sizes[a] > 1],
            "traffic": [t.to_dict() for t in traffic(inputs.shape, sizes, dtype, cluster.devices_per_host)],
            "meshes_that_fit": fitting}


def _table(rows: list[dict], cols: list[str]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    line = lambda r: "  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols).rstrip()  # noqa: E731
    return "\n".join([line({c: c for c in cols}), line({c: "-" * widths[c] for c in cols})] + [line(r) for r in rows])


def _load_estimate(path: Path, manifest: dict) -> dict:
    """How long reading a day0jax checkpoint's parameters takes here: their bytes over the storage's throughput,
    timed on a sample of the largest group's files (out of the page cache first)."""
    from day0jax.weights import checkpoint
    from day0jax.weights.stream import time_storage

    files = sorted((f for f in (path / checkpoint.PARAMS_DIR).rglob("*") if f.is_file()),
                   key=lambda f: -f.stat().st_size)
    total = sum(f.stat().st_size for f in files)
    sampled, seconds = time_storage(files)
    rate = sampled / seconds if seconds > 0 else 0.0
    return {"bytes": total, "sample_bytes": sampled, "bytes_per_second": rate,
            "seconds": total / rate if rate else None}


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
    if report.layers:
        out += ["", "layers:", _table(report.layers, ["kind", "layers", "cache"])]
    if report.ops:
        out += ["", f"operators on {report.backend}:", _table(report.ops, ["op", "variant", "layers",
                                                                          "implementation"])]
    if report.parameters:
        p = report.parameters
        out += ["", f"parameters: {p['model']:,} in the model ({p['model'] / 1e6:.2f}M), "
                    f"{p['checkpoint_elements']:,} elements stored; runtime dtype {p['runtime_dtype']}"]
        out += [f"  {k}: {fmt_bytes(v)}" for k, v in sorted(p["checkpoint_bytes_by_dtype"].items())]
    if report.quantization:
        out += [f"  {report.quantization}"]
    if report.vision:
        v = report.vision
        if v["pixels"] is None:
            size = f"images of any size, a token per {v['merge']}x{v['merge']} patches"
        else:
            size = f"{v['tokens_per_image']} tokens per image, pixels {'x'.join(map(str, v['pixels']))}"
        extras = [text for text, on in (("an image's tokens attend to each other both ways",
                                         v["image_tokens_attend_both_ways"]),
                                        ("3-D multimodal RoPE", v["multimodal_rope"]),
                                        (f"DeepStack into {v['deepstack_layers']} layers", v["deepstack_layers"]))
                  if on]
        out += ["", f"images: {v['tower']} tower, {size}" + "".join(f"; {x}" for x in extras) +
                f"; {v['parameters']:,} vision parameters ({fmt_bytes(v['parameter_bytes'])})"]
    if report.mtp:
        t = report.mtp
        out += ["", f"multi-token-prediction layers: {t['layers']} ({t['parameters']:,} parameters, "
                    f"{fmt_bytes(t['bytes'])}; {t['kv_per_token']} cached numbers per token), for speculative "
                    "decoding (--speculative mtp; convert --no-mtp leaves them out)"]
    if report.adapters:
        t = report.adapters
        out += ["", "LoRA adapters: " + ", ".join(f"{a['name']} (r={a['rank']}, {a['modules']} modules)"
                                                    for a in t["adapters"]) +
                f"; {t['modules']} adapted linear maps, slots padded to r={t['padded_rank']}, "
                f"{fmt_bytes(t['bytes'])} on every device"]
    if report.load.get("seconds") is not None:
        ld = report.load
        out += ["", f"loading: {fmt_bytes(ld['bytes'])} of parameter files, about {ld['seconds']:.1f} s at "
                    f"{ld['bytes_per_second'] / 1e9:.2f} GB/s (this storage, timed reading "
                    f"{fmt_bytes(ld['sample_bytes'])} not in the page cache)"]
    if report.memory and not report.cluster:
        m = report.memory
        out += ["", f"memory per device ({m['visible_devices']} device(s) visible): {m['summary']}"]
        if m.get("kv_dtype"):
            scales = " with a float32 scale per token and kv head" if m["kv_dtype"].startswith("float8") else ""
            out += [f"KV cache dtype: {m['kv_dtype']}{scales} (--kv-cache-dtype)"]
        out += [f"  note: {n}" for n in m.get("notes", ())]
    if report.training:
        t = report.training
        verdict = "fits" if t["fits"] else "DOES NOT FIT"
        precision = t["setup"]["dtype"] + (" with float32 masters" if t["setup"]["dtype"] != "float32" else "")
        out += ["", f"fine-tuning memory per device (one device, {precision}; {t['setup']['fine_tune_type']}): "
                f"{verdict}",
                _table(t["rows"], ["part", "bytes", "what"])]
        if t["would_fit"]:
            out.append("would fit: " + "; or ".join(t["would_fit"]))
    if report.cluster:
        out += _render_cluster(report)
    if report.probe:
        out += _render_probe(report.probe)
    return "\n".join(out)


def _render_probe(probe: dict) -> list[str]:
    rows = [{"axis": f"{x['axis']}={x['size']}",
             "all-reduce": f"{x['all_reduce_bandwidth'] / 1e9:.2f} GB/s, {x['all_reduce_latency'] * 1e6:.0f} us",
             "all-gather": f"{x['all_gather_bandwidth'] / 1e9:.2f} GB/s, {x['all_gather_latency'] * 1e6:.0f} us"}
            for x in probe["links"]]
    step = probe["decode_step_seconds"]
    times = ", ".join(f"{axis} {seconds * 1e3:.2f} ms" for axis, seconds in step.items()) or "none"
    return ["", f"collectives measured on {probe['mesh']} (bytes each device sends per second; latency):",
            _table(rows, ["axis", "all-reduce", "all-gather"]),
            f"estimated communication per decode step of {probe['rows']} sequences: {times}"]


def _render_cluster(report: Report) -> list[str]:
    from sharding.plan import fmt_bytes

    c, m = report.cluster, report.memory
    crossing = ", ".join(c["axes_crossing_hosts"]) or "none"
    out = ["", f"cluster: {m['visible_devices']}; mesh {c['mesh']} "
               f"({'fits' if c['fits'] else 'DOES NOT FIT'}); axes crossing hosts: {crossing}",
           f"memory per device: {m['summary']}"]
    out += [f"  note: {n}" for n in m.get("notes", ())]
    if c["traffic"]:
        rows = [{"axis": f"{t['axis']}={t['size']}", "crosses hosts": "yes" if t["crosses_hosts"] else "no",
                 "per decode token": fmt_bytes(t["decode_bytes"]), "per prefill token": fmt_bytes(t["prefill_bytes"]),
                 "what": t["what"]} for t in c["traffic"]]
        out += ["bytes sent per token (all devices of the axis together):",
                _table(rows, ["axis", "crosses hosts", "per decode token", "per prefill token", "what"])]
    out.append("meshes that fit, best placed first: " + ("; ".join(c["meshes_that_fit"][:8]) or "none"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m day0jax.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="Hugging Face folder, day0jax checkpoint folder or .gguf file")
    parser.add_argument("--mesh", default=None, help="SPEC such as 'dp=2,tp=4' (may name more devices than are "
                        "visible), or 'auto' (default: one device, as load and serve)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: per backend)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--probe", action="store_true",
                        help="measure all-reduce and all-gather over each mesh axis on the devices present, and the "
                             "communication time of a decode step")
    parser.add_argument("--quantize", choices=["int8", "int4", "fp8", "mxfp4", "nvfp4"],
                        help="plan the weights as `convert --quantize KIND` would store them")
    g = parser.add_argument_group("a cluster that is not here (all three together)")
    g.add_argument("--hosts", type=int, help="number of hosts")
    g.add_argument("--devices-per-host", type=int, help="accelerators in each host")
    g.add_argument("--device-memory", help="memory of one accelerator, e.g. 141GiB or 80GB")
    g = parser.add_argument_group("the checklist for a model_type day0jax does not implement")
    g.add_argument("--graph", action="store_true", help="trace one forward pass of the model's transformers code "
                   "(config.json alone, random weights) and map it onto day0jax's operators: covered, missing, "
                   "nearest family, verdict")
    g.add_argument("--torch-python", default=None, help="the Python with torch and transformers that traces "
                   "(default: the project's .venv-ref/bin/python)")
    g = parser.add_argument_group("a fine-tuning run instead of serving (python -m day0jax.train's flags)")
    g.add_argument("--train", action="store_true", help="plan fine-tuning memory on one device (with "
                   "--device-memory alone: that device's memory)")
    g.add_argument("--fine-tune-type", choices=["lora", "full"], default=None)
    g.add_argument("--lora-rank", type=int, default=None)
    g.add_argument("--lora-targets", default=None, help="comma-separated HF module names (default: every dense "
                   "projection)")
    g.add_argument("--batch-size", type=int, default=None)
    g.add_argument("--max-seq-length", type=int, default=None)
    g.add_argument("--grad-accumulation", type=int, default=None)
    g.add_argument("--grad-checkpoint", action="store_true")
    g.add_argument("--optimizer", choices=["adamw", "sgd"], default=None)
    cli.add_engine_arguments(parser)
    args = parser.parse_args(argv)
    if args.graph:
        return _graph_main(args)
    if args.torch_python:
        parser.error("--torch-python goes with --graph")
    if args.train:
        return _train_main(parser, args)
    given = [f"--{k.replace('_', '-')}" for k in TRAIN_FLAGS if getattr(args, k) not in (None, False)]
    if given:
        parser.error(f"{', '.join(given)} {'goes' if len(given) == 1 else 'go'} with --train")
    cluster = None
    described = (args.hosts, args.devices_per_host, args.device_memory)
    if any(x is not None for x in described):
        from sharding.cluster import Cluster, parse_size

        if any(x is None for x in described):
            parser.error("--hosts, --devices-per-host and --device-memory describe a cluster together; give all three")
        try:
            cluster = Cluster(args.hosts, args.devices_per_host, parse_size(args.device_memory))
        except Day0Error as e:
            parser.error(str(e))
    report = check(args.path, mesh=args.mesh, engine=cli.engine_config_from_args(args), dtype=args.dtype,
                   cluster=cluster, quantize=args.quantize, probe=args.probe)
    print(json.dumps(report.to_dict(), indent=2) if args.json else render(report))
    return RUNS if report.supported else WONT_RUN


TRAIN_FLAGS = ("fine_tune_type", "lora_rank", "lora_targets", "batch_size", "max_seq_length", "grad_accumulation",
               "grad_checkpoint", "optimizer")


def _train_main(parser: argparse.ArgumentParser, args) -> int:
    """`check --train`: the fine-tuning plan on one device, as the trainer runs (--dtype float32 or bfloat16, its
    default per backend; no mesh)."""
    from day0jax.train_plan import TRAIN_DTYPES, TrainSetup, default_train_dtype
    from sharding.cluster import parse_size

    if args.mesh is not None:
        parser.error("--mesh with --train: the fine-tuning plan is for one device (a mesh's split is not planned)")
    if args.hosts is not None or args.devices_per_host is not None:
        parser.error("--hosts and --devices-per-host with --train: the trainer runs on one device (give "
                     "--device-memory alone)")
    if args.dtype not in (None, *TRAIN_DTYPES):
        parser.error(f"--dtype {args.dtype} with --train: the trainer trains in {' or '.join(TRAIN_DTYPES)}")
    defaults = {f.name: f.default for f in dataclasses.fields(TrainSetup)}
    given = {k: getattr(args, k) for k in TRAIN_FLAGS if getattr(args, k) not in (None, False)}
    given["dtype"] = args.dtype or default_train_dtype()
    if "lora_targets" in given:
        given["lora_targets"] = tuple(t for t in given["lora_targets"].split(",") if t)
    try:
        setup = TrainSetup(**{**defaults, **given})
        memory = parse_size(args.device_memory) if args.device_memory is not None else None
    except Day0Error as e:
        parser.error(str(e))
    report = check(args.path, engine=cli.engine_config_from_args(args), dtype="float32", quantize=args.quantize,
                   train=setup, device_memory=memory)
    print(json.dumps(report.to_dict(), indent=2) if args.json else render(report))
    return RUNS if report.supported else WONT_RUN


def _graph_main(args) -> int:
    from day0jax.graph import report as graph

    try:
        result = graph.check_graph(args.path, args.torch_python)
    except Day0Error as e:
        print(f"day0jax check --graph: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result.to_dict(), indent=2) if args.json else graph.render(result))
    return RUNS if result.runs_today else WONT_RUN


if __name__ == "__main__":
    sys.exit(main())
