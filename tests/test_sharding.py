"""sharding/ in one process on its one device (the CPU in CI, or one GPU): mesh specs and their refusals, the rules
table, golden sharding files, the memory planner (against XLA:CPU's own figures) and refusals before any weight is
read, multi-host flags.

The tests that need 8 devices run in subprocesses: tests/test_sharding_multidevice.py.

Golden files (tests/golden_sharding/<model_type>.json): every family's parameter path -> PartitionSpec table on a
few meshes, so a change of sharding shows up in review. After an intended change, regenerate them with
    .venv/bin/python tests/test_sharding.py --update-golden
"""

from __future__ import annotations

import gc
import json
import math
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from day0jax import models
from day0jax.core.cache_layout import KVLayer, StateLayer
from day0jax.core.errors import GenerationError, MeshError, OutOfMemoryPlan
from sharding import distributed, mesh as mesh_lib, plan as plan_lib, rules

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden_sharding"
MESHES = ["tp=2,dp=4", "tp=2,ep=4", "tp=2,ep=2,dp=2", "tp=8"]  # tp inside, combined with dp, ep or both

sys.path.insert(0, str(ROOT / "tests"))
from families import FAMILIES as TEST_FAMILIES, MULTIMODAL  # noqa: E402

# Sharding test configs: each family's first config in tests/families.py with 8 query heads, so every mesh above
# (tp up to 8) is valid. Per family, further overrides (more experts, so ep=4 leaves two per rank).
OVERRIDES = {
    "deepseek_v2": dict(num_key_value_heads=8),
    "deepseek_v3": dict(num_key_value_heads=8),
    "deepseek_v32": dict(num_key_value_heads=8),
    "deepseek_v4": dict(o_groups=8),  # the grouped output projection splits by group, like the heads
    "glm_moe_dsa": dict(num_key_value_heads=8),
    "mistral4": dict(num_key_value_heads=8),
    "mistral_large4_text": dict(num_key_value_heads=8),
    "qwen3_moe": dict(num_experts=8),
    # Linear-attention heads divisible by tp=8 too, so that their state splits on every mesh.
    "qwen3_5_moe_text": dict(num_experts=8, linear_num_key_heads=8, linear_num_value_heads=8),
    "kimi_linear": dict(num_key_value_heads=8, linear_num_heads=8),
    "glm5_next_text": dict(num_key_value_heads=8, linear_num_heads=8),
    # Its own query heads per layer, each a multiple of 8 too.
    "laguna": dict(num_attention_heads_per_layer=[8, 16, 8]),
    "step3p7": dict(num_sliding_attention_heads=16),
}
# Vision towers with 8 heads too, so that tp=8 splits them (their MLPs, 64 wide, split as well).
VISION_OVERRIDES = {"kimi_k25": dict(num_attention_heads=8), "mistral3": dict(num_attention_heads=8)}
# The families the 8-device tests load and compare on every mesh: a dense, an MoE, an MLA, a hybrid
# linear-attention, a sparse-attention and a Mamba2 hybrid model, vision-language ones (towers of one and of
# any image size), and two hyper-connected ones (compressed attention; pooled sparse MLA beside linear attention).
# Adding a family is adding its model_type here.
MULTI_DEVICE_FAMILIES = ["llama", "qwen3_moe", "deepseek_v3", "qwen3_5_moe_text", "deepseek_v32", "gemma4_text",
                         "gemma3", "qwen3_vl", "nemotron_h", "kimi_k25", "mistral3", "deepseek_v4", "glm5_next_text"]
# One model_type per family module (a family may implement several: a multimodal one and its text model).
FAMILY_TYPES = sorted({models.family(mt).model_types[0] for mt in models.FAMILIES})


