"""The definition of correct attention, in plain jax.numpy; also the fallback on every backend."""

from __future__ import annotations

import functools

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
    S = k.shape[1]
    scale = H ** -0.5 if scale is None else scale
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
    return _attend(q, k, v, sinks, visible, scale, logit_softcap).astype(q.dtype)


def _masked_scores(q, k, visible, scale, logit_softcap):
    """float32 [B, K, G, T, S]: scaled (and soft-capped) scores, hidden keys at FLOOR."""
    scores = grouped_scores(q, k) * scale
    if logit_softcap is not None:
        scores = logit_softcap * jnp.tanh(scores / logit_softcap)
    return jnp.where(visible[:, None, None, :, :], scores, FLOOR)


def _softmax_parts(scores, sinks):
    """(peak, denominator) [B, K, G, T, 1] of the softmax over keys, sinks in the denominator."""
    peak = scores.max(axis=-1, keepdims=True)
    if sinks is None:
        return peak, jnp.exp(scores - peak).sum(axis=-1, keepdims=True)
    K, G = scores.shape[1], scores.shape[2]
    sink = sinks.astype(jnp.float32).reshape(1, K, G, 1, 1)
    peak = jnp.maximum(peak, sink)
    return peak, jnp.exp(scores - peak).sum(axis=-1, keepdims=True) + jnp.exp(sink - peak)


def _attend_forward(q, k, v, sinks, visible, scale, logit_softcap):
    scores = _masked_scores(q, k, visible, scale, logit_softcap)
    peak, denominator = _softmax_parts(scores, sinks)
    out = weighted_values(jnp.exp(scores - peak) / denominator, v)
    return out, (q, k, v, sinks, visible, out, peak, denominator)


# The gradient by hand, flash attention's way: only q, k, v, the output and the softmax's peak and denominator are
# kept for the backward pass, which recomputes the weights. Autodiff of the forward kept every layer's [T, S] weights
# and softmax intermediates (most of a training step's memory at long rows) and XLA:CPU fused its softmax backward
# into the score product, at a tenth of the product's speed. (XLA still merges the recomputed weights with the
# forward's identical ones, keeping one [T, S] array per layer; optimization barriers against that cost more memory
# than they saved.)

@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attend(q, k, v, sinks, visible, scale, logit_softcap):
    """float32 [B, T, N, Hv]: softmax(masked scores) . v, with its hand-written gradient."""
    return _attend_forward(q, k, v, sinks, visible, scale, logit_softcap)[0]


def _attend_backward(scale, logit_softcap, residuals, d_out):
    q, k, v, sinks, visible, out, peak, denominator = residuals
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    raw = grouped_scores(q, k) * scale
    capped = raw if logit_softcap is None else logit_softcap * jnp.tanh(raw / logit_softcap)
    seen = visible[:, None, None, :, :]
    weights = jnp.exp(jnp.where(seen, capped, FLOOR) - peak) / denominator  # [B, K, G, T, S], as the forward's

    def rows(x):  # [B, T, N, D] -> [B, K, G * T, D], the layout of grouped_scores' rows
        return x.reshape(B, T, K, G, x.shape[-1]).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, x.shape[-1])

    d_rows = rows(d_out.astype(jnp.float32))
    flat = weights.reshape(B, K, G * T, S)
    d_v = jnp.einsum("bkms,bkmh->bskh", flat.astype(v.dtype), d_rows.astype(v.dtype),
                     preferred_element_type=jnp.float32)
    d_weights = jnp.einsum("bkmh,bskh->bkms", d_rows.astype(v.dtype), v,
                           preferred_element_type=jnp.float32).reshape(B, K, G, T, S)
    # sum_s weights * d_weights = d_out . out, per query row and head
    row_dot = (d_out.astype(jnp.float32) * out).sum(-1).reshape(B, T, K, G).transpose(0, 2, 3, 1)[..., None]
    d_scores = jnp.where(seen, weights * (d_weights - row_dot), 0.0)
    if logit_softcap is not None:
        d_scores = d_scores * (1.0 - jnp.square(capped / logit_softcap))
    d_scores = (d_scores * scale).reshape(B, K, G * T, S)
    d_q = jnp.einsum("bkms,bskh->bkmh", d_scores.astype(k.dtype), k, preferred_element_type=jnp.float32)
    d_q = d_q.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)
    d_k = jnp.einsum("bkms,bkmh->bskh", d_scores.astype(q.dtype), rows(q), preferred_element_type=jnp.float32)
    d_sinks = None
    if sinks is not None:  # a sink's weight exp(sink - peak) / denominator multiplies -out in d out / d sink
        sink = sinks.astype(jnp.float32).reshape(1, K, G, 1, 1)
        sink_weight = jnp.exp(sink - peak) / denominator
        d_sinks = (-(sink_weight * row_dot).sum(axis=(0, 3, 4))).reshape(N).astype(sinks.dtype)
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), d_sinks, None


_attend.defvjp(_attend_forward, _attend_backward)


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
