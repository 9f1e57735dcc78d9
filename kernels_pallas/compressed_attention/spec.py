"""The compressed attention op's spec: a decode step and a prefill chunk over a context longer than the window, its
entries all seen (HCA) or the indexer's top-k (CSA), in the engine's pools."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kernels_pallas.calls import OpCall
from kernels_pallas.cases import Case, Random
from kernels_pallas.ops import OpSpec

PARAMS = {"N": "query heads (one shared key-value head)", "H": "head dim", "window": "uncompressed positions seen",
          "ratio": "positions per compressed entry (0: none, a plain sliding layer)",
          "topk": "entries per query an indexer picks (None: all)", "I": "indexer heads", "Di": "indexer head dim",
          "sinks": "learned sink logits (bool)", "scale": "score scale (None: H ** -0.5)"}


def describe(p: dict) -> str:
    head = f"MQA {p['N']}q heads over one shared K=V head x {p['H']}, window {p['window']}"
    if not p.get("ratio"):
        return head + (", sinks" if p.get("sinks") else "")
    seen = f"top-{p['topk']} of a {p['I']}-head indexer x {p['Di']}" if p.get("topk") else "all"
    return f"{head} + entries of {p['ratio']} positions ({seen}){', sinks' if p.get('sinks') else ''}"


def cases(call: OpCall, dtype: str, scale: str, prefix: str, tp: int) -> list[Case]:
    N, H, window, ratio, topk = call["N"], call["H"], call["window"], call.get("ratio") or 0, call.get("topk")
    if tp > 1 and N % tp == 0:
        N //= tp
    if scale == "tiny":
        N, H, window, topk = min(N, 4), min(H, 32), min(window, 16), topk and min(topk, 8)
        ratio = min(ratio, 8)
    context = {"full": 16384, "startup": 2048, "tiny": 256}[scale]
    shapes = [("decode", {"full": 32, "startup": 4, "tiny": 2}[scale], 1),
              ("prefill", 1, {"full": 256, "startup": 64, "tiny": 16}[scale])]
    return [Case("compressed_attention", f"{prefix}{label} window {window}" + (f" ratio {ratio}" if ratio else ""),
                 dtype, dict(B=B, T=T, N=N, H=H, window=window, ratio=ratio, topk=topk, sinks=bool(call.get("sinks")),
                             scale=call.get("scale"), context=context)) for label, B, T in shapes]


def build(rnd: Random, dtype, *, B, T, N, H, window, ratio, topk, sinks, scale, context, page=16):
    W = -(-context // page)
    ring = -(-(window + T) // page) + 1
    lengths = rnd.integers(window + T, context + 1, (B,))
    lengths[0] = context
    ring_table = (np.arange(1, B + 1)[:, None] * ring + np.arange(W)[None, :] % ring).astype(np.int32)
    q_pos = (lengths[:, None] - T + np.arange(T)[None, :]).astype(np.int32)
    args = [rnd.normal((B, T, N, H), dtype), rnd.normal(((B + 1) * ring, page, H), dtype), jnp.asarray(ring_table)]
    indices = None
    if ratio:
        per_page, stride = max(1, page // ratio), max(1, ratio // page)
        Wc = -(-W // stride)
        tables = rnd.rng.permutation(np.arange(1, B * Wc + 1, dtype=np.int32)).reshape(B, Wc)
        args += [rnd.normal((B * Wc + 1, per_page, H), dtype), jnp.asarray(tables)]
        if topk:  # distinct entries per query, visible or not, in a random order, as the indexer's top-k gives them
            n = int(lengths.min()) // ratio
            indices = jnp.asarray(np.stack([[rnd.rng.permutation(n)[:topk] for _ in range(T)] for _ in range(B)])
                                  .astype(np.int32))
    else:
        args += [None, None]
    args += [jnp.asarray(lengths), jnp.asarray(q_pos), indices]
    return tuple(args), dict(window=window, ratio=ratio or 1, sinks=rnd.normal((N,), jnp.float32) if sinks else None,
                             scale=scale)


SPEC = OpSpec("compressed_attention", "compressed attention (engine)", PARAMS, describe,
              dict(N=8, H=64, window=16, ratio=4, topk=8, I=4, Di=16, sinks=True, scale=None),
              api="kernels_pallas.compressed_attention.api", cases=cases, build=build,
              torch_patterns=("DeepseekV4CSACompressor", "DeepseekV4HCACompressor", "DeepseekV4Indexer",
                              "DeepseekV4IndexerScorer", "DeepseekV4GroupedLinear"))
