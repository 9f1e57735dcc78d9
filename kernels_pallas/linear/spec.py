"""The linear op's spec: float weights times a few rows (decode steps), one weight or a layer's q, k and v in one
call."""

from __future__ import annotations

import math

from kernels_pallas.calls import OpCall
from kernels_pallas.cases import Case, Random
from kernels_pallas.ops import OpSpec

PARAMS = {"O": "outputs (every output dim)", "I": "inputs (every input dim)"}
# Rows `day0jax.check` shows the choice for: a decode step of one sequence, and of a small batch.
CHECKED_ROWS = (1, 8)


def describe(p: dict) -> str:
    return f"float weights [{p['O']} x {p['I']}]"


def cases(call: OpCall, dtype: str, scale: str, prefix: str, tp: int) -> list[Case]:
    O, I = call["O"], call["I"]
    if scale == "full":
        return [Case("linear", f"{prefix}[{O} x {I}] x {R} rows", dtype, dict(R=R, O=(O,), I=I))
                for R in CHECKED_ROWS]
    # Below full scale the same cases whatever the weight's shape (the kernel's arithmetic is per output): one row
    # times one weight, and a few rows times three in one call; I keeps its remainder mod 64, which picks the
    # kernel's step (64 inputs, else 16), or makes it decline.
    I = min(I, 256 + I % 64)
    return [Case("linear", f"{prefix}1 row", dtype, dict(R=1, O=(96,), I=I)),
            Case("linear", f"{prefix}5 rows x 3 weights", dtype, dict(R=5, O=(96, 32, 32), I=I))]


def phases(call: OpCall, case: Case) -> list[tuple[str, Case]]:
    """The call's own weight at `CHECKED_ROWS` rows: the CPU kernel's limits depend on both."""
    return [(f"{R} row{'s' if R > 1 else ''}", Case("linear", case.name, case.dtype,
                                                     dict(R=R, O=(call["O"],), I=call["I"])))
            for R in CHECKED_ROWS]


def build(rnd: Random, dtype, *, R, O, I):
    return (rnd.normal((R, I), dtype), [rnd.normal((o, I), dtype, 1 / math.sqrt(I)) for o in O]), {}


SPEC = OpSpec("linear", "linear", PARAMS, describe, dict(O=96, I=256), api="kernels_pallas.linear.api",
              cases=cases, build=build, phases=phases,
              torch_patterns=("Linear", "fn:linear"))
