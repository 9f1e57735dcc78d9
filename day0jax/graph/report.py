"""`check --graph`: trace a model's `transformers` code in another Python, then say what day0jax has for each part.

The report: covered and missing module classes (each missing one with its file:line, calls per decode step and share
of the decode step's FLOPs and bytes), torch functions no operator or plain expression covers, the nearest supported
family by module structure, the config keys that family does not read, and a verdict.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

from day0jax.core import hf_config as config_lib
from day0jax.core.errors import Day0Error
from day0jax.graph import mapping

SCRIPT = Path(__file__).with_name("trace_torch.py")
PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TORCH_PYTHON = PROJECT_ROOT / ".venv-ref" / "bin" / "python"
# Module classes that are one family's heads for other tasks, never part of a causal LM's forward pass.
OTHER_HEADS = ("PreTrainedModel", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")


class TracerUnavailable(Day0Error):
    """No Python with torch and transformers to trace the modeling code with."""


def torch_python(path: str | Path | None) -> Path:
    """The Python that traces: `path`, else the project's reference venv.

    Raises:
        TracerUnavailable: neither exists.
    """
    chosen = Path(path) if path else DEFAULT_TORCH_PYTHON
    if not chosen.exists():
        where = f"{chosen} does not exist" if path else f"no reference venv at {DEFAULT_TORCH_PYTHON}"
        raise TracerUnavailable(f"--graph traces the modeling code with a Python that has torch and transformers: "
                                f"{where}; name one with --torch-python PATH (or run `make install`)")
    return chosen


def run_traces(paths: list[str | Path], python: Path, families: list[str], tokens: int = 8,
               timeout: float = 1800) -> list[dict]:
    """One trace per folder (see `trace_torch.py`), all in one subprocess of `python`.

    Raises:
        TracerUnavailable: the subprocess failed as a whole (not one model's trace, which its result reports).
    """
    jobs = [{"path": str(p), "families": families, "tokens": tokens} for p in paths]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(jobs, f)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    try:
        proc = subprocess.run([str(python), "-P", str(SCRIPT), f.name], capture_output=True, text=True,
                              timeout=timeout, env=env)
    finally:
        os.unlink(f.name)
    if proc.returncode:
        raise TracerUnavailable(f"tracing with {python} failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout)


@dataclasses.dataclass
class GraphReport:
    """What `check --graph` found; `to_dict()` is the `--json` output."""

    path: str
    model_type: str | None = None
    supported: bool = False  # day0jax implements this model_type
    transformers: str = ""
    model_class: str = ""
    modeling_file: str | None = None
    multimodal: bool = False
    shrunk: bool = False  # traced on a shrunk copy, calls scaled back to the true config
    stopped: dict | None = None  # where tracing stopped
    covered: list[dict] = dataclasses.field(default_factory=list)
    missing: list[dict] = dataclasses.field(default_factory=list)
    missing_functions: list[dict] = dataclasses.field(default_factory=list)
    parameters: int = 0
    nearest: dict = dataclasses.field(default_factory=dict)
    unread_keys: list[dict] = dataclasses.field(default_factory=list)
    verdict: str = ""
    runs_today: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _owners(tree: list[list], mapped: dict[str, mapping.Mapped]) -> dict[str, str]:
    """Module path -> the class its own weights are charged to: the nearest enclosing module that is an operator
    (other than a bare linear map), a layer below the model and its decoder layers, or missing; else its own class
    (the LM head's linear map, a linear map straight in a decoder layer)."""
    by_path = {row[0]: row[1] for row in tree}

    def carrier(cls: str) -> bool:
        m = mapped[cls]
        return (m.kind == "missing" or (m.kind == "operator" and m.name != "linear")
                or (m.kind == "layer" and m.name not in ("model", "decoder layer")))

    owners = {}
    for path, cls, _, _ in tree:
        owner, parts = cls, path.split(".") if path else []
        for n in range(len(parts), -1, -1):
            up = by_path.get(".".join(parts[:n]))
            if up is not None and carrier(up):
                owner = up
                break
        owners[path] = owner
    return owners


def _live(tree: list[list], called: set[str]) -> list[list]:
    """The rows the forward pass used: none under a module with children that never ran (a multimodal model's vision
    tower, built but not run for text). A leaf that never ran stays: its weights may be read directly (a Conv1d's
    weight passed to a convolution function); containers (ModuleList) never run themselves."""
    by_path = {row[0]: row[1] for row in tree}
    parents = {p.rpartition(".")[0] for p in by_path if p}
    dead = {p for p, cls in by_path.items()
            if p in parents and cls not in called and cls not in ("ModuleList", "ModuleDict", "ParameterList")}

    def used(path: str) -> bool:
        parts = path.split(".") if path else []
        return not any(".".join(parts[:n]) in dead for n in range(len(parts) + 1))

    return [row for row in tree if used(row[0])]


def _signature(classes: list[str], prefixes: list[str]) -> Counter:
    """A family's module structure: one token per class, what day0jax maps it to and its role."""
    out = Counter()
    for c in classes:
        if c.endswith(OTHER_HEADS):
            continue
        m = mapping.module(c, prefixes)
        if m.kind != "plain":
            out[f"{m.kind}:{m.name if m.kind != 'missing' else ''}:{mapping.role(c, prefixes)}"] += 1
    return out


def _family_prefixes(classes: list[str]) -> list[str]:
    found = set()
    for c in classes:
        for suffix in ("PreTrainedModel", "ForCausalLM", "Model"):  # 'Glm5NextTextModel' -> 'Glm5NextText'
            if c.endswith(suffix) and len(c) > len(suffix):
                found.add(c.removesuffix(suffix))
    return sorted(found, key=len, reverse=True)


def _nearest(model_type: str, trace: dict, supported: list[str]) -> dict:
    """The supported family whose module structure (mapped operators and class roles, as a multiset) is the most
    like this model's: weighted Jaccard; ties go to the same model_type, then to the most similar name."""
    families = trace.get("families", {})
    own = families.get(trace.get("text_model_type")) or families.get(model_type)
    mine = _signature(own, _family_prefixes(own)) if own else _signature(
        list(trace.get("calls", {})), trace.get("prefixes", []))
    best = None
    for family in supported:
        classes = families.get(family)
        if not classes:
            continue
        theirs = _signature(classes, _family_prefixes(classes))
        union = sum((mine | theirs).values())
        score = sum((mine & theirs).values()) / union if union else 0.0
        key = (round(score, 6), family in (model_type, trace.get("text_model_type")),
               difflib.SequenceMatcher(None, model_type, family).ratio())
        if best is None or key > best[0]:
            best = (key, family, theirs)
    if best is None:
        return {}
    _, family, theirs = best
    return {"family": family, "score": round(best[0][0], 3),
            "only_here": sorted((mine - theirs).elements()), "only_there": sorted((theirs - mine).elements())}


def _unread_keys(hf: dict, family: str) -> list[dict]:
    """The config.json keys (of the text config, for a multimodal config read by a text family) that the nearest
    family's config does not declare, alias or ignore: the math they may change is not implemented there."""
    from day0jax import models

    config = models.family(family).config
    text = hf.get("text_config")
    if isinstance(text, dict) and getattr(config, "VISION_CONFIG", None) is None:
        hf = text
    fields = {f.name for f in dataclasses.fields(config)} | set(getattr(config, "ALIASES", {}))
    return [{"key": k, "value": json.dumps(hf[k])[:60]} for k in sorted(hf)
            if k not in fields and k not in config_lib.IGNORED_KEYS and not k.endswith("_config")]


def build(trace: dict, hf: dict | None, supported: list[str]) -> GraphReport:
    """The report of one trace (`trace_torch.py`'s result) of the model whose config.json is `hf`."""
    report = GraphReport(path=trace["path"], model_type=trace.get("model_type") or (hf or {}).get("model_type"),
                         transformers=trace.get("transformers", ""), model_class=trace.get("model_class", ""),
                         modeling_file=trace.get("modeling_file"), multimodal=bool(trace.get("multimodal")),
                         shrunk=bool(trace.get("shrunk")), stopped=trace.get("stopped"))
    report.supported = report.model_type in supported
    calls = trace.get("calls", {})
    tree = trace.get("tree", [])
    if not calls and not tree:
        report.verdict = _verdict(report)
        return report
    prefixes = trace.get("prefixes", [])
    if calls and not report.stopped:
        tree = _live(tree, set(calls))
    true_instances = Counter(row[1] for row in tree)
    traced_instances = trace.get("traced_instances", {})
    classes = sorted(set(true_instances) | set(calls))
    mapped = {c: mapping.module(c, prefixes) for c in classes}
    owners = _owners(tree, mapped)
    flops, nbytes = Counter(), Counter()
    for path, cls, own, active in tree:
        if mapped[cls].name != "embedding":  # a lookup, no multiply-adds
            flops[owners[path]] += 2 * active
        nbytes[owners[path]] += active
    report.parameters = sum(row[2] for row in tree)
    total_flops, total_bytes = sum(flops.values()) or 1, sum(nbytes.values()) or 1
    sources = trace.get("sources", {})
    ops = trace.get("ops", {})

    def per_step(c: str) -> float:
        # The forward pass traced over a few tokens calls each module once per decode step; a shrunk copy has fewer
        # layers and experts, scaled back by the true config's instances of the class.
        traced = traced_instances.get(c) or 0
        return round(calls.get(c, 0) * (true_instances[c] / traced if traced else 1), 2)

    for c in classes:
        m = mapped[c]
        if m.kind == "plain":
            continue
        src = sources.get(c, {})
        row = {"class": c, "calls_per_step": per_step(c)}
        if m.covered:
            report.covered.append(dict(row, maps_to=f"{m.kind} {m.name}" + (f" ({m.where})" if m.where else "")))
            if m.kind == "operator":
                continue  # the functions inside an operator's module are that operator's business
        functions = {f: n for f, n in ops.get(c, {}).items() if not mapping.function(f).covered}
        if not m.covered:
            report.missing.append(dict(row, file=src.get("file"), line=src.get("line"),
                                       flops_share=round(flops[c] / total_flops, 4),
                                       bytes_share=round(nbytes[c] / total_bytes, 4),
                                       parameters=sum(r[2] for r in tree if owners[r[0]] == c),
                                       functions=sorted(ops.get(c, {})), uncovered_functions=sorted(functions)))
        else:
            report.missing_functions += [{"function": f, "module_class": c, "calls": n, "file": src.get("file"),
                                          "line": src.get("line")} for f, n in sorted(functions.items())]
    report.missing.sort(key=lambda r: (-r["flops_share"], r["class"]))
    if report.model_type:
        report.nearest = _nearest(report.model_type, trace, supported)
    if report.nearest and hf is not None:
        report.unread_keys = _unread_keys(hf, report.nearest["family"])
    report.runs_today = (report.supported and not report.missing and not report.missing_functions
                         and not report.unread_keys and not report.stopped)
    report.verdict = _verdict(report)
    return report


def _verdict(r: GraphReport) -> str:
    if r.runs_today:
        return "runs today"
    if r.stopped and not r.covered and not r.missing:
        return f"cannot tell: tracing stopped while {r.stopped['stage']}"
    needs = [m["class"] for m in r.missing] + sorted({f"torch.{f['function']}" for f in r.missing_functions})
    if r.unread_keys:
        needs.append("config key(s) " + ", ".join(k["key"] for k in r.unread_keys))
    if not r.supported and r.nearest:
        needs.append(f"a family file for model_type {r.model_type!r} (nearest: {r.nearest['family']!r})")
    text = "runs after: " + "; ".join(needs) if needs else "runs after: nothing found missing"
    if r.multimodal and not r.supported:
        text += "; needs the multimodal path (its vision tower and processor were not traced)"
    if r.stopped:
        text += f"; tracing stopped while {r.stopped['stage']}, so the lists may be incomplete"
    return text


def check_graph(path: str | Path, python: str | Path | None = None) -> GraphReport:
    """The `--graph` report for the model folder (or config.json) at `path`; reads config.json only.

    Raises:
        TracerUnavailable: no Python with torch and transformers to trace with.
    """
    return check_graphs([path], python)[0]


def check_graphs(paths: list[str | Path], python: str | Path | None = None) -> list[GraphReport]:
    """`check_graph` for many folders, traced in one subprocess."""
    from day0jax import models

    interpreter = torch_python(python)
    folders = [Path(p).parent if Path(p).name == "config.json" else Path(p) for p in paths]
    supported = sorted(models.FAMILIES)
    traces = run_traces(folders, interpreter, supported + _own_types(folders))
    out = []
    for folder, trace in zip(folders, traces):
        try:
            hf = config_lib.read_config_json(folder / "config.json")
        except Day0Error:
            hf = None
        out.append(build(trace, hf, supported))
    return out


def _own_types(folders: list[Path]) -> list[str]:
    """The model types of the folders themselves (and their text configs), for their own structure."""
    found = []
    for folder in folders:
        try:
            hf = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            continue
        for t in (hf.get("model_type"), (hf.get("text_config") or {}).get("model_type")):
            if isinstance(t, str) and t not in found:
                found.append(t)
    return found


def _at(path: str | None, line: int | None = None) -> str:
    """`path:line`, relative to the working folder when under it (the reference venv's copy of transformers)."""
    if path and Path(path).is_absolute() and Path(path).is_relative_to(Path.cwd()):
        path = str(Path(path).relative_to(Path.cwd()))
    return f"{path}:{line}" if line is not None else str(path)


def _function(name: str) -> str:
    m = mapping.function(name)
    return f"{name} ({m.name})" if m.kind == "operator" else name


def _share(x: float) -> str:
    return f"{100 * x:.1f}%"


def render(r: GraphReport) -> str:
    """The human-readable report."""
    out = [f"day0jax check --graph: {r.path}",
           f"model_type {r.model_type!r} ({'supported' if r.supported else 'not supported'} by day0jax); "
           f"traced {r.model_class or '-'} with transformers {r.transformers or '?'}"
           + (" (text model of a multimodal config)" if r.multimodal else "")
           + (" on a shrunk copy, calls scaled back" if r.shrunk else "")]
    if r.modeling_file:
        out.append(f"modeling code: {_at(r.modeling_file)}")
    if r.parameters:
        out.append(f"parameters: {r.parameters:,} ({r.parameters / 1e9:.2f}B)")
    if r.stopped:
        s = r.stopped
        out.append(f"TRACING STOPPED while {s['stage']}: {s['error']}")
        if s.get("file"):
            out.append(f"  at {_at(s['file'], s['line'])}" + (f", inside {s['module']}" if s.get("module") else ""))
    out += ["", f"VERDICT: {r.verdict}"]
    if r.nearest:
        n = r.nearest
        out.append(f"nearest supported family by structure: {n['family']} (similarity {n['score']:.2f})")
        if n["only_here"]:
            out.append("  only in this model: " + ", ".join(x.rsplit(":", 1)[1] for x in n["only_here"]))
        if n["only_there"]:
            out.append(f"  only in {n['family']}: " + ", ".join(x.rsplit(":", 1)[1] for x in n["only_there"]))
    if r.missing:
        out += ["", "MISSING (decode-step shares count 2 FLOPs and one read per weight a token uses; attention over "
                    "the cache is not counted):"]
        for m in r.missing:
            fns = f"; torch functions with no counterpart: {', '.join(m['uncovered_functions'])}" \
                if m["uncovered_functions"] else ""
            out.append(f"  {m['class']}  {_at(m['file'], m['line'])}")
            out.append(f"      {m['calls_per_step']:g} calls per step, {_share(m['flops_share'])} of FLOPs, "
                       f"{_share(m['bytes_share'])} of bytes, {m['parameters']:,} parameters{fns}")
            if m["functions"]:  # what a jax.numpy version of it has to write; in parentheses, an operator that has it
                out.append("      calls torch: " + ", ".join(_function(f) for f in m["functions"] if f[0] != "_"))
    if r.missing_functions:
        out += ["", "torch functions no operator covers:"]
        out += [f"  {f['function']} in {f['module_class']} ({_at(f['file'], f['line'])}), {f['calls']} calls"
                for f in r.missing_functions]
    if r.unread_keys:
        out += ["", f"config keys {r.nearest['family']} does not read:"]
        out += [f"  {k['key']} = {k['value']}" for k in r.unread_keys]
    if r.covered:
        out += ["", "covered:"]
        out += [f"  {c['class']:<40} {c['maps_to']}  ({c['calls_per_step']:g} per step)" for c in r.covered]
    return "\n".join(out)
