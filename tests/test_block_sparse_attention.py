"""Block-sparse attention (MiniMax-M3) against transformers' own lightning indexer, `build_block_mask` and
eager attention (float32): the blocks chosen, the attention over them, the paged path the engine takes; the forced
local blocks taken away, to show the comparison would catch their loss; and, with top-k covering every block, equal
to dense causal attention.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run_reference
from kernels_pallas.attention import reference as dense
from kernels_pallas.block_sparse_attention import api as block_op
from kernels_pallas.block_sparse_attention import reference as block_ref

BLOCK, TOPK, LOCAL = 4, 3, 2
CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, index_n_heads=2, index_head_dim=16, index_block_size=BLOCK,
              index_topk_blocks=TOPK, index_local_blocks=LOCAL, rms_norm_eps=1e-5, max_position_embeddings=64,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
B, T, N, K, H = 2, 26, 4, 2, 16  # 7 blocks of 4 (the last partial), top-3 of them


def rel_err(ours, ref) -> float:
    return float(np.abs(np.asarray(ours) - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("minimax_m3_ops")
    rng = np.random.default_rng(0)
    inputs = dict(q=rng.standard_normal((B, T, N, H), np.float32), k=rng.standard_normal((B, T, K, H), np.float32),
                  v=rng.standard_normal((B, T, K, H), np.float32))
    np.savez(root / "attention.npz", **inputs)
    run_reference([{"op": "minimax_m3_ops", "config": CONFIG, "seed": 0, "attention": str(root / "attention.npz"),
                    "out": str(root / "out.npz")}], root)
    return dict(np.load(root / "out.npz")), inputs


def as_kept(block_indices: np.ndarray, blocks: int) -> np.ndarray:
    """transformers' [B, I, T, topk] block ids (-1: none) as [B, I, T, Nb] bool."""
    kept = np.zeros(block_indices.shape[:-1] + (blocks + 1,), bool)
    np.put_along_axis(kept, np.where(block_indices < 0, blocks, block_indices), True, axis=-1)
    return kept[..., :blocks]


def positions():
    return jnp.broadcast_to(jnp.arange(T), (B, T))


def select(ref, local=LOCAL, topk=TOPK):
    return np.asarray(block_ref.block_select(jnp.asarray(ref["iq"]), jnp.asarray(ref["ik"]), block_size=BLOCK,
                                             topk_blocks=topk, local_blocks=local, q_positions=positions()))


def test_block_selection_matches_transformers(hf):
    ref, _ = hf
    theirs = as_kept(ref["block_indices"], -(-T // BLOCK))
    assert (select(ref) == theirs).all()
    # The test means something: later queries see more blocks than they keep.
    visible_blocks = np.arange(T) // BLOCK + 1
    assert (theirs.sum(-1) < visible_blocks[None, None]).any()


def test_forced_local_blocks_are_caught(hf):
    """Without the forced blocks (or with fewer), some queries keep other blocks than transformers."""
    ref, _ = hf
    theirs = as_kept(ref["block_indices"], -(-T // BLOCK))
    assert (select(ref, local=0) != theirs).any()
    assert (select(ref, local=1) != theirs).any()


def test_attention_over_kept_blocks_matches_transformers(hf):
    ref, inputs = hf
    kept = jnp.asarray(select(ref))
    q, k, v = (jnp.asarray(inputs[n]) for n in "qkv")
    ours = block_ref.block_sparse_attention(q, k, v, kept, block_size=BLOCK, q_positions=positions())
    # Float32, errors seen: 1.5e-7 relative.
    assert rel_err(ours, ref["attention"]) < 1e-5
    # Dense causal attention is far from it: the selection shows in the output.
    assert rel_err(dense.attention(q, k, v, q_positions=positions()), ref["attention"]) > 1e-2
    combined = block_op.indexed_block_sparse_attention(q, k, v, jnp.asarray(ref["iq"]), jnp.asarray(ref["ik"]),
                                                       block_size=BLOCK, topk_blocks=TOPK, local_blocks=LOCAL,
                                                       q_positions=positions())
    assert rel_err(combined, ref["attention"]) < 1e-5


def test_paged_path_matches_transformers(hf):
    """The engine's path: keys, values and indexer keys in shuffled pages of 8, the block tables one page longer
    than the rows need (more blocks gathered than there are keys), each query of the last 6 positions attending as
    a decode chunk."""
    ref, inputs = hf
    page, width = 8, -(-T // 8) + 1
    rng = np.random.default_rng(1)
    tables = rng.permutation(np.arange(1, B * width + 1)).reshape(B, width).astype(np.int32)
    pools = []
    for x in (inputs["k"], inputs["v"], ref["ik"]):
        pool = np.zeros((B * width + 1, page) + x.shape[2:], np.float32)
        for b in range(B):
            for s in range(T):
                pool[tables[b, s // page], s % page] = x[b, s]
        pools.append(jnp.asarray(pool))
    chunk = slice(T - 6, T)
    out = block_op.paged_block_sparse_attention(
        jnp.asarray(inputs["q"][:, chunk]), *pools, jnp.asarray(tables), jnp.full((B,), T, jnp.int32),
        positions()[:, chunk], jnp.asarray(ref["iq"][:, chunk]), block_size=BLOCK, topk_blocks=TOPK,
        local_blocks=LOCAL)
    # Float32, errors seen: 1.5e-7 relative.
    assert rel_err(out, ref["attention"][:, chunk]) < 1e-5


def test_every_block_kept_is_dense_attention():
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal(s, np.float32)) for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H)))
    iq, ik = jnp.asarray(rng.standard_normal((B, T, K, 8), np.float32)), jnp.asarray(rng.standard_normal((B, T, 8),
                                                                                                         np.float32))
    blocks = -(-T // BLOCK)
    ours = block_op.indexed_block_sparse_attention(q, k, v, iq, ik, block_size=BLOCK, topk_blocks=blocks,
                                                   local_blocks=1, q_positions=positions())
    # The same operations with a mask that lets every visible key through: equal up to float32 rounding.
    np.testing.assert_allclose(ours, dense.attention(q, k, v, q_positions=positions()), rtol=0, atol=1e-6)
    sparse = block_op.indexed_block_sparse_attention(q, k, v, iq, ik, block_size=BLOCK, topk_blocks=TOPK,
                                                     local_blocks=1, q_positions=positions())
    assert rel_err(sparse, np.asarray(dense.attention(q, k, v, q_positions=positions()))) > 1e-2