def sharding_config(model_type: str) -> dict:
    """The HF config.json dict the sharding tests use for `model_type`.

    Raises:
        KeyError: tests/families.py has no config of that model_type (every family must have one).
    """
    for mt, config, _ in TEST_FAMILIES.values():
        if mt == model_type and "text_config" in config:  # a multimodal checkpoint read as its language model
            text = dict(config["text_config"], num_attention_heads=8, **OVERRIDES.get(model_type, {}))
            return dict(config, model_type=model_type, text_config=text)
        if mt == model_type:
            return dict(config, model_type=model_type, num_attention_heads=8, **OVERRIDES.get(model_type, {}))
    for case in MULTIMODAL.values():  # a vision-language family: its language model gets the 8 heads
        if case.model_type == model_type:
            return dict(case.config, model_type=model_type,
                        text_config=dict(case.config["text_config"], num_attention_heads=8,
                                         **OVERRIDES.get(case.config["text_config"]["model_type"], {})),
                        vision_config=dict(case.config["vision_config"], **VISION_OVERRIDES.get(model_type, {})))
        if case.config["text_config"]["model_type"] == model_type:  # a text model only multimodal ones test
            return dict(case.config["text_config"], num_attention_heads=8)
    for mt, config, _ in TEST_FAMILIES.values():  # a text model the tests build from its multimodal checkpoint
        if "text_config" in config and models.family(mt).model_types[0] == model_type:
            return dict(config["text_config"], model_type=model_type, num_attention_heads=8,
                        **OVERRIDES.get(model_type, {}))
    raise KeyError(f"tests/families.py has no config for model_type {model_type!r}")


def abstract_infos(hf: dict):
    config = models.config_from_hf(hf)
    module = models.abstract_model(config)
    return module, models.param_infos(module)


def synthetic_checkpoint(hf: dict, dst: Path, seed: int = 0, processor: dict | None = None) -> Path:
    """A day0jax checkpoint with random weights for `hf` (no tokenizer), written with the converter's writer; with
    `processor`, a vision-language model's preprocessor_config.json.

    Kernels are scaled by 1/sqrt(fan-in) and norm weights and scales sit near 1, so activations stay O(1) through
    the layers and logits are not dominated by rounding.
    """
    from convert.writer import CheckpointWriter

    config = models.config_from_hf(hf)
    rng = np.random.default_rng(seed)
    with CheckpointWriter(Path(dst), force=True) as writer:
        for info in models.param_infos(models.abstract_model(config)):
            shape = info.shape
            noise = rng.standard_normal(shape, dtype=np.float32)
            if "in_ndim" in info.metadata:
                array = noise / np.sqrt(math.prod(shape[len(shape) - info.metadata["in_ndim"]:]))
            elif len(shape) == 1 and ("norm" in info.path or "scal" in info.path.rsplit(".", 1)[-1]):
                array = 1 + 0.1 * noise  # norms, and multiplicative scales (Gemma 4's layer_scalar)
            elif len(shape) == 1:
                array = 0.1 * noise
            else:
                array = noise / np.sqrt(shape[-1])
            writer.add(info.path, array.astype(np.float32))
        writer.write_json("config.json", hf)
        if processor is not None:
            writer.write_json("preprocessor_config.json", processor)
        writer.commit({"model_type": config.model_type, "dtype": "float32", "source": {"kind": "synthetic"}})
    return Path(dst)


# --- mesh specs ----------------------------------------------------------------------------------------------

def test_parse_spec_sizes_and_defaults():
    assert mesh_lib.parse_spec("dp=2,tp=4") == {"pp": 1, "dp": 2, "ep": 1, "tp": 4}
    assert mesh_lib.parse_spec(" tp = 2 , ep=2 ") == {"pp": 1, "dp": 1, "ep": 2, "tp": 2}
    assert mesh_lib.parse_spec(None) == {"pp": 1, "dp": 1, "ep": 1, "tp": 1}
    assert mesh_lib.format_spec({"dp": 2, "ep": 1, "tp": 4}) == "dp=2,tp=4"


@pytest.mark.parametrize("spec, words", [
    ("xp=2", ["'xp=2'", "dp (data parallel", "tp (tensor parallel", "Example: 'dp=2,tp=4'"]),
    ("tp=2,tp=4", ["given twice"]),
    ("tp=0", ["positive integer", "'0'"]),
    ("tp", ["is not AXIS=SIZE"]),
])
def test_parse_spec_refusals_say_what_would_work(spec, words):
    with pytest.raises(MeshError) as e:
        mesh_lib.parse_spec(spec)
    for w in words:
        assert w in str(e.value), str(e.value)


class FakeDevice:
    """Enough of a jax Device for make_mesh's checks, which refuse before any Mesh is built."""

    def __init__(self, i, process=0):
        self.id, self.process_index, self.platform = i, process, "cpu"


