"""`python -m day0jax.check PATH --graph`: the traced `transformers` model mapped onto day0jax's operators.

Every folder holds config.json alone (no weights). All of them are traced in one subprocess of the reference venv
(module fixture): one tiny config per supported model_type (tests/families.py), tiny configs of families day0jax
does not implement (written by transformers' own config classes), and two that cannot be traced.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REF_PYTHON
from families import FAMILIES, TINY

from day0jax import check, models
from day0jax.graph import mapping
from day0jax.graph import report as graph
from kernels_pallas import ops

# One tiny config per supported model_type: the first entry of tests/families.py that has it.
SUPPORTED: dict[str, dict] = {}
for _name, (_model_type, _overrides, _) in FAMILIES.items():
    SUPPORTED.setdefault(_model_type, _overrides)

# Families transformers has and day0jax does not (their layer lists chosen so each layer kind runs once).
UNSUPPORTED = {
    # Ling/Ring's hybrid: delta attention with a forget gate beside MLA, grouped MoE.
    "bailing_hybrid": ("bailing_hybrid", dict(TINY, intermediate_size=128, moe_intermediate_size=32,
                                              num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2,
                                              n_group=1, topk_group=1, kv_lora_rank=16, qk_rope_head_dim=8,
                                              qk_nope_head_dim=8, v_head_dim=16, head_dim=16, first_k_dense_replace=1,
                                              layer_group_size=2)),
    # HY-V4's vision-language checkpoint: the text model day0jax runs as hy_v4, its classes under the composite's
    # names, and a vision tower.
    "hy_v4_vl": ("hy_v4_vl", {"text_config": dict(TINY, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                                                  qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                                                  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                  mlp_layer_types=["dense", "sparse"], indexer_types=["full", "shared"],
                                                  index_topk=8, index_head_dim=16, index_n_heads=4, hc_mult=2,
                                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                   "mrope_section": [2, 1, 1]})}),
    # Jamba: Mamba (v1) mixers beside attention.
    "jamba": ("jamba", dict(TINY, num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
                            expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_dt_rank=8)),
    # OLMo (the first): every module one day0jax has (LayerNorm blocks, a gated MLP), only the family file is lacking.
    "olmo": ("olmo", dict(TINY, clip_qkv=8.0)),
}
# A supported family at its full size (Qwen3-30B-A3B's shape: 48 layers of 128 experts, top-8): built on the meta
# device, traced on a shrunk copy, its calls scaled back.
FULL_SIZE = ("qwen3_moe", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                               num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                               num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False))
# Qwen4-Exp with two linear-attention layers: its forward raises inside transformers (the cache asks an attention
# layer for mask sizes and there is none).
BROKEN_FORWARD = ("qwen4_exp", {"text_config": dict(TINY, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                    moe_intermediate_size=32,
                                                    layer_types=["linear_attention", "linear_attention"],
                                                    indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                                                    indexer_budget=8, indexer_compress_ratio=4)})

WRITE_CONFIGS = """
import json, sys
from transformers import AutoConfig
for out, (model_type, overrides) in json.load(open(sys.argv[1])).items():
    AutoConfig.for_model(model_type, **overrides).save_pretrained(out)
