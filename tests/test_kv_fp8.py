"""The fp8 KV cache (`EngineConfig(kv_cache_dtype="fp8")`): float8_e4m3fn pages with a float32 scale per token and kv
head. Its quantization matches a numpy rendering; the engine's cached decode gives logits within a few percent of
the float cache's on tiny families (full attention, MoE, sliding-window rings, multi-head latent attention) and on
SmolLM2, whose greedy tokens stay the same; the planner counts half the bytes and `check` says so; cache kinds fp8
does not cover are refused.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from day0jax import models
from day0jax.core.errors import UnsupportedKVCache
from day0jax.engine.config import EngineConfig
from day0jax.engine.engine import Engine
from day0jax.engine.paged_cache import kv_cache_refusal
from day0jax.engine.requests import SamplingParams
from families import FAMILIES
from kernels_pallas.paged_attention import fp8
from kernels_pallas.paged_attention import reference as paged_ref
from sharding.mesh import make_mesh

CONTEXT = 128
PROMPT = [5, 17, 33, 9, 101, 64, 7, 250, 3, 88, 41, 12, 190, 77, 23, 54, 99, 140, 6, 31]


def test_quantize_round_trip_matches_numpy():
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(3, 5, 2, 64)) * np.array([1e-3, 1.0, 300.0])[:, None, None, None]).astype(np.float32)
    x[0, 0, 0] = 0.0  # an all-zero vector: scale 1, zero codes
    codes, scales = fp8.quantize(jnp.asarray(x))
    assert codes.dtype == jnp.float8_e4m3fn and scales.dtype == jnp.float32 and scales.shape == (3, 5, 2)
    peak = np.abs(x).max(-1)
    want_scales = np.where(peak > 0, peak * np.float32(1 / 448), 1.0).astype(np.float32)
    want_codes = (x / want_scales[..., None]).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(scales), want_scales)
    np.testing.assert_array_equal(np.asarray(codes).view(np.uint8), want_codes.view(np.uint8))
    back = np.asarray(fp8.dequantize(codes, scales))
    np.testing.assert_array_equal(back, want_codes.astype(np.float32) * want_scales[..., None])
    # e4m3's 3-bit mantissa: at most half a step (2^-4) of relative error per element above the subnormals
    big = np.abs(x) >= want_scales[..., None] * 2.0 ** -6
    assert np.all(np.abs(back - x)[big] <= np.abs(x)[big] * 2.0 ** -4 + 1e-30)


def test_paged_reference_reads_fp8_pages_as_their_dequantized_values():
    rng = np.random.default_rng(1)
    k, v = (rng.normal(size=(5, 4, 2, 32)).astype(np.float32) for _ in range(2))
    kq, vq = (fp8.QuantPages(*fp8.quantize(jnp.asarray(a))) for a in (k, v))
    q = jnp.asarray(rng.normal(size=(2, 1, 4, 32)).astype(np.float32))
    tables, lengths, positions = jnp.array([[1, 2], [3, 4]]), jnp.array([7, 5]), jnp.array([[6], [4]])
    got = paged_ref.paged_attention(q, kq, vq, tables, lengths, positions)
    want = paged_ref.paged_attention(q, kq[jnp.arange(5)], vq[jnp.arange(5)], tables, lengths, positions)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def tiny_module(name: str, abstract: bool = False):
    """The tiny family's model with random weights (`abstract`: shapes only, enough for layouts and plans)."""
    model_type, config, _ = FAMILIES[name]
    cfg = models.config_from_hf(dict(config, model_type=model_type))
    if abstract:
        return models.abstract_model(cfg)
    with nnx.use_eager_sharding(False):
        return models.family(model_type).model(cfg, rngs=nnx.Rngs(0))


def engine_for(module, kv_cache_dtype: str) -> Engine:
    # Few shapes (batch 1, chunk 32, one width) keep compilation short; page 8 spreads the prompt over pages.
    config = EngineConfig(page_size=8, max_num_seqs=1, kv_cache_tokens=1024, chunk_buckets=(32,), min_width=CONTEXT,
                          kv_cache_dtype=kv_cache_dtype)
    return Engine(module, make_mesh(None), jnp.float32, context_length=CONTEXT, config=config)