def test_make_mesh_refuses_a_product_that_does_not_match_the_devices():
    _, infos = abstract_infos(sharding_config("llama"))
    eight = [FakeDevice(i) for i in range(8)]
    with pytest.raises(MeshError) as e:
        mesh_lib.make_mesh("tp=16", eight, infos=infos)
    msg = str(e.value)
    assert "needs 16 devices but only 8" in msg and "tp=8" in msg and "dp=2,tp=4" in msg, msg
    # An explicit device list is used whole: a smaller product is refused too.
    with pytest.raises(MeshError) as e:
        mesh_lib.make_mesh("tp=4", eight, infos=infos)
    assert "must equal 8" in str(e.value) and "tp=8" in str(e.value)
    # Several processes: the mesh must span every process's devices.
    two_hosts = [FakeDevice(i, process=i // 4) for i in range(8)]
    with pytest.raises(MeshError, match="all 8 devices of the"):
        mesh_lib.make_mesh("tp=4", two_hosts, infos=infos)


def test_make_mesh_on_the_visible_devices():
    # One process: the spec takes the first dp*ep*tp visible devices; more than visible is refused.
    mesh = mesh_lib.make_mesh("dp=1")
    assert dict(mesh.shape) == {"dp": 1, "ep": 1, "tp": 1} and mesh.axis_names == ("dp", "ep", "tp")
    with pytest.raises(MeshError, match=f"only {len(jax.devices())} {jax.devices()[0].platform} device"):
        mesh_lib.make_mesh(f"tp={len(jax.devices()) + 1}")


def test_heads_and_experts_must_divide():
    _, dense = abstract_infos(sharding_config("llama"))
    with pytest.raises(MeshError) as e:
        mesh_lib.make_mesh("tp=3", [FakeDevice(i) for i in range(3)], infos=dense)
    msg = str(e.value)
    assert "tp=3 does not divide the 8 attention heads" in msg and "tp must be one of 1, 2, 4, 8" in msg, msg
    assert "dp=3" in msg  # what would work on these 3 devices
    _, moe = abstract_infos(sharding_config("qwen3_moe"))
    assert mesh_lib.problems({"dp": 1, "ep": 4, "tp": 2}, moe) == []
    bad = mesh_lib.problems({"dp": 1, "ep": 3, "tp": 1}, moe)
    assert len(bad) == 1 and "ep=3 does not divide the 8 experts" in bad[0], bad
    # In a dense model ep only splits the batch: allowed, but never proposed (dp does the same).
    assert mesh_lib.problems({"dp": 1, "ep": 4, "tp": 2}, dense) == []
    assert all(s["ep"] == 1 for s in mesh_lib.valid_sizes(8, dense))
    assert {"pp": 1, "dp": 1, "ep": 4, "tp": 2} in mesh_lib.valid_sizes(8, moe)


def test_auto_mesh():
    _, dense = abstract_infos(sharding_config("llama"))
    assert mesh_lib.auto_sizes(8, dense) == {"pp": 1, "dp": 1, "ep": 1, "tp": 8}  # no memory test: most memory-frugal
    # With a memory test: the smallest model-parallel group that fits, the other devices data parallel.
    assert mesh_lib.auto_sizes(8, dense, fits=lambda s: s["tp"] >= 2) == {"pp": 1, "dp": 4, "ep": 1, "tp": 2}
    assert mesh_lib.auto_sizes(8, dense, fits=lambda s: True) == {"pp": 1, "dp": 8, "ep": 1, "tp": 1}


def test_auto_mesh_keeps_tp_inside_a_host():
    """Among the meshes that fit with the same model-parallel group, one host's devices take tp; ep crosses."""
    _, moe = abstract_infos(sharding_config("qwen3_moe"))
    needs_8 = lambda s: s["tp"] * s["ep"] >= 8  # noqa: E731
    assert mesh_lib.auto_sizes(8, moe, fits=needs_8) == {"pp": 1, "dp": 1, "ep": 1, "tp": 8}  # one host: the most tp
    assert mesh_lib.auto_sizes(8, moe, fits=needs_8, devices_per_host=4) == {"pp": 1, "dp": 1, "ep": 2, "tp": 4}
    assert mesh_lib.crossing({"dp": 1, "ep": 2, "tp": 4}, 4) == {"pp": False, "dp": False, "ep": True, "tp": False}
    # Devices of two processes, listed interleaved, are numbered host by host.
    mixed = [FakeDevice(i, process=i % 2) for i in range(8)]
    ordered, per_host = mesh_lib.host_ordered(mixed)
    assert [d.process_index for d in ordered] == [0] * 4 + [1] * 4 and per_host == 4
    assert mesh_lib.host_ordered(mixed[:1]) == (mixed[:1], None)


# --- rules ---------------------------------------------------------------------------------------------------

def test_rules_split_heads_mlp_vocab_experts_and_batch():
    P = jax.sharding.PartitionSpec
    tp8 = {"dp": 1, "ep": 1, "tp": 8}
    assert rules.partition_spec(("embed", "heads", "head_dim"), (64, 8, 8), tp8) == P(None, "tp", None)
    # Fewer kv heads than tp: replicated, each rank keeps them all.
    assert rules.partition_spec(("embed", "kv_heads", "head_dim"), (64, 2, 8), tp8) == P(None, None, None)
    assert rules.partition_spec(("embed", "kv_heads", "head_dim"), (64, 2, 8), {"tp": 2}) == P(None, "tp", None)
    assert rules.partition_spec(("vocab", "embed"), (256, 64), tp8) == P("tp", None)
    assert rules.partition_spec(("vocab", "embed"), (250, 64), tp8) == P(None, None)  # odd vocabulary
    mixed = {"dp": 2, "ep": 2, "tp": 2}
    assert rules.partition_spec(("experts", "embed", "expert_mlp"), (8, 64, 32), mixed) == P("ep", None, "tp")
    # The batch is split over dp and ep; where their product does not divide it, over dp alone.
    assert rules.partition_spec(("batch", None, "kv_heads", None), (4, 64, 2, 8), mixed) == \
        P(("dp", "ep"), None, "tp", None)
    assert rules.partition_spec(("batch", None), (2, 16), mixed) == P("dp", None)
    # A mesh axis splits at most one dimension of an array.
    assert rules.partition_spec(("mlp", "vocab"), (8, 8), tp8) == P("tp", None)
    assert rules.shard_shape(("batch", None, "kv_heads", None), (4, 64, 2, 8), mixed) == (1, 64, 1, 8)


def test_every_logical_axis_of_every_family_is_in_the_rules():
    for model_type in FAMILY_TYPES:
        _, infos = abstract_infos(sharding_config(model_type))
        names = {a for i in infos for a in i.axes if a is not None}
        assert names <= set(rules.RULES), f"{model_type}: {sorted(names - set(rules.RULES))} not in sharding RULES"


def test_constrain_is_a_no_op_without_a_mesh():
    x = jnp.ones((2, 3, 4))
    assert rules.constrain(x) is x
    with jax.set_mesh(mesh_lib.make_mesh(None)):
        np.testing.assert_array_equal(jax.jit(rules.constrain)(x), x)


# --- golden sharding files -----------------------------------------------------------------------------------

def golden_table(model_type: str) -> dict:
    """What tests/golden_sharding/<model_type>.json holds: per mesh, every parameter's and the KV cache's spec,
    or why the mesh is refused."""
    hf = sharding_config(model_type)
    module, infos = abstract_infos(hf)
    out = {"model_type": model_type, "config": hf, "meshes": {}}
    for spec in MESHES:
        sizes = mesh_lib.parse_spec(spec)
        bad = mesh_lib.problems(sizes, infos)
        if bad:
            out["meshes"][spec] = {"refused": bad}
            continue
        layout = module.cache_layout()
        kv = {f"{k}x{kd}x{vd}": list(rules.partition_spec(rules.KV_POOL, (64, 16, k, 1), sizes))
              for k, kd, vd, *_ in sorted({x for x in layout if isinstance(x, KVLayer)})}
        out["meshes"][spec] = {"params": _jsonable(rules.spec_table(infos, sizes)), "kv_cache": _jsonable(kv)}
        state = {"x".join(map(str, shape)): list(rules.partition_spec((None,) + axes, (64,) + shape, sizes))
                 for x in layout if isinstance(x, StateLayer) for shape, axes in x.arrays}
        if state:  # linear-attention state slots [slots, *per-sequence shape]
            out["meshes"][spec]["state"] = _jsonable(state)
    return out


def dump_golden(table: dict) -> str:
    """JSON with one parameter per line, so a review diff shows exactly which specs changed."""
    def block(d: dict, indent: str) -> str:
        return "{\n" + ",\n".join(f"{indent}  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(d.items())) + \
            f"\n{indent}}}"
    meshes = []
    for spec, entry in table["meshes"].items():
        parts = ",\n".join(f"    {json.dumps(k)}: {block(v, '    ') if isinstance(v, dict) else json.dumps(v)}"
                            for k, v in sorted(entry.items()))
        meshes.append(f"  {json.dumps(spec)}: {{\n{parts}\n  }}")
    return ("{\n" + f' "model_type": {json.dumps(table["model_type"])},\n'
            + f' "config": {json.dumps(table["config"], sort_keys=True)},\n'
            + ' "meshes": {\n' + ",\n".join(meshes) + "\n }\n}\n")


def _jsonable(x):
    return json.loads(json.dumps(x))  # tuples (multi-axis entries) become lists, as in the file


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_golden_sharding(model_type):
    path = GOLDEN / f"{model_type}.json"
    assert path.is_file(), f"{path} is missing: run `.venv/bin/python tests/test_sharding.py --update-golden`"
    want = json.loads(path.read_text())
    got = golden_table(model_type)
    assert got["config"] == want["config"], f"{model_type}: the test config changed; regenerate the golden files"
    for spec in MESHES:
        assert got["meshes"][spec] == want["meshes"].get(spec), (
            f"{model_type} on {spec}: sharding differs from {path.name}; if intended, run "
            "`.venv/bin/python tests/test_sharding.py --update-golden` and review the diff")


def test_golden_files_split_heads_experts_and_the_kv_pool():
    """Spot checks of the checked-in tables themselves (not only that they are stable)."""
    llama = json.loads((GOLDEN / "llama.json").read_text())["meshes"]["tp=8"]
    assert llama["params"]["model.layers.0.self_attn.q_proj.kernel"] == ["tp", None, None]  # [N, H, D]
    assert llama["params"]["model.layers.0.self_attn.k_proj.kernel"] == [None, None, None]  # 2 kv heads < tp
    assert llama["params"]["model.layers.0.mlp.down_proj.kernel"] == [None, "tp"]  # [D, F]
    assert llama["params"]["model.embed_tokens.weight"] == ["tp", None]
    assert llama["kv_cache"] == {"2x8x8": [None, None, None, None]}
    moe = json.loads((GOLDEN / "qwen3_moe.json").read_text())["meshes"]["tp=2,ep=4"]
    expert = [v for k, v in moe["params"].items() if "experts" in k and k.startswith("model.layers.0")]
    assert expert and all(v[0] == "ep" and "tp" in v for v in expert), expert
    assert moe["kv_cache"] == {"2x8x8": [None, None, "tp", None]}  # the page pool serves every row: kv heads only


# --- the memory planner --------------------------------------------------------------------------------------

def engine_plan(hf: dict, engine=None):
    """The planner's inputs for `hf` served by `engine` (default EngineConfig), as `load` makes them."""
    from day0jax.engine.config import EngineConfig
    from day0jax.loader import EnginePlanInputs

    config = models.config_from_hf(hf)
    return EnginePlanInputs.of(models.abstract_model(config), config, engine or EngineConfig())


def test_plan_params_and_kv_bytes():
    from day0jax.engine.config import EngineConfig

    _, infos = abstract_infos(sharding_config("llama"))
    inputs = engine_plan(sharding_config("llama"), EngineConfig(max_num_seqs=4, kv_cache_tokens=1024))
    total = sum(math.prod(i.shape) for i in infos) * 4
    one = inputs.plan("dp=1", "float32", None)
    assert one.params_bytes == one.model_bytes == total
    tp8 = inputs.plan("tp=8", "float32", None)
    # Per parameter: split by 8 where its tp axis divides, whole otherwise (kv projections, norms).
    expect = sum(math.prod(i.shape) // (8 if any(rules.RULES.get(a) == "tp" and n % 8 == 0
                                                 for a, n in zip(i.axes, i.shape)) else 1) for i in infos) * 4
    assert tp8.params_bytes == expect < total / 4
    # KV: layers x the pool's token slots (1024 + the trash page) x kv heads (2: replicated under tp=8, split
    # under tp=2) x (k + v dims); dp does not split the pool, whose pages serve every row.
    c = models.config_from_hf(sharding_config("llama"))
    assert one.kv_slots == 1024 + 16
    assert tp8.kv_cache_bytes == c.num_hidden_layers * 1040 * 2 * (8 + 8) * 4
    tp2 = inputs.plan("dp=4,tp=2", "bfloat16", None)
    assert tp2.kv_cache_bytes == c.num_hidden_layers * 1040 * 1 * (8 + 8) * 2
    assert tp2.fits and "KV cache" in tp2.summary() and "4 sequences" in tp2.summary()


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """A synthetic model loaded with an engine whose every program is compiled (the server's start-up)."""
    import day0jax
    from day0jax.engine.config import EngineConfig

    hf = dict(sharding_config("llama"), hidden_size=256, intermediate_size=1024, vocab_size=1024,
              max_position_embeddings=1024, head_dim=64, num_key_value_heads=2)
    # Serving-shaped: 8 sequences of up to 1024 tokens; two prefill chunks, spans from 256.
    engine = EngineConfig(max_num_seqs=8, chunk_buckets=(32, 128), min_width=256)
    # Arrays earlier tests left alive in this process are not the engine's: held here (so no buffer of theirs
    # is freed and its address reused by the engine) and left out of the count.
    gc.collect()
    preexisting = jax.live_arrays()
    model = day0jax.load(synthetic_checkpoint(hf, tmp_path_factory.mktemp("alloc") / "ckpt"), engine=engine,
                         dtype="float32")
    model.engine.warm_up()
    model.preexisting_buffers = {a.unsafe_buffer_pointer() for a in preexisting}
    yield model
    del preexisting


