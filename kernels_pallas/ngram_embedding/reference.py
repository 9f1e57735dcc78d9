"""The definition of hashed n-gram embeddings, in plain jax.numpy; also the fallback on every backend.

For each token t and each order g = 2 .. n (n = `ngram_size`), the ids of the g tokens ending at t are hashed:

    shifted_s[t] = tokens[t - s] if no `eos` lies among tokens[t - s .. t - 1], else eos   (s = 0 .. n - 1)
    mixed_g[t]   = XOR over s < g of (shifted_s[t] * multipliers[s])           64-bit, never overflowing
    id_(g,h)[t]  = mixed_g[t] mod primes[g, h] + offsets[g, h]                  h = 0 .. heads_per_ngram - 1

and the (n - 1) * heads_per_ngram ids look up rows of one table [Vn, Dh], concatenated into [(n - 1) hpn Dh]. So an
n-gram restarts after each eos (the sequence before it reads as eos), as does the start of a sequence, whose context
is n - 1 eos. The only state a sequence carries from one call to the next is its last n - 1 token ids (the
`context`), since no hash reaches further back.

XLA's default integers are 32-bit: the 64-bit products, XOR and remainder are computed on (high, low) uint32 pairs,
the remainder by Horner's rule over limbs small enough that no step overflows. Exact, whatever the backend.

Letters: B batch, T tokens, C = n - 1 context tokens, G = (n - 1) * heads_per_ngram hashed heads, Dh their dims.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

MASK64 = (1 << 64) - 1
SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
SPLITMIX_M1, SPLITMIX_M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
LAYER_PRIME = 10007  # spaces the seeds of successive hashed layers apart


def _splitmix64(value: int) -> int:
    value = (value + SPLITMIX_GAMMA) & MASK64
    value = ((value ^ (value >> 30)) * SPLITMIX_M1) & MASK64
    value = ((value ^ (value >> 27)) * SPLITMIX_M2) & MASK64
    return (value ^ (value >> 31)) & MASK64


def multipliers(vocab_size: int, ngram_size: int, layer: int, seed: int) -> tuple[int, ...]:
    """The odd multiplier of each of the n shifted ids for the `layer`-th hashed layer: below (2^63 - 1) / vocab, so
    no product of an id and its multiplier overflows a signed 64-bit integer (transformers' int64)."""
    half_bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + LAYER_PRIME * layer
    return tuple(2 * (_splitmix64((base + SPLITMIX_GAMMA * (i + 1)) & MASK64) % half_bound) + 1
                 for i in range(ngram_size))


def _is_prime(value: int) -> bool:
    if value < 2 or value % 2 == 0:
        return value == 2
    return all(value % d for d in range(3, math.isqrt(value) + 1, 2))


def head_primes(vocab_base: int, heads: int, layer: int) -> tuple[int, ...]:
    """The table size of each of the `heads` hashed heads of the `layer`-th hashed layer: the successive primes from
    `vocab_base` on, each layer's heads after the previous layers' (every head of every layer its own prime)."""
    primes, p, skip = [], vocab_base - 1, layer * heads
    while len(primes) < heads:
        p += 1
        while not _is_prime(p):
            p += 1
        if skip:
            skip -= 1
        else:
            primes.append(p)
    return tuple(primes)


def _mul_u32(a: jax.Array, b: int) -> tuple[jax.Array, jax.Array]:
    """a [uint32] * b (a Python int < 2^32) as the (high, low) uint32 halves of the 64-bit product."""
    a0, a1 = a & 0xFFFF, a >> 16
    b0, b1 = jnp.uint32(b & 0xFFFF), jnp.uint32(b >> 16)
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> 16) + (p01 & 0xFFFF) + (p10 & 0xFFFF)
    return p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16), a * jnp.uint32(b & 0xFFFFFFFF)


