"""The op table: every operator's `OpSpec`, the one place that says what an op is.

Each op folder (`kernels_pallas/<op>/`) declares its `SPEC` in `spec.py`: its name and title, the parameters of its
calls and how a call reads in words, its test cases and their input builder, and the api module that holds its
candidate pool. The registry (`registry.api`), `OpCall.describe`, `cases.cases_from_calls`, the startup self-test,
`selfcheck` and `day0jax.check` all read these specs. The ops the layers write in plain jax.numpy themselves (`PLAIN`
below) have a light spec: a title and a description, no cases and no candidates.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

# The op folders, each with a `spec.py` declaring `SPEC`: registering an op is adding its folder's name here.
FOLDERS = ("attention", "paged_attention", "moe", "rms_norm", "gated_delta_rule", "sparse_attention",
           "quantized_linear", "linear", "causal_conv1d", "mamba2_ssd", "hyper_connection",
           "kv_compress", "compressed_attention", "block_sparse_attention", "ngram_embedding")


@dataclass(frozen=True)
class OpSpec:
    """What an operator says about itself.

    `cases(call, dtype, scale, prefix, tp) -> list[Case]` turns one of its calls into test cases at a scale (see
    `cases.py`); `build(rnd, dtype, **case.spec) -> (args, kwargs)` makes a case's inputs from a `cases.Random`;
    `phases(call, case) -> [(label, case)]` splits `day0jax.check`'s implementation column where the op's phases
    may choose differently (default: one entry, the call's first startup case).
    """

    name: str  # as an `OpCall` names it and the api passes it to `registry.dispatch`
    title: str  # the op column of `day0jax.check`'s operator table
    params: Mapping[str, str]  # the parameters its calls carry (the static facts that fix shapes) -> meaning
    describe: Callable[[dict[str, Any]], str]  # a call's parameters -> its variant in words
    example: Mapping[str, Any]  # the parameters of one representative call (tests build its cases)
    api: str | None = None  # the module with the candidate pool and the op function; None: plain jax.numpy
    cases: Callable[..., list] | None = None
    build: Callable[..., tuple[tuple, dict]] | None = None
    phases: Callable[..., list] | None = None
    quantized: bool = False  # its weights are always quantized (`verify` reports those kernels' checks)
    # What the op covers in a `transformers` model, for `check --graph`: fnmatch patterns over a module class's role
    # (its name less the model's prefix: 'Qwen3NextGatedDeltaNet' -> 'GatedDeltaNet') or its full name; 'fn:NAME'
    # patterns over the torch functions a module calls. A role names a mechanism shared across families; a full name
    # pins one family's variant where the same role differs between families (each indexer scores its own way).
    torch_patterns: tuple[str, ...] = ()


def _mlp(p: dict[str, Any]) -> str:
    return f"{'gated ' if p.get('gated', True) else ''}MLP x {p['F']} ({p['act']})"


def _rope(p: dict[str, Any]) -> str:
    if p.get("kind") is None:
        return "none (NoPE layer)"
    factor = f", factor {p['factor']:g}" if p.get("factor") else ""
    part = f", {p['rotary_dim']} of {p['head_dim']} dims" if p["rotary_dim"] != p["head_dim"] else ""
    pairs = f", {p['pairs']} pairs" if p.get("pairs") else ""
    return f"{p['kind']} (theta {p['theta']:g}{factor}{part}{pairs})"


def _gated_rms_norm(p: dict[str, Any]) -> str:
    order = "silu(z) gate, then RMSNorm" if p["order"] == "gate_then_norm" else "RMSNorm, then silu(z) gate"
    return f"{order} over {p['G']} groups of {p['N']} heads x {p['H']}"


def _layer_norm(p: dict[str, Any]) -> str:
    return f"LayerNorm over {p['D']} ({'with' if p['bias'] else 'no'} bias, eps {p['eps']:g})"


def _vision_attention(p: dict[str, Any]) -> str:
    return f"bidirectional MHA {p['N']} heads x {p['H']} over {p['T']} tokens per image"


# Listed so the report shows every operator a layer runs; no kernel, no cases.
PLAIN = (
    OpSpec("mlp", "mlp", {"D": "hidden size", "F": "MLP width", "act": "activation", "gated": "gate_proj * up_proj "
                          "(default True)"}, _mlp, dict(D=64, F=128, act="silu"),
           torch_patterns=("MLP", "DenseMLP")),
    OpSpec("rope", "rope", {"kind": "rope_type (None: a NoPE layer)", "theta": "base", "factor": "scaling factor",
                            "rotary_dim": "rotated dims", "head_dim": "head dim",
                            "pairs": "'interleaved': HF rotates (x0, x1), (x2, x3)... (default: half-split)"}, _rope,
           dict(kind="default", theta=10000.0, factor=None, rotary_dim=64, head_dim=64),
           torch_patterns=("RotaryEmbedding",)),
    OpSpec("gated_rms_norm", "gated_rms_norm", {"N": "heads", "H": "head dim", "G": "groups normalized apart",
                                                "order": "'gate_then_norm' or 'norm_before_gate'"},
           _gated_rms_norm, dict(N=8, H=64, G=2, order="gate_then_norm"), torch_patterns=("RMSNormGated",)),
    OpSpec("layer_norm", "layer_norm", {"D": "normalized dim", "eps": "epsilon", "bias": "with a bias"},
           _layer_norm, dict(D=64, eps=1e-5, bias=True)),
    OpSpec("vision_attention", "vision_attention", {"N": "heads", "H": "head dim", "T": "tokens per image (None: as "
                                                    "many as the image has patches)"}, _vision_attention,
           dict(N=12, H=64, T=196)),
)


@functools.cache
def specs() -> dict[str, OpSpec]:
    """Op name -> its spec: the op folders' and the plain ones."""
    found = [importlib.import_module(f"kernels_pallas.{folder}.spec").SPEC for folder in FOLDERS] + list(PLAIN)
    return {s.name: s for s in found}


def spec(op: str) -> OpSpec:
    """The spec of `op`.

    Raises:
        KeyError: no op of that name.
    """
    table = specs()
    if op not in table:
        raise KeyError(f"unknown op {op!r}; known: {sorted(table)}")
    return table[op]


def kernel_ops() -> tuple[str, ...]:
    """The ops with a candidate pool (an api module), sorted."""
    return tuple(sorted(name for name, s in specs().items() if s.api is not None))
