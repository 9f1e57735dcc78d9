"""DeepSeek-V4's operators against transformers' own modules (float32): the manifold-constrained hyper-connection
and the hyper head, the HCA and CSA compressors with the lightning indexer's choice, and attention over a window plus
chosen entries with sinks; each with the feature taken away, to show the comparison would catch its loss. Then the
engine's gather path against the reference over paged pools. Tolerances next to each test, near the errors seen.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import run_reference
from day0jax import models
from day0jax.layers.compressed_attention import Compressor, Indexer, interleave_tail
from day0jax.layers.rope import Rope
from kernels_pallas import cases
from kernels_pallas.compressed_attention import api, gather
from kernels_pallas.compressed_attention import reference as attention_ref
from kernels_pallas.hyper_connection import api as hc_op
from kernels_pallas.sparse_attention import api as sparse_op

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
# Layers: sliding, CSA (entries of 4, the top 3 of 8 indexer heads), HCA (entries of 8); four streams; half of each
# head rotated, YaRN on the compressed branch.
CONFIG = dict(vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=1, head_dim=16, q_lora_rank=16, partial_rotary_factor=0.5, o_groups=2,
              o_lora_rank=8, n_routed_experts=4, num_experts_per_tok=2, layer_types=["sliding_attention", CSA, HCA],
              mlp_layer_types=["hash_moe", "moe", "moe"], compress_rates={CSA: 4, HCA: 8}, index_n_heads=8,
              index_head_dim=8, index_topk=3, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, sliding_window=6,
              rms_norm_eps=1e-6, compress_rope_theta=1000.0, max_position_embeddings=256,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
FAR = 1e-3  # a feature taken away moves the output at least this far (relative), a hundred times the tolerances
WINDOW, RATIO, SCALE = 6, 4, 0.3


def rel_err(ours, ref) -> float:
    return float(np.abs(np.asarray(ours) - ref).max() / np.abs(ref).max())


def attention_inputs(rng) -> dict:
    """Queries at 0..T-1 over the window's keys and 5 entries, each query's top 4 in a random order, those it
    cannot see replaced by -1 as transformers' indexer does."""
    B, T, N, H, C, Kt = 2, 20, 4, 16, 5, 4
    visible = (np.arange(T) + 1) // RATIO
    indices = np.stack([[rng.permutation(C)[:Kt] for _ in range(T)] for _ in range(B)]).astype(np.int32)
    indices = np.where(indices < visible[None, :, None], indices, -1).astype(np.int32)
    return dict(q=rng.standard_normal((B, T, N, H), np.float32), k=rng.standard_normal((B, T, H), np.float32),
                entries=rng.standard_normal((B, C, H), np.float32), indices=indices,
                sinks=rng.standard_normal(N).astype(np.float32), window=np.int32(WINDOW), ratio=np.int32(RATIO),
                scale=np.float32(SCALE))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v4_ops")
    inputs = attention_inputs(np.random.default_rng(0))
    np.savez(root / "attention.npz", **inputs)
    run_reference([{"op": "deepseek_v4_ops", "config": CONFIG, "seed": 0, "attention": str(root / "attention.npz"),
                    "out": str(root / "out.npz")}], root)
    return dict(np.load(root / "out.npz")), inputs


@pytest.fixture(scope="module")
def compressors():
    """Our CSA compressor (with its indexer) and HCA compressor of CONFIG, and the compressed branch's RoPE; random
    weights (the tests set the ones they compare)."""
    c = models.config_from_hf(dict(CONFIG, model_type="deepseek_v4"))
    rope = Rope(c.compress_rope, c.head_dim, c.max_position_embeddings)
    with nnx.use_eager_sharding(False):
        rngs = nnx.Rngs(0)
        csa = Compressor(c.hidden_size, c.head_dim, c.rates[CSA], overlap=True, eps=c.rms_norm_eps, rngs=rngs)
        csa.indexer = Indexer(c.hidden_size, c.q_lora_rank, c.index_n_heads, c.index_head_dim, c.rates[CSA],
                              c.index_topk, eps=c.rms_norm_eps, rngs=rngs)
        hca = Compressor(c.hidden_size, c.head_dim, c.rates[HCA], overlap=False, eps=c.rms_norm_eps, rngs=rngs)
    return {"csa": csa, "hca": hca, "rope": rope}


