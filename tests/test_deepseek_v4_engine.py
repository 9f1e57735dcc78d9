"""DeepSeek-V4 through the engine: a sequence's compressed entries and its buffer of projections not yet pooled follow
it through prefill chunks that end inside windows, decode steps and batches, and the greedy tokens are
those of the cache-less forward pass; the plan counts what the engine allocates and the report names each layer's
window and entries. The layer kinds and the entries' sizes: tests/test_deepseek_v4_ops.py's CONFIG.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from day0jax import check as check_lib, models
from day0jax.engine.config import EngineConfig
from day0jax.engine.engine import Engine
from sharding import plan as plan_lib
from sharding.mesh import make_mesh
from test_deepseek_v4_ops import CONFIG
from test_engine_paged import cache_less_greedy, greedy, run

CONTEXT = 64
HF = dict(CONFIG, model_type="deepseek_v4", vocab_size=256, max_position_embeddings=CONTEXT)
# 41 tokens: chunks of 6 end inside windows of 4 and 8 (and a buffer of two HCA windows' positions is crossed).
PROMPTS = [[1, 17, 42, 5, 99], [1] + [(7 * i + 3) % 250 + 3 for i in range(40)], [9], [4] * 23]
NEW = 12


@pytest.fixture(scope="module")
def module():
    """The model with random weights and a random token -> experts table (zeros, its initial value, would send
    every token to expert 0 twice)."""
    cfg = models.config_from_hf(HF)
    with nnx.use_eager_sharding(False):
        model = models.family("deepseek_v4").model(cfg, rngs=nnx.Rngs(0))
    table = model.model.layers[0].mlp.gate.tid2eid
    rng = np.random.default_rng(0)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    table[...] = jnp.asarray(np.stack([rng.permutation(E)[:k] for _ in range(table.shape[0])]), jnp.int32)
    return model


def make_engine(module) -> Engine:
    # 4-token pages: the CSA layer keeps one entry per page, the HCA layer one per two pages. Chunks of 6 end inside
    # the 4- and 8-token windows, so windows close across chunk boundaries. Few shapes (batch 1/2, one chunk, one
    # width) keep compilation short; staggered requests join while others decode, slots of finished sequences go
    # to later ones.
    config = dict(page_size=4, max_num_seqs=2, kv_cache_tokens=256, max_model_len=CONTEXT, chunk_buckets=(6,),
                  min_width=CONTEXT)
    return Engine(module, make_mesh(None), jnp.float32, context_length=CONTEXT, config=EngineConfig(**config))


def test_entries_follow_each_sequence_through_chunks_and_batches(module):
    engine = make_engine(module)
    assert not engine.config.prefix_caching  # a cached page cannot restore the buffer of projections
    out = run(engine, {f"r{i}": (p, greedy(NEW)) for i, p in enumerate(PROMPTS)}, stagger=2)
    reference = cache_less_greedy(module, PROMPTS, NEW, CONTEXT)
    for i, ref in enumerate(reference):
        assert out[(f"r{i}", 0)] == ref, f"prompt {i}"


def test_plan_and_report_count_the_window_and_the_entries(module, tmp_path):
    """Per sequence, the CSA layer buffers 8 tokens' projections of its compressor (2 x 32 numbers: kv and gate of
    both halves) and of its indexer (2 x 16), the HCA layer 8 of its compressor's (2 x 16); per token every layer
    keeps one 16-dim key; per entry, the CSA layer 16 + 8 index numbers per 4 positions, the HCA layer 16 per 8,
    in pools numbered as the page pool (one entry per 4-token page; the HCA layer's, one per two pages, fill half
    of theirs)."""
    engine = make_engine(module)
    shape = plan_lib.ModelShape.from_model(module, models.param_infos(module), CONTEXT)
    planned = plan_lib.plan(shape, "tp=1", engine.layout.workload(), dtype="float32")
    slots = engine.layout.state_slots
    assert planned.state_bytes == engine.runner.state_bytes == slots * (8 * (64 + 32) + 8 * 32) * 4
    assert planned.kv_cache_bytes == engine.runner.pool_bytes
    pages = engine.layout.num_pages
    entries = pages * (16 + 8) * 4 + pages * 16 * 4
    assert engine.runner.pool_bytes - entries == sum(x.nbytes for p, n in zip(engine.runner.pools,
                                                                             engine.runner.stateful)
                                                     for x in p[n:n + 2])  # the windows' keys
    (tmp_path / "config.json").write_text(json.dumps(HF))
    report = check_lib.check(tmp_path, dtype="float32")
    assert report.supported, report.reasons
    assert report.layers == [
        {"kind": "sliding attention (window 6)", "layers": "0", "cache": "KV 64 B per token"},
        {"kind": "compressed sparse attention + sliding attention (window 6)", "layers": "1",
         "cache": "state 3.00 KiB per sequence, KV 64 B per token, entry 64 B + index key 32 B per 4 positions"},
        {"kind": "heavily compressed attention + sliding attention (window 6)", "layers": "2",
         "cache": "state 1.00 KiB per sequence, KV 64 B per token, entry 64 B per 8 positions"}]