def _mul64(a: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """a [uint32] * m (a Python int < 2^64) modulo 2^64, as (high, low) uint32."""
    hi, lo = _mul_u32(a, m & 0xFFFFFFFF)
    return hi + a * jnp.uint32((m >> 32) & 0xFFFFFFFF), lo


def _mod64(hi: jax.Array, lo: jax.Array, primes: tuple[int, ...]) -> jax.Array:
    """(hi 2^32 + lo) mod each prime: [...] uint32 pairs -> [..., len(primes)] uint32, by Horner's rule over limbs
    of `bits` bits, r <- (r 2^bits + limb) mod p, with p 2^bits <= 2^32 so that no step overflows."""
    bits = 32 - max(primes).bit_length()
    if bits < 1:
        raise ValueError(f"n-gram table sizes must be below 2^31, got {max(primes)}")
    p = jnp.asarray(np.array(primes, np.uint32))
    r = jnp.zeros((*hi.shape, len(primes)), jnp.uint32)
    for word in (hi, lo):
        for shift in range(32 - bits, -bits, -bits):
            width = bits if shift >= 0 else bits + shift
            limb = (word >> max(shift, 0)) & ((1 << width) - 1)
            r = ((r << width) | limb[..., None]) % p
    return r


def shifted_ids(context: jax.Array, tokens: jax.Array, *, eos: int) -> jax.Array:
    """[B, C] context and [B, T] tokens -> [n, B, T] int32: shifted_s of the module docstring (s = 0 .. C)."""
    C, T = context.shape[1], tokens.shape[1]
    history = jnp.concatenate([context, tokens], axis=1).astype(jnp.int32)
    out = [tokens.astype(jnp.int32)]
    blocked = jnp.zeros(tokens.shape, bool)  # an eos among history[t - s .. t - 1]
    for s in range(1, C + 1):
        earlier = history[:, C - s:C - s + T]
        blocked = blocked | (earlier == eos)
        out.append(jnp.where(blocked, eos, earlier))
    return jnp.stack(out)


def ngram_ids(context: jax.Array, tokens: jax.Array, *, eos: int, multipliers: tuple[int, ...],
              primes: tuple[tuple[int, ...], ...], offsets: tuple[tuple[int, ...], ...]) -> jax.Array:
    """The hashed ids [B, T, G] int32 (orders 2 .. n, each with its heads), offsets added."""
    shifted = shifted_ids(context, tokens, eos=eos).astype(jnp.uint32)
    hi, lo = _mul64(shifted[0], multipliers[0])
    blocks = []
    for g in range(2, len(multipliers) + 1):
        h, l = _mul64(shifted[g - 1], multipliers[g - 1])
        hi, lo = hi ^ h, lo ^ l
        ids = _mod64(hi, lo, primes[g - 2]) + jnp.asarray(np.array(offsets[g - 2], np.uint32))
        blocks.append(ids)
    return jnp.concatenate(blocks, axis=-1).astype(jnp.int32)


def next_context(context: jax.Array, tokens: jax.Array, lengths: jax.Array | None = None) -> jax.Array:
    """The last C ids of context + each row's first `lengths` tokens (None: all T): [B, C]."""
    C, T = context.shape[1], tokens.shape[1]
    history = jnp.concatenate([context, tokens.astype(context.dtype)], axis=1)
    if lengths is None:
        return history[:, T:]
    idx = lengths.astype(jnp.int32)[:, None] + jnp.arange(C)[None, :]
    return jnp.take_along_axis(history, idx, axis=1)


def ngram_embedding(tokens: jax.Array, context: jax.Array, table: jax.Array, *, eos: int,
                    multipliers: tuple[int, ...], primes: tuple[tuple[int, ...], ...],
                    offsets: tuple[tuple[int, ...], ...], lengths: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array]:
    """Hashed n-gram embeddings of a chunk that continues `context`.

    Args:
        tokens: [B, T] int token ids; context: [B, C] the ids before them (n - 1 eos at a sequence start).
        table: [Vn, Dh] every head's rows, head (g, h) from offsets[g][h] on.
        eos: the id an n-gram restarts after; multipliers: n odd ints (`multipliers()`).
        primes, offsets: per order 2 .. n, per head: its table size and first row.
        lengths: [B] real tokens per row (None: all T): padding past them does not enter the new context.
    Returns:
        (embeddings [B, T, G Dh] in table's dtype, new context [B, C] int32).
    Raises:
        ValueError: a context of the wrong length.
    """
    if context.shape[1] != len(multipliers) - 1:
        raise ValueError(f"the context must hold {len(multipliers) - 1} ids, got {context.shape[1]}")
    ids = ngram_ids(context, tokens, eos=eos, multipliers=multipliers, primes=primes, offsets=offsets)
    rows = jnp.take(table, ids, axis=0)
    return rows.reshape(*ids.shape[:2], -1), next_context(context.astype(jnp.int32), tokens, lengths)
