"""The MoE op's spec: the grouped matmul of routed experts (gate/up and down projections), float or quantized."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from kernels_pallas.calls import OpCall
from kernels_pallas.cases import Case, Random
from kernels_pallas.ops import OpSpec
from kernels_pallas.quantized_linear.spec import SCALE_DTYPES, quantized_weight

PARAMS = {"E": "routed experts", "k": "experts per token", "D": "hidden size", "F": "expert width",
          "routing": "how the router scores and picks", "shared": "the shared experts' name (where there are some)",
          "quantized": "the experts' storage, e.g. 'int4/32' (reported only for quantized experts)",
          "gated": "False for experts without gate_proj (reported only then)",
          "latent_of": "the hidden size the experts' latent space D is projected from (a latent MoE only)"}


def describe(p: dict) -> str:
    shared = f", shared {p['shared']}" if p.get("shared") else ""
    quantized = f", {p['quantized']} weights" if p.get("quantized") else ""
    ungated = ", ungated" if p.get("gated") is False else ""
    latent = f", in a {p['D']}-dim latent of {p['latent_of']}" if p.get("latent_of") else ""
    return f"MoE {p['E']} experts x {p['F']}{ungated}{latent}, top-{p['k']} {p['routing']}{shared}{quantized}"


def cases(call: OpCall, dtype: str, scale: str, prefix: str, tp: int) -> list[Case]:
    G, k, D, F = call["E"], call["k"], call["D"], call["F"]
    if scale == "tiny":
        G, k, D, F = min(G, 6), min(k, 2), 128, 128
    prefill, decode = {"full": (1024, 8), "startup": (128, 8), "tiny": (24, 4)}[scale]
    fmt = dict(quantized=call["quantized"]) if call.get("quantized") else {}
    label = f"{prefix}{call['quantized']} " if fmt else prefix
    return [Case("moe", f"{label}gate/up prefill", dtype, dict(M=prefill * k, G=G, D=D, F=F, k=k, **fmt)),
            Case("moe", f"{label}gate/up decode", dtype, dict(M=decode * k, G=G, D=D, F=F, k=k, **fmt)),
            Case("moe", f"{label}down prefill", dtype, dict(M=prefill * k, G=G, D=F, F=D, k=k, **fmt))]


def build(rnd: Random, dtype, *, M, G, D, F, k, quantized=None):
    # Rows routed like a softmax router's top-k: each token picks k distinct experts; group sizes follow.
    tokens = max(M // k, 1)
    logits = rnd.rng.standard_normal((tokens, G))
    chosen = np.argsort(-logits, axis=1)[:, :min(k, G)].reshape(-1)
    sizes = np.bincount(chosen, minlength=G)[:G].astype(np.int32)
    sizes[-1] += M - int(sizes.sum())  # M may exceed tokens * k by rounding; those rows go to the last expert
    lhs = rnd.normal((M, D), dtype)
    if quantized:  # 'int4/32+offset': each expert's [F, D] map as quantized_linear stores it
        kind, _, rest = quantized.partition("/")
        rhs = quantized_weight(rnd, (G, F), D, kind=kind, group=int(rest.split("+")[0]),
                               offset=rest.endswith("+offset"), scale_dtype=SCALE_DTYPES.get(kind, "float32"))
    else:
        rhs = rnd.normal((G, D, F), dtype, 1 / math.sqrt(D))  # unit-scale outputs
    return (lhs, rhs, jnp.asarray(sizes)), {}


SPEC = OpSpec("moe", "moe grouped matmul", PARAMS, describe,
              dict(E=8, k=2, D=128, F=64, routing="softmax_topk", shared=None, quantized="int4/32+offset"),
              api="kernels_pallas.moe.api", cases=cases, build=build,
              torch_patterns=("Experts", "SparseMoeBlock", "MoE", "Moe", "TopKRouter", "TopkRouter",
                              "TokenChoiceRouter", "HashRouter", "Llama4Router", "HunYuanMoEV1Gate",
                              "Ernie4_5_MoeStatics", "fn:_grouped_mm"))
