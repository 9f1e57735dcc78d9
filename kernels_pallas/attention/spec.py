"""The attention op's spec: a cache-less forward's causal attention (prefill from position 0, and chunks of a ragged
batch). Its description and per-shard dims serve paged attention too (`paged_attention/spec.py`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kernels_pallas.calls import OpCall
from kernels_pallas.cases import Case, Random
from kernels_pallas.ops import OpSpec

PARAMS = {
    "N": "query heads", "K": "kv heads", "H": "key head dim", "Hv": "value head dim",
    "scale": "score scale (None: H ** -0.5)", "window": "sliding window (None: none)",
    "softcap": "score soft-cap (None: none)", "sinks": "learned sinks (bool)",
    "latent": "multi-head latent attention in its absorbed form (bool)",
    "chunk": "chunked local attention: a query sees its own chunk of positions (reported only where set)",
    "gate": "the output gate, in words (reported only where there is one)",
}
EXAMPLE = dict(N=8, K=2, H=64, Hv=64, scale=None, window=48, softcap=None, sinks=True, latent=False)


def describe(p: dict) -> str:
    """E.g. 'GQA 32q/8kv heads x 128, sliding window 4096'."""
    N, K, H, Hv = p["N"], p["K"], p["H"], p["Hv"]
    kind = "MHA" if N == K else "MQA" if K == 1 else "GQA"
    head = f"x {H}" if H == Hv else f"x {H} (values {Hv})"
    parts = [f"{'MLA (absorbed): ' if p.get('latent') else ''}{kind} {N}q/{K}kv heads {head}"]
    if p.get("window") is not None:
        parts.append(f"sliding window {p['window']}")
    if p.get("chunk") is not None:
        parts.append(f"chunked local attention {p['chunk']}")
    if p.get("softcap") is not None:
        parts.append(f"score soft-cap {p['softcap']}")
    if p.get("sinks"):
        parts.append("sinks")
    if p.get("gate"):
        parts.append(f"output gate ({p['gate']})")
    if p.get("scale") is not None:
        parts.append(f"scale {p['scale']:.4g}")
    return ", ".join(parts)


def dims(call: OpCall, scale: str, tp: int) -> tuple[dict, str]:
    """The case dims both attention ops share (heads per shard of `tp`; at 'tiny' scale one kv head, few query
    heads and a short window, keeping the family's GQA ratio and head dim), and a name suffix."""
    N, K, H, window = call["N"], call["K"], call["H"], call["window"]
    if tp > 1 and N % tp == 0 and K % tp == 0:
        N, K = N // tp, K // tp
    elif tp > 1 and N % tp == 0 and K == 1:
        N //= tp
    if scale == "tiny":
        K, N = 1, min(N // K, 4)
        window = None if window is None else min(window, 48)
    attn = dict(N=N, K=K, H=H, scale=call["scale"], softcap=call["softcap"], sinks=call["sinks"], window=window)
    suffix = " sliding" if window else ""
    if call.get("chunk") is not None:  # chunked local attention: chunks shorter than the tiny sequences
        attn["chunk"] = min(call["chunk"], 32) if scale == "tiny" else call["chunk"]
        suffix += " chunked"
    return attn, suffix


def cases(call: OpCall, dtype: str, scale: str, prefix: str, tp: int) -> list[Case]:
    attn, suffix = dims(call, scale, tp)
    # (label, B, T, S, offsets): prefill from position 0, and chunks of a ragged batch that end at kv_len.
    shapes = {"full": [("prefill", 1, 2048, 2048, False), ("chunked prefill", 4, 256, 1024, True)],
              "startup": [("prefill", 1, 256, 256, False), ("chunked prefill", 2, 128, 384, True)],
              "tiny": [("prefill", 1, 128, 128, False), ("chunked prefill", 2, 64, 192, True)]}[scale]
    return [Case("attention", f"{prefix}{label}{suffix}", dtype, dict(attn, B=B, T=T, S=S, offsets=offsets))
            for label, B, T, S, offsets in shapes]


def build(rnd: Random, dtype, *, B, T, S, N, K, H, scale, window, softcap, sinks, offsets, chunk=None):
    q = rnd.normal((B, T, N, H), dtype)
    k = rnd.normal((B, S, K, H), dtype)
    v = rnd.normal((B, S, K, H), dtype)
    if offsets:  # chunked prefill / ragged batch: row b holds kv_len_b keys, its T queries are the last ones
        lengths = rnd.integers(T, S + 1, (B,))
        lengths[0] = S
    else:
        lengths = np.full((B,), S, np.int32)
    positions = lengths[:, None] - T + np.arange(T, dtype=np.int32)[None, :]
    kwargs = dict(q_positions=jnp.asarray(positions), kv_lengths=jnp.asarray(lengths), causal=True,
                  sliding_window=window, logit_softcap=softcap, scale=scale,
                  sinks=rnd.normal((N,), jnp.float32) if sinks else None)
    if chunk is not None:
        kwargs["chunk_size"] = chunk
    return (q, k, v), kwargs


SPEC = OpSpec("attention", "attention (cache-less forward)", PARAMS, describe, EXAMPLE,
              api="kernels_pallas.attention.api", cases=cases, build=build,
              torch_patterns=("Attention", "fn:scaled_dot_product_attention"))