# A string condition: evaluated when the test runs, so importing this module (tests/test_sharding_multidevice.py
# does, before it starts the distributed runtime) does not start a JAX backend.
XLA_CPU_ONLY = pytest.mark.skipif("jax.default_backend() != 'cpu'",
                                  reason="calibrated against XLA:CPU's buffer assignment")


@XLA_CPU_ONLY
def test_plan_matches_what_the_engine_allocates(started):
    """After start-up, the plan's figures are the bytes the engine holds (parameters and the KV page pool, every
    live array on the device) and the temporary memory of its largest compiled program: within 10% in all."""
    runner = started.engine.runner
    live = {a.unsafe_buffer_pointer(): a.nbytes for a in jax.live_arrays()  # each buffer once
            if a.unsafe_buffer_pointer() not in started.preexisting_buffers}
    temps = {p: c.memory_analysis().temp_size_in_bytes for p, c in runner.programs.items()}
    plan = started.memory_plan
    assert plan.params_bytes == runner.param_bytes and plan.kv_cache_bytes == runner.pool_bytes
    assert plan.params_bytes + plan.kv_cache_bytes == sum(live.values())
    allocated = sum(live.values()) + max(temps.values())
    assert abs(plan.total_bytes - allocated) <= 0.1 * allocated, (plan.summary(), allocated)
    # The program the plan names as the largest is the one XLA gives the most temporary memory.
    largest = max((p for p in temps if p.name == "forward"), key=temps.get)
    rows, tokens, width = largest.shape
    assert plan.largest_program == (rows, tokens, width * started.engine.page_size)


