"""References of paged attention, grouped matmul and RMSNorm against simpler formulations of the same math.

Tolerances: float32, rtol/atol 1e-5 (paged vs dense attention, grouped matmul vs per-row matmul, RMSNorm vs
NumPy).
"""

import jax.numpy as jnp
import numpy as np

from kernels_pallas.attention import reference as dense
from kernels_pallas.moe import api as moe
from kernels_pallas.paged_attention import api as paged
from kernels_pallas.rms_norm import api as rms


def test_paged_attention_equals_dense_over_gathered_pages():
    rng = np.random.default_rng(1)
    B, T, N, K, H, page, pages = 2, 2, 4, 2, 8, 4, 10
    lengths = np.array([7, 10], np.int32)
    tables = np.array([[3, 7, 1], [9, 0, 5]], np.int32)
    k_pages = rng.standard_normal((pages, page, K, H)).astype(np.float32)
    v_pages = rng.standard_normal((pages, page, K, H)).astype(np.float32)
    # the same keys laid out contiguously per sequence
    k = np.stack([np.concatenate([k_pages[p] for p in tables[b]]) for b in range(B)])
    v = np.stack([np.concatenate([v_pages[p] for p in tables[b]]) for b in range(B)])
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    pos = np.stack([lengths - 2, lengths - 1], axis=1).astype(np.int32)
    got = paged.paged_attention(jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(tables),
                                jnp.asarray(lengths), jnp.asarray(pos), sliding_window=5)
    want = dense.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), q_positions=jnp.asarray(pos),
                           kv_lengths=jnp.asarray(lengths), sliding_window=5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_paged_chunked_attention_matches_brute_force_mask():
    """Chunked local attention over pages (chunks of 3 positions, pages of 4 tokens: chunks straddle pages): each
    query sees only the cached keys of its own chunk, up to itself."""
    from test_attention_op import naive

    rng = np.random.default_rng(2)
    B, T, N, K, H, page, pages, chunk = 2, 2, 4, 2, 8, 4, 10, 3
    lengths = np.array([7, 10], np.int32)
    tables = np.array([[3, 7, 1], [9, 2, 5]], np.int32)
    k_pages = rng.standard_normal((pages, page, K, H)).astype(np.float32)
    v_pages = rng.standard_normal((pages, page, K, H)).astype(np.float32)
    k = np.stack([np.concatenate([k_pages[p] for p in tables[b]]) for b in range(B)])
    v = np.stack([np.concatenate([v_pages[p] for p in tables[b]]) for b in range(B)])
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    pos = np.stack([lengths - 2, lengths - 1], axis=1).astype(np.int32)  # [5, 6] and [8, 9]: across a chunk edge
    got = paged.paged_attention(jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(tables),
                                jnp.asarray(lengths), jnp.asarray(pos), chunk_size=chunk)
    want = naive(q, k, v, pos, lengths, True, None, None, None, H ** -0.5, chunk=chunk)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_grouped_matmul_equals_per_row_matmul():
    rng = np.random.default_rng(2)
    M, D, F, G = 37, 8, 6, 5
    sizes = np.array([10, 0, 7, 13, 4], np.int32)  # 34 rows used, 3 trailing rows must come out zero
    lhs = rng.standard_normal((M, D)).astype(np.float32)
    rhs = rng.standard_normal((G, D, F)).astype(np.float32)
    got = np.asarray(moe.grouped_matmul(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes)))
    group = np.repeat(np.arange(G), sizes)
    want = np.zeros((M, F), np.float32)
    for m, g in enumerate(group):
        want[m] = lhs[m] @ rhs[g]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(moe.grouped_matmul(jnp.asarray(lhs), jnp.asarray(rhs),
                                                             jnp.asarray(sizes), implementation="xla_ragged_dot")),
                               want, rtol=1e-5, atol=1e-5)


def test_rms_norm_with_fused_residual():
    rng = np.random.default_rng(3)
    x, r = rng.standard_normal((3, 16)).astype(np.float32), rng.standard_normal((3, 16)).astype(np.float32)
    w = rng.standard_normal(16).astype(np.float32)
    h = x + r
    want = h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-6) * w
    normed, summed = rms.rms_norm(jnp.asarray(x), jnp.asarray(w), eps=1e-6, residual=jnp.asarray(r))
    np.testing.assert_allclose(np.asarray(summed), h, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(normed), want, rtol=1e-5, atol=1e-5)
    gemma, _ = rms.rms_norm(jnp.asarray(x), jnp.asarray(w), eps=1e-6, offset=1.0)
    np.testing.assert_allclose(np.asarray(gemma), x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * (1 + w),
                               rtol=1e-5, atol=1e-5)