def decode_logits(engine: Engine, prompt: list[int], new_tokens: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and each step's logits as the engine's forward program returns them (prefill's last, then one
    per decode step)."""
    seen = []
    forward = engine.runner.forward

    def recording(batch, previous=None):
        logits, tokens = forward(batch, previous)
        seen.append(np.asarray(logits)[0])
        return logits, tokens

    engine.runner.forward = recording
    engine.add_request("r", prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    out = []
    while engine.has_work():
        out += [ev.token for ev in engine.step() if ev.token is not None]
    return out, seen


def relative_errors(want: list[np.ndarray], got: list[np.ndarray], want_tokens: list[int], tokens: list[int]):
    """max |a - b| / max |a| per step, over the steps fed the same tokens (all of them unless a near-tie flipped a
    greedy pick; the first always is)."""
    same = next((i for i, (a, b) in enumerate(zip(want_tokens, tokens)) if a != b), len(tokens)) + 1
    return [float(np.abs(a - b).max() / np.abs(a).max()) for a, b in zip(want[:same], got[:same])]


# e4m3 keeps 3 mantissa bits (a rounding error up to 1/16 of each element, 16 times bfloat16's), whatever the scale:
# the logits move by a few percent (seen, max over 8 steps: llama 2.7e-2, qwen3_moe 1.8e-2, gemma2 4.2e-2; with
# the pages rounded to bfloat16 instead: 1.2e-3 to 2.0e-3). deepseek_v3's latent is one head that every query head
# reads, and its grouped MoE routing flips on small changes: 1.1e-1 by the second step.
TOLERANCE = {"llama": 5e-2, "qwen3_moe": 5e-2, "gemma2": 6e-2, "deepseek_v3": 2e-1}


@pytest.mark.parametrize("name", sorted(TOLERANCE))
def test_fp8_cache_logits_stay_near_the_float_cache(name):
    module = tiny_module(name)
    plain, quant = engine_for(module, "auto"), engine_for(module, "fp8")
    pools = [p for layer in quant.runner.pools for p in layer]
    assert pools and all(isinstance(p, fp8.QuantPages) and p.codes.dtype == jnp.float8_e4m3fn for p in pools)
    if name == "gemma2":  # its sliding-window layers keep rings of their window, in fp8 too
        assert quant.layout.rings
    want_tokens, want = decode_logits(plain, PROMPT, 8)
    tokens, got = decode_logits(quant, PROMPT, 8)
    errors = relative_errors(want, got, want_tokens, tokens)
    assert 0 < max(errors) < TOLERANCE[name], errors  # above 0: the cache really is quantized


def test_smollm2_greedy_tokens_and_logits_near_the_float_cache(smollm2):
    import day0jax

    prompt = smollm2["prompts"][0]
    runs = {}
    for kind in ("auto", "fp8"):
        model = day0jax.load(smollm2["ckpt_gguf"], dtype="float32",
                             engine=EngineConfig(kv_cache_dtype=kind, max_num_seqs=1, max_model_len=256,
                                                 chunk_buckets=(32,)))
        runs[kind] = decode_logits(model.engine, prompt, 16)
        pages = model.runner.pools[0][0]
        assert isinstance(pages, fp8.QuantPages) == (kind == "fp8")
    (want_tokens, want), (tokens, got) = runs["auto"], runs["fp8"]
    assert tokens == want_tokens and len(tokens) == 16
    errors = relative_errors(want, got, want_tokens, tokens)
    # Seen: 5.7e-2 at the prompt's last token, 2.0e-2 to 4.1e-2 after (logits up to 31 in magnitude); a bfloat16
    # cache moves them by 1.5e-3 to 6.9e-3: e4m3 keeps 4 fewer mantissa bits, 16 times the rounding error.
    assert 0 < max(errors) < 8e-2, errors


def test_planner_counts_fp8_bytes():
    from day0jax.loader import EnginePlanInputs

    module = tiny_module("llama", abstract=True)
    plans = {}
    for kind in ("auto", "fp8"):
        inputs = EnginePlanInputs.of(module, module.config, EngineConfig(kv_cache_dtype=kind, max_model_len=128))
        plans[kind] = inputs.plan({"dp": 1, "tp": 1, "pp": 1, "ep": 1}, "bfloat16", None)
    auto, quant = plans["auto"], plans["fp8"]
    slots, layers, heads, dim = auto.kv_slots, 2, 2, 16
    assert auto.kv_cache_bytes == slots * layers * heads * 2 * dim * 2  # bfloat16 keys and values
    assert quant.kv_cache_bytes == slots * layers * heads * 2 * (dim + 4)  # a byte each, and a float32 scale
    assert (quant.kv_dtype, auto.kv_dtype) == ("float8_e4m3fn", "bfloat16")
    assert "float8_e4m3fn" in quant.summary()


@pytest.mark.parametrize("name, kind", [("deepseek_v32", "sparse-attention indexer keys"),
                                        ("deepseek_v4", "compressed attention")])
def test_fp8_refuses_cache_kinds_it_does_not_cover(name, kind, tmp_path):
    import json

    from day0jax import check as check_lib

    module = tiny_module(name, abstract=True)
    kv_cache_refusal(module.cache_layout(), name, "auto")  # the default takes every kind
    with pytest.raises(UnsupportedKVCache, match=kind) as e:
        kv_cache_refusal(module.cache_layout(), module.config.model_type, "fp8")
    assert e.value.family == FAMILIES[name][0] and kind in e.value.kind
    # `check` (and `load`, which plans through the same inputs) says so
    model_type, config, _ = FAMILIES[name]
    (tmp_path / "config.json").write_text(json.dumps(dict(config, model_type=model_type)))
    report = check_lib.check(tmp_path, engine=EngineConfig(kv_cache_dtype="fp8"), dtype="float32")
    assert not report.supported and any(kind in r and model_type in r for r in report.reasons), report.reasons


def test_check_reports_the_fp8_cache_from_the_flag(tmp_path):
    import argparse
    import json

    from day0jax import check as check_lib
    from day0jax import cli

    model_type, config, _ = FAMILIES["llama"]
    (tmp_path / "config.json").write_text(json.dumps(dict(config, model_type=model_type)))
    parser = argparse.ArgumentParser()
    cli.add_engine_arguments(parser)
    reports = {}
    for flags in ([], ["--kv-cache-dtype", "fp8"]):
        engine = cli.engine_config_from_args(parser.parse_args(["--max-model-len", "128"] + flags))
        reports[engine.kv_cache_dtype] = check_lib.check(tmp_path, engine=engine, dtype="bfloat16")
    auto, quant = reports["auto"].memory, reports["fp8"].memory
    assert reports["fp8"].supported and quant["kv_dtype"] == "float8_e4m3fn" and auto["kv_dtype"] == "bfloat16"
    assert quant["kv_cache_bytes"] * 32 == auto["kv_cache_bytes"] * 20  # (16 + 4 scale bytes) per 16 bfloat16s
    assert "KV cache dtype: float8_e4m3fn" in check_lib.render(reports["fp8"])
    assert "KV cache dtype: bfloat16" in check_lib.render(reports["auto"])