@XLA_CPU_ONLY
def test_activation_estimate_bounds_every_program(started):
    """Per forward program, the estimate covers XLA's own temporary buffers and is at most 1.5 times them."""
    engine = started.engine
    inputs = engine_plan(json.loads((started.path / "config.json").read_text()), engine.config)
    for program, compiled in engine.runner.programs.items():
        if program.name != "forward":
            continue
        rows, tokens, width = program.shape
        temp = compiled.memory_analysis().temp_size_in_bytes
        est = plan_lib.forward_activation_bytes(inputs.shape, mesh_lib.parse_spec(None), rows, tokens,
                                                width * engine.page_size, "float32", inputs.workload.score_block,
                                                inputs.workload.decode_in_place)
        assert temp <= est <= 1.5 * temp, (program.label, temp, est)


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    return synthetic_checkpoint(sharding_config("llama"), tmp_path_factory.mktemp("plan") / "llama")


def test_out_of_memory_plan_refuses_before_reading_weights(small_ckpt, tmp_path):
    import day0jax
    from day0jax.engine.config import EngineConfig

    inputs = engine_plan(sharding_config("llama"))
    need_1 = inputs.plan("dp=1", "float32", None).total_bytes
    need_2 = inputs.plan("tp=2", "float32", None).total_bytes
    budget = (need_1 + need_2) // 2  # fits on tp=2, not on one device
    # The weights are gone: a refusal that read them would fail differently.
    no_weights = tmp_path / "no-weights"
    shutil.copytree(small_ckpt, no_weights, ignore=shutil.ignore_patterns("params"))
    with pytest.raises(OutOfMemoryPlan) as e:
        day0jax.load(no_weights, memory_budget=budget, dtype="float32")
    msg = str(e.value)
    assert "2 devices of this size would fit it (--mesh tp=2)" in msg, msg
    assert "max_model_len=64" in msg and "per device (params" in msg, msg
    # Following the hint works.
    model = day0jax.load(small_ckpt, memory_budget=budget, engine=EngineConfig(max_model_len=64), dtype="float32")
    assert model.memory_plan.fits and model.memory_plan.max_model_len == 64 and model.context_length == 64
    with pytest.raises(GenerationError, match="maximum context length is 64"):
        model.generate([[1] * 60], 10)
    assert len(model.generate([[1] * 50], 10, ignore_eos=True)[0]) == 10


