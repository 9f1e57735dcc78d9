"""The Mamba2 scan's spec: a prefill continuing from a state (some rows padded, T not a multiple of the chunk) and a
decode step, in the model's head, group and state sizes."""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.calls import OpCall
from kernels_pallas.cases import Case, Random
from kernels_pallas.ops import OpSpec

PARAMS = {"N": "heads", "H": "head dim", "G": "groups (consecutive heads sharing the state's input and output maps)",
          "Z": "state size (d_state)", "chunk": "the model's chunk size (prefill)",
          "limit": "dt's clip after the softplus as 'low..high', reported only where it is not 0..inf"}


def describe(p: dict) -> str:
    limit = f", dt clipped to {p['limit']}" if p.get("limit") else ""
    return f"Mamba2 SSD {p['N']} heads x {p['H']}, {p['G']} groups, state {p['Z']}, chunks of {p['chunk']}{limit}"


def cases(call: OpCall, dtype: str, scale: str, prefix: str, tp: int) -> list[Case]:
    N, H, G, Z, chunk = call["N"], call["H"], call["G"], call["Z"], call["chunk"]
    if tp > 1 and N % tp == 0:  # heads split over tp; the groups with them, or each device within one group
        N, G = N // tp, G // tp if G % tp == 0 else 1
    if scale == "tiny":  # the family's grouping with few heads, small dims
        G = min(G, 2)
        N, H, Z, chunk = G * min(N // G, 2), min(H, 16), min(Z, 16), min(chunk, 32)
    # (label, B, T): a prefill continuing from a state (T not a multiple of the chunk: padding), and a decode step.
    shapes = {"full": [("prefill", 2, 1000), ("decode", 32, 1)], "startup": [("prefill", 1, 200), ("decode", 4, 1)],
              "tiny": [("prefill", 2, 80), ("decode", 2, 1)]}[scale]
    limit = tuple(float(v) for v in call["limit"].split("..")) if call.get("limit") else None
    return [Case("mamba2_ssd", f"{prefix}{label} {G} groups", dtype,
                 dict(B=B, T=T, N=N, H=H, G=G, Z=Z, chunk=chunk, limit=limit)) for label, B, T in shapes]


def build(rnd: Random, dtype, *, B, T, N, H, G, Z, chunk, limit):
    x, dt = rnd.normal((B, T, N, H), dtype), rnd.normal((B, T, N), dtype)
    b, c = rnd.normal((B, T, G, Z), dtype), rnd.normal((B, T, G, Z), dtype)
    A, D, dt_bias = rnd.normal((N,), jnp.float32), rnd.normal((N,), dtype), rnd.normal((N,), dtype, 0.5)
    state = rnd.normal((B, N, H, Z), jnp.float32, 0.1)
    if not rnd.abstract:  # as the models make it: A = -exp(A_log) < 0
        A = -jnp.exp(A)
    # Rows of a prefill chunk end where their prompts do: the padding past `valid` must not enter the state.
    valid = rnd.integers(1, T + 1, (B,))
    valid[0] = T
    return (x, dt, A, b, c, state), dict(D=D, dt_bias=dt_bias, dt_limit=limit or (0.0, float("inf")),
                                         valid=jnp.asarray(valid), chunk_size=chunk)


SPEC = OpSpec("mamba2_ssd", "Mamba2 SSD (state-space scan)", PARAMS, describe,
              dict(N=8, H=64, G=2, Z=128, chunk=128), api="kernels_pallas.mamba2_ssd.api", cases=cases, build=build,
              torch_patterns=("Mamba2Mixer", "MambaLayer", "FalconH1Mixer", "BambaMixer"))
