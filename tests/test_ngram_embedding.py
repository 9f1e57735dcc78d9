"""Hashed n-gram embeddings (`kernels_pallas/ngram_embedding`): the hash against a plain Python transcription of
transformers' `Qwen4ExpTextNGramEmbedding` (arbitrary-precision integers, one token at a time), the constants against
transformers' own, the eos restart, and the context carried across chunk boundaries."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.ngram_embedding import api, reference
from kernels_pallas.ngram_embedding.spec import tables

V, N, HEADS, EOS = 248320, 3, 4, 7


def python_ids(tokens: list[int], mult, primes, offsets, eos: int, context: list[int] | None = None) -> np.ndarray:
    """transformers' hash, token by token: shifted ids restart after an eos; XOR of id * multiplier; mod prime."""
    context = [eos] * (len(mult) - 1) if context is None else context
    history = context + tokens
    out = []
    for t in range(len(context), len(history)):
        last_eos = max([i for i in range(t) if history[i] == eos], default=-1)
        shifted = [history[t - s] if t - s > last_eos else eos for s in range(len(mult))]
        row = []
        for g in range(2, len(mult) + 1):
            mixed = 0
            for s in range(g):
                mixed ^= shifted[s] * mult[s]
            row += [mixed % p + o for p, o in zip(primes[g - 2], offsets[g - 2])]
        out.append(row)
    return np.array(out)


def test_constants_are_transformers_own():
    # transformers' _build_layer_multipliers(248320, 3, layer, 1234) and _find_nth_prime_after(19999999, i + 1).
    assert reference.multipliers(248320, 3, 0, 1234) == (23703573157769, 20109073645365, 8052911324071)
    assert reference.multipliers(248320, 3, 1, 1234) == (3352040966061, 19752442147475, 10742103100073)
    assert reference.head_primes(20_000_000, 4, 0) == (20000003, 20000023, 20000033, 20000047)
    assert reference.head_primes(20_000_000, 2, 3) == (20000069, 20000077)  # the 7th and 8th: after 3 layers of 2


@pytest.mark.parametrize("base", [1000, 20_000_000])
def test_hash_matches_the_integer_definition(base):
    mult, primes, offsets, _ = tables(N, HEADS, V, base)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, V, (2, 12))
    tokens[0, 5] = EOS
    tokens[1, 0] = EOS
    tokens[1, 11] = EOS
    context = np.full((2, N - 1), EOS)
    got = np.asarray(reference.ngram_ids(jnp.asarray(context), jnp.asarray(tokens), eos=EOS, multipliers=mult,
                                         primes=primes, offsets=offsets))
    for row in range(2):
        np.testing.assert_array_equal(got[row], python_ids(tokens[row].tolist(), mult, primes, offsets, EOS))


def test_the_eos_restart_changes_the_ids_after_it():
    """Without the restart (an eos that is not the eos id) the tokens after the eos hash their predecessors."""
    mult, primes, offsets, _ = tables(N, HEADS, V, 1000)
    tokens = jnp.asarray([[11, 12, EOS, 13, 14]])
    context = jnp.full((1, N - 1), EOS)
    ids = lambda eos: np.asarray(reference.ngram_ids(context, tokens, eos=eos, multipliers=mult, primes=primes,
                                                     offsets=offsets))
    restarted = ids(EOS)
    np.testing.assert_array_equal(restarted[0], python_ids([11, 12, EOS, 13, 14], mult, primes, offsets, EOS))
    assert (restarted[0, 3] != ids(EOS + 1)[0, 3]).any()
    # After the restart, token 13 sees only eos before it, as the first token of a sequence does.
    np.testing.assert_array_equal(restarted[0, 3], python_ids([13], mult, primes, offsets, EOS)[0])


def test_context_carried_across_chunks_equals_one_pass():
    """Chunks split inside an n-gram (and around an eos) give the whole sequence's embeddings, rows padded apart."""
    mult, primes, offsets, rows = tables(N, HEADS, V, 1000)
    table = jnp.asarray(np.random.default_rng(1).standard_normal((rows, 8), np.float32))
    kw = dict(eos=EOS, multipliers=mult, primes=primes, offsets=offsets)
    seq = [5, 6, 9, EOS, 3, 4, 8, 2, 1]
    whole, _ = api.ngram_embedding(jnp.asarray([seq]), jnp.full((1, N - 1), EOS), table, **kw)
    context, parts = jnp.full((1, N - 1), EOS, jnp.int32), []
    for chunk in ([5], [6, 9, EOS, 3], [4], [8, 2, 1]):
        # Each chunk padded to 4 tokens: the padding must not enter the carried context.
        padded = jnp.asarray([chunk + [0] * (4 - len(chunk))])
        out, context = api.ngram_embedding(padded, context, table, lengths=jnp.asarray([len(chunk)]), **kw)
        parts.append(out[:, :len(chunk)])
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), whole)
    np.testing.assert_array_equal(context, [[2, 1]])
