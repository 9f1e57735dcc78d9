"""Test cases for every op, built from a model's op calls: what `selfcheck`, the startup self-test and the tests run.

The op calls fix the shapes; the scale fixes sequence lengths and batches: 'full' serving-sized, 'startup' the
model's real dims with short sequences (cheap enough for every load), 'tiny' the family's features (GQA, window,
soft-cap, sinks, head dim) with few heads, rows and experts and a small hidden size, for the CPU interpreter in CI.
Inputs are random normal (never zeros: zeros hide unwritten outputs and wrong indexing), fresh per run unless a
seed is given, and every query sees at least one key, so every output element is defined and compared.
`TOLERANCE` is the largest accepted max|out - ref| / max|ref| per dtype: bf16 rounds to 2^-9 relative per element
and kernels round P or partial sums differently from the reference; float32 on GPUs may go through TF32 matrix
units (about 1e-3).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.calls import PLAIN_OPS, OpCall

TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 2e-3}

# The flagship models' op calls, written from the model code (day0jax's tests check they still match it).
FLAGSHIPS_FILE = Path(__file__).with_name("flagships.json")
# Op calls of families whose model code is not in day0jax yet (so not in flagships.json), from their published
# configs: they let `selfcheck` cover ops no flagship reaches. A family moves to flagships.json
# (`tests/test_op_calls.py --update`) once its model reports its calls.
PENDING_FAMILIES = {
    "kimi-linear-48b-a3b": [OpCall.of("gated_delta_rule", Nk=32, Nv=32, Hk=128, Hv=128, decay="channel")],
}
# What `selfcheck` runs by default: a dense GQA model, a fine-grained MoE, MLA with a large MoE, sparse MLA, and
# linear attention (gated delta rule, per-head and per-channel decay).
DEFAULT_FLAGSHIPS = ("llama-3-8b", "qwen3-30b-a3b", "deepseek-v3", "deepseek-v3.2", "qwen3-next-80b-a3b",
                     "kimi-linear-48b-a3b")
SCALES = ("full", "startup", "tiny")


@dataclass(frozen=True)
class Case:
    """One call of one op: `build(seed)` makes (args, kwargs) with random arrays."""

    op: str  # the op's registry name
    name: str  # family and what the case exercises
    dtype: str  # of the inputs
    spec: dict[str, Any] = field(hash=False)  # the static description the inputs are built from (shapes and flags)

    def build(self, seed: int, *, abstract: bool = False) -> tuple[tuple, dict]:
        """(args, kwargs) for the op, random from `seed`; `abstract`: float arrays as `jax.ShapeDtypeStruct`s (to
        lower serving-sized cases without allocating them), small integer inputs still concrete."""
        return _BUILDERS[self.op](_Random(seed, abstract), jnp.dtype(self.dtype), **self.spec)

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.dtype]

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.spec.items() if v is not None)


def flagships() -> dict[str, list[OpCall]]:
    """Flagship name -> its op calls, from `flagships.json`."""
    data = json.loads(FLAGSHIPS_FILE.read_text())
    return {name: [OpCall.from_dict(c) for c in entry["calls"]] for name, entry in data.items()}


def families() -> dict[str, list[OpCall]]:
    """`flagships()` and `PENDING_FAMILIES`: every family `flagship_cases` and `selfcheck --family` know."""
    return {**flagships(), **PENDING_FAMILIES}


def flagship_cases(names=DEFAULT_FLAGSHIPS, dtype: str = "bfloat16", *, scale: str = "full",
                   ops: tuple[str, ...] | None = None) -> list[Case]:
    """`cases_from_calls` over flagship (or pending) models."""
    table = families()
    return [c for n in names for c in cases_from_calls(table[n], dtype, scale=scale, name=n, ops=ops)]


def cases_from_calls(calls: list[OpCall], dtype: str = "bfloat16", *, scale: str = "full", name: str = "",
                     tp: int = 1, ops: tuple[str, ...] | None = None) -> list[Case]:
    """The cases a model's op calls call for (each distinct call once; plain jax.numpy ops have none).

    Args:
        calls: the model's op calls (`OpCall`s, as its `op_calls()` reports them).
        dtype: input dtype name.
        scale: 'full', 'startup' or 'tiny' (see the module docstring).
        name: prefix of the case names (the model).
        tp: tensor-parallel size; heads are split across it as the model's shards see them.
        ops: restrict to these ops.
    Returns:
        Cases for attention, paged_attention, rms_norm, moe, gated_delta_rule, sparse_attention and quantized_linear.
    Raises:
        ValueError: an unknown scale.
    """
    if scale not in SCALES:
        raise ValueError(f"scale {scale!r} is not one of {SCALES}")
    dtype = jnp.dtype(dtype).name
    prefix = f"{name} " if name else ""
    out: list[Case] = []
    for call in dict.fromkeys(calls):
        if call.op in PLAIN_OPS or (ops is not None and call.op not in ops):
            continue
        out += _CASES_OF[call.op](call, dtype, scale, prefix, tp)
    return list(dict.fromkeys(out))  # calls that differ only in what a scale leaves out make one case


def _attention_cases(call: OpCall, dtype: str, scale: str, prefix: str, tp: int) -> list[Case]:
    N, K, H, window = call["N"], call["K"], call["H"], call["window"]
    if tp > 1 and N % tp == 0 and K % tp == 0:
        N, K = N // tp, K // tp
    elif tp > 1 and N % tp == 0 and K == 1:
        N //= tp
    if scale == "tiny":  # the family's features (GQA ratio, head dim, window...) with few heads
        K, N = 1, min(N // K, 4)
        window = None if window is None else min(window, 48)
    attn = dict(N=N, K=K, H=H, scale=call["scale"], softcap=call["softcap"], sinks=call["sinks"], window=window)
    suffix = " sliding" if window else ""
    if call.get("chunk") is not None:  # chunked local attention: chunks shorter than the tiny sequences
        attn["chunk"] = min(call["chunk"], 32) if scale == "tiny" else call["chunk"]
        suffix += " chunked"
    if call.op == "paged_attention":
        paged = {"full": dict(B=32, T=1, page=16, max_len=4096), "startup": dict(B=4, T=1, page=16, max_len=512),
                 "tiny": dict(B=2, T=2, page=16, max_len=200)}[scale]
        return [Case("paged_attention", f"{prefix}decode{suffix}", dtype, {**attn, **paged})]
    # (label, B, T, S, offsets): prefill from position 0, and chunks of a ragged batch that end at kv_len.
    shapes = {"full": [("prefill", 1, 2048, 2048, False), ("chunked prefill", 4, 256, 1024, True)],
              "startup": [("prefill", 1, 256, 256, False), ("chunked prefill", 2, 128, 384, True)],
              "tiny": [("prefill", 1, 128, 128, False), ("chunked prefill", 2, 64, 192, True)]}[scale]
    return [Case("attention", f"{prefix}{label}{suffix}", dtype, dict(attn, B=B, T=T, S=S, offsets=offsets))
            for label, B, T, S, offsets in shapes]


def _rms_norm_cases(call: OpCall, dtype: str, scale: str, prefix: str, tp: int) -> list[Case]:
    rows = {"full": 2048, "startup": 64, "tiny": 12}[scale]
    D = 256 if scale == "tiny" else call["D"]
    return [Case("rms_norm", f"{prefix}residual {call['D']}", dtype,
                 dict(M=rows, D=D, eps=call["eps"], offset=call["offset"]))]


def _moe_cases(call: OpCall, dtype: str, scale: str, prefix: str, tp: int) -> list[Case]:
    G, k, D, F = call["E"], call["k"], call["D"], call["F"]
    if scale == "tiny":
        G, k, D, F = min(G, 6), min(k, 2), 128, 128
    prefill, decode = {"full": (1024, 8), "startup": (128, 8), "tiny": (24, 4)}[scale]
    fmt = dict(quantized=call["quantized"]) if call.get("quantized") else {}
    label = f"{prefix}{call['quantized']} " if fmt else prefix
    return [Case("moe", f"{label}gate/up prefill", dtype, dict(M=prefill * k, G=G, D=D, F=F, k=k, **fmt)),
            Case("moe", f"{label}gate/up decode", dtype, dict(M=decode * k, G=G, D=D, F=F, k=k, **fmt)),
            Case("moe", f"{label}down prefill", dtype, dict(M=prefill * k, G=G, D=F, F=D, k=k, **fmt))]


def _gated_delta_rule_cases(call: OpCall, dtype: str, scale: str, prefix: str, tp: int) -> list[Case]:
    Nk, Nv, Hk, Hv = call["Nk"], call["Nv"], call["Hk"], call["Hv"]
    if tp > 1 and Nk % tp == 0 and Nv % tp == 0:
        Nk, Nv = Nk // tp, Nv // tp
    if scale == "tiny":  # the family's head dims and grouping with one key head
        Nk, Nv = 1, min(Nv // Nk, 2)
    # (label, B, T): a prefill continuing from a state (T not a multiple of the chunk: padding), and a decode step.
    shapes = {"full": [("prefill", 2, 1000), ("decode", 32, 1)], "startup": [("prefill", 1, 200), ("decode", 4, 1)],
              "tiny": [("prefill", 1, 80), ("decode", 2, 1)]}[scale]
    return [Case("gated_delta_rule", f"{prefix}{label} {call['decay']} decay", dtype,
                 dict(B=B, T=T, Nk=Nk, Nv=Nv, Hk=Hk, Hv=Hv, decay=call["decay"])) for label, B, T in shapes]


def _sparse_attention_cases(call: OpCall, dtype: str, scale: str, prefix: str, tp: int) -> list[Case]:
    N, K, H, Hv, topk = call["N"], call["K"], call["H"], call["Hv"], call["topk"]
    if tp > 1 and N % tp == 0:
        N = N // tp
    if scale == "tiny":
        N, topk = min(N, 4), min(topk, 32)
    # A decode step over a context longer than top-k: the gather path reads only the selected keys.
    paged = {"full": dict(B=32, page=64, max_len=4 * topk), "startup": dict(B=4, page=16, max_len=2 * topk),
             "tiny": dict(B=2, page=16, max_len=3 * topk)}[scale]
    return [Case("sparse_attention", f"{prefix}decode top-{topk}", dtype,
                 dict(N=N, K=K, H=H, Hv=Hv, topk=topk, scale=call["scale"], **paged))]


def _quantized_linear_cases(call: OpCall, dtype: str, scale: str, prefix: str, tp: int) -> list[Case]:
    O, I, group = call["O"], call["I"], call["group"]
    fmt = dict(kind=call["kind"], group=group, offset=call["offset"], scale_dtype=call["scale_dtype"])
    label = f"{call['kind']}/{group}{'+offset' if call['offset'] else ''} {call['scale_dtype']} scales"
    if scale != "full":  # one case per format, whatever the weight's shape: the kernel's arithmetic is per group
        O, I = min(O, 96), group * max(1, min(I // group, 256 // group))
    else:
        label += f" [{O} x {I}]"
    # A decode step of one row and one of a small batch (the rows one pass over the codes serves).
    rows = (1, 16) if scale == "full" else (1, 5)
    return [Case("quantized_linear", f"{prefix}{label} x {R} rows", dtype, dict(fmt, O=O, I=I, R=R)) for R in rows]


_CASES_OF = {"attention": _attention_cases, "paged_attention": _attention_cases, "rms_norm": _rms_norm_cases,
             "moe": _moe_cases, "gated_delta_rule": _gated_delta_rule_cases,
             "sparse_attention": _sparse_attention_cases, "quantized_linear": _quantized_linear_cases}


class _Random:
    """Inputs from one seed: NumPy for small arrays (nothing to compile, which dominates on a CPU), jax.random
    on the device for large ones (serving-sized weights would take minutes and gigabytes on the host)."""

    LARGE = 1 << 22

    def __init__(self, seed: int, abstract: bool):
        self.rng, self.seed, self.abstract, self.count = np.random.default_rng(seed), seed, abstract, 0

    def normal(self, shape, dtype, scale: float = 1.0):
        self.count += 1
        if self.abstract:
            return jax.ShapeDtypeStruct(tuple(shape), dtype)
        if math.prod(shape) >= self.LARGE:
            key = jax.random.fold_in(jax.random.key(self.seed), self.count)
            return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)
        return jnp.asarray((self.rng.standard_normal(shape, np.float32) * scale).astype(dtype))

    def integers(self, low: int, high: int, size) -> np.ndarray:
        return self.rng.integers(low, high, size).astype(np.int32)


def _attention(rnd: _Random, dtype, *, B, T, S, N, K, H, scale, window, softcap, sinks, offsets, chunk=None):
    q = rnd.normal((B, T, N, H), dtype)
    k = rnd.normal((B, S, K, H), dtype)
    v = rnd.normal((B, S, K, H), dtype)
    if offsets:  # chunked prefill / ragged batch: row b holds kv_len_b keys, its T queries are the last ones
        lengths = rnd.integers(T, S + 1, (B,))
        lengths[0] = S
    else:
        lengths = np.full((B,), S, np.int32)
    positions = lengths[:, None] - T + np.arange(T, dtype=np.int32)[None, :]
    kwargs = dict(q_positions=jnp.asarray(positions), kv_lengths=jnp.asarray(lengths), causal=True,
                  sliding_window=window, logit_softcap=softcap, scale=scale,
                  sinks=rnd.normal((N,), jnp.float32) if sinks else None)
    if chunk is not None:
        kwargs["chunk_size"] = chunk
    return (q, k, v), kwargs


def _paged_attention(rnd: _Random, dtype, *, B, T, N, K, H, page, max_len, scale, window, softcap, sinks,
                     chunk=None):
    width = -(-max_len // page)
    pages = B * width + 1  # page 0 stays unused, as the engine's trash page
    lengths = rnd.integers(T, max_len + 1, (B,))
    lengths[0] = max_len
    tables = rnd.rng.permutation(np.arange(1, pages, dtype=np.int32))[: B * width].reshape(B, width)
    for b in range(B):  # entries past a row's pages point at the trash page, as the engine leaves them
        tables[b, -(-lengths[b] // page):] = 0
    positions = lengths[:, None] - T + np.arange(T, dtype=np.int32)[None, :]
    args = (rnd.normal((B, T, N, H), dtype), rnd.normal((pages, page, K, H), dtype),
            rnd.normal((pages, page, K, H), dtype), jnp.asarray(tables), jnp.asarray(lengths),
            jnp.asarray(positions))
    kwargs = dict(sliding_window=window, logit_softcap=softcap, scale=scale,
                  sinks=rnd.normal((N,), jnp.float32) if sinks else None)
    if chunk is not None:
        kwargs["chunk_size"] = chunk
    return args, kwargs


def _moe(rnd: _Random, dtype, *, M, G, D, F, k, quantized=None):
    # Rows routed like a softmax router's top-k: each token picks k distinct experts; group sizes follow.
    tokens = max(M // k, 1)
    logits = rnd.rng.standard_normal((tokens, G))
    chosen = np.argsort(-logits, axis=1)[:, :min(k, G)].reshape(-1)
    sizes = np.bincount(chosen, minlength=G)[:G].astype(np.int32)
    sizes[-1] += M - int(sizes.sum())  # M may exceed tokens * k by rounding; those rows go to the last expert
    lhs = rnd.normal((M, D), dtype)
    if quantized:  # 'int4/32+offset': each expert's [F, D] map as quantized_linear stores it
        kind, _, rest = quantized.partition("/")
        rhs = _quantized_weight(rnd, (G, F), D, kind=kind, group=int(rest.split("+")[0]),
                                offset=rest.endswith("+offset"), scale_dtype="float32")
    else:
        rhs = rnd.normal((G, D, F), dtype, 1 / math.sqrt(D))  # unit-scale outputs
    return (lhs, rhs, jnp.asarray(sizes)), {}


def _rms_norm(rnd: _Random, dtype, *, M, D, eps, offset):
    x = rnd.normal((M, D), dtype)
    residual = rnd.normal((M, D), dtype)
    weight = jax.ShapeDtypeStruct((D,), dtype) if rnd.abstract else jnp.asarray(
        (1.0 - offset + 0.1 * rnd.rng.standard_normal(D)).astype(dtype))
    return (x, weight), dict(eps=eps, offset=offset, residual=residual)


def _gated_delta_rule(rnd: _Random, dtype, *, B, T, Nk, Nv, Hk, Hv, decay):
    q, k, v = rnd.normal((B, T, Nk, Hk), dtype), rnd.normal((B, T, Nk, Hk), dtype), rnd.normal((B, T, Nv, Hv), dtype)
    g_shape = (B, T, Nv, Hk) if decay == "channel" else (B, T, Nv)
    g, beta = rnd.normal(g_shape, jnp.float32), rnd.normal((B, T, Nv), dtype)
    state = rnd.normal((B, Nv, Hk, Hv), jnp.float32, 0.1)
    if not rnd.abstract:  # as the models make them: g = -softplus(.) <= 0 in float32, beta = sigmoid(.)
        g, beta = -jax.nn.softplus(g), jax.nn.sigmoid(beta.astype(jnp.float32)).astype(dtype)
    return (q, k, v, g, beta, state), {}


def _sparse_attention(rnd: _Random, dtype, *, B, N, K, H, Hv, topk, page, max_len, scale):
    width = -(-max_len // page)
    pages = B * width + 1
    lengths = rnd.integers(topk, max_len + 1, (B,))
    lengths[0] = max_len
    tables = rnd.rng.permutation(np.arange(1, pages, dtype=np.int32))[: B * width].reshape(B, width)
    # Distinct visible positions per row, in a random order, as the indexer's top-k gives them.
    indices = np.stack([rnd.rng.permutation(int(n))[:topk] for n in lengths]).astype(np.int32)[:, None, :]
    args = (rnd.normal((B, 1, N, H), dtype), rnd.normal((pages, page, K, H), dtype),
            rnd.normal((pages, page, K, Hv), dtype), jnp.asarray(tables), jnp.asarray(lengths),
            jnp.asarray(lengths[:, None] - 1), jnp.asarray(indices))
    return args, dict(scale=scale)


def _quantized_weight(rnd: _Random, lead: tuple[int, ...], I: int, *, kind, group, offset, scale_dtype):
    """Random quantized maps [*lead, I] in `kind` (abstract: shapes only), scaled for unit-scale outputs."""
    from kernels_pallas.quantized_linear.reference import CODE_DTYPES, QuantizedWeight

    G, width = I // group, I // 2 if kind == "int4" else I
    if rnd.abstract:
        s = jax.ShapeDtypeStruct
        return QuantizedWeight(s((*lead, width), CODE_DTYPES[kind]), s((*lead, G), jnp.dtype(scale_dtype)),
                               s((*lead, G), jnp.dtype(scale_dtype)) if offset else None, kind, group)
    if kind == "fp8":  # random finite float8 codes: normal values cast
        codes = jnp.asarray(rnd.rng.standard_normal((*lead, width)).astype(CODE_DTYPES[kind]))
    else:
        low, high = (-127, 128) if kind == "int8" else (0, 256)
        codes = jnp.asarray(rnd.integers(low, high, (*lead, width)).astype(CODE_DTYPES[kind]))
    scales = jnp.asarray(np.abs(rnd.rng.standard_normal((*lead, G)) / math.sqrt(I) / 8).astype(jnp.dtype(scale_dtype)))
    offsets = jnp.asarray((rnd.rng.standard_normal((*lead, G)) / math.sqrt(I)).astype(jnp.dtype(scale_dtype))) \
        if offset else None
    return QuantizedWeight(codes, scales, offsets, kind, group)


def _quantized_linear(rnd: _Random, dtype, *, R, O, I, kind, group, offset, scale_dtype):
    w = _quantized_weight(rnd, (O,), I, kind=kind, group=group, offset=offset, scale_dtype=scale_dtype)
    return (rnd.normal((R, I), dtype), w), {}


_BUILDERS = {"attention": _attention, "paged_attention": _paged_attention, "moe": _moe, "rms_norm": _rms_norm,
             "gated_delta_rule": _gated_delta_rule, "sparse_attention": _sparse_attention,
             "quantized_linear": _quantized_linear}


def upcast(tree: Any) -> Any:
    """The tree with its bfloat16 arrays in float32: the inputs of the float32 reference answer."""
    return jax.tree.map(lambda x: x.astype(jnp.float32) if isinstance(x, jax.Array) and x.dtype == jnp.bfloat16
                        else x, tree)


def max_relative_error(out: Any, ref: Any) -> float:
    """max|out - ref| / max|ref| over every array of the outputs (float64; NaN or a shape mismatch -> inf)."""
    worst = 0.0
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        o, r = np.asarray(o, np.float64), np.asarray(r, np.float64)
        if o.shape != r.shape or not np.all(np.isfinite(o)):
            return math.inf
        worst = max(worst, float(np.abs(o - r).max() / max(np.abs(r).max(), 1e-30)))
    return worst
