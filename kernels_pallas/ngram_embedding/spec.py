"""The hashed n-gram embedding op's spec: a prefill chunk continuing from each row's context (some rows padded, an
eos inside) and a decode step."""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.calls import OpCall
from kernels_pallas.cases import Case, Random
from kernels_pallas.ngram_embedding.reference import head_primes, multipliers
from kernels_pallas.ops import OpSpec

PARAMS = {"n": "largest n-gram order", "heads": "hashed heads per order", "Dh": "dims per head",
          "V": "token vocabulary (bounds the hash multipliers)", "base": "smallest table size (the primes start there)"}


def describe(p: dict) -> str:
    return (f"hashed 2..{p['n']}-gram embeddings, {p['heads']} heads per order x {p['Dh']}, tables of primes from "
            f"{p['base']}")


def cases(call: OpCall, dtype: str, scale: str, prefix: str, tp: int) -> list[Case]:
    shapes = {"full": [("prefill", 2, 1000), ("decode", 32, 1)], "startup": [("prefill", 1, 200), ("decode", 4, 1)],
              "tiny": [("prefill", 2, 40), ("decode", 2, 1)]}[scale]
    # Tables of the real sizes would be gigabytes; the hash is the same for any base, so the cases use small primes.
    base = min(call["base"], 1000)
    return [Case("ngram_embedding", f"{prefix}{label} {call['n']}-grams", dtype,
                 dict(B=B, T=T, n=call["n"], heads=call["heads"], Dh=call["Dh"], V=call["V"], base=base))
            for label, B, T in shapes]


def tables(n: int, heads: int, V: int, base: int, seed: int = 1234, layer: int = 0):
    """(multipliers, primes, offsets, rows) of one hashed layer, as `reference.ngram_embedding` takes them."""
    primes_flat = head_primes(base, (n - 1) * heads, layer)
    offsets_flat = [sum(primes_flat[:i]) for i in range(len(primes_flat))]
    per_order = lambda flat: tuple(tuple(flat[g * heads:(g + 1) * heads]) for g in range(n - 1))
    return multipliers(V, n, layer, seed), per_order(primes_flat), per_order(offsets_flat), sum(primes_flat)


def build(rnd: Random, dtype, *, B, T, n, heads, Dh, V, base):
    mult, primes, offsets, rows = tables(n, heads, V, base)
    eos = V - 1
    tokens = rnd.integers(0, V, (B, T))
    tokens[0, T // 2] = eos
    lengths = rnd.integers(1, T + 1, (B,))
    lengths[0] = T
    args = (jnp.asarray(tokens), jnp.asarray(rnd.integers(0, V, (B, n - 1))), rnd.normal((rows, Dh), dtype))
    return args, dict(eos=eos, multipliers=mult, primes=primes, offsets=offsets, lengths=jnp.asarray(lengths))


SPEC = OpSpec("ngram_embedding", "ngram embedding", PARAMS, describe,
              dict(n=3, heads=8, Dh=16, V=248320, base=20_000_000),
              api="kernels_pallas.ngram_embedding.api", cases=cases, build=build,
              # Qwen4-Exp's per-layer embedding layer is built around these tables (its dilated convolution and
              # injection are plain products beside them): day0jax runs it as `layers/ple.py`.
              torch_patterns=("NGramEmbedding", "Qwen4ExpTextPLELayer"))
