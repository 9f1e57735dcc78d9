"""The paged attention op's spec: the engine's attention over its page pool. Its calls carry attention's parameters
and read the same (`attention/spec.py`); its cases are decode steps, and `day0jax.check` names the implementation of
decode steps and of prefill chunks apart (on the CPU they differ)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from kernels_pallas.attention import spec as attention_spec
from kernels_pallas.calls import OpCall
from kernels_pallas.cases import Case, Random
from kernels_pallas.ops import OpSpec

# A prefill chunk as the engine runs one deep into a long prompt: 256 tokens over a 4096-token table.
PREFILL_CHUNK = dict(B=1, T=256, max_len=4096)


def cases(call: OpCall, dtype: str, scale: str, prefix: str, tp: int) -> list[Case]:
    attn, suffix = attention_spec.dims(call, scale, tp)
    paged = {"full": dict(B=32, T=1, page=16, max_len=4096), "startup": dict(B=4, T=1, page=16, max_len=512),
             "tiny": dict(B=2, T=2, page=16, max_len=200)}[scale]
    return [Case("paged_attention", f"{prefix}decode{suffix}", dtype, {**attn, **paged})]


def phases(call: OpCall, case: Case) -> list[tuple[str, Case]]:
    """A decode step (the startup case) and a prefill chunk: the engine runs both, and they may choose apart."""
    return [("decode", case), ("prefill chunks", dataclasses.replace(case, spec={**case.spec, **PREFILL_CHUNK}))]


def build(rnd: Random, dtype, *, B, T, N, K, H, page, max_len, scale, window, softcap, sinks, chunk=None):
    width = -(-max_len // page)
    pages = B * width + 1  # page 0 stays unused, as the engine's trash page
    lengths = rnd.integers(T, max_len + 1, (B,))
    lengths[0] = max_len
    tables = rnd.rng.permutation(np.arange(1, pages, dtype=np.int32))[: B * width].reshape(B, width)
    for b in range(B):  # entries past a row's pages point at the trash page, as the engine leaves them
        tables[b, -(-lengths[b] // page):] = 0
    positions = lengths[:, None] - T + np.arange(T, dtype=np.int32)[None, :]
    args = (rnd.normal((B, T, N, H), dtype), rnd.normal((pages, page, K, H), dtype),
            rnd.normal((pages, page, K, H), dtype), jnp.asarray(tables), jnp.asarray(lengths),
            jnp.asarray(positions))
    kwargs = dict(sliding_window=window, logit_softcap=softcap, scale=scale,
                  sinks=rnd.normal((N,), jnp.float32) if sinks else None)
    if chunk is not None:
        kwargs["chunk_size"] = chunk
    return args, kwargs


SPEC = OpSpec("paged_attention", "paged attention (engine)", attention_spec.PARAMS, attention_spec.describe,
              attention_spec.EXAMPLE, api="kernels_pallas.paged_attention.api", cases=cases, build=build,
              phases=phases)
