"""The hyper-connection op's spec: the weights around one block of a model with n residual streams, for a prefill
chunk and a decode batch."""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.calls import OpCall
from kernels_pallas.cases import Case, Random
from kernels_pallas.ops import OpSpec

PARAMS = {"n": "residual streams", "D": "hidden size",
          "form": "'mhc' (Sinkhorn-projected stream mixing), 'plain' or 'gated' (a low-rank per-channel input mix)",
          "sinkhorn": "Sinkhorn-Knopp iterations (mhc)", "post_scale": "post's sigmoid times this",
          "R": "rank of the gated form's input mix", "combine": "whether the gated form spreads a block's output "
          "back (False: the final mixer)"}


def describe(p: dict) -> str:
    if p["form"] == "gated":
        what = "gated residual" if p.get("combine", True) else "final mixer"
        return f"{what} over {p['n']} streams x {p['D']}, input mix of rank {p['R']}"
    mix = (f"streams mixed by a Sinkhorn-projected matrix ({p['sinkhorn']} iterations)" if p["form"] == "mhc"
           else "plain residual per stream")
    return f"hyper-connection over {p['n']} streams x {p['D']}, {mix}, post x {p['post_scale']:g}"


def cases(call: OpCall, dtype: str, scale: str, prefix: str, tp: int) -> list[Case]:
    n, D = call["n"], call["D"]
    if scale == "tiny":
        D = min(D, 64)
    shapes = {"full": [("prefill", 1, 2048), ("decode", 64, 1)], "startup": [("prefill", 1, 128), ("decode", 4, 1)],
              "tiny": [("prefill", 2, 24), ("decode", 2, 1)]}[scale]
    return [Case("hyper_connection", f"{prefix}{label} {n} streams", dtype,
                 dict(B=B, T=T, n=n, D=D, form=call["form"], sinkhorn=call.get("sinkhorn", 0),
                      post_scale=call.get("post_scale", 2.0), R=call.get("R", 0), combine=call.get("combine", True)))
            for label, B, T in shapes]


def build(rnd: Random, dtype, *, B, T, n, D, form, sinkhorn, post_scale, R=0, combine=True):
    if form == "gated":
        weights = (rnd.normal((n * D,), jnp.float32, 0.1), rnd.normal((R, n * D), jnp.float32, (n * D) ** -0.5),
                   rnd.normal((n * D, R), jnp.float32, R ** -0.5))
        if combine:
            weights += (rnd.normal((n, n * D), jnp.float32, (n * D) ** -0.5),)
        return (rnd.normal((B, T, n, D), dtype), *weights), dict(form=form, norm_eps=1e-6)
    rows = (2 + n) * n if form == "mhc" else 2 * n
    # fn's rows see a normalized input of n * D unit entries: 0.1 / sqrt(n D) keeps the mixes of order 0.1-1.
    fn = rnd.normal((rows, n * D), jnp.float32, (n * D) ** -0.5)
    args = (rnd.normal((B, T, n, D), dtype), fn, rnd.normal((rows,), jnp.float32, 0.5),
            rnd.normal((3 if form == "mhc" else 2,), jnp.float32, 0.5))
    return args, dict(form=form, norm_eps=1e-6, eps=1e-6, post_scale=post_scale, sinkhorn_iters=sinkhorn)


SPEC = OpSpec("hyper_connection", "hyper-connection", PARAMS, describe,
              dict(n=4, D=256, form="mhc", sinkhorn=20, post_scale=2.0),
              api="kernels_pallas.hyper_connection.api", cases=cases, build=build,
              torch_patterns=("HyperConnection", "HyperHead", "GatedResidual"))
