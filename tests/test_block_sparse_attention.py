"""Block-sparse attention (MiniMax-M3) against transformers' own lightning indexer, `build_block_mask` and
eager attention (float32): the blocks chosen, the attention over them, the paged path the engine takes; the forced
local blocks taken away, to show the comparison would catch their loss; and, with top-k covering every block, equal
to dense causal attention. The gather path, which reads only the kept blocks' keys, against the same references.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run_reference
from kernels_pallas import registry
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


def paged(inputs: dict, ref: dict, page: int = 8):
    """Keys, values and indexer keys in shuffled pages, the block tables one page longer than the rows need (more
    blocks gathered than there are keys): (pools, block tables)."""
    width = -(-T // page) + 1
    rng = np.random.default_rng(1)
    tables = rng.permutation(np.arange(1, B * width + 1)).reshape(B, width).astype(np.int32)
    pools = []
    for x in (inputs["k"], inputs["v"], ref["ik"]):
        pool = np.zeros((B * width + 1, page) + x.shape[2:], np.float32)
        for b in range(B):
            for s in range(T):
                pool[tables[b, s // page], s % page] = x[b, s]
        pools.append(jnp.asarray(pool))
    return pools, jnp.asarray(tables)


def test_paged_path_matches_transformers(hf):
    """The engine's path: each query of the last 6 positions attending as one prefill chunk (the reference: the
    gather path would read more than the pages hold), then each as its own decode step through the gather path,
    which reads only the kept blocks' keys."""
    ref, inputs = hf
    pools, tables = paged(inputs, ref)
    lengths = jnp.full((B,), T, jnp.int32)
    chunk = slice(T - 6, T)
    run = lambda rows, **kw: block_op.paged_block_sparse_attention(  # noqa: E731
        jnp.asarray(inputs["q"][:, rows]), *pools, tables, lengths, positions()[:, rows],
        jnp.asarray(ref["iq"][:, rows]), block_size=BLOCK, topk_blocks=TOPK, local_blocks=LOCAL, **kw)
    # Float32, errors seen: 1.5e-7 relative.
    assert rel_err(run(chunk), ref["attention"][:, chunk]) < 1e-5
    with pytest.raises(registry.KernelUnavailable, match="gather more"):
        run(chunk, implementation="gather")
    step = jax.jit(lambda q, p, iq: block_op.paged_block_sparse_attention(
        q, *pools, tables, lengths, p, iq, block_size=BLOCK, topk_blocks=TOPK, local_blocks=LOCAL,
        implementation="gather"))
    for t in range(T - 6, T):  # causal: a query's output is the same whatever comes after it
        out = step(jnp.asarray(inputs["q"][:, t:t + 1]), positions()[:, t:t + 1], jnp.asarray(ref["iq"][:, t:t + 1]))
        # Errors seen: 1.2e-7 to 3.0e-7 relative.
        assert rel_err(out, ref["attention"][:, t:t + 1]) < 1e-6


@pytest.mark.parametrize("indexer_heads", [1, K])
def test_gather_reads_the_kept_blocks_alone(hf, indexer_heads):
    """Attention over blocks chosen elsewhere (one choice for every head, as the mean and learned poolings make, or
    one per KV group): the gather path equals the reference's over the whole row, and reads no key outside the kept
    blocks (keys elsewhere made NaN change nothing)."""
    ref, inputs = hf
    pools, tables = paged(inputs, ref)
    lengths, blocks = jnp.full((B,), T, jnp.int32), -(-(tables.shape[1] * 8) // BLOCK)
    rng = np.random.default_rng(3)
    q = jnp.asarray(inputs["q"][:, -1:])
    kept = np.zeros((B, indexer_heads, 1, blocks), bool)  # at most TOPK + 1 blocks, the query's own among them
    for b in range(B):
        for i in range(indexer_heads):
            kept[b, i, 0, rng.choice((T - 1) // BLOCK, TOPK, replace=False)] = True
            kept[b, i, 0, (T - 1) // BLOCK] = True
    args = (q, pools[0], pools[1], tables, lengths, positions()[:, -1:], jnp.asarray(kept))
    attend = lambda *a, **kw: block_op.paged_attend_blocks(*a, block_size=BLOCK,  # noqa: E731
                                                           most_blocks=TOPK + 1, **kw)
    ours, theirs = attend(*args, implementation="gather"), attend(*args, implementation="reference")
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=5e-7)  # errors seen: 1.2e-7 (outputs of size about 1)
    outside = ~np.repeat(np.repeat(kept, BLOCK, axis=-1)[:, :, 0, :T], K // indexer_heads, axis=1)  # [B, K, T]
    k_pages, v_pages = np.asarray(pools[0]).copy(), np.asarray(pools[1]).copy()
    for b, g, s in zip(*np.nonzero(outside)):
        k_pages[tables[b, s // 8], s % 8, g] = np.nan
        v_pages[tables[b, s // 8], s % 8, g] = np.nan
    poisoned = attend(q, jnp.asarray(k_pages), jnp.asarray(v_pages), *args[3:], implementation="gather")
    np.testing.assert_array_equal(poisoned, ours)


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
