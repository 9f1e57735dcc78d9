"""The definition of correct attention, in plain jax.numpy; also the fallback on every backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp

FLOOR = jnp.finfo(jnp.float32).min  # masked scores: finite, so fully masked rows (batch padding) stay free of NaNs


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_positions: jax.Array,
              kv_lengths: jax.Array | None = None, causal: bool = True, sliding_window: int | None = None,
              logit_softcap: float | None = None, sinks: jax.Array | None = None,
              scale: float | None = None, chunk_size: int | None = None,
              visible_until: jax.Array | None = None) -> jax.Array:
    """Scaled dot-product attention with the masks and variants LLM families use.

    Args:
        q: [B, T, N, H] queries (letters as in docs/architecture.md).
        k: [B, S, K, H] keys, N a multiple of K (GQA; K == 1 is MQA); key s sits at position s.
        v: [B, S, K, Hv] values.
        q_positions: [B, T] int, absolute position of each query.
        kv_lengths: [B] int, number of valid keys per row (None: all S); keys s >= kv_lengths[b] are hidden.
        causal: hide keys after the query's position (s > q_positions[b, t]).
        sliding_window: if set, a query sees only the last `sliding_window` positions (itself included).
        logit_softcap: if set, scores become softcap * tanh(scores / softcap) (Gemma 2).
        sinks: [N] learned logits that join every softmax denominator and take no value (gpt-oss).
        scale: score scale; default H ** -0.5.
        chunk_size: if set, a query sees only keys in its own chunk of positions (key // chunk_size ==
            position // chunk_size; with `causal`, [floor(p / chunk_size) * chunk_size, p]): Llama 4's local layers.
        visible_until: [B, T] int, with `causal`: the last position each query sees, at least its own (later keys of
            a span that attends bidirectionally, Gemma 3's image tokens); the window still counts from the query.
    Returns:
        [B, T, N, Hv] in q's dtype, Hv being v's head dim (H except in multi-head latent attention).
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    scale = H ** -0.5 if scale is None else scale
    scores = grouped_scores(q, k) * scale
    if logit_softcap is not None:
        scores = logit_softcap * jnp.tanh(scores / logit_softcap)

    key_pos = jnp.arange(S)[None, None, :]  # [1, 1, S]
    qpos = q_positions[:, :, None]  # [B, T, 1]
    visible = jnp.ones((B, T, S), dtype=bool)
    if kv_lengths is not None:
        visible &= key_pos < kv_lengths[:, None, None]
    if causal:
        visible &= key_pos <= (qpos if visible_until is None else visible_until[:, :, None])
    if sliding_window is not None:
        visible &= qpos - key_pos < sliding_window
    if chunk_size is not None:
        visible &= key_pos // chunk_size == qpos // chunk_size
    scores = jnp.where(visible[:, None, None, :, :], scores, FLOOR)

    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(1, K, G, 1, 1)
        peak = jnp.maximum(scores.max(axis=-1, keepdims=True), sink)
        weights = jnp.exp(scores - peak)
        weights = weights / (weights.sum(axis=-1, keepdims=True) + jnp.exp(sink - peak))
    else:
        weights = jax.nn.softmax(scores, axis=-1)
    return weighted_values(weights, v).astype(q.dtype)


# Each kv head's G query heads and T queries are the M rows of one [M, H] x [H, S] product: with G as a batch axis of
# its own, XLA:CPU ran G times smaller products, 2-3x slower for the same math.

def grouped_scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """q [B, T, N, H] . k [B, S, K, H] -> unscaled float32 scores [B, K, G, T, S], query head n = k * G + g."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    qm = q.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4).reshape(B, K, N // K * T, H)
    return jnp.einsum("bkmh,bskh->bkms", qm, k, preferred_element_type=jnp.float32).reshape(B, K, N // K, T, S)


def weighted_values(weights: jax.Array, v: jax.Array) -> jax.Array:
    """weights [B, K, G, T, S] (cast to v's dtype) times v [B, S, K, Hv] -> float32 [B, T, N, Hv]."""
    B, K, G, T, S = weights.shape
    Hv = v.shape[-1]
    out = jnp.einsum("bkms,bskh->bkmh", weights.astype(v.dtype).reshape(B, K, G * T, S), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(B, K, G, T, Hv).transpose(0, 3, 1, 2, 4).reshape(B, T, K * G, Hv)
