"""The sparse attention op's spec: a decode step over the top-k keys an indexer picked (DeepSeek-V3.2)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kernels_pallas.calls import OpCall
from kernels_pallas.cases import Case, Random
from kernels_pallas.ops import OpSpec

PARAMS = {"N": "query heads", "K": "kv heads", "H": "key head dim", "Hv": "value head dim",
          "scale": "score scale (None: H ** -0.5)", "latent": "absorbed multi-head latent attention (bool)",
          "topk": "keys per query", "I": "indexer heads", "Di": "indexer head dim",
          "indexer": "False: the layer reuses an earlier layer's top-k", "sinks": "learned sink logits (bool)"}


def describe(p: dict) -> str:
    source = f"a {p['I']}-head indexer x {p['Di']}" if p.get("indexer") else "an earlier layer's indexer"
    return (f"{'MLA (absorbed): ' if p.get('latent') else ''}{p['N']}q/{p['K']}kv heads x {p['H']} over the "
            f"top-{p['topk']} keys of {source}{', sinks' if p.get('sinks') else ''}")


def cases(call: OpCall, dtype: str, scale: str, prefix: str, tp: int) -> list[Case]:
    N, K, H, Hv, topk = call["N"], call["K"], call["H"], call["Hv"], call["topk"]
    if tp > 1 and N % tp == 0:
        N = N // tp
    if scale == "tiny":
        N, topk = min(N, 4), min(topk, 32)
    # A decode step over a context longer than top-k: the gather path reads only the selected keys.
    paged = {"full": dict(B=32, page=64, max_len=4 * topk), "startup": dict(B=4, page=16, max_len=2 * topk),
             "tiny": dict(B=2, page=16, max_len=3 * topk)}[scale]
    return [Case("sparse_attention", f"{prefix}decode top-{topk}", dtype,
                 dict(N=N, K=K, H=H, Hv=Hv, topk=topk, scale=call["scale"], sinks=bool(call.get("sinks")),
                      **paged))]


def build(rnd: Random, dtype, *, B, N, K, H, Hv, topk, page, max_len, scale, sinks=False):
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
    return args, dict(scale=scale, sinks=rnd.normal((N,), jnp.float32) if sinks else None)


SPEC = OpSpec("sparse_attention", "sparse attention (engine)", PARAMS, describe,
              dict(N=8, K=1, H=24, Hv=16, scale=0.3, latent=True, topk=16, I=4, Di=16, indexer=True, sinks=True),
              api="kernels_pallas.sparse_attention.api", cases=cases, build=build,
              torch_patterns=("DeepseekV32Indexer", "GlmMoeDsaIndexer", "MistralLarge4TextIndexer", "HYV4Indexer"))
