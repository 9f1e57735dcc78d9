"""Pipeline parallelism without devices: the `pp` axis in mesh specs, the split of layers into stages, where each
parameter lives, and the memory plan per stage. Runs on stages of simulated devices (one process and two) are in
tests/test_sharding_multidevice.py."""

import itertools
import json
import math
import random

import pytest

from day0jax import check as check_lib
from day0jax.core.errors import MeshError
from sharding import mesh as mesh_lib
from sharding.pipeline import Stages, balanced_ranges, layer_index, plan_stages
from test_sharding import abstract_infos, sharding_config


def test_pp_in_mesh_specs():
    assert mesh_lib.parse_spec("pp=2,tp=4") == {"pp": 2, "dp": 1, "ep": 1, "tp": 4}
    assert mesh_lib.format_spec({"pp": 4, "dp": 2, "ep": 1, "tp": 1}) == "pp=4,dp=2"
    assert mesh_lib.mesh_sizes("pp=2,ep=2,tp=2")["pp"] == 2
    with pytest.raises(MeshError, match="pp \\(pipeline parallel"):
        mesh_lib.parse_spec("qp=2")
    # Stages are the outermost axis: a pipeline over two hosts crosses between stages, tp stays inside.
    assert mesh_lib.crossing({"pp": 2, "dp": 1, "ep": 1, "tp": 4}, 4) == {
        "pp": True, "dp": False, "ep": False, "tp": False}


def _brute_force(costs, pp, first, last):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), pp - 1):
        bounds = (0,) + cuts + (n,)
        worst = max(sum(costs[bounds[s]:bounds[s + 1]]) + (first if s == 0 else 0) + (last if s == pp - 1 else 0)
                    for s in range(pp))
        best = worst if best is None else min(best, worst)
    return best


def test_balanced_ranges_are_contiguous_and_minimize_the_fullest_stage():
    assert balanced_ranges([1] * 8, 2) == (range(0, 4), range(4, 8))
    assert balanced_ranges([1] * 8, 4) == (range(0, 2), range(2, 4), range(4, 6), range(6, 8))
    # Extra bytes on the first stage weigh 3 layers: it takes fewer layers.
    assert balanced_ranges([1] * 8, 2, first=3) == (range(0, 2), range(2, 8))
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        pp = rng.randint(1, n)
        costs = [rng.randint(1, 20) for _ in range(n)]
        first, last = rng.randint(0, 30), rng.randint(0, 30)
        ranges = balanced_ranges(costs, pp, first, last)
        assert [i for r in ranges for i in r] == list(range(n)) and all(len(r) for r in ranges)
        worst = max(sum(costs[i] for i in r) + (first if s == 0 else 0) + (last if s == pp - 1 else 0)
                    for s, r in enumerate(ranges))
        assert worst == _brute_force(costs, pp, first, last), (costs, pp, first, last, ranges)
    with pytest.raises(ValueError, match="at least as many layers"):
        balanced_ranges([1, 1], 3)


def test_stages_balance_what_a_decode_step_reads():
    """The vocabulary projection weighs on the last stage; the embedding table, of which a step reads one row per
    token, does not weigh on the first (its memory is planned, not balanced): 8 equal layers, a table of 2 layers'
    bytes, untied then tied. Counting the table on the first stage too would split them 4 | 4."""
    from types import SimpleNamespace

    def info(path, rows):
        return SimpleNamespace(path=path, shape=(rows, 4), axes=(None, None))

    layers = [info(f"model.layers.{i}.mlp.kernel", 1) for i in range(8)]
    untied = layers + [info("model.embed_tokens.weight", 2), info("lm_head.kernel", 2)]
    stages = plan_stages(untied, [0] * 8, 2, {"dp": 1, "ep": 1, "tp": 1}, lambda p: 1)
    assert stages.ranges == (range(0, 5), range(5, 8)) and not stages.tied  # 5 layers | 3 layers + projection
    tied = plan_stages(layers + [info("model.embed_tokens.weight", 2)], [0] * 8, 2, {"dp": 1, "ep": 1, "tp": 1},
                       lambda p: 1)
    assert tied.ranges == (range(0, 5), range(5, 8)) and tied.tied


