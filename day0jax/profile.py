"""Where a step's time goes: `python -m day0jax.profile --model CKPT [--mesh SPEC] [--batch B] [--prompt-len T]
[--new-tokens N] [--trace DIR] [--speculative ngram|draft|mtp --num-speculative-tokens K [--draft-model PATH]]`.

Runs `batch` random prompts of `prompt-len` tokens through the engine once to compile every program, then again
under `jax.profiler`, prefill and decode each in its own trace. Each XLA operation the trace records is put in an
operator group by the named scope the model code gives it (`jax.named_scope("mlp")`, "attention", "norm", ...,
read from the compiled program's op metadata); bytes moved per operation come from its operand and result shapes.
Per phase it prints time per step, share, bytes and achieved GB/s per group, against the copy bandwidth measured in
the same run; "host overhead" is the step's wall time that no operation covers (scheduling, dispatch, transfers).
With speculative decoding, the decode phase shows the time of its programs apart: "speculative: propose" (a device
proposer's drafting), "speculative: verify" (the target's forward over each row's drafts) and "speculative: accept"
(the acceptance), and a line gives the host's own proposing (prompt lookup) per step.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# Operator groups by named scope; an operation inside several takes the first listed (an MLP's projections are MLP,
# the vocabulary projection is not "other projections").
GROUPS = {"propose": "speculative: propose", "verify": "speculative: verify", "accept": "speculative: accept",
          "mlp": "MLP projections", "attention": "attention", "cache_write": "cache writes", "rope": "RoPE",
          "norm": "norms", "vocab": "vocabulary projection", "sampling": "sampling",
          "projection": "other projections"}
OTHER, HOST = "other ops", "host overhead"
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\([^=]*?\)|\S+)\s+(?P<op>[\w\-]+)"
                          r"\((?P<operands>[^)]*)\)(?P<rest>.*)$")


def group_of(op_name: str) -> str:
    """The operator group of an operation whose op metadata is `op_name` (scopes joined by "/")."""
    scopes = set(op_name.split("/"))
    return next((label for scope, label in GROUPS.items() if scope in scopes), OTHER)


def _bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(shape):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


@dataclass(frozen=True)
class HloOp:
    group: str
    bytes: int  # operands read plus result written


def hlo_ops(hlo_text: str) -> dict[str, HloOp]:
    """Each instruction of a compiled program's HLO text (`Compiled.as_text()`): its group and bytes moved.

    XLA drops the op metadata of some instructions it rewrites (a fusion keeps it only inside its computation, a dot
    turned into a matrix-vector product loses it): those take the group found inside the computation they call, or
    else their users' or their operands' group."""
    sizes, op_names, operands, calls = {}, {}, {}, {}
    computation = ""
    owner: dict[str, str] = {}  # instruction -> the computation it is in
    params: dict[str, dict[str, int]] = {}  # computation -> its parameters' numbers, by name
    sliced: dict[str, set[str]] = {}  # computation -> the names it only slices or gathers from
    for line in hlo_text.splitlines():
        head = re.match(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and "=" not in line.split("{")[0]:
            computation = head.group(1)
            continue
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        name = m["name"]
        sizes[name] = _bytes(m["shape"])
        if m["op"] == "parameter":
            params.setdefault(computation, {})[name] = int(m["operands"])
        if m["op"] in ("gather", "dynamic-slice", "slice"):  # reads only the rows or window it returns
            sliced.setdefault(computation, set()).update(re.findall(r"%([\w.\-]+)", m["operands"])[:1])
        found = re.search(r'op_name="([^"]*)"', m["rest"])
        op_names[name] = found.group(1) if found else ""
        operands[name] = re.findall(r"%([\w.\-]+)", m["operands"])
        calls[name] = re.findall(r"calls=%?([\w.\-]+)", m["rest"])
        owner[name] = computation
        if re.search(r"scatter|dynamic.update.slice", name + " " + m["op"]) and operands[name]:
            # In place: the buffer is neither read nor written whole, only the update is.
            sizes[name] = -max(sizes.get(o, 0) for o in operands[name])
    parameters = {name for names in params.values() for name in names}  # they take no time
    groups = {name: group_of(op) for name, op in op_names.items() if op}
    inside: dict[str, str] = {}
    for name, computation in owner.items():
        if name in groups and groups[name] != OTHER:
            inside.setdefault(computation, groups[name])
    users: dict[str, list[str]] = {}
    for name, ops in operands.items():
        for o in ops:
            users.setdefault(o, []).append(name)
    for name in op_names:
        if groups.get(name, OTHER) == OTHER:
            near = [inside.get(c) for c in calls[name]] + [groups.get(u) for u in users.get(name, [])] \
                + [groups.get(o) for o in operands[name]]
            groups[name] = next((g for g in near if g and g != OTHER), OTHER)

    def moved(name: str) -> int:
        # An operand a fused computation only slices or gathers from is read as much as the fusion writes.
        windowed = {i for c in calls[name] for p, i in params.get(c, {}).items() if p in sliced.get(c, set())}
        inputs = [min(max(sizes.get(o, 0), 0), abs(sizes[name])) if i in windowed else max(sizes.get(o, 0), 0)
                  for i, o in enumerate(operands[name])]
        if sizes[name] < 0:  # in place: read and write the update (the operands but the buffer)
            return 2 * (sum(inputs) + sizes[name])
        if "gather" in name and inputs:  # reads the rows it writes, not its whole table
            return 2 * sizes[name] + sum(inputs) - max(inputs)
        return sizes[name] + sum(inputs)

    return {name: HloOp(groups[name], moved(name)) for name in op_names if name not in parameters}


@dataclass
class Phase:
    """One phase's profile: wall seconds per step, and per group seconds and bytes per step."""

    name: str
    steps: int
    step_s: float
    groups: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, float] = field(default_factory=dict)
    trace: str = ""
    host_propose_s: float | None = None  # speculative decoding: the host proposer's seconds per step

    @property
    def busy_s(self) -> float:
        return sum(v for k, v in self.groups.items() if k != HOST)