def hc_args(ref, prefix="hc"):
    return [jnp.asarray(ref[f"{prefix}.{name}"]) for name in ("fn", "base", "scale")]


def test_hyper_connection_matches_transformers(hf):
    ref, _ = hf
    x = jnp.asarray(ref["streams"])
    collapsed, post, comb = hc_op.hyper_connection(x, *hc_args(ref), form="mhc", norm_eps=1e-6, eps=1e-6,
                                                   sinkhorn_iters=20)
    expanded = hc_op.expand(x, jnp.asarray(ref["block_out"]), post, comb)
    head = hc_op.head(x, *[jnp.asarray(ref[f"head.hc_{n}"]) for n in ("fn", "base", "scale")], norm_eps=1e-6,
                      eps=1e-6)
    # Float32, errors seen up to 4e-7 relative (the Sinkhorn iterations' sums).
    for name, ours in (("collapsed", collapsed), ("post", post), ("comb", comb), ("expanded", expanded),
                       ("head", head)):
        assert rel_err(ours, ref[name]) < 1e-5, name
    np.testing.assert_allclose(np.asarray(comb).sum(-1), 1.0, atol=1e-4)  # doubly stochastic, to within hc_eps
    np.testing.assert_allclose(np.asarray(comb).sum(-2), 1.0, atol=1e-4)


def test_hyper_connection_without_sinkhorn_is_caught(hf):
    """One normalization instead of twenty rounds: the mixing matrix is far from transformers'."""
    ref, _ = hf
    _, _, comb = hc_op.hyper_connection(jnp.asarray(ref["streams"]), *hc_args(ref), form="mhc", norm_eps=1e-6,
                                        eps=1e-6, sinkhorn_iters=1)
    assert rel_err(comb, ref["comb"]) > FAR


def set_weights(module, ref: dict, prefix: str) -> None:
    """transformers' weights `prefix.<path>` into our module: `x.weight` of a linear map is our `x.kernel`."""
    for key, value in ref.items():
        if not key.startswith(prefix + "."):
            continue
        *path, leaf = key[len(prefix) + 1:].split(".")
        owner = module
        for part in path:
            owner = getattr(owner, part)
        if leaf == "weight" and hasattr(owner, "kernel"):
            leaf = "kernel"
        param = getattr(owner, leaf)
        param[...] = jnp.asarray(value).reshape(param.shape)


