"""The gated delta rule op's spec: linear attention's recurrence (Qwen3-Next's per-head decay, Kimi Linear's
per-channel one), a prefill continuing from a state and a decode step."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.calls import OpCall
from kernels_pallas.cases import Case, Random
from kernels_pallas.ops import OpSpec

PARAMS = {"Nk": "query/key heads", "Nv": "value heads", "Hk": "key head dim", "Hv": "value head dim",
          "decay": "'head': one log decay per value head (Qwen3-Next); 'channel': one per key channel (Kimi Linear)",
          "lower_bound": "the log decay's lower bound, lower_bound * sigmoid(...) (GLM-5-Next; absent: none)"}


def describe(p: dict) -> str:
    Nk, Nv, Hk, Hv = p["Nk"], p["Nv"], p["Hk"], p["Hv"]
    head = f"x {Hk}" if Hk == Hv else f"x {Hk} (values {Hv})"
    decay = "per-channel decay" if p["decay"] == "channel" else "per-head decay"
    bound = f" bounded below by {p['lower_bound']:g}" if p.get("lower_bound") is not None else ""
    return f"gated delta rule {Nk}qk/{Nv}v heads {head}, {decay}{bound}"


def cases(call: OpCall, dtype: str, scale: str, prefix: str, tp: int) -> list[Case]:
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


def build(rnd: Random, dtype, *, B, T, Nk, Nv, Hk, Hv, decay):
    q, k, v = rnd.normal((B, T, Nk, Hk), dtype), rnd.normal((B, T, Nk, Hk), dtype), rnd.normal((B, T, Nv, Hv), dtype)
    g_shape = (B, T, Nv, Hk) if decay == "channel" else (B, T, Nv)
    g, beta = rnd.normal(g_shape, jnp.float32), rnd.normal((B, T, Nv), dtype)
    state = rnd.normal((B, Nv, Hk, Hv), jnp.float32, 0.1)
    if not rnd.abstract:  # as the models make them: g = -softplus(.) <= 0 in float32, beta = sigmoid(.)
        g, beta = -jax.nn.softplus(g), jax.nn.sigmoid(beta.astype(jnp.float32)).astype(dtype)
    return (q, k, v, g, beta, state), {}


SPEC = OpSpec("gated_delta_rule", "gated delta rule (linear attention)", PARAMS, describe,
              dict(Nk=2, Nv=4, Hk=32, Hv=16, decay="channel"), api="kernels_pallas.gated_delta_rule.api",
              cases=cases, build=build,
              torch_patterns=("GatedDeltaNet", "KimiLinearDeltaAttention", "KimiLinearForgetGate",
                              "Glm5NextTextLinearAttention", "Glm5NextTextForgetGate",
                              "fn:linalg_solve_triangular"))
