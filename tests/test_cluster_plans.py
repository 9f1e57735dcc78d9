"""`day0jax.check --hosts N --devices-per-host M --device-memory SIZE`: plans for clusters that are not here.

The configurations in tests/published_configs/ are the published config.json files of four of the largest open
models; their parameter counts are checked against the totals their publishers give, and their plans against
arithmetic done here by hand.
"""

import math
from pathlib import Path

import pytest

from day0jax import check as check_lib
from day0jax.core.errors import MeshError
from sharding.cluster import Cluster, parse_size
from sharding.mesh import crossing

CONFIGS = Path(__file__).resolve().parent / "published_configs"
GiB = 1 << 30
H200 = 141 * GiB

# Published totals: DeepSeek-V3 671B (without its 14B multi-token-prediction module, which serving drops), Kimi K2
# 1.03T (its model card's count), Qwen3-235B-A22B 235B, Llama-3.1-405B 405B.
PUBLISHED = {"deepseek_v3_671b": 671e9, "kimi_k2_1t": 1.03e12, "qwen3_235b_a22b": 235e9, "llama3_1_405b": 405e9}


def plan(name: str, hosts: int, per_host: int, memory: int = H200, **kw) -> check_lib.Report:
    return check_lib.check(CONFIGS / name, cluster=Cluster(hosts, per_host, memory), **kw)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_the_published_totals(name):
    report = check_lib.check(CONFIGS / name)
    count = report.parameters["model"]
    assert abs(count - PUBLISHED[name]) / PUBLISHED[name] < 0.01, count  # within 1%


def test_deepseek_v3_on_two_hosts_of_eight_h200():
    """bfloat16 needs two hosts: the auto mesh keeps tp inside a host and puts pipeline stages across (one
    residual stream per token crosses, not 58 layers' expert exchanges). With ep across hosts instead, the traffic
    is the layout's arithmetic."""
    auto = plan("deepseek_v3_671b", 2, 8)
    assert auto.supported, auto.reasons
    assert auto.cluster["mesh"] == "pp=2,tp=8" and auto.cluster["axes_crossing_hosts"] == ["pp"]
    # Layers balanced by bytes: the first 3 are dense (smaller), so the first stage takes 32 of the 61.
    assert auto.memory["stages"] == ((0, 32), (32, 61)) and auto.memory["total_bytes"] <= 0.9 * H200
    hop = {t["axis"]: t for t in auto.cluster["traffic"]}["pp"]
    assert hop["decode_bytes"] == hop["prefill_bytes"] == 7168 * 2 * 8 and hop["crosses_hosts"]
    report = plan("deepseek_v3_671b", 2, 8, mesh="ep=2,tp=8")
    assert report.supported, report.reasons
    c, m = report.cluster, report.memory
    assert c["mesh"] == "ep=2,tp=8" and c["axes_crossing_hosts"] == ["ep"] and c["fits"]
    assert m["dtype"] == "bfloat16" and m["total_bytes"] <= 0.9 * H200
    # Experts split over ep=2 and tp=8; everything else over tp (or replicated): about 671B x 2 bytes / 16 plus the
    # replicated MLA latents and norms.
    assert 671e9 * 2 / 16 < m["params_bytes"] < 671e9 * 2 / 16 * 1.1
    traffic = {t["axis"]: t for t in c["traffic"]}
    D, V, item = 7168, 129280, 2
    allreduce = (2 * 61 + 1) * 2 * 7 * D * item  # 61 layers' mixer and feed-forward, and the embedding
    assert traffic["tp"]["prefill_bytes"] == allreduce
    assert traffic["tp"]["decode_bytes"] == allreduce + 7 * V * 4  # the logits gathered for the sampler
    # 58 MoE layers (the first 3 are dense), 8 experts each, half of them on the other ep rank, for each tp rank.
    assert traffic["ep"]["decode_bytes"] == 58 * 2 * 8 * D * item // 2 * 8
    assert traffic["ep"]["crosses_hosts"] and not traffic["tp"]["crosses_hosts"]
    fit = c["meshes_that_fit"]
    assert fit[0] == "pp=2,tp=8" and "ep=2,tp=8" in fit and "tp=16" in fit
    assert fit.index("ep=2,tp=8") < fit.index("tp=16")  # tp inside a host first
    text = check_lib.render(report)
    assert "axes crossing hosts: ep" in text and "per decode token" in text