def test_plan_refusal_names_a_mesh_on_the_visible_devices():
    from day0jax.engine.config import EngineConfig

    inputs = engine_plan(sharding_config("qwen3_moe"), EngineConfig(max_num_seqs=8))
    p = inputs.plan("dp=8", "float32", None)
    budget = inputs.plan("tp=2,ep=4", "float32", None).total_bytes
    with pytest.raises(OutOfMemoryPlan) as e:
        inputs.require_fit(inputs.plan("dp=8", "float32", budget), n_devices=8)
    assert "--mesh" in str(e.value) and p.mesh in str(e.value)
    hinted = str(e.value).split("--mesh ")[1].split(" ")[0]
    assert inputs.plan(hinted, "float32", budget).fits, hinted


# --- multi-host flags ----------------------------------------------------------------------------------------

def test_distributed_flags_and_environment():
    import argparse

    parser = argparse.ArgumentParser()
    distributed.add_arguments(parser)
    args = parser.parse_args(["--coordinator", "localhost:1234", "--num-processes", "2", "--process-id", "1"])
    assert distributed.resolve(args.coordinator, args.num_processes, args.process_id, env={}) == \
        distributed.Cluster("localhost:1234", 2, 1)
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:99", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert distributed.resolve(env=env) == distributed.Cluster("10.0.0.1:99", 4, 3)
    assert distributed.resolve(process_id=2, env=env).process_id == 2  # flags win over the environment
    assert distributed.resolve(env={}) is None  # no coordinator: one process, nothing to start
    for kwargs, words in [(dict(coordinator="localhost"), "HOST:PORT"),
                          (dict(coordinator="h:1"), "--num-processes is not"),
                          (dict(coordinator="h:1", num_processes=2, process_id=2), "0..1"),
                          (dict(num_processes=2, process_id=1), "need --coordinator")]:
        with pytest.raises(MeshError, match=words):
            distributed.resolve(env={}, **kwargs)


def test_generate_cli_takes_the_multihost_flags(capsys):
    from day0jax import generate

    args = generate.build_parser().parse_args(["--prompt", "x", "--coordinator", "h:1", "--num-processes", "2",
                                               "--process-id", "1"])
    assert (args.coordinator, args.num_processes, args.process_id) == ("h:1", 2, 1)
    # A bad flag is refused before anything is loaded, with the typed error's message.
    assert generate.main(["--prompt", "x", "--coordinator", "nohost"]) == 2
    assert "--coordinator 'nohost' is not HOST:PORT" in capsys.readouterr().err


def test_distributed_start_after_devices_are_in_use_is_refused():
    jax.devices()  # this process already uses its devices
    with pytest.raises(MeshError, match="before any JAX device is used"):
        distributed.initialize("localhost:1234", 2, 0, env={})


if __name__ == "__main__":
    if sys.argv[1:] != ["--update-golden"]:
        sys.exit("usage: python tests/test_sharding.py --update-golden")
    GOLDEN.mkdir(exist_ok=True)
    for mt in FAMILY_TYPES:
        (GOLDEN / f"{mt}.json").write_text(dump_golden(golden_table(mt)))
        print("wrote", GOLDEN / f"{mt}.json")
