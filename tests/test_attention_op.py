"""The attention op's reference against a direct per-(row, head, query) NumPy computation, and dispatch rules.

Tolerance: float32 both sides, atol/rtol 1e-5.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import registry
from kernels_pallas.attention import api, reference


def naive(q, k, v, q_positions, kv_lengths, causal, window, softcap, sinks, scale, chunk=None):
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    out = np.zeros_like(q)
    for b in range(B):
        for n in range(N):
            kh = n // (N // K)
            for t in range(T):
                p = q_positions[b, t]
                scores = np.array([q[b, t, n] @ k[b, s, kh] * scale for s in range(S)])
                if softcap:
                    scores = softcap * np.tanh(scores / softcap)
                ok = np.array([s < kv_lengths[b] and (not causal or s <= p) and (window is None or p - s < window)
                               and (chunk is None or s // chunk == p // chunk) for s in range(S)])
                logits = np.where(ok, scores, -np.inf)
                extra = [sinks[n]] if sinks is not None else []
                m = max(logits.max(), *extra) if extra else logits.max()
                w = np.exp(logits - m)
                denom = w.sum() + sum(np.exp(e - m) for e in extra)
                out[b, t, n] = (w / denom) @ v[b, :, kh]
    return out


@pytest.mark.parametrize("N,K,window,softcap,use_sinks", [
    (4, 4, None, None, False), (4, 2, None, None, False), (4, 1, 3, None, False), (4, 2, None, 5.0, False),
    (4, 2, 4, None, True)])
def test_reference_matches_naive(N, K, window, softcap, use_sinks):
    rng = np.random.default_rng(0)
    B, T, S, H = 2, 3, 7, 8
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k = rng.standard_normal((B, S, K, H)).astype(np.float32)
    v = rng.standard_normal((B, S, K, H)).astype(np.float32)
    q_positions = np.array([[2, 3, 4], [4, 5, 6]], np.int32)  # decode-like: queries after a cached prefix
    kv_lengths = np.array([5, 7], np.int32)
    sinks = rng.standard_normal(N).astype(np.float32) if use_sinks else None
    got = reference.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), q_positions=jnp.asarray(q_positions),
                              kv_lengths=jnp.asarray(kv_lengths), sliding_window=window, logit_softcap=softcap,
                              sinks=None if sinks is None else jnp.asarray(sinks))
    want = naive(q, k, v, q_positions, kv_lengths, True, window, softcap, sinks, H ** -0.5)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk,window,causal", [(3, None, True), (2, None, True), (4, 3, True), (3, None, False)])
def test_reference_chunked_mask_matches_naive(chunk, window, causal):
    """Chunked local attention: a query sees only the keys of its own chunk of positions; the queries here straddle
    chunk boundaries, and the chunk mask combines with a window, GQA and ragged lengths."""
    rng = np.random.default_rng(1)
    B, T, S, N, K, H = 2, 4, 9, 4, 2, 8
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k = rng.standard_normal((B, S, K, H)).astype(np.float32)
    v = rng.standard_normal((B, S, K, H)).astype(np.float32)
    q_positions = np.array([[2, 3, 4, 5], [5, 6, 7, 8]], np.int32)
    kv_lengths = np.array([6, 9], np.int32)
    got = reference.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), q_positions=jnp.asarray(q_positions),
                              kv_lengths=jnp.asarray(kv_lengths), causal=causal, sliding_window=window,
                              chunk_size=chunk)
    want = naive(q, k, v, q_positions, kv_lengths, causal, window, None, None, H ** -0.5, chunk=chunk)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    unchunked = naive(q, k, v, q_positions, kv_lengths, causal, window, None, None, H ** -0.5)
    assert np.abs(want - unchunked).max() > 1e-2  # the chunks cut something here


def test_dispatch_falls_back_and_named_kernel_raises(monkeypatch):
    calls = []

    def picky(*args, **kwargs):
        calls.append("picky")
        raise NotImplementedError("head_dim 8 is too small")

    monkeypatch.setitem(api.IMPLEMENTATIONS, "picky", picky)
    monkeypatch.setitem(api.CANDIDATES, jax.default_backend(), ("picky",))
    q = jnp.ones((1, 2, 2, 8))
    k = v = jnp.ones((1, 2, 2, 8))
    pos = jnp.array([[0, 1]])
    out = api.attention(q, k, v, q_positions=pos)  # declined, so the reference ran
    assert calls == ["picky"] and out.shape == q.shape
    with pytest.raises(registry.KernelUnavailable, match="picky.*too small"):
        api.attention(q, k, v, q_positions=pos, implementation="picky")
    with pytest.raises(registry.KernelUnavailable, match="no implementation 'nope'"):
        api.attention(q, k, v, q_positions=pos, implementation="nope")