"""


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """name -> GraphReport for every folder, traced in one subprocess."""
    if not REF_PYTHON.exists():
        pytest.fail(f"{REF_PYTHON} is missing: run `make install` (it builds the transformers reference venv)")
    root = tmp_path_factory.mktemp("graph")
    folders = {}
    for model_type, overrides in SUPPORTED.items():
        folder = root / "supported" / model_type
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(dict(overrides, model_type=model_type)))
        folders[model_type] = folder
    specs = {str(root / name): spec for name, spec in UNSUPPORTED.items()}
    specs[str(root / "broken_forward")] = BROKEN_FORWARD
    specs[str(root / "full_size")] = FULL_SIZE
    (root / "specs.json").write_text(json.dumps(specs))
    subprocess.run([str(REF_PYTHON), "-c", WRITE_CONFIGS, str(root / "specs.json")], check=True, capture_output=True)
    folders |= {name: root / name for name in [*UNSUPPORTED, "broken_forward", "full_size"]}
    folders["unknown_type"] = root / "unknown_type"
    folders["unknown_type"].mkdir()
    (folders["unknown_type"] / "config.json").write_text(json.dumps({"model_type": "zorblax", "hidden_size": 64}))
    reports = graph.check_graphs(list(folders.values()))
    return dict(zip(folders, reports))


def test_every_supported_family_is_covered_and_nearest_itself(graphs):
    wrong = {}
    for model_type in SUPPORTED:
        r = graphs[model_type]
        if r.stopped or r.missing or r.missing_functions or r.nearest.get("family") != model_type or not r.runs_today:
            wrong[model_type] = (r.stopped, [m["class"] for m in r.missing], r.missing_functions,
                                 r.nearest.get("family"), r.verdict)
    assert not wrong, wrong
    assert all(graphs[t].verdict == "runs today" and graphs[t].covered for t in SUPPORTED)


def test_a_full_size_config_is_traced_shrunk_and_scaled_back(graphs):
    r = graphs["full_size"]
    config = FULL_SIZE[1]  # (transformers leaves its defaults out of the config.json it writes)
    assert r.shrunk and r.stopped is None and not r.missing and r.nearest["family"] == "qwen3_moe" and r.runs_today
    # the true config's parameters, counted on the meta device
    D, V, L, E, F = (config[k] for k in ("hidden_size", "vocab_size", "num_hidden_layers", "num_experts",
                                         "moe_intermediate_size"))
    N, K, H = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    layer = 2 * D * N * H + 2 * D * K * H + 2 * H + 2 * D + D * E + E * 3 * D * F
    assert r.parameters == V * D * (1 if config["tie_word_embeddings"] else 2) + L * layer + D > 1e10
    calls = {c["class"]: c["calls_per_step"] for c in r.covered}
    layers = config["num_hidden_layers"]
    assert calls["Qwen3MoeDecoderLayer"] == calls["Qwen3MoeSparseMoeBlock"] == layers
    assert calls["Qwen3MoeRMSNorm"] == 4 * layers + 1  # two per layer, q and k norms, the final one


def _roles_covered(graphs) -> set[str]:
    """The roles day0jax covers in any family (its RMSNorm, its MLP...), less those it covers only by a family's full
    class name: one family's indexer is not another's."""
    pinned = {p for s in ops.specs().values() for p in s.torch_patterns for model_type in SUPPORTED
              if any(c["class"] == p for c in graphs[model_type].covered)}
    found = set()
    for model_type in SUPPORTED:
        r = graphs[model_type]
        found |= {mapping.role(c["class"], _prefixes(r)) for c in r.covered if c["class"] not in pinned}
    return found


def _prefixes(r) -> list[str]:
    return [c["class"].removesuffix("DecoderLayer") for c in r.covered if c["class"].endswith("DecoderLayer")]


def test_unsupported_families_name_their_own_missing_classes(graphs):
    covered_roles = _roles_covered(graphs)
    for name in UNSUPPORTED:
        r = graphs[name]
        assert r.stopped is None, r.stopped
        assert not r.supported and not r.runs_today and r.verdict.startswith("runs after: ")
        assert r.nearest["family"] in models.FAMILIES
        assert f"a family file for model_type {name!r}" in r.verdict
        for m in r.missing:
            source = Path(m["file"]).read_text().splitlines()
            assert m["file"] == r.modeling_file
            assert re.match(rf"class {m['class']}\b", source[m["line"] - 1]), m
            # nothing day0jax implements in a supported family is listed missing here
            assert mapping.role(m["class"], _prefixes(r)) not in covered_roles, m
            assert 0 <= m["flops_share"] <= 1 and m["calls_per_step"] >= 0
    bailing = {m["class"] for m in graphs["bailing_hybrid"].missing}
    assert {"BailingHybridDeltaAttention", "BailingHybridForgetGate"} <= bailing
    # hy_v4's indexer is its own op's by full class name: the composite's class of that role is not covered
    assert {m["class"] for m in graphs["hy_v4_vl"].missing} == {"HYV4VLIndexer"}
    assert "JambaMambaMixer" in {m["class"] for m in graphs["jamba"].missing}
    assert not graphs["olmo"].missing  # every module mapped: the family file is all that is lacking
    assert "needs the multimodal path" in graphs["hy_v4_vl"].verdict and graphs["hy_v4_vl"].nearest["family"] == "hy_v4"
    assert any(k["key"].startswith("linear_") for k in graphs["bailing_hybrid"].unread_keys)


def test_the_report_renders_what_it_found(graphs):
    r = graphs["bailing_hybrid"]
    text = graph.render(r)
    assert f"VERDICT: {r.verdict}" in text
    for m in r.missing:
        assert re.search(rf"{m['class']}  \S*{Path(m['file']).name}:{m['line']}\n", text)
    assert f"nearest supported family by structure: {r.nearest['family']}" in text
    assert json.loads(json.dumps(r.to_dict()))["missing"] == r.missing


def test_untraceable_models_say_where_tracing_stopped(graphs):
    unknown = graphs["unknown_type"]
    assert unknown.stopped["stage"].startswith("reading config.json")
    assert "zorblax" in unknown.stopped["error"]
    assert unknown.verdict.startswith("cannot tell: tracing stopped while reading config.json")
    broken = graphs["broken_forward"]
    assert broken.stopped["stage"] == "the forward pass"
    assert broken.stopped["file"].endswith(".py") and isinstance(broken.stopped["line"], int)
    assert "tracing stopped while the forward pass" in broken.verdict
    assert "TRACING STOPPED while the forward pass" in graph.render(broken)


def test_check_graph_runs_without_importing_torch(graphs, capsys):
    """The command in this process, on a config-only folder: the trace runs elsewhere, torch never loads here."""
    folder = Path(graphs["unknown_type"].path)
    status = check.main([str(folder), "--graph", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert status == check.WONT_RUN
    assert out["stopped"]["stage"].startswith("reading config.json") and out["verdict"].startswith("cannot tell")
    assert "torch" not in sys.modules


def test_unsupported_model_type_points_to_graph(graphs):
    report = check.check(graphs["unknown_type"].path)
    assert not report.supported
    assert any("--graph" in r and "zorblax" in r for r in report.reasons), report.reasons


def test_a_missing_tracer_python_names_the_flag(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(graph.TracerUnavailable, match="--torch-python"):
        graph.check_graph(tmp_path, tmp_path / "no-python")
    assert check.main([str(tmp_path), "--graph", "--torch-python", str(tmp_path / "no-python")]) == 1
    assert "--torch-python" in capsys.readouterr().err


def test_the_mapping_is_the_operator_specs_data(monkeypatch):
    """A module class maps by role or full name to the op whose spec names it; a new op's patterns count at once."""
    assert mapping.module("Qwen3NextGatedDeltaNet", ["Qwen3Next"]) == mapping.Mapped("operator", "gated_delta_rule")
    assert mapping.module("Glm5NextTextRMSNorm", ["Glm5NextText", "Glm5Next"]).name == "rms_norm"
    # a role that merely ends like a covered one is not covered
    assert mapping.module("BailingHybridDeltaAttention", ["BailingHybrid"]).kind == "missing"
    assert mapping.module("SiLUActivation", []).kind == "plain"
    assert mapping.function("scaled_dot_product_attention") == mapping.Mapped("operator", "attention")
    assert mapping.function("reshape").kind == "plain" and mapping.function("fft_rfft").kind == "missing"
    table = dict(ops.specs())
    new = dataclasses.replace(table["gated_delta_rule"], name="linear_attention_x",
                              torch_patterns=("DeltaAttention", "fn:fft_rfft"))
    monkeypatch.setattr(ops, "specs", lambda: {**table, new.name: new})
    assert mapping.module("BailingHybridDeltaAttention", ["BailingHybrid"]) == mapping.Mapped("operator", new.name)
    assert mapping.function("fft_rfft") == mapping.Mapped("operator", new.name)
