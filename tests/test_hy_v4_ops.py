"""HY-V4's operators against transformers' own modules (float32): the plain hyper-connection (no stream mixing,
post scaled by `hc_magnitude`), the hyper head, and sparse attention with per-head sinks over the chosen keys (the
reference and the engine's paged paths); each with the feature taken away, to show the comparison would catch its
loss. Tolerances next to each test, near the errors seen. Then a checkpoint under transformers' module names, which
converts as one under the original names.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run_reference
from kernels_pallas.hyper_connection import api as hc_op
from kernels_pallas.sparse_attention import api as sparse_op
from kernels_pallas.sparse_attention import gather
from kernels_pallas.sparse_attention import reference as sparse_ref

HC_MAGNITUDE, HC_EPS, NORM_EPS = 1.5, 1e-6, 1e-5
CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
              qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, index_n_heads=4,
              index_head_dim=16, index_topk=4, hc_mult=4, hc_magnitude=HC_MAGNITUDE, hc_eps=HC_EPS,
              rms_norm_eps=NORM_EPS, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAR = 1e-3  # a feature taken away moves the output at least this far (relative), a hundred times the tolerances
B, T, N, H, HV, KT, SCALE = 2, 20, 4, 16, 12, 5, 0.3


def rel_err(ours, ref) -> float:
    return float(np.abs(np.asarray(ours) - ref).max() / np.abs(ref).max())


def attention_inputs(rng) -> dict:
    """Queries at 0..T-1, each choosing KT distinct positions (some past it, which the causal mask removes, as
    transformers' indexer picks among masked keys when fewer than top-k are visible)."""
    indices = np.stack([[rng.permutation(T)[:KT] for _ in range(T)] for _ in range(B)]).astype(np.int32)
    for t in range(T):  # the query's own position always among them: no query without a visible key
        indices[:, t, 0] = t
    return dict(q=rng.standard_normal((B, T, N, H), np.float32), k=rng.standard_normal((B, T, H), np.float32),
                v=rng.standard_normal((B, T, HV), np.float32), indices=indices,
                sinks=(2.0 * rng.standard_normal(N)).astype(np.float32), scale=np.float32(SCALE))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("hy_v4_ops")
    inputs = attention_inputs(np.random.default_rng(0))
    np.savez(root / "attention.npz", **inputs)
    run_reference([{"op": "hy_v4_ops", "config": CONFIG, "seed": 0, "attention": str(root / "attention.npz"),
                    "out": str(root / "out.npz")}], root)
    return dict(np.load(root / "out.npz")), inputs


def plain(ref, **overrides):
    x = jnp.asarray(ref["streams"])
    kwargs = dict(dict(form="plain", norm_eps=NORM_EPS, eps=HC_EPS, post_scale=HC_MAGNITUDE), **overrides)
    collapsed, post, comb = hc_op.hyper_connection(x, *[jnp.asarray(ref[f"hc.{n}"]) for n in ("fn", "base", "scale")],
                                                   **kwargs)
    return collapsed, post, comb, hc_op.expand(x, jnp.asarray(ref["block_out"]), post, comb)


def head(ref):
    return hc_op.head(jnp.asarray(ref["streams"]), *[jnp.asarray(ref[f"head.hc_{n}"]) for n in ("fn", "base", "scale")],
                      norm_eps=NORM_EPS, eps=HC_EPS)


def test_plain_hyper_connection_matches_transformers(hf):
    ref, _ = hf
    collapsed, post, comb, expanded = plain(ref)
    assert comb is None  # the plain form never mixes the streams
    # Float32, errors seen up to 2.0e-7 relative (post).
    for name, ours in (("collapsed", collapsed), ("post", post), ("expanded", expanded), ("head", head(ref))):
        assert rel_err(ours, ref[name]) < 1e-5, name


def test_plain_hyper_connection_features_are_caught(hf):
    """DeepSeek-V4's post scale (2) in place of hc_magnitude, and the streams mixed evenly in place of each keeping
    its own residual: both far from transformers'."""
    ref, _ = hf
    assert rel_err(plain(ref, post_scale=2.0)[1], ref["post"]) > FAR
    x = jnp.asarray(ref["streams"])
    _, post, _, _ = plain(ref)
    n = x.shape[2]
    mixed = hc_op.expand(x, jnp.asarray(ref["block_out"]), post, jnp.full((*x.shape[:2], n, n), 1.0 / n))
    assert rel_err(mixed, ref["expanded"]) > FAR


def test_sparse_attention_with_sinks_matches_transformers(hf):
    ref, a = hf
    q, k, v = (jnp.asarray(a[name]) for name in ("q", "k", "v"))
    indices, sinks = jnp.asarray(a["indices"]), jnp.asarray(a["sinks"])
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    ours = sparse_op.sparse_attention(q, k[:, :, None], v[:, :, None], indices, q_positions=positions, scale=SCALE,
                                      sinks=sinks)
    assert rel_err(ours, ref["attention"]) < 1e-5  # float32, seen 1.5e-7
    without = sparse_op.sparse_attention(q, k[:, :, None], v[:, :, None], indices, q_positions=positions, scale=SCALE)
    assert rel_err(without, ref["attention"]) > FAR

    # The engine's paths over pages of 4 positions: the reference and the gather path (a decode step's shape: one
    # query per row at the end of the context, where T * Kt fits the cached positions).
    page = 4
    W = T // page
    tables = jnp.asarray(np.arange(B * W, dtype=np.int32).reshape(B, W)[:, ::-1].copy())
    k_pages = jnp.zeros((B * W, page, 1, H)).at[tables].set(k.reshape(B, W, page, 1, H))
    v_pages = jnp.zeros((B * W, page, 1, HV)).at[tables].set(v.reshape(B, W, page, 1, HV))
    lengths = jnp.full((B,), T, jnp.int32)
    last = slice(T - 1, T)
    for impl in (sparse_ref.paged_sparse_attention, gather.paged_sparse_attention):
        paged = impl(q[:, last], k_pages, v_pages, tables, lengths, positions[:, last], indices[:, last],
                     scale=SCALE, sinks=sinks)
        assert rel_err(paged, ref["attention"][:, last]) < 1e-5, impl.__module__


# transformers' conversion mapping for hy_v4 (original checkpoint name -> its module name), in order.
MODULE_NAMES = [(r"\.hc_pre\.hc_", ".hc_"), (r"\.learnable_sink_param", ".sinks"), (r"\.linear_gate", ".gate_proj"),
                (r"\.hc_attn_layer\.hc_(fn|base|scale)", r".attn_hc.\1"),
                (r"\.hc_mlp_layer\.hc_(fn|base|scale)", r".ffn_hc.\1"), (r"\.hc_head_(fn|base|scale)", r".hc_\1")]


def test_checkpoint_under_module_names_converts_as_the_original(tmp_path):
    """A checkpoint saved under transformers' module names (no conversion mapping applied) converts to the same
    parameters as the original names."""
    import re
    import shutil

    from safetensors.numpy import load_file, save_file

    from convert import convert_checkpoint
    from day0jax.weights.checkpoint import read_params

    run_reference([{"op": "tiny_hf", "family": "hy_v4", "config": CONFIG, "seed": 0, "out": str(tmp_path / "hf")}],
                  tmp_path)
    shutil.copytree(tmp_path / "hf", tmp_path / "modules")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    renamed = {}
    for name, value in tensors.items():
        for pattern, repl in MODULE_NAMES:
            name = re.sub(pattern, repl, name)
        renamed[name] = value
    assert "model.layers.0.attn_hc.fn" in renamed and "model.hc_head.hc_fn" in renamed
    assert "model.layers.0.mlp.gate_proj.weight" in renamed and "model.layers.0.self_attn.sinks" in renamed
    save_file(renamed, tmp_path / "modules" / "model.safetensors", metadata={"format": "pt"})
    original = read_params(convert_checkpoint(tmp_path / "hf", tmp_path / "a", progress=False).dst)
    modules = read_params(convert_checkpoint(tmp_path / "modules", tmp_path / "b", progress=False).dst)
    assert original.keys() == modules.keys()
    for name in original:
        np.testing.assert_array_equal(np.asarray(original[name]), np.asarray(modules[name]), err_msg=name)


def test_default_layer_lists_are_transformers(tmp_path):
    """Without `mlp_layer_types` and `indexer_types` the config derives the lists transformers derives (and writes
    into config.json): here over 10 layers, so that several shared runs follow each full layer."""
    import json

    from day0jax import models

    config = dict(CONFIG, num_hidden_layers=10)
    run_reference([{"op": "tiny_hf", "family": "hy_v4", "config": config, "seed": 0, "out": str(tmp_path / "hf")}],
                  tmp_path)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    ours = models.config_from_hf(dict(config, model_type="hy_v4"))
    assert list(ours.mlp_kinds) == written["mlp_layer_types"]
    assert list(ours.indexer_kinds) == written["indexer_types"]
    assert "shared" in ours.indexer_kinds and "dense" in ours.mlp_kinds and "sparse" in ours.mlp_kinds
