"""The engine's per-sequence state for LFM's short-convolution layers (tiny, random LFM2 and LFM3 models): greedy
tokens equal the cache-less forward pass whatever the chunking, batching or preemption, and the plan counts the
state the engine allocates. transformers parity is in test_models.py; these reach past its single-chunk prompts.
"""

from __future__ import annotations

import pytest
from flax import nnx

from day0jax import models
from sharding import plan as plan_lib
from test_engine_paged import PROMPTS, cache_less_greedy, greedy, run
from test_linear_attention import CONTEXT, make_engine  # the same chunking, across the state's chunks
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=CONTEXT)
CONFIGS = {
    "lfm2": dict(TINY, model_type="lfm2", num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                 conv_bias=True),
    # A convolution of width 10, wider than the 8-token chunks (its state reaches back across two), and a window.
    "lfm3": dict(TINY, model_type="lfm3", num_hidden_layers=3, head_dim=16, conv_L_cache=10, sliding_window=8,
                 layer_types=["conv", "sliding_attention", "conv"]),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def module(request):
    cfg = models.config_from_hf(CONFIGS[request.param])
    with nnx.use_eager_sharding(False):
        return models.family(cfg.model_type).model(cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def reference(module):
    return cache_less_greedy(module)


def test_state_follows_each_sequence_through_chunks_and_batches(module, reference):
    engine = make_engine(module)
    assert not engine.config.prefix_caching  # a sequence's state cannot be rebuilt from shared pages
    out = run(engine, {f"r{i}": (p, greedy()) for i, p in enumerate(PROMPTS)}, stagger=3)
    for i, ref in enumerate(reference):
        assert out[(f"r{i}", 0)] == ref, f"prompt {i}"
    # The slots of finished sequences serve new ones from a zero state.
    again = run(engine, {"again": (PROMPTS[3], greedy())})
    assert again[("again", 0)] == reference[3]


def test_preempted_sequences_recompute_their_state(module, reference):
    small = make_engine(module, kv_cache_tokens=96, max_model_len=96)
    out = run(small, {f"r{i}": (p, greedy()) for i, p in enumerate(PROMPTS)})
    assert small.scheduler.num_preemptions > 0
    for i, ref in enumerate(reference):
        assert out[(f"r{i}", 0)] == ref, f"prompt {i}"


def test_plan_counts_the_state_slots_the_engine_allocates(module):
    engine = make_engine(module)
    c = module.config
    per_seq = (c.conv_L_cache - 1) * c.hidden_size * 4  # the last W - 1 inputs of D channels, float32
    shape = plan_lib.ModelShape.from_model(module, models.param_infos(module), CONTEXT)
    assert [(layer.kind, layer.bytes_per_sequence) for layer in shape.state_layers] == [
        ("short convolution", per_seq)] * 2
    planned = plan_lib.plan(shape, "tp=1", engine.layout.workload(), dtype="float32")
    assert planned.state_bytes == engine.runner.state_bytes == 2 * engine.layout.state_slots * per_seq
