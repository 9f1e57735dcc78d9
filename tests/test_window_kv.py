"""Sliding-window layers keep only their window in the KV pool (`EngineConfig.window_kv`, on by default): a ring of
pages per sequence that positions wrap around (engine/paged_cache.py).

Generations that wrap the ring several times give the tokens (greedy and sampled) of the engine keeping every page,
for a model whose layers all slide (Mistral) and one that alternates sliding and full layers (Gemma 2); a ring one
page too small gives other tokens. The planner counts the rings, so an all-sliding model's cache stops growing with
the context.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import day0jax
from day0jax import check as check_lib
from day0jax.engine.config import EngineConfig, EngineLayout
from day0jax.engine.paged_cache import ring_table
from test_sharding import sharding_config, synthetic_checkpoint

WINDOW = 24
# One 32-token chunk at most: a ring of ceil((24 + 32) / 16) + 1 = 5 pages (80 positions) per sequence.
ENGINE = dict(max_model_len=256, chunk_buckets=(32,), page_size=16)
NEW = 100  # the longest prompt (70 tokens) ends at position 170: the ring wraps twice
PROMPTS = [np.random.default_rng(n).integers(3, 250, n).tolist() for n in (5, 40, 70)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("window")
    return {mt: synthetic_checkpoint(dict(sharding_config(mt), sliding_window=WINDOW, max_position_embeddings=512),
                                     root / mt) for mt in ("mistral", "gemma2")}


def _generate(ckpt, window_kv: bool):
    model = day0jax.load(ckpt, engine=EngineConfig(window_kv=window_kv, **ENGINE))
    engine = model.engine
    out = {"greedy": model.generate(PROMPTS, NEW, ignore_eos=True),
           "sampled": model.generate(PROMPTS, NEW, ignore_eos=True, temperature=0.7, top_p=0.95, seed=3),
           "rings": engine.layout.rings, "pool_bytes": engine.runner.pool_bytes,
           "planned": model.memory_plan.kv_cache_bytes, "prefix_caching": engine.config.prefix_caching,
           "num_pages": engine.layout.num_pages}
    return out


@pytest.mark.parametrize("model_type", ["mistral", "gemma2"])
def test_window_pages_give_the_tokens_of_every_page(checkpoints, model_type):
    every = _generate(checkpoints[model_type], window_kv=False)
    ring = _generate(checkpoints[model_type], window_kv=True)
    assert every["rings"] == () and ring["rings"] == ((WINDOW, 5),)
    assert ring["greedy"] == every["greedy"] and ring["sampled"] == every["sampled"]
    assert all(len(t) == NEW for t in ring["greedy"])
    # What the planner counted is what was allocated: sliding layers hold 5 pages per sequence slot (16 and the
    # trash slot) in place of the shared pool's pages.
    assert ring["planned"] == ring["pool_bytes"] and every["planned"] == every["pool_bytes"]
    layers = sharding_config(model_type)["num_hidden_layers"]
    sliding = layers if model_type == "mistral" else layers // 2  # Gemma 2 alternates, sliding first
    per_page = every["pool_bytes"] // (layers * every["num_pages"])
    assert ring["pool_bytes"] == per_page * ((layers - sliding) * every["num_pages"] + sliding * 17 * 5)
    assert ring["prefix_caching"] is False and every["prefix_caching"] is True


def test_a_ring_too_small_changes_the_tokens(checkpoints, monkeypatch):
    """The ring must hold the window and a chunk: one of 2 pages (32 positions) loses keys a query sees, and the
    tokens change (so the test above can fail)."""
    every = _generate(checkpoints["mistral"], window_kv=False)
    monkeypatch.setattr(EngineLayout, "ring_pages", lambda self, window: 2 if window else 0)
    small = day0jax.load(checkpoints["mistral"], engine=EngineConfig(**ENGINE))
    assert small.generate(PROMPTS, NEW, ignore_eos=True) != every["greedy"]


def test_ring_table_wraps_each_slot_around_its_pages():
    table = np.asarray(ring_table(np.array([0, 2], np.int32), 3, 7))
    assert table.tolist() == [[0, 1, 2, 0, 1, 2, 0], [6, 7, 8, 6, 7, 8, 6]]


def test_an_all_sliding_models_cache_stops_growing_with_the_context(tmp_path):
    """Mistral-7B's shape (32 layers, 8 kv heads of 128, window 4096) with a 128k context: 4 sequences at a 32k
    and at a 128k max_model_len plan the same KV cache, the rings' (window + the largest chunk per sequence);
    keeping every page, it grows with the context. Where the rings would not be smaller (an 8k pool), none."""
    hf = dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
              sliding_window=4096, rms_norm_eps=1e-5)
    (tmp_path / "config.json").write_text(json.dumps(hf))

    def kv(max_len, window_kv=True):
        engine = EngineConfig(max_model_len=max_len, max_num_seqs=4, window_kv=window_kv)
        return check_lib.check(tmp_path, engine=engine, dtype="bfloat16").memory["kv_cache_bytes"]

    # 5 sequence slots (4 and the trash slot) of ceil((4096 + 256) / 16) + 1 = 273 pages, 32 layers, k and v.
    ring = 5 * 273 * 16 * 32 * 2 * 8 * 128 * 2
    assert kv(32768) == kv(131072) == ring
    assert kv(131072, window_kv=False) / kv(32768, window_kv=False) == pytest.approx(4, rel=0.01)
    assert kv(32768, window_kv=False) > 1.4 * ring
    assert kv(8192) == kv(8192, window_kv=False) < ring  # the shared pool is the smaller: no rings
