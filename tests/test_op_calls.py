"""The model's own description of its operators: what each layer reports, and the flagship descriptions that
`kernels_pallas` ships (`kernels_pallas/flagships.json`) must equal what the model code reports today.

    .venv/bin/python tests/test_op_calls.py --update     # rewrites the calls in flagships.json from the model code
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from day0jax import models  # noqa: E402
from kernels_pallas import cases  # noqa: E402
from kernels_pallas.calls import OpCall  # noqa: E402


def reported(hf: dict) -> list[dict]:
    """Each distinct op call the model built from `hf` reports, in order."""
    model = models.abstract_model(models.config_from_hf(hf))
    return [call.to_dict() for call in dict.fromkeys(call for _, call in model.op_calls())]


def dump(table: dict) -> str:
    """flagships.json with one op call per line, so a diff shows which call changed."""
    entries = []
    for name, entry in table.items():
        calls = ",\n".join(f"    {json.dumps(c, sort_keys=True)}" for c in entry["calls"])
        entries.append(f'  {json.dumps(name)}: {{\n   "config": {json.dumps(entry["config"], sort_keys=True)},\n'
                       f'   "calls": [\n{calls}\n   ]\n  }}')
    return "{\n" + ",\n".join(entries) + "\n}\n"


@pytest.mark.parametrize("name", sorted(json.loads(cases.FLAGSHIPS_FILE.read_text())))
def test_flagship_calls_match_the_model_code(name):
    entry = json.loads(cases.FLAGSHIPS_FILE.read_text())[name]
    assert reported(entry["config"]) == entry["calls"], (
        f"{name}: the model code reports other op calls than kernels_pallas/flagships.json; if intended, run "
        "`.venv/bin/python tests/test_op_calls.py --update` and review the diff")


def test_layers_report_what_they_run():
    """Per-layer calls follow the config: GQA heads, the window of sliding layers only, soft-caps, Gemma norms."""
    hf = dict(model_type="gemma2", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=16,
              attn_logit_softcapping=50.0, query_pre_attn_scalar=8, max_position_embeddings=64)
    calls = models.abstract_model(models.config_from_hf(hf), jnp.float32).op_calls()
    attention = {layer: c for layer, c in calls if c.op == "paged_attention"}
    assert attention[0]["window"] == 16 and attention[1]["window"] is None  # layer 0 slides, layer 1 is global
    assert all(c["N"] == 4 and c["K"] == 2 and c["H"] == 8 and c["softcap"] == 50.0 for c in attention.values())
    norms = [c for layer, c in calls if c.op == "rms_norm"]
    assert {(c["D"], c["offset"]) for c in norms} == {(32, 1.0)} and len(norms) == 2 * 4 + 1  # sandwich + final
    assert [c["F"] for layer, c in calls if c.op == "mlp"] == [48, 48]


def test_moe_and_latent_attention_calls():
    hf = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_group=2,
              topk_group=1,
              num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
              v_head_dim=8, first_k_dense_replace=1, max_position_embeddings=64, num_nextn_predict_layers=0)
    calls = models.abstract_model(models.config_from_hf(hf)).op_calls()
    (moe,) = [c for layer, c in calls if c.op == "moe"]
    assert (moe["E"], moe["k"], moe["D"], moe["F"], moe["shared"]) == (8, 2, 32, 16, "shared_experts")
    latent = {c for _, c in calls if c.op == "attention"}
    assert {(c["N"], c["K"], c["H"], c["latent"]) for c in latent} == {(4, 1, 16 + 8, True)}
    # The shared experts are a dense MLP every token passes through, beside its 2 routed experts.
    assert [c["F"] for layer, c in calls if layer == 1 and c.op == "mlp"] == [16]


def test_cases_come_from_the_calls():
    """One description: the kernel cases are built from the op calls, with the calls' own dims."""
    calls = [OpCall.from_dict(c) for c in reported(dict(
        model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=64))]
    built = cases.cases_from_calls(calls, "float32", scale="startup", tp=2)
    assert {c.op for c in built} == {"attention", "paged_attention", "rms_norm", "linear"}
    assert all(c.spec["N"] == 4 and c.spec["K"] == 1 and c.spec["H"] == 16 for c in built if "N" in c.spec)
    assert [c.spec["D"] for c in built if c.op == "rms_norm"] == [64]


def test_linear_maps_report_their_weights():
    """Every float projection is a `linear` call of its [O x I] weight: q, k and v, o, the MLP's three, and the tied
    embeddings as the output projection."""
    calls = models.abstract_model(models.config_from_hf(dict(
        model_type="llama", vocab_size=80, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        tie_word_embeddings=True))).op_calls()
    linear = [(layer, c["O"], c["I"]) for layer, c in calls if c.op == "linear"]
    assert set(linear) == {(layer, O, I) for layer in (0, 1) for O, I in ((128, 64), (32, 64), (64, 128), (96, 64),
                                                                         (64, 96))} | {(None, 80, 64)}
    assert len(linear) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer


def test_chunked_attention_calls():
    """Llama 4: the chunk of the RoPE layers' local attention reaches their op calls (and only theirs), the words of
    the report and the kernel cases; the global layer has no RoPE and no chunk."""
    from families import FAMILIES

    model_type, config, _ = FAMILIES["llama4"]
    calls = models.abstract_model(models.config_from_hf(dict(config, model_type=model_type))).op_calls()
    paged = {layer: c for layer, c in calls if c.op == "paged_attention"}
    assert paged[0]["chunk"] == 8 and paged[1].get("chunk") is None
    assert "chunked local attention 8" in paged[0].describe() and "chunked" not in paged[1].describe()
    assert [c.get("kind") for layer, c in calls if c.op == "rope"] == ["default", None]
    built = cases.cases_from_calls([paged[0], paged[1]], "float32", scale="tiny")
    assert [c.build(0)[1].get("chunk_size") for c in built] == [8, None]


if __name__ == "__main__" and "--update" in sys.argv:
    table = json.loads(cases.FLAGSHIPS_FILE.read_text())
    for entry in table.values():
        entry["calls"] = reported(entry["config"])
    cases.FLAGSHIPS_FILE.write_text(dump(table))
    print(f"wrote {cases.FLAGSHIPS_FILE}")