def test_each_parameter_is_held_by_the_stages_that_use_it():
    stages = Stages((range(0, 2), range(2, 4), range(4, 6)), tied=True)
    assert layer_index("model.layers.13.mlp.up_proj.kernel") == 13 and layer_index("lm_head.kernel") is None
    assert stages.holders("model.layers.3.self_attn.q_proj.kernel") == (1,)
    assert stages.holders("model.embed_tokens.weight") == (0, 2)  # the tied vocabulary projection reads them too
    assert stages.holders("model.norm.weight") == (2,)
    assert stages.holders("model.rope.scale") == (0, 1, 2)  # anything else: every stage
    untied = Stages(stages.ranges, tied=False)
    assert untied.holders("model.embed_tokens.weight") == (0,) and untied.holders("lm_head.kernel") == (2,)
    assert stages.describe() == "0-1 | 2-3 | 4-5"


def _config_dir(hf: dict, where) -> str:
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.json").write_text(json.dumps(hf))
    return str(where)


def test_memory_plan_per_stage(tmp_path):
    """Each device holds its stage's layers (and KV pages), split over the stage's tp: the fullest stage is
    planned. A 4-layer llama on pp=2 holds 2 layers per device; pp=2,tp=2 halves those again."""
    hf = dict(sharding_config("llama"), num_hidden_layers=4)
    path = _config_dir(hf, tmp_path)
    one = check_lib.check(path, mesh="dp=1").memory
    two = check_lib.check(path, mesh="pp=2").memory
    both = check_lib.check(path, mesh="pp=2,tp=2").memory
    assert two["stages"] == ((0, 2), (2, 4)) and "layers per stage 0-1 | 2-3" in two["summary"]
    assert two["kv_cache_bytes"] * 2 == one["kv_cache_bytes"]
    _, infos = abstract_infos(hf)
    nbytes = {i.path: 4 * math.prod(i.shape) for i in infos}  # float32
    layers = [sum(n for p, n in nbytes.items() if p.startswith(f"model.layers.{k}.")) for k in range(4)]
    first = layers[0] + layers[1] + nbytes["model.embed_tokens.weight"]
    last = layers[2] + layers[3] + nbytes["model.norm.weight"]
    assert two["params_bytes"] == max(first, last + nbytes["lm_head.kernel"])
    # Tied embeddings: the first stage (lookup) and the last (vocabulary projection) both hold them.
    tied = check_lib.check(_config_dir(dict(hf, tie_word_embeddings=True), tmp_path / "tied"), mesh="pp=2").memory
    assert tied["params_bytes"] == max(first, last + nbytes["model.embed_tokens.weight"])
    assert both["kv_cache_bytes"] * 2 == two["kv_cache_bytes"]
    assert both["params_bytes"] < two["params_bytes"]


def test_pipeline_refusals_name_what_is_missing(tmp_path):
    report = check_lib.check(_config_dir(sharding_config("llama"), tmp_path / "llama"), mesh="pp=4")  # 2 layers
    assert not report.supported
    assert any("pp=4 is more pipeline stages than the model's 2 decoder layers" in r for r in report.reasons)
    carried = check_lib.check(_config_dir(sharding_config("gemma4_text"), tmp_path / "gemma4"), mesh="pp=2")
    assert any("hand each other a carry" in r and "use tp, ep and dp" in r for r in carried.reasons), \
        carried.reasons


def test_auto_mesh_considers_pipeline_stages():
    """Without a memory test or when a single-stage mesh fits, no stages; when tp alone would cross hosts, the
    same group of devices as stages with tp inside each host comes first."""
    _, dense = abstract_infos(dict(sharding_config("llama"), num_hidden_layers=4))
    assert mesh_lib.auto_sizes(8, dense)["pp"] == 1
    assert mesh_lib.auto_sizes(8, dense, fits=lambda s: True)["pp"] == 1
    needs_8 = lambda s: s["pp"] * s["tp"] >= 8  # noqa: E731
    assert mesh_lib.auto_sizes(8, dense, fits=needs_8) == {"pp": 1, "dp": 1, "ep": 1, "tp": 8}
    assert mesh_lib.auto_sizes(8, dense, fits=needs_8, devices_per_host=4) == {"pp": 2, "dp": 1, "ep": 1, "tp": 4}