def pooled(compressor, h, rope):
    """The entries of every complete window of the hidden states h [B, T, D] (no cache)."""
    B, T, _ = h.shape
    zeros = jnp.zeros((B,), jnp.int32)
    return compressor.entries(compressor.project(h), zeros, zeros, T // compressor.ratio, zeros + T, rope)[0]


def compress(compressors, ref, prefix: str):
    """Our entries of transformers' hidden states with its weights, the tails back in its interleaved layout."""
    compressor, rope = compressors[prefix], compressors["rope"]
    set_weights(compressor, ref, prefix)
    return interleave_tail(pooled(compressor, jnp.asarray(ref["hidden"]), rope), rope.rotary_dim)


@pytest.mark.parametrize("prefix", ["csa", "hca"])
def test_compressor_matches_transformers(hf, compressors, prefix):
    ref, _ = hf
    entries = compress(compressors, ref, prefix)
    assert entries.shape == ref[f"{prefix}_entries"].shape
    # Float32, errors seen up to 5e-7 relative (the gated softmax over each window, the norm, the rotation).
    assert rel_err(entries, ref[f"{prefix}_entries"]) < 1e-5


def test_compressor_without_the_overlapping_windows_is_caught(hf, compressors):
    """The CSA entries pooled from their own window only (the previous window's half gated off)."""
    ref, _ = hf
    cut = dict(ref)
    bias = ref["csa.position_bias"].copy()
    bias[:, :bias.shape[1] // 2] = -1e30  # the half each token gives the next window's entry
    cut["csa.position_bias"] = bias
    entries = compress(compressors, cut, "csa")
    set_weights(compressors["csa"], ref, "csa")  # as the other tests expect them
    assert rel_err(entries, ref["csa_entries"]) > FAR


def test_indexer_chooses_the_entries_transformers_chooses(hf, compressors):
    ref, _ = hf
    set_weights(compressors["csa"], ref, "csa")
    indexer, rope = compressors["csa"].indexer, compressors["rope"]
    h, q_resid = jnp.asarray(ref["hidden"]), jnp.asarray(ref["q_resid"])
    B, T, _ = h.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    keys = pooled(indexer, h, rope)
    q, weights = indexer.queries(h, q_resid, rope, rope.cos_sin(positions))
    last = attention_ref.entry_positions(positions, indexer.ratio)
    chosen = np.asarray(sparse_op.index_topk(q, keys, weights, topk=indexer.topk, scale=indexer.scale,
                                             q_positions=last))
    visible = np.zeros(ref["csa_visible"].shape, bool)
    for b, t, i in np.ndindex(chosen.shape):
        if 0 <= chosen[b, t, i] <= last[b, t]:
            visible[b, t, chosen[b, t, i]] = True
    np.testing.assert_array_equal(visible, ref["csa_visible"])
    # The choice matters: later queries see fewer entries than causality allows.
    causal = np.arange(visible.shape[-1])[None, None, :] <= np.asarray(last)[:, :, None]
    assert (visible.sum(-1) < causal.sum(-1)).any()


def test_attention_over_window_and_entries_matches_transformers(hf):
    ref, x = hf
    args = (jnp.asarray(x["q"]), jnp.asarray(x["k"]), jnp.asarray(x["entries"]), jnp.asarray(x["indices"]))
    positions = jnp.broadcast_to(jnp.arange(x["q"].shape[1], dtype=jnp.int32), x["q"].shape[:2])
    out = attention_ref.compressed_attention(*args, q_positions=positions, window=WINDOW, ratio=RATIO,
                                             sinks=jnp.asarray(x["sinks"]), scale=SCALE)
    # Float32, errors seen up to 3e-7 relative.
    assert rel_err(out, ref["attention"]) < 1e-5
    no_sinks = attention_ref.compressed_attention(*args, q_positions=positions, window=WINDOW, ratio=RATIO,
                                                  sinks=None, scale=SCALE)
    assert rel_err(no_sinks, ref["attention"]) > FAR
    every_entry = attention_ref.compressed_attention(*args[:3], None, q_positions=positions, window=WINDOW,
                                                     ratio=RATIO, sinks=jnp.asarray(x["sinks"]), scale=SCALE)
    assert rel_err(every_entry, ref["attention"]) > FAR


@pytest.mark.parametrize("topk", [8, None])  # CSA's chosen entries, HCA's every entry
def test_gather_path_equals_the_reference_over_pages(topk):
    call = cases.OpCall.of("compressed_attention", N=4, H=32, window=16, ratio=4, topk=topk, I=4, Di=16, sinks=True,
                           scale=None)
    for case in cases.cases_from_calls([call], "float32", scale="tiny"):
        args, kwargs = case.build(0)
        ref = attention_ref.paged_compressed_attention(*args, **kwargs)
        if topk and "prefill" in case.name:  # more chosen entries than the short context holds: declined
            with pytest.raises(NotImplementedError):
                gather.paged_compressed_attention(*args, **kwargs)
        else:
            # Float32; only the order of the softmax sums differs (the window's pages and the entries apart).
            assert cases.max_relative_error(gather.paged_compressed_attention(*args, **kwargs), ref) < 1e-5, case.name
        assert cases.max_relative_error(api.paged_compressed_attention(*args, **kwargs), ref) < 1e-5, case.name