def test_kimi_k2_needs_four_hosts_in_bfloat16_and_two_in_fp8():
    """1T parameters do not fit 16 H200 in bfloat16: refused naming what would (32 devices); stored as fp8 (every
    projection and expert; kv_b_proj, routers and norms float) they fit 16."""
    report = plan("kimi_k2_1t", 2, 8)
    assert not report.supported and report.family == "day0jax.models.deepseek_v3"
    [reason] = report.reasons
    assert "will not fit 2 host(s) x 8 device(s)" in reason and "32 devices of this size would fit" in reason
    assert report.cluster["meshes_that_fit"] == []
    four = plan("kimi_k2_1t", 4, 8)
    assert four.supported, four.reasons
    assert four.cluster["mesh"] == "pp=4,tp=8" and four.cluster["axes_crossing_hosts"] == ["pp"]
    fp8 = plan("kimi_k2_1t", 2, 8, quantize="fp8")
    assert fp8.supported, fp8.reasons
    assert "fp8/128" in fp8.quantization and fp8.cluster["mesh"] == "pp=2,tp=8"
    # One byte per weight (and a float32 scale per 128) instead of two, on the same mesh.
    bf16 = plan("kimi_k2_1t", 2, 8, mesh="pp=2,tp=8")
    assert 0.5 < fp8.memory["params_bytes"] / bf16.memory["params_bytes"] < 0.53


def test_kimi_k25_plans_with_its_tower_and_int4_experts_as_shipped():
    """The published Kimi K2.5 config.json alone (its remote code's keys, a compressed-tensors quantization_config):
    Kimi K2's language model behind the 27-layer MoonViT tower; the routed experts planned as stored (int4 in
    groups of 32; attention, shared experts, the dense layer and lm_head bfloat16, as its `ignore` list says), which
    fits 2 hosts of 8 H200, one replica per host."""
    report = plan("kimi_k25_1t", 2, 8)
    assert report.supported, report.reasons
    assert report.family == "day0jax.models.kimi_k25"
    text = check_lib.check(CONFIGS / "kimi_k2_1t").parameters["model"]
    v = report.vision
    assert v["tower"].startswith("kimi_k25_vision (27 layers x 1152)") and v["merge"] == 2
    assert report.parameters["model"] == text + v["parameters"] and 400e6 < v["parameters"] < 500e6
    # 60 MoE layers x 3 expert weights, and nothing else, stay int4.
    assert report.quantization.startswith("quantized weights: 180 x int4/32")
    assert report.cluster["fits"] and report.cluster["mesh"] == "dp=2,tp=8"
    assert any(r["key"] == "vision_config.vt_hidden_size" and r["status"] == "used" for r in report.keys)


def test_parameters_that_alone_do_not_fit_get_no_engine_hints():
    """Fewer sequences or a shorter context cannot help when the parameters alone overflow every device."""
    report = plan("deepseek_v3_671b", 1, 8)
    [reason] = report.reasons
    assert "16 devices of this size would fit it" in reason
    assert "max_num_seqs" not in reason and "max_model_len" not in reason


def test_llama_405b_takes_pipeline_stages_where_tp_would_cross_hosts():
    """On 2 x 8 devices of 80 GB, 405B in bfloat16 needs all 16 devices for one copy: without pipeline stages only
    tp=16 fits, across hosts; `auto` takes pp=2,tp=8 instead (tp inside each host, one hop per token across), and
    tp=16 stays on the list, last, said to cross hosts when asked for."""
    engine = _engine(max_model_len=8192)
    report = plan("llama3_1_405b", 2, 8, memory=parse_size("80GB"), engine=engine)
    assert report.supported, report.reasons
    assert report.cluster["mesh"] == "pp=2,tp=8" and report.cluster["axes_crossing_hosts"] == ["pp"]
    assert report.memory["stages"] == ((0, 63), (63, 126))
    fit = report.cluster["meshes_that_fit"]
    assert fit[0] == "pp=2,tp=8" and fit[-1] == "tp=16" and all(m.startswith("pp=") for m in fit[:-1])
    tp16 = plan("llama3_1_405b", 2, 8, memory=parse_size("80GB"), engine=engine, mesh="tp=16")
    assert tp16.supported and tp16.cluster["axes_crossing_hosts"] == ["tp"]
    # Half the layers per device split 8 ways instead of all of them split 16 ways: fewer parameter bytes (tp=16
    # cannot split the 8 kv heads' projections), and a 16th of the KV cache per token slot: 63 layers of one kv
    # head each, where tp=16 keeps all 8 kv heads of all 126 layers on every device.
    pp2 = plan("llama3_1_405b", 2, 8, memory=parse_size("80GB"), engine=engine, mesh="pp=2,tp=8")
    assert pp2.memory["params_bytes"] < tp16.memory["params_bytes"]
    per_slot = [p.memory["kv_cache_bytes"] / p.memory["kv_slots"] for p in (pp2, tp16)]
    assert per_slot == [63 * 1 * 256 * 2, 126 * 8 * 256 * 2]


def test_a_given_mesh_that_does_not_fit_is_refused_with_those_that_do():
    report = plan("qwen3_235b_a22b", 2, 8, mesh="dp=16")
    assert not report.supported
    [reason] = report.reasons
    assert "dp=16" in reason and "meshes over the cluster that fit, best placed first: dp=4,tp=4" in reason
    wrong_size = plan("qwen3_235b_a22b", 2, 8, mesh="tp=8")
    assert any("uses 8 device(s); the cluster has 16" in r for r in wrong_size.reasons)


