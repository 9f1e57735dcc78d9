"""Token sampling from logits: greedy, temperature, top-k and top-p, per row, inside the jitted step.

Order and semantics follow transformers' logits processors: temperature, then top-k, then top-p (the smallest
set of tokens whose probability reaches top_p, at least one kept). Temperature 0 means greedy.

Sorting a 50k-200k vocabulary costs more than a small model's whole decode step on a CPU, so the caller picks a
static `mode` for the batch: "greedy" (argmax only), "random" (temperature only, no sort) or "filtered".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MODES = ("greedy", "random", "filtered")


def mode_for(temperature, top_k, top_p) -> str:
    """The cheapest mode that serves every row of these (host-side) per-row parameters."""
    temperature, top_k, top_p = (np.asarray(x) for x in (temperature, top_k, top_p))
    sampled = temperature > 0
    if not sampled.any():
        return "greedy"
    if ((top_k[sampled] > 0) | (top_p[sampled] < 1.0)).any():
        return "filtered"
    return "random"


def sample(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           mode: str = "filtered") -> jax.Array:
    """Picks one token per row.

    Args:
        logits: [B, V] float32.
        key: a PRNG key for this step.
        temperature: [B]; 0 means greedy for that row.
        top_k: [B] int; 0 means no limit.
        top_p: [B]; 1.0 means no limit.
        mode: static; see `mode_for`.
    Returns:
        [B] int32 token ids.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if mode == "greedy":
        return greedy
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    if mode == "random":
        sampled = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
        return jnp.where(temperature > 0, sampled, greedy)
    V = logits.shape[-1]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(V)[None, :]
    k = jnp.where(top_k > 0, top_k, V)[:, None]
    sorted_logits = jnp.where(rank < k, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep a token if the mass before it is below top_p (so the first token is always kept).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    sorted_logits = jnp.where(mass_before < top_p[:, None], sorted_logits, -jnp.inf)
    choice = jax.random.categorical(key, sorted_logits, axis=-1)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)
