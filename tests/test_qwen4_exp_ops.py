"""Qwen4-Exp's operators against transformers' own modules (float32): the gated residual and the final mixer
(`kernels_pallas/hyper_connection`, form "gated"), the QSA indexer's choice of tokens (`block_sparse_attention`'s
"mean" pooling: mean-pooled blocks, the top ones plus the tail), and the hashed n-gram ids of a PLE layer
(`ngram_embedding`), each with the feature taken away, to show the comparison would catch its loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run_reference
from kernels_pallas.block_sparse_attention import reference as block_ref
from kernels_pallas.hyper_connection import api as hc_op
from kernels_pallas.ngram_embedding import reference as ngram_ref

EOS, V, NGRAM, HEADS_PER_NGRAM, VOCAB_BASE = 2, 256, 3, 2, 1000
CONFIG = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, rms_norm_eps=1e-5, eos_token_id=EOS, hc_count=3, hc_lowrank=8, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
              layer_types=["linear_attention", "indexed_attention"], indexer_n_heads=2, indexer_kv_heads=1,
              indexer_head_dim=16, indexer_budget=4, indexer_compress_ratio=2, ple_layer_ids=[1],
              ple_embed_dim=16, ngram_size=NGRAM, heads_per_ngram=HEADS_PER_NGRAM, ngram_vocab_size_base=VOCAB_BASE,
              rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))
TOKENS = [[5, 9, EOS, 7, 7, 11, 3, EOS, EOS, 4], [EOS, 1, 200, 255, 6, 6, 6, 30, 31, 2]]
FAR = 1e-3  # a feature taken away moves the output at least this far (relative), far above the tolerances


def rel_err(ours, ref) -> float:
    return float(np.abs(np.asarray(ours) - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen4_exp_ops")
    run_reference([{"op": "qwen4_exp_ops", "config": CONFIG, "seed": 0, "tokens": TOKENS,
                    "out": str(root / "out.npz")}], root)
    return dict(np.load(root / "out.npz"))


def gated(ref, prefix, *, inject=True, **overrides):
    x = jnp.asarray(ref["streams"]).reshape(*ref["streams"].shape[:2], CONFIG["hc_count"], -1)
    names = ["hc_norm", "input_mix_weight_down", "input_mix_weight_up"] + (["block_inject_weight"] if inject else [])
    weights = [jnp.asarray(overrides.get(n, ref[f"{prefix}.{n}.weight"])) for n in names]
    return hc_op.hyper_connection(x, *weights, form="gated", norm_eps=CONFIG["rms_norm_eps"])


def test_gated_residual_matches_transformers(hf):
    collapsed, post, comb = gated(hf, "gr")
    assert comb is None
    # float32 against float32: errors seen about 1e-7.
    assert rel_err(collapsed, hf["gr_input"]) < 2e-6
    assert rel_err(post, hf["gr_post"]) < 2e-6
    mixed, none, _ = gated(hf, "mixer", inject=False)
    assert none is None and rel_err(mixed, hf["mixer_out"]) < 2e-6
    # Without the per-channel input mix (every stream weighted alike) the block's input is another.
    flat = jnp.zeros_like(jnp.asarray(hf["gr.input_mix_weight_up.weight"]))
    assert rel_err(gated(hf, "gr", input_mix_weight_up=flat)[0], hf["gr_input"]) > FAR
    # The expansion adds the block's output to each stream's own residual, times post.
    y = jax.random.normal(jax.random.key(0), collapsed.shape)
    x = jnp.asarray(hf["streams"]).reshape(*collapsed.shape[:2], CONFIG["hc_count"], -1)
    np.testing.assert_allclose(hc_op.expand(x, y, post, None), x + post[..., None] * y[:, :, None], rtol=1e-6)


def rotate(x, positions, theta=10000.0):
    """HF's partial half-split RoPE over the first half of 16 dims (partial_rotary_factor 0.5 of head_dim 16)."""
    dim = 8
    inv = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    freqs = np.asarray(positions)[..., None] * inv
    cos, sin = np.cos(np.concatenate([freqs, freqs], -1)), np.sin(np.concatenate([freqs, freqs], -1))
    r, rest = x[..., :dim], x[..., dim:]
    half = np.concatenate([-r[..., dim // 2:], r[..., :dim // 2]], -1)
    return np.concatenate([r * cos + half * sin, rest], -1).astype(np.float32)


def block_keys(hf, cr):
    """The layer's part around `mean_pool`: transformers' k_layernorm ((1 + weight)) and RoPE at each block start."""
    pooled = np.asarray(block_ref.mean_pool(jnp.asarray(hf["ix_k"]), cr))
    normed = pooled / np.sqrt((pooled ** 2).mean(-1, keepdims=True) + CONFIG["rms_norm_eps"])
    normed = normed * (1.0 + hf["ix.k_layernorm.weight"])
    return rotate(normed, np.arange(pooled.shape[1]) * cr)


def selected_positions(hf, budget, cr):
    B, T = hf["ix_selected"].shape[:2]
    kept = block_ref.block_select(jnp.asarray(hf["ix_q"]), jnp.asarray(block_keys(hf, cr)), block_size=cr,
                                  topk_blocks=budget // cr, local_blocks=0, q_positions=jnp.tile(jnp.arange(T), (B, 1)),
                                  pool="mean")
    on_keys = np.repeat(np.asarray(kept[:, 0]), cr, axis=-1)[..., :T]
    return on_keys & np.tril(np.ones((T, T), bool))


def assert_same_choice(hf, ours, cr):
    """Equal selections, except among blocks of equal score (relu makes ties at 0 common: which of them
    transformers keeps is the order of torch.topk's ties; ours keeps the first): there the kept scores agree."""
    theirs = hf["ix_selected"]
    bk = block_keys(hf, cr)
    scores = np.maximum(np.einsum("btid,bjd->btij", hf["ix_q"], bk), 0).sum(2) / 4.0
    B, T, _ = theirs.shape
    for b in range(B):
        for t in range(T):
            whole = (t + 1) // cr * cr
            np.testing.assert_array_equal(ours[b, t, whole:], theirs[b, t, whole:])  # the tail
            kept = lambda sel: sorted(scores[b, t, j] for j in range(whole // cr) if sel[b, t, j * cr])
            np.testing.assert_allclose(kept(ours), kept(theirs), rtol=1e-6, atol=0)
    return (ours == theirs).all()


def test_mean_pooled_block_choice_matches_transformers(hf):
    budget, cr = CONFIG["indexer_budget"], CONFIG["indexer_compress_ratio"]
    ours = selected_positions(hf, budget, cr)
    assert_same_choice(hf, ours, cr)
    causal = np.tril(np.ones(ours.shape[1:], bool))
    assert (ours != causal).any()  # the budget is smaller than the context: some keys are left out
    # A budget covering every block keeps every visible key: dense causal attention.
    np.testing.assert_array_equal(selected_positions(hf, 16 * cr, cr), np.broadcast_to(causal, ours.shape))
    # Without the tail (only whole blocks) queries lose their own block's keys.
    without_tail = ours & (np.arange(ours.shape[-1]) < (np.arange(ours.shape[1])[:, None] + 1) // cr * cr)
    assert (without_tail != hf["ix_selected"]).any()


def test_ngram_ids_match_transformers(hf):
    heads = (NGRAM - 1) * HEADS_PER_NGRAM
    primes_flat = ngram_ref.head_primes(VOCAB_BASE, heads, 1)  # the second PLE layer's heads
    offsets_flat = [sum(primes_flat[:i]) for i in range(heads)]
    per_order = lambda flat: tuple(tuple(flat[g * HEADS_PER_NGRAM:(g + 1) * HEADS_PER_NGRAM]) for g in range(NGRAM - 1))
    tokens = jnp.asarray(TOKENS)
    ids = lambda eos, layer=1: np.asarray(ngram_ref.ngram_ids(
        jnp.full((2, NGRAM - 1), EOS), tokens, eos=eos, multipliers=ngram_ref.multipliers(V, NGRAM, layer, 1234),
        primes=per_order(primes_flat), offsets=per_order(offsets_flat)))
    np.testing.assert_array_equal(ids(EOS), hf["ngram_ids"])
    assert (ids(EOS + 1) != hf["ngram_ids"]).any()  # without the restart at eos
    assert (ids(EOS, layer=0) != hf["ngram_ids"]).any()  # another layer's multipliers
