"""Hashed n-gram embeddings as layers see them: the reference everywhere (a few integer operations per token and a
gather, which XLA fuses); the pool is where a kernel would go."""

from __future__ import annotations

import jax

from kernels_pallas import registry
from kernels_pallas.ngram_embedding import reference
from kernels_pallas.ngram_embedding.reference import head_primes, multipliers, ngram_ids

__all__ = ["ngram_embedding", "ngram_ids", "head_primes", "multipliers"]

IMPLEMENTATIONS = {registry.REFERENCE: reference.ngram_embedding}
CANDIDATES: dict[str, tuple[str, ...]] = {}
PALLAS: dict[str, str] = {}
INTERPRET: dict[str, str] = {}


@jax.named_scope("ngram_embedding")
def ngram_embedding(tokens: jax.Array, context: jax.Array, table: jax.Array, *, eos: int,
                    multipliers: tuple[int, ...], primes: tuple[tuple[int, ...], ...],
                    offsets: tuple[tuple[int, ...], ...], lengths: jax.Array | None = None,
                    implementation: str | None = None) -> tuple[jax.Array, jax.Array]:
    """See `reference.ngram_embedding`; `implementation` forces one candidate by name.

    Raises:
        registry.KernelUnavailable: the named implementation cannot take these inputs.
    """
    return registry.dispatch("ngram_embedding", IMPLEMENTATIONS, CANDIDATES, implementation, tokens, context, table,
                             eos=eos, multipliers=multipliers, primes=primes, offsets=offsets, lengths=lengths)
