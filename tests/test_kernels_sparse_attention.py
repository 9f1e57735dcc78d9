"""Indexed sparse attention: the indexer's top-k against a brute-force choice, sparse attention equal to dense
attention (bit for bit) when every visible key is selected, and the paged gather path (which reads only the
selected keys) equal to the reference over the whole pages. Float32 throughout; tolerances next to each test.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernels_pallas import cases
from kernels_pallas.attention import reference as dense
from kernels_pallas.sparse_attention import api, gather, reference

RNG = np.random.default_rng(0)


def normal(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def test_index_topk_picks_the_highest_visible_scores():
    B, T, S, I, Di, topk = 2, 6, 12, 3, 8, 4
    q, k, w = normal(B, T, I, Di), normal(B, S, Di), normal(B, T, I)
    positions = np.array([[0, 2, 5, 7, 9, 11], [1, 3, 4, 6, 8, 10]], np.int32)
    lengths = np.array([12, 9], np.int32)
    got = np.asarray(reference.index_topk(q, k, w, topk=topk, scale=0.3, q_positions=positions,
                                          kv_lengths=lengths))
    assert got.shape == (B, T, topk)
    for b in range(B):
        for t in range(T):
            seen = [s for s in range(S) if s <= positions[b, t] and s < lengths[b]]
            score = {s: sum(w[b, t, i] * max(0.0, 0.3 * float(q[b, t, i] @ k[b, s])) for i in range(I))
                     for s in seen}
            best = sorted(seen, key=lambda s: -score[s])[:topk]
            assert set(got[b, t, :len(best)].tolist()) == set(best), (b, t)


def test_equals_dense_attention_exactly_when_top_k_covers_the_context():
    # A chunk of 5 queries at positions 3..7 over 8 keys, top-8: every visible key is selected.
    B, T, S, N, K, H = 2, 5, 8, 4, 2, 16
    q, k, v = normal(B, T, N, H), normal(B, S, K, H), normal(B, S, K, H)
    positions = np.tile(np.arange(3, 8, dtype=np.int32), (B, 1))
    indices = reference.index_topk(normal(B, T, 2, 8), normal(B, S, 8), normal(B, T, 2), topk=8, scale=1.0,
                                   q_positions=positions)
    sparse = reference.sparse_attention(q, k, v, indices, q_positions=positions, scale=0.2)
    full = dense.attention(q, k, v, q_positions=positions, scale=0.2)
    np.testing.assert_array_equal(np.asarray(sparse), np.asarray(full))


def test_selection_changes_the_output_beyond_top_k():
    B, T, S, N, H = 1, 1, 16, 2, 8
    q, k, v = normal(B, T, N, H), normal(B, S, 1, H), normal(B, S, 1, H)
    positions = np.array([[15]], np.int32)
    indices = np.array([[[3, 9, 14, 0]]], np.int32)
    out = np.asarray(reference.sparse_attention(q, k, v, indices, q_positions=positions))
    # By hand: softmax over the four selected keys only.
    scores = np.einsum("nh,sh->ns", q[0, 0], k[0, [3, 9, 14, 0], 0]) * H ** -0.5
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(out[0, 0], p @ v[0, [3, 9, 14, 0], 0], rtol=1e-5, atol=1e-6)  # float32 sums


@pytest.mark.parametrize("seed", [0, 1])
def test_gather_path_equals_the_reference(seed):
    call = cases.OpCall.of("sparse_attention", N=8, K=1, H=24, Hv=24, scale=0.3, latent=True, topk=16, I=4, Di=16,
                           indexer=True)
    case = cases.cases_from_calls([call], "float32", scale="tiny")[0]
    args, kwargs = case.build(seed)
    ours = gather.paged_sparse_attention(*args, **kwargs)
    ref = reference.paged_sparse_attention(*args, **kwargs)
    # Float32; only the order of the softmax sums differs (selected keys in score order vs position order).
    assert cases.max_relative_error(ours, ref) < 1e-5
    assert cases.max_relative_error(api.paged_sparse_attention(*args, **kwargs), ref) < 1e-5


def test_gather_path_declines_a_prefill_over_a_short_context():
    args, kwargs = cases.cases_from_calls([cases.OpCall.of(
        "sparse_attention", N=2, K=1, H=8, Hv=8, scale=None, latent=False, topk=32, I=2, Di=8, indexer=True)],
        "float32", scale="tiny")[0].build(0)
    q = np.repeat(np.asarray(args[0]), 64, axis=1)  # 64 queries x 32 keys > the row's cached positions
    positions = np.repeat(np.asarray(args[5]), 64, axis=1)
    indices = np.repeat(np.asarray(args[6]), 64, axis=1)
    with pytest.raises(NotImplementedError):
        gather.paged_sparse_attention(q, *args[1:5], positions, indices, **kwargs)
