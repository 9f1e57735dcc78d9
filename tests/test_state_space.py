"""Mamba2 hybrids in the engine (tiny, random): NemotronH (Mamba2, attention, MLP and MoE layers) and Falcon-H1
(Mamba2 and attention side by side in every layer, both caches kept): greedy tokens equal the cache-less forward
pass whatever the chunking, batching, preemption or reuse of a slot; the readiness report shows the Mamba2 layers
with their state per sequence and the memory plan counts the state slots and the KV pages the engine allocates.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest
from flax import nnx

from day0jax import check as check_lib, models
from day0jax.core.cache_layout import StateLayer
from day0jax.engine.config import EngineConfig
from day0jax.engine.engine import Engine
from families import FAMILIES
from sharding import plan as plan_lib
from sharding.mesh import make_mesh
from test_engine_paged import PROMPTS, cache_less_greedy, greedy, run

CONTEXT = 128


def hybrid_config(name: str) -> dict:
    _, config, _ = FAMILIES[name]
    return dict(config, model_type=FAMILIES[name][0], max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module", params=["nemotron_h", "falcon_h1"])
def hybrid(request):
    """(name, module, greedy continuations of the cache-less forward pass) of each hybrid."""
    cfg = models.config_from_hf(hybrid_config(request.param))
    with nnx.use_eager_sharding(False):
        module = models.family(cfg.model_type).model(cfg, rngs=nnx.Rngs(0))
    return request.param, module, cache_less_greedy(module)


def make_engine(module, **overrides) -> Engine:
    # Chunks of 8 and 32: the 41- and 71-token prompts take several chunks, each carrying the convolution's and the
    # scan's state to the next, with chunk boundaries of the scan (chunk_size 8) inside and between them.
    config = dict(page_size=8, max_num_seqs=4, kv_cache_tokens=512, chunk_buckets=(8, 32), min_width=CONTEXT)
    config.update(overrides)
    return Engine(module, make_mesh(None), jnp.float32, context_length=CONTEXT, config=EngineConfig(**config))


def test_state_follows_each_sequence_through_chunks_batches_and_preemption(hybrid):
    name, module, reference = hybrid
    engine = make_engine(module)
    assert not engine.config.prefix_caching
    # Staggered: requests join while others decode; slots of finished sequences are handed to later ones, whose
    # first chunk must start from zeros, not from what the slot held.
    out = run(engine, {f"r{i}": (p, greedy()) for i, p in enumerate(PROMPTS)}, stagger=3)
    for i, ref in enumerate(reference):
        assert out[(f"r{i}", 0)] == ref, f"{name} prompt {i}"
    assert sorted(engine.scheduler.free_slots) == [1, 2, 3, 4]
    if name == "falcon_h1":  # preempted sequences recompute both their state and their keys and values
        small = make_engine(module, kv_cache_tokens=96, max_model_len=96)
        out = run(small, {f"r{i}": (p, greedy()) for i, p in enumerate(PROMPTS)})
        assert small.scheduler.num_preemptions > 0
        for i, ref in enumerate(reference):
            assert out[(f"r{i}", 0)] == ref, f"{name} prompt {i} with preemption"


# Per sequence, a Mamba2 layer of N heads x H, G groups, state Z, width W keeps the convolution's last W - 1 inputs
# of x [N, H], B and C [G, Z] and the scan state [N, H, Z], float32.
def mamba_bytes(N, H, G, Z, W):
    return ((W - 1) * (N * H + 2 * G * Z) + N * H * Z) * 4


def test_plan_and_report_count_the_mamba2_state(tmp_path):
    """NemotronH: its Mamba2 layer keeps 5.25 KiB per sequence, its attention layer KV per token, its MLP and MoE
    layers nothing; Falcon-H1: each layer both. The plan counts what the engine allocates, split over tp like the
    heads; the readiness report names the Mamba2 layers with their state and their operators."""
    nemotron = mamba_bytes(8, 8, 2, 16, 4)
    falcon = mamba_bytes(4, 16, 2, 16, 4)
    for name, per_seq, layers, kv_per_token in (
            ("nemotron_h", nemotron, [
                {"kind": "mamba2", "layers": "0", "cache": f"state {nemotron / 1024:.2f} KiB per sequence"},
                {"kind": "MLP or MoE only (no token mixer)", "layers": "1,3", "cache": "none"},
                {"kind": "full attention", "layers": "2", "cache": "KV 256 B per token"}], 2 * 2 * 16 * 4),
            ("falcon_h1", falcon, [
                {"kind": "mamba2 + full attention", "layers": "0-1",
                 "cache": f"state {falcon / 1024:.2f} KiB per sequence, KV 256 B per token"}], 2 * 2 * 2 * 16 * 4)):
        cfg = models.config_from_hf(hybrid_config(name))
        with nnx.use_eager_sharding(False):
            module = models.family(cfg.model_type).model(cfg, rngs=nnx.Rngs(0))
        states = [x for x in module.cache_layout() if isinstance(x, StateLayer)]
        assert [x.bytes_per_sequence for x in states] == [per_seq] * len(states)
        engine = make_engine(module)
        shape = plan_lib.ModelShape.from_model(module, models.param_infos(module), CONTEXT)
        planned = plan_lib.plan(shape, "tp=1", engine.layout.workload(), dtype="float32")
        assert planned.state_slots == engine.layout.state_slots == 5
        assert planned.state_bytes == engine.runner.state_bytes == len(states) * 5 * per_seq
        assert planned.kv_cache_bytes == engine.runner.pool_bytes == engine.layout.num_pages * 8 * kv_per_token
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(hybrid_config(name)))
        report = check_lib.check(folder, dtype="float32")
        assert report.supported, report.reasons
        assert report.layers == layers
        ops = {r["op"]: r["variant"] for r in report.ops}
        assert ops["Mamba2 SSD (state-space scan)"].startswith(f"Mamba2 SSD {cfg.mamba_shape[0]} heads x")
        assert report.memory["state_bytes"] == report.memory["state_slots"] * len(states) * per_seq
        # tp=2 splits the heads (and the two groups): half the state per device.
        split = check_lib.check(folder, mesh="tp=2", dtype="float32").memory
        assert split["state_bytes"] == split["state_slots"] * len(states) * per_seq // 2
