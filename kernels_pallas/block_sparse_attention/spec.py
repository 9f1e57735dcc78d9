"""The block-sparse attention op's spec: a decode step over the key blocks an indexer kept (MiniMax-M3)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kernels_pallas.calls import OpCall
from kernels_pallas.cases import Case, Random
from kernels_pallas.ops import OpSpec

PARAMS = {"N": "query heads", "K": "kv heads", "H": "head dim", "scale": "score scale (None: H ** -0.5)",
          "I": "indexer heads (one per kv group)", "Di": "indexer head dim", "block": "positions per key block",
          "topk": "key blocks kept per query", "local": "blocks at and before the query's own, always kept",
          "pool": "how blocks are scored: 'max' (MiniMax-M3: max-pooled position scores), 'mean' (Qwen4-Exp: "
                  "mean-pooled keys) or 'learned' (GLM-5-Next: one learned average of each block's keys); with "
                  "'mean' and 'learned' the query's incomplete block is kept besides",
          "indexer": "the layer has its own indexer (False: it reuses an earlier layer's blocks)"}


def describe(p: dict) -> str:
    heads = f"{p['N']}q/{p['K']}kv heads x {p['H']} over the top-{p['topk']}"
    pool = p.get("pool", "max")
    if pool == "max":
        return f"{heads} blocks of {p['block']} keys ({p['local']} local) of a {p['I']}-head indexer x {p['Di']}"
    source = (f"a {p['I']}-head {pool}-pooled indexer x {p['Di']}" if p.get("indexer", True)
              else "an earlier layer's indexer")
    return f"{heads} complete blocks of {p['block']} keys and the query's own incomplete block, of {source}"


def cases(call: OpCall, dtype: str, scale: str, prefix: str, tp: int) -> list[Case]:
    N, K = call["N"], call["K"]
    block, topk = call["block"], call["topk"]
    if tp > 1 and K % tp == 0:
        N, K = N // tp, K // tp
    if scale == "tiny":
        N, K, block = min(N, 4), min(K, 2), min(block, 8)
        N -= N % K
    # A decode step over a context of more blocks than top-k, so that some blocks are left out. A layer that reuses
    # an earlier layer's blocks (Di None) is timed with a small indexer: its attention over the kept blocks is alike.
    paged = {"full": dict(B=32, page=64, max_len=4 * topk * block),
             "startup": dict(B=4, page=16, max_len=2 * topk * block),
             "tiny": dict(B=2, page=16, max_len=3 * topk * block)}[scale]
    return [Case("block_sparse_attention", f"{prefix}decode top-{topk} blocks", dtype,
                 dict(N=N, K=K, H=call["H"], Di=call["Di"] or 16, block=block, topk=topk, local=call["local"],
                      scale=call["scale"], **paged))]


def build(rnd: Random, dtype, *, B, N, K, H, Di, block, topk, local, page, max_len, scale):
    width = -(-max_len // page)
    pages = B * width + 1
    lengths = rnd.integers(1, max_len + 1, (B,))
    lengths[0] = max_len
    tables = rnd.rng.permutation(np.arange(1, pages, dtype=np.int32))[: B * width].reshape(B, width)
    args = (rnd.normal((B, 1, N, H), dtype), rnd.normal((pages, page, K, H), dtype),
            rnd.normal((pages, page, K, H), dtype), rnd.normal((pages, page, Di), dtype), jnp.asarray(tables),
            jnp.asarray(lengths), jnp.asarray(lengths[:, None] - 1), rnd.normal((B, 1, K, Di), dtype))
    return args, dict(block_size=block, topk_blocks=topk, local_blocks=local, scale=scale)


SPEC = OpSpec("block_sparse_attention", "block-sparse attention (engine)", PARAMS, describe,
              dict(N=8, K=2, H=16, scale=0.25, I=2, Di=16, block=8, topk=4, local=1),
              api="kernels_pallas.block_sparse_attention.api", cases=cases, build=build,
              torch_patterns=("MiniMaxM3VLIndexer", "MiniMaxM3VLTextIndexer", "Glm5NextTextIndexer",
                              "Qwen4ExpTextQSAIndexer"))
