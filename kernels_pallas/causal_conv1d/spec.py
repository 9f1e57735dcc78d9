"""The causal convolution's spec: a prefill chunk continuing from a state (some rows padded) and a decode step."""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.calls import OpCall
from kernels_pallas.cases import Case, Random
from kernels_pallas.ops import OpSpec

PARAMS = {"C": "channels", "W": "kernel width",
          "act": "the activation, reported only where it is not SiLU (None: LFM's convolution, which has none)"}


def describe(p: dict) -> str:
    act = "SiLU" if p.get("act", "silu") == "silu" else "no activation"
    return f"depthwise causal conv1d over {p['C']} channels, width {p['W']}, {act}"


def cases(call: OpCall, dtype: str, scale: str, prefix: str, tp: int) -> list[Case]:
    C, W, act = call["C"], call["W"], call.get("act", "silu")
    if tp > 1 and C % tp == 0:
        C //= tp
    if scale == "tiny":
        C = min(C, 64)
    # (label, B, T): a prefill chunk and a decode step.
    shapes = {"full": [("prefill", 2, 1000), ("decode", 32, 1)], "startup": [("prefill", 1, 200), ("decode", 4, 1)],
              "tiny": [("prefill", 2, 40), ("decode", 2, 1)]}[scale]
    return [Case("causal_conv1d", f"{prefix}{label} width {W}", dtype, dict(B=B, T=T, C=C, W=W, act=act))
            for label, B, T in shapes]


def build(rnd: Random, dtype, *, B, T, C, W, act):
    # Rows of a prefill chunk end where their prompts do: the padding past `valid` must not enter the state.
    valid = rnd.integers(1, T + 1, (B,))
    valid[0] = T
    args = (rnd.normal((B, T, C), dtype), rnd.normal((C, W), dtype, 0.5), rnd.normal((B, W - 1, C), dtype))
    return args, dict(valid=jnp.asarray(valid), bias=rnd.normal((C,), dtype, 0.1), activation=act)


SPEC = OpSpec("causal_conv1d", "causal conv1d", PARAMS, describe, dict(C=64, W=4),
              api="kernels_pallas.causal_conv1d.api", cases=cases, build=build,
              torch_patterns=("ShortConv", "Conv1d", "fn:conv1d"))