def read_trace(trace_dir: Path) -> list[dict]:
    """The complete events ("X") of the Perfetto trace `jax.profiler.trace` wrote under `trace_dir`."""
    files = sorted(trace_dir.rglob("*.trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no Perfetto trace (*.trace.json.gz) under {trace_dir}")
    with gzip.open(files[-1], "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X"]


def attribute(events: list[dict], programs: list[dict[str, HloOp]], steps: int,
              step_s: float) -> tuple[dict, dict]:
    """Seconds and bytes per step by group from the trace's operation events. Each execution (the events of one
    run_id) is matched to the program (`hlo_ops` of each) holding its operations: programs of one jitted function
    share a module name and reuse operation names with other meanings. Operations that ran at the same time (XLA
    runs independent ones in parallel) share the time they overlapped, so the groups add up to the time some
    operation was running; the rest of the wall time is host overhead."""
    runs: dict[str, list[dict]] = {}
    for e in events:
        if "hlo_op" in e.get("args", {}):
            runs.setdefault(str(e["args"].get("run_id")), []).append(e)
    spans = []  # (start us, end us, HloOp)
    for run in runs.values():
        names = {e["args"]["hlo_op"] for e in run}
        ops = max(programs, key=lambda p: len(names & p.keys()), default={})
        spans += [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), ops[e["args"]["hlo_op"]]) for e in run
                  if e["args"]["hlo_op"] in ops]
    seconds: dict[str, float] = {}
    moved: dict[str, float] = {}
    # Sweep the span boundaries: each elementary interval is split evenly among the operations running in it.
    bounds = sorted({t for s, e, _ in spans for t in (s, e)})
    starts = sorted(spans, key=lambda span: span[0])
    active: list = []
    k = 0
    for left, right in zip(bounds, bounds[1:]):
        while k < len(starts) and starts[k][0] <= left:
            active.append(starts[k])
            k += 1
        active = [a for a in active if a[1] > left]
        for _, _, op in active:
            seconds[op.group] = seconds.get(op.group, 0.0) + (right - left) * 1e-6 / len(active) / steps
    for _, _, op in spans:
        moved[op.group] = moved.get(op.group, 0.0) + op.bytes / steps
    seconds[HOST] = step_s - sum(seconds.values())
    return seconds, moved


