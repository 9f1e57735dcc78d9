"""The one sampler: a token per row from logits, each row with its own parameters and seeded random stream.

In the order of transformers' logits processors and vLLM: penalties, logit biases and the grammar's mask,
temperature (0: greedy), then min_p, top-k and top-p (the smallest set reaching top_p, at least one kept).
Filtering a 50k-200k vocabulary costs more than a small model's whole CPU decode step, so a batch runs only the
mode its rows need (chosen at run time), and filtering bisects a threshold instead of sorting: a few dozen masked
reductions over [B, V] cost a fraction of a sort on a CPU and keep the same set (ties at the threshold are all
kept, as a sort-based filter keeps them in rank order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MODES = ("greedy", "random", "filtered")
TOP_LOGPROBS = 20  # the OpenAI API's maximum top_logprobs; computed for every row in logprobs mode
_BISECT_STEPS = 32


def sampler_mode(temperature, top_k, top_p, min_p) -> str:
    """The cheapest static mode that serves every row of these host-side per-row values: "greedy" when no row
    samples, "random" when no sampled row filters, else "filtered"."""
    temperature, top_k, top_p, min_p = (np.asarray(x) for x in (temperature, top_k, top_p, min_p))
    sampled = temperature > 0
    if not sampled.any():
        return "greedy"
    if ((top_k[sampled] > 0) | (top_p[sampled] < 1.0) | (min_p[sampled] > 0)).any():
        return "filtered"
    return "random"


def _bisect_threshold(x: jax.Array, enough) -> jax.Array:
    """The largest t (per row, to bisection precision) with enough(x >= t) true; x [B, V] finite where kept."""
    finite = jnp.isfinite(x)
    lo = jnp.min(jnp.where(finite, x, jnp.inf), axis=-1)
    hi = jnp.max(jnp.where(finite, x, -jnp.inf), axis=-1)

    def body(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) * 0.5
        ok = enough(x >= mid[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, hi = jax.lax.fori_loop(0, _BISECT_STEPS, body, (lo, hi))
    # hi itself may qualify (the maximum always keeps at least one token).
    return jnp.where(enough(x >= hi[:, None]), hi, lo)


def apply_penalties(logits: jax.Array, counts: jax.Array, seen: jax.Array, presence: jax.Array,
                    frequency: jax.Array, repetition: jax.Array) -> jax.Array:
    """OpenAI presence/frequency penalties on generated-token counts, then the multiplicative repetition
    penalty (as transformers and vLLM apply it) on every token seen in the prompt or the output.

    Args:
        logits: [B, V] float32.
        counts: [B, V] float32, how often each token was generated so far.
        seen: [B, V] bool, tokens in the prompt or the output.
        presence, frequency: [B]; 0 is off.  repetition: [B]; 1 is off.
    """
    logits = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)
    rep = repetition[:, None]
    penalized = jnp.where(logits > 0, logits / rep, logits * rep)
    return jnp.where(seen, penalized, logits)


MAX_LOGIT_BIAS = 300  # logit_bias entries per request (OpenAI's limit); the sampler takes them as [B, 300]


def apply_guidance(logits: jax.Array, allowed: jax.Array, bias_ids: jax.Array, bias: jax.Array) -> jax.Array:
    """Adds each row's logit biases, then masks (to -inf) the tokens its grammar does not allow.

    Args:
        logits: [B, V] float32.
        allowed: [B, ceil(V / 32)] int32 bitmask, bit t % 32 of word t // 32 set when token t is allowed (all bits
            set for a row without a grammar).
        bias_ids, bias: [B, MAX_LOGIT_BIAS] token ids and the values added to their logits (0 where unused).
    """
    B, V = logits.shape
    logits = logits.at[jnp.arange(B)[:, None], bias_ids].add(bias)
    bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return jnp.where(bits.reshape(B, -1)[:, :V] != 0, logits, -jnp.inf)


def filter_logits(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """Masks (to -inf) what min_p, then top_k, then top_p exclude from temperature-scaled logits [B, V]."""
    probs = jax.nn.softmax(scaled, axis=-1)
    keep_min_p = probs >= min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    x = jnp.where(keep_min_p, scaled, -jnp.inf)
    t_k = _bisect_threshold(x, lambda m: jnp.sum(m, axis=-1) >= top_k)
    x = jnp.where((top_k[:, None] <= 0) | (x >= t_k[:, None]), x, -jnp.inf)
    probs = jax.nn.softmax(x, axis=-1)
    # The small slack keeps float rounding of the running mass from dropping the token that reaches top_p.
    t_p = _bisect_threshold(x, lambda m: jnp.sum(jnp.where(m, probs, 0.0), axis=-1) >= top_p * (1 - 1e-6))
    return jnp.where((top_p[:, None] >= 1.0) | (x >= t_p[:, None]), x, -jnp.inf)


def _mix32(x: jax.Array) -> jax.Array:
    # murmur3's 32-bit finalizer: every input bit flips about half the output bits.
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def gumbel_noise(seeds: jax.Array, counters: jax.Array, V: int) -> jax.Array:
    """Gumbel(0, 1) noise [B, V] that depends only on each row's (seed, counter) and the token index, from a
    counter-based integer hash: jax.random's per-row keys through vmap cost seconds of compilation and milliseconds
    per step on a CPU, and sampling needs only well-mixed uniforms. argmax(logits + noise) samples softmax(logits)
    (the Gumbel-max trick)."""
    row = _mix32(seeds.astype(jnp.uint32) ^ _mix32(counters.astype(jnp.uint32) + jnp.uint32(0x9E3779B9)))
    bits = _mix32(row[:, None] ^ (jnp.arange(V, dtype=jnp.uint32)[None, :] * jnp.uint32(0x27D4EB2F)))
    return -jnp.log(-jnp.log(uniform(bits)))


def uniform(bits: jax.Array) -> jax.Array:
    """float32 in (0, 1), never 0 or 1, from uint32 bits: 23 of them. (With 24, the largest value, 1 - 2**-25,
    rounds to 1.0 in float32, and its noise is +inf: once in 2**24 tokens, a draw ignored the logits, or met a
    masked -inf and made NaN.)"""
    return ((bits >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))


def mode_index(temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """`sampler_mode` on the device: the index in MODES of the cheapest mode that serves every row."""
    sampled = temperature > 0
    filtered = sampled & ((top_k > 0) | (top_p < 1.0) | (min_p > 0))
    return jnp.where(jnp.any(filtered), 2, jnp.where(jnp.any(sampled), 1, 0)).astype(jnp.int32)


@jax.named_scope("sampling")
def sample(logits: jax.Array, seeds: jax.Array, counters: jax.Array, temperature: jax.Array,
           top_k: jax.Array, top_p: jax.Array, min_p: jax.Array, penalties: tuple | None = None,
           guidance: tuple | None = None, logprobs: bool | jax.Array = False, *,
           mode: str | None = None) -> dict[str, jax.Array]:
    """Picks one token per row, each row with its own parameters and its own seeded random stream.

    One compiled program serves every batch: the mode and the log-probabilities are chosen at run time by
    `lax.switch`/`lax.cond`, which run only the branch taken (a static variant per mode and logprobs flag cost 12
    programs per row count and saved nothing measurable per step; see bench/sampler.py).

    Args:
        logits: [B, V] float32 model output.
        seeds: [B] uint32 per-request seeds; counters: [B] int32 the row's output index (so a request's draws
            depend only on its seed and position, never on which other requests share the batch).
        temperature: [B]; 0 is greedy.  top_k: [B] int, <= 0 is off.  top_p: [B], 1 is off.  min_p: [B], 0 is off.
        penalties: None, or (counts, seen, presence, frequency, repetition) as in `apply_penalties`.
        guidance: None, or (allowed, bias_ids, bias) as in `apply_guidance`: grammars and logit biases.
        logprobs: also return log-probabilities of the raw model distribution: a Python bool, or a scalar bool
            array decided at run time (the outputs are then always there, zeros when it is false).
        mode: None (chosen per batch at run time, as `sampler_mode`), or a static "greedy" | "random" | "filtered"
            that serves every row.
    Returns:
        {"tokens": [B] int32} and, with logprobs, "logprob" [B] (of the chosen token), "top_ids" and
        "top_logprobs" [B, TOP_LOGPROBS].
    """
    raw = logits
    if penalties is not None:
        logits = apply_penalties(logits, *penalties)
    if guidance is not None:
        logits = apply_guidance(logits, *guidance)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(filtered: bool):
        def branch():
            scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
            if filtered:
                scaled = filter_logits(scaled, top_k, top_p, min_p)
            drawn = jnp.argmax(scaled + gumbel_noise(seeds, counters, scaled.shape[-1]), axis=-1).astype(jnp.int32)
            return jnp.where(temperature > 0, drawn, greedy)
        return branch

    branches = {"greedy": lambda: greedy, "random": draw(False), "filtered": draw(True)}
    if mode is None:
        tokens = jax.lax.switch(mode_index(temperature, top_k, top_p, min_p), [branches[m] for m in MODES])
    else:
        tokens = branches[mode]()
    out = {"tokens": tokens}
    if logprobs is False:
        return out

    def with_logprobs():
        lp = jax.nn.log_softmax(raw, axis=-1)
        top_lp, top_ids = jax.lax.top_k(lp, min(TOP_LOGPROBS, lp.shape[-1]))
        return jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0], top_ids, top_lp

    def without():
        B, k = raw.shape[0], min(TOP_LOGPROBS, raw.shape[-1])
        return jnp.zeros(B, jnp.float32), jnp.zeros((B, k), jnp.int32), jnp.zeros((B, k), jnp.float32)

    values = with_logprobs() if logprobs is True else jax.lax.cond(logprobs, with_logprobs, without)
    out["logprob"], out["top_ids"], out["top_logprobs"] = values
    return out


def accept_uniform(seeds: jax.Array, counters: jax.Array) -> jax.Array:
    """A uniform in (0, 1) per row from its (seed, counter), independent of `gumbel_noise`'s for the same pair: the
    coin of speculative acceptance at output index `counter`."""
    row = _mix32(seeds.astype(jnp.uint32) ^ _mix32(counters.astype(jnp.uint32) + jnp.uint32(0x9E3779B9)))
    return uniform(_mix32(row ^ jnp.uint32(0x5BD1E995)))


@jax.named_scope("accept")
def accept_drafts(logits: jax.Array, drafts: jax.Array, num_drafts: jax.Array, seeds: jax.Array,
                  counters: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array, penalties: tuple | None = None, guidance: tuple | None = None,
                  logprobs: bool | jax.Array = False, force_accept: jax.Array | None = None) -> dict[str, jax.Array]:
    """Speculative verification: which of each row's drafted tokens the target keeps, and the token after them.

    Position t of a row scores the draft at t + 1 (`drafts[:, t]`) against the target's distribution there, as
    `sample` would draw output index `counters + t`: penalties counting the drafts before t, the logit biases, the
    grammar's mask for position t, temperature, then min_p, top-k and top-p. A greedy row (temperature 0) keeps a
    draft while it equals the argmax. A sampled row keeps it with probability min(1, p/q), q being the draft's
    probability under its proposer: the proposers draft their argmax, so q is one-hot and the test is u < p(draft),
    with u the row's own uniform for that output index (`accept_uniform`). At the first rejected position the token
    comes from max(p - q, 0) normalized (p without the draft), after the last accepted draft from p itself; both
    through the Gumbel noise of that output index. Every token is then distributed as plain sampling's, whatever the
    drafts, and depends only on the row's seed and positions, never on the batch.

    Args:
        logits: [B, T, V] float32, the target's logits at each row's last token and its T - 1 draft slots.
        drafts: [B, T - 1] int32 drafted tokens (any value past a row's `num_drafts`).
        num_drafts: [B] int32, 0..T-1.
        seeds, counters, temperature, top_k, top_p, min_p: per row as in `sample`; `counters` is the output index
            of position 0.
        penalties: None, or (counts, seen, presence, frequency, repetition) as in `apply_penalties`, before the drafts.
        guidance: None, or (allowed [B, T, words], bias_ids, bias): a grammar mask per position (the grammar advanced
            through the drafts before it), logit biases as in `apply_guidance`.
        logprobs: also return the target's log-probabilities of each output token (and the top ones), as `sample`.
        force_accept: [B] bool, a test hook: those rows keep every draft (to time full acceptance).
    Returns:
        {"tokens": [B, T] int32 (the accepted drafts, then the next token; the rest 0), "accepted": [B] int32 drafts
        kept} and, with logprobs, "logprob" [B, T], "top_ids" and "top_logprobs" [B, T, TOP_LOGPROBS].
    """
    B, T, V = logits.shape
    raw = logits
    flat = logits.reshape(B * T, V)
    per_pos = lambda x: jnp.repeat(x, T, axis=0)  # noqa: E731 - a row's value at each of its positions
    position = jnp.arange(T, dtype=jnp.int32)
    in_run = position[None, :-1] < num_drafts[:, None]  # [B, T - 1] real drafts
    if penalties is not None:
        counts, seen, presence, frequency, repetition = penalties
        # The drafts before each position count as generated there.
        onehot = jax.nn.one_hot(jnp.where(in_run, drafts, -1), V, dtype=jnp.float32)  # [B, T - 1, V]
        before = jnp.concatenate([jnp.zeros((B, 1, V), jnp.float32), jnp.cumsum(onehot, axis=1)], axis=1)
        flat = apply_penalties(flat, (counts[:, None] + before).reshape(B * T, V),
                               (seen[:, None] | (before > 0)).reshape(B * T, V), per_pos(presence),
                               per_pos(frequency), per_pos(repetition))
    if guidance is not None:
        allowed, bias_ids, bias = guidance
        flat = apply_guidance(flat, allowed.reshape(B * T, -1), per_pos(bias_ids), per_pos(bias))
    greedy = jnp.argmax(flat, axis=-1).astype(jnp.int32).reshape(B, T)
    # What each position proposes to keep: the draft after it (none after the last).
    proposed = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1).astype(jnp.int32)
    has_draft = jnp.concatenate([in_run, jnp.zeros((B, 1), bool)], axis=1)
    temp = per_pos(temperature)
    index = (counters[:, None] + position[None, :]).reshape(B * T)

    def greedy_branch():
        return greedy, has_draft & (proposed == greedy)

    def draw(filtered: bool):
        def branch():
            scaled = flat / jnp.maximum(temp, 1e-6)[:, None]
            if filtered:
                scaled = filter_logits(scaled, per_pos(top_k), per_pos(top_p), per_pos(min_p))
            p = jax.nn.softmax(scaled, axis=-1)
            p_draft = jnp.take_along_axis(p, proposed.reshape(B * T, 1), axis=-1)[:, 0].reshape(B, T)
            coin = accept_uniform(per_pos(seeds), index).reshape(B, T)
            keep = has_draft & (coin < p_draft)
            # Where the draft is rejected, the residual max(p - onehot(draft), 0) is p without the draft.
            residual = jnp.where(has_draft.reshape(B * T, 1) & (jnp.arange(V)[None, :] == proposed.reshape(B * T, 1)),
                                 -jnp.inf, scaled)
            residual = jnp.where(jnp.isfinite(residual).any(axis=-1, keepdims=True), residual, scaled)
            noise = gumbel_noise(per_pos(seeds), index, V)
            drawn = jnp.argmax(residual + noise, axis=-1).astype(jnp.int32).reshape(B, T)
            sampled = (temperature > 0)[:, None]
            return jnp.where(sampled, drawn, greedy), jnp.where(sampled, keep, has_draft & (proposed == greedy))
        return branch

    tokens, keep = jax.lax.switch(mode_index(temperature, top_k, top_p, min_p),
                                  [greedy_branch, draw(False), draw(True)])
    accepted = jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    if force_accept is not None:
        accepted = jnp.where(force_accept, num_drafts, accepted)
    # The kept drafts, then the position's own token where the run stops.
    tokens = jnp.where(position[None, :] < accepted[:, None], proposed,
                       jnp.where(position[None, :] == accepted[:, None], tokens, 0)).astype(jnp.int32)
    out = {"tokens": tokens, "accepted": accepted}
    if logprobs is False:
        return out

    def with_logprobs():
        lp = jax.nn.log_softmax(raw, axis=-1)
        top_lp, top_ids = jax.lax.top_k(lp, min(TOP_LOGPROBS, V))
        return jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0], top_ids, top_lp

    def without():
        k = min(TOP_LOGPROBS, V)
        return jnp.zeros((B, T), jnp.float32), jnp.zeros((B, T, k), jnp.int32), jnp.zeros((B, T, k), jnp.float32)

    values = with_logprobs() if logprobs is True else jax.lax.cond(logprobs, with_logprobs, without)
    out["logprob"], out["top_ids"], out["top_logprobs"] = values
    return out
