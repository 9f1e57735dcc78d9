"""GLM-5-Next's pooled block selection (`block_sparse_attention.pooled_block_select`) against transformers' own
Glm5NextTextIndexer (float32): the keys each query may attend to, as its top-k token indices name them (the complete
blocks it picks, expanded, plus its incomplete tail); the learned pooling replaced by a plain mean, to show the
comparison would catch its loss; and, with top-k covering every block, equal to dense causal attention (with fewer
blocks, not).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run_reference
from kernels_pallas.attention import reference as dense
from kernels_pallas.block_sparse_attention import reference as block_ref

KPOOL, TOPK = 4, 8  # the best 2 complete blocks of 4
CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, v_head_dim=8,
              index_n_heads=8, index_head_dim=16, index_kpool=KPOOL, index_topk=TOPK,
              layer_types=["indexed_attention"], mlp_layer_types=["dense"], pad_token_id=0)
B, T = 2, 27  # 6 complete blocks of 4 and a tail of 3


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm5_next_ops")
    run_reference([{"op": "glm5_next_ops", "config": CONFIG, "seed": 0, "shape": [B, T],
                    "out": str(root / "out.npz")}], root)
    return dict(np.load(root / "out.npz"))


def positions():
    return jnp.broadcast_to(jnp.arange(T), (B, T))


def allowed(kept: np.ndarray) -> np.ndarray:
    """[B, 1, T, Nb] kept blocks -> [B, T, T] the keys a query attends to (its kept blocks' visible positions)."""
    on_keys = np.repeat(np.asarray(kept)[:, 0], KPOOL, axis=-1)[..., :T]
    return on_keys & np.tril(np.ones((T, T), bool))[None]


def hf_allowed(indices: np.ndarray) -> np.ndarray:
    mask = np.zeros((B, T, T + 1), bool)
    np.put_along_axis(mask, np.where(indices < 0, T, indices), True, axis=-1)
    return mask[..., :T]


def select(ref, ik=None, gate=None, ape=None, topk=TOPK // KPOOL):
    return block_ref.pooled_block_select(
        jnp.asarray(ref["iq"]), jnp.asarray(ref["weights"]), jnp.asarray(ref["ik"] if ik is None else ik),
        jnp.asarray(ref["gate"] if gate is None else gate), jnp.asarray(ref["ape"] if ape is None else ape),
        block_size=KPOOL, topk_blocks=topk, scale=CONFIG["index_head_dim"] ** -0.5, q_positions=positions())


def test_pooled_selection_matches_transformers(hf):
    theirs = hf_allowed(hf["topk_indices"])
    assert (allowed(select(hf)) == theirs).all()
    # Sparsity bites: late queries leave out some of the keys before them.
    assert theirs.sum(-1)[:, -1].max() < T


def test_learned_pooling_is_caught(hf):
    mean = select(hf, gate=np.zeros_like(hf["gate"]), ape=np.zeros_like(hf["ape"]))
    assert (allowed(mean) != hf_allowed(hf["topk_indices"])).any()


def test_every_block_kept_is_dense_attention(hf):
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((B, T, 4, 16), np.float32))
    k, v = (jnp.asarray(rng.standard_normal((B, T, 1, 16), np.float32)) for _ in range(2))
    blocks = -(-T // KPOOL)
    full = block_ref.block_sparse_attention(q, k, v, select(hf, topk=blocks), block_size=KPOOL,
                                            q_positions=positions())
    want = np.asarray(dense.attention(q, k, v, q_positions=positions()))
    # The same operations with a mask that lets every visible key through: equal up to float32 rounding.
    np.testing.assert_allclose(full, want, rtol=0, atol=1e-6)
    sparse = block_ref.block_sparse_attention(q, k, v, select(hf), block_size=KPOOL, q_positions=positions())
    assert float(np.abs(np.asarray(sparse) - want).max() / np.abs(want).max()) > 1e-2