def copy_bandwidth(megabytes: int = 256) -> float:
    """Bytes per second of a jitted elementwise pass over a float32 array (read once, written once), best of 5."""
    import jax
    import jax.numpy as jnp

    # In place (the input donated): a fresh output would time the kernel's first touch of new pages instead.
    double = jax.jit(lambda a: a * 0.5, donate_argnums=0)
    x = double(jnp.ones(megabytes * 2**20 // 4, jnp.float32)).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x = double(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * x.nbytes / best


def profile(model, batch: int = 1, prompt_len: int = 128, new_tokens: int = 32, trace_dir: Path | None = None,
            seed: int = 0) -> list[Phase]:
    """Profiles prefill and decode of `batch` random prompts on `model` (a `day0jax.Model`); traces go under
    `trace_dir` (prefill/, decode/)."""
    import jax

    from day0jax.engine.requests import SamplingParams
    from day0jax.engine.programs import Program

    trace_dir = Path(trace_dir or tempfile.mkdtemp(prefix="day0jax-profile-"))
    rng = np.random.default_rng(seed)
    warmup, prompts = ([rng.integers(0, int(model.config.vocab_size), prompt_len).tolist() for _ in range(batch)]
                       for _ in range(2))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine = model.engine
    # Compiles (or loads) every program the run takes; other prompts, or the run would hit the prefix cache.
    model.generate(warmup, new_tokens, ignore_eos=True)

    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-{i}", prompt, params)
    phases, first = [], set()
    spec = engine.spec
    host_propose = spec.propose_seconds if spec is not None else 0.0
    for name in ("prefill", "decode"):
        steps, t0 = 0, time.perf_counter()
        with jax.profiler.trace(str(trace_dir / name), create_perfetto_trace=True):
            while engine.has_work():
                for ev in engine.step():
                    if ev.token is not None:
                        first.add(ev.request_id)
                steps += 1
                if name == "prefill" and len(first) == batch:
                    break  # every prompt has its first token
            jax.effects_barrier()
            elapsed = time.perf_counter() - t0
        phases.append(Phase(name, steps, elapsed / max(steps, 1), trace=str(trace_dir / name)))
        if spec is not None and name == "decode":
            phases[-1].host_propose_s = (spec.propose_seconds - host_propose) / max(steps, 1)
    runner = engine.runner
    # The programs the runs used: those warm-up installed, and those jit compiled on first use (their HLO, lowered
    # again for the same shapes, comes from the compilation cache).
    compiled = list(runner.programs.values()) + [
        runner.compile(runner.lower(Program(key[0], key[1:]) if isinstance(key[0], str) else Program("forward", key)))
        for key in runner.compiled if not isinstance(key[0], str) or key[0] == "verify"]
    programs = [hlo_ops(c.as_text()) for c in compiled]
    for phase in phases:
        phase.groups, phase.bytes = attribute(read_trace(Path(phase.trace)), programs, phase.steps, phase.step_s)
    return phases


def table(phase: Phase, bandwidth: float) -> str:
    """The phase as a Markdown table: per group time per step, share, bytes per step and achieved GB/s."""
    rows = [f"{phase.name}: {phase.steps} steps, {phase.step_s * 1e3:.2f} ms per step (trace in {phase.trace})",
            "| group | ms/step | share | MB/step | GB/s | of copy bandwidth |", "|---|---:|---:|---:|---:|---:|"]
    for group, seconds in sorted(phase.groups.items(), key=lambda kv: -kv[1]):
        moved = phase.bytes.get(group, 0.0)
        rate = moved / seconds / 1e9 if seconds > 0 and moved else 0.0
        rows.append(f"| {group} | {seconds * 1e3:.3f} | {seconds / phase.step_s:.1%} | {moved / 1e6:.2f} | "
                    + (f"{rate:.1f} | {rate * 1e9 / bandwidth:.0%} |" if rate else "| |"))
    rows.append(f"| total | {sum(phase.groups.values()) * 1e3:.3f} | | | | |")
    if phase.host_propose_s is not None:
        rows.append(f"(host proposing, within host overhead: {phase.host_propose_s * 1e3:.3f} ms per step)")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m day0jax.profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a day0jax checkpoint folder")
    ap.add_argument("--mesh", default=None, help="mesh spec, e.g. tp=2 (default: one device)")
    ap.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: the checkpoint's)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--trace", type=Path, default=None, help="where to write the Perfetto traces (default: a new "
                    "temporary folder)")
    ap.add_argument("--speculative", choices=["mtp", "ngram", "draft"], help="profile speculative decoding")
    ap.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K")
    ap.add_argument("--draft-model", metavar="PATH")
    args = ap.parse_args(argv)

    import day0jax
    from day0jax.engine.config import EngineConfig, SpeculativeConfig

    max_len = args.prompt_len + args.new_tokens
    spec = None if args.speculative is None else SpeculativeConfig(
        args.speculative, num_tokens=args.num_speculative_tokens, draft_model=args.draft_model,
        max_batch=args.batch)
    model = day0jax.load(args.model, dtype=args.dtype, mesh=args.mesh, engine=EngineConfig(
        max_num_seqs=args.batch, max_model_len=max_len, min_width=max_len, speculative=spec))
    phases = profile(model, args.batch, args.prompt_len, args.new_tokens, args.trace)
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth (float32 elementwise, read + write): {bandwidth / 1e9:.1f} GB/s\n")
    for phase in phases:
        print(table(phase, bandwidth) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
