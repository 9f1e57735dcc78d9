"""Test cases for every op, built from a model's op calls: what `selfcheck`, the startup self-test and the tests run.

Each op's spec (`ops.spec`) makes its cases and builds their inputs; what they share is here. The op calls fix the
shapes; the scale fixes sequence lengths and batches: 'full' serving-sized, 'startup' the
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

from kernels_pallas import ops as ops_lib
from kernels_pallas.calls import OpCall

TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 2e-3}

# The flagship models' op calls, written from the model code (day0jax's tests check they still match it).
FLAGSHIPS_FILE = Path(__file__).with_name("flagships.json")
# Op calls of families whose model code is not in day0jax yet (so not in flagships.json), from their published
# configs: they let `selfcheck` cover ops no flagship reaches. A family moves to flagships.json
# (`tests/test_op_calls.py --update`) once its model reports its calls.
PENDING_FAMILIES = {
    "kimi-linear-48b-a3b": [OpCall.of("gated_delta_rule", Nk=32, Nv=32, Hk=128, Hv=128, decay="channel")],
    # transformers' NemotronHConfig defaults, which it documents as this checkpoint's.
    "nemotron-3-nano-30b-a3b": [OpCall.of("mamba2_ssd", N=128, H=64, G=8, Z=128, chunk=128),
                                OpCall.of("causal_conv1d", C=128 * 64 + 2 * 8 * 128, W=4)],
}
# What `selfcheck` runs by default: a dense GQA model, a fine-grained MoE, MLA with a large MoE, sparse MLA, linear
# attention (gated delta rule, per-head and per-channel decay) and a Mamba2 hybrid.
DEFAULT_FLAGSHIPS = ("llama-3-8b", "qwen3-30b-a3b", "deepseek-v3", "deepseek-v3.2", "qwen3-next-80b-a3b",
                     "kimi-linear-48b-a3b", "nemotron-3-nano-30b-a3b")
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
        return ops_lib.spec(self.op).build(Random(seed, abstract), jnp.dtype(self.dtype), **self.spec)

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
        The cases each call's op spec makes of it.
    Raises:
        ValueError: an unknown scale.
        KeyError: a call names an op with no spec.
    """
    if scale not in SCALES:
        raise ValueError(f"scale {scale!r} is not one of {SCALES}")
    dtype = jnp.dtype(dtype).name
    prefix = f"{name} " if name else ""
    out: list[Case] = []
    for call in dict.fromkeys(calls):
        spec = ops_lib.spec(call.op)
        if spec.cases is None or (ops is not None and call.op not in ops):
            continue
        out += spec.cases(call, dtype, scale, prefix, tp)
    return list(dict.fromkeys(out))  # calls that differ only in what a scale leaves out make one case


class Random:
    """What an op's `build` draws its inputs from, all from one seed: NumPy for small arrays (nothing to compile,
    which dominates on a CPU), jax.random on the device for large ones (serving-sized weights would take minutes and
    gigabytes on the host); `rng` (NumPy) for integers and permutations. `abstract`: float arrays as shapes only."""

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