def test_config_quantization_is_named_when_not_planned():
    report = plan("deepseek_v3_671b", 2, 8)
    assert any("config.json names fp8 quantization" in n for n in report.notes)


def test_crossing_follows_devices_numbered_host_by_host():
    sizes = {"dp": 2, "ep": 2, "tp": 4}
    assert crossing(sizes, 8) == {"pp": False, "dp": True, "ep": False, "tp": False}
    assert crossing(sizes, 4) == {"pp": False, "dp": True, "ep": True, "tp": False}
    assert crossing(sizes, 2) == {"pp": False, "dp": True, "ep": True, "tp": True}
    assert crossing(sizes, 16) == {"pp": False, "dp": False, "ep": False, "tp": False}
    assert crossing({"dp": 2, "ep": 1, "tp": 3}, 4)["tp"]  # devices 3, 4, 5: a group straddling two hosts


def test_sizes_and_bad_cluster_descriptions():
    assert parse_size("141GiB") == 141 * GiB and parse_size("80GB") == 80 * 10**9
    assert parse_size("1.5 TiB") == int(1.5 * (1 << 40)) and parse_size("4096") == 4096
    for bad in ("", "12XB", "-3GiB", "GiB"):
        with pytest.raises(MeshError, match="device memory"):
            parse_size(bad)
    with pytest.raises(MeshError, match="hosts must be a positive integer"):
        Cluster(0, 8, H200)


def test_cli_needs_the_whole_cluster_description(capsys):
    with pytest.raises(SystemExit) as e:
        check_lib.main([str(CONFIGS / "llama3_1_405b"), "--hosts", "2"])
    assert e.value.code == 2 and "give all three" in capsys.readouterr().err
    code = check_lib.main([str(CONFIGS / "llama3_1_405b"), "--hosts", "2", "--devices-per-host", "8",
                           "--device-memory", "141GiB", "--max-model-len", "8192"])
    out = capsys.readouterr().out
    assert code == check_lib.RUNS and "cluster: 2 host(s) x 8 device(s) of 141.00 GiB (16 devices)" in out
    assert math.isclose(405.85, float(out.split(" in the model (")[1].split("M)")[0]) / 1000, rel_tol=1e-3)


def _engine(**kw):
    from day0jax.engine.config import EngineConfig

    return EngineConfig(**kw)


def test_probe_measures_each_axis_and_prices_a_decode_step(tmp_path):
    """--probe on 8 simulated devices: latency and bandwidth of both collectives for every axis of size > 1, and a
    decode step's communication time that is those figures applied to the model's traffic (pipeline stages, expert
    and tensor parallelism)."""
    import json
    import os
    import subprocess
    import sys

    from families import FAMILIES, TINY

    _, config, _ = FAMILIES["qwen3_moe"]
    folder = tmp_path / "tiny-moe"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(config, model_type="qwen3_moe")))
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-m", "day0jax.check", str(folder), "--mesh", "pp=2,ep=2,tp=2", "--probe",
                           "--json", "--max-num-seqs", "8"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    probe = json.loads(proc.stdout)["probe"]
    links = {x["axis"]: x for x in probe["links"]}
    assert sorted(links) == ["ep", "pp", "tp"] and probe["rows"] == 8
    for x in links.values():
        for key in ("all_reduce_bandwidth", "all_reduce_latency", "all_gather_bandwidth", "all_gather_latency"):
            assert 0 < x[key] < float("inf"), (x["axis"], key)
    # The step's communication, recomputed by hand: 8 rows over dp x ep = 4 per device; float32 activations.
    D, V, L, k, item = TINY["hidden_size"], TINY["vocab_size"], TINY["num_hidden_layers"], 2, 4
    tp_bytes = (2 * L + 1) * 2 * 1 * D * item + 1 * V * 4  # summed over tp=2 devices: 2(t-1) = 2, (t-1) = 1
    ep_bytes = L * 2 * k * D * item // 2 * 2  # half the experts elsewhere, a copy per tp rank
    pp_bytes = 1 * D * item * 2  # one stage boundary, a copy per tp rank
    tp, ep, pp = links["tp"], links["ep"], links["pp"]
    want = {"tp": (2 * L + 2) * tp["all_reduce_latency"] + tp_bytes / 2 * 4 / tp["all_reduce_bandwidth"],
            "ep": 2 * L * ep["all_gather_latency"] + ep_bytes / 2 * 4 / ep["all_gather_bandwidth"],
            "pp": 1 * pp["all_gather_latency"] + pp_bytes / 2 * 4 / pp["all_gather_bandwidth"]}
    assert probe["decode_step_seconds"].keys() == want.keys()
    for axis, seconds in want.items():
        assert math.isclose(probe["decode_step_seconds"][axis], seconds, rel_tol=1e-9), axis
