"""`day0jax.check` (the readiness report) and the refusals it reports: unknown model types, unknown config keys,
values a family does not implement, checkpoints whose tensors do not map, kernels versus reference fallback.

The refusals are also checked where they matter most, in `convert` and `day0jax.load`: a model that would run
with silently wrong numbers is the worst outcome.
"""

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from day0jax import check as check_lib
from day0jax import models
from day0jax.core.errors import UnsupportedArchitecture

ROOT = Path(__file__).resolve().parent.parent


def variant(src: Path, dst: Path, **changes) -> Path:
    """A copy of HF folder `src` (weights hard-linked) whose config.json has `changes` (None deletes a key)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).hardlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def config_only(dst: Path, cfg: dict) -> Path:
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_moe_family_report(tiny):
    """Supported, every key classified, the operators with their implementation, counts and memory."""
    report = check_lib.check(tiny["qwen2_moe"]["hf"], dtype="float32")  # the runtime's default on the CPU only
    assert report.supported, report.reasons
    assert report.family == "day0jax.models.qwen2_moe" and report.source == "safetensors"
    status = {r["key"]: r["status"] for r in report.keys}
    assert status["num_experts"] == "used" and status["shared_expert_intermediate_size"] == "used"
    assert status["transformers_version"] == "ignored" and "unknown" not in status.values()
    ops = {(r["op"], r["layers"]): r for r in report.ops}
    moe = ops[("moe grouped matmul", "1")]  # layer 0 is dense (mlp_only_layers)
    assert "4 experts" in moe["variant"] and "top-2" in moe["variant"] and "shared_expert (gated)" in moe["variant"]
    assert ops[("mlp", "0")]["variant"] == "gated MLP x 128 (silu)"
    attention = ops[("attention (cache-less forward)", "0-1")]
    assert attention["variant"].startswith("GQA 4q/2kv heads x 16")
    assert attention["implementation"].startswith("reference")  # no kernel takes float32 (nor any on the CPU)
    params = report.parameters
    abstract = models.abstract_model(models.config_from_hf(json.loads((tiny["qwen2_moe"]["hf"] / "config.json")
                                                                      .read_text())))
    assert params["model"] == sum(int(jax.numpy.size(jax.numpy.zeros(i.shape))) for i in models.param_infos(abstract))
    assert params["checkpoint_elements"] == params["model"]
    assert params["checkpoint_bytes_by_dtype"] == {"float32": 4 * params["model"]}
    m = report.memory
    assert m["params_bytes"] == 4 * params["model"] and m["kv_cache_bytes"] > 0 and m["fits"]
    # The engine's defaults, as `load` and the server plan them: 16 sequences of the model's 128 tokens, a pool
    # of 512 tokens a sequence (+ the trash page).
    assert m["max_model_len"] == 128 and m["max_num_seqs"] == 16 and m["kv_slots"] == 16 * 512 + 16


def test_report_of_every_family_variant(tiny, converted):
    """MLA, sinks, soft-caps, NoPE layers and per-layer windows show up; a converted checkpoint checks too."""
    rows = {name: {(r["op"], r["layers"]): r["variant"] for r in check_lib.check(tiny[name]["hf"]).ops}
            for name in ("deepseek_v3", "gpt_oss", "gemma2", "smollm3")}
    assert rows["deepseek_v3"][("attention (cache-less forward)", "0-2")].startswith("MLA (absorbed)")
    assert "sigmoid_grouped" in rows["deepseek_v3"][("moe grouped matmul", "1-2")]
    assert "sinks" in rows["gpt_oss"][("attention (cache-less forward)", "0")]
    assert "sliding window 8" in rows["gpt_oss"][("attention (cache-less forward)", "0")]
    assert "sliding window" not in rows["gpt_oss"][("attention (cache-less forward)", "1")]
    assert "score soft-cap 2.0" in rows["gemma2"][("attention (cache-less forward)", "0")]
    assert "(1 + w)" in rows["gemma2"][("rms_norm", "0-1,final")]  # four per layer and the final norm
    assert rows["smollm3"][("rope", "1")] == "none (NoPE layer)"
    ckpt = check_lib.check(converted["deepseek_v3"], dtype="float32")
    assert ckpt.supported and ckpt.source == "day0jax", ckpt.reasons
    # The latent cache: one "head" of kv_lora_rank + qk_rope_head_dim for key and value, 3 layers, every slot.
    assert ckpt.memory["kv_cache_bytes"] == 3 * ckpt.memory["kv_slots"] * 2 * (16 + 8) * 4


def test_hybrid_linear_attention_report(tiny):
    """Qwen3-Next: which layers are linear attention and what they keep per sequence, their operators, and the
    memory plan's state slots (split over tp like their heads)."""
    report = check_lib.check(tiny["qwen3_next"]["hf"], dtype="float32")
    assert report.supported, report.reasons
    # Layer 0: 2 key heads x 8 and 4 value heads x 8; conv states [3, 2+2+4 heads, 8], recurrent [4, 8, 8].
    per_seq = (3 * (2 + 2 + 4) * 8 + 4 * 8 * 8) * 4
    assert report.layers == [
        {"kind": "linear attention", "layers": "0", "cache": f"state {per_seq / 1024:.2f} KiB per sequence"},
        {"kind": "full attention", "layers": "1", "cache": "KV 256 B per token"}]
    ops = {(r["op"], r["layers"]): r["variant"] for r in report.ops}
    assert "2qk/4v heads x 8" in ops[("gated delta rule (linear attention)", "0")]
    assert "width 4" in ops[("causal conv1d", "0")]
    m = report.memory
    assert m["state_slots"] == 17 and m["state_bytes"] == 17 * per_seq and "per-sequence state" in m["summary"]
    assert check_lib.check(tiny["qwen3_next"]["hf"], mesh="tp=2").memory["state_bytes"] == 17 * per_seq // 2


def test_short_convolution_report(tiny, tmp_path):
    """LFM2 and LFM3: the short-convolution layers keep their last W - 1 inputs per sequence and the plan counts
    them, the attention layers KV per token (LFM3's sliding one with its window); Liquid's own config.json keys,
    which restate others, are accepted."""
    report = check_lib.check(tiny["lfm2"]["hf"], dtype="float32")
    assert report.supported, report.reasons
    per_seq = 2 * 64 * 4  # [W - 1, D] float32
    assert report.layers == [
        {"kind": "short convolution", "layers": "0,2", "cache": f"state {per_seq} B per sequence"},
        {"kind": "full attention", "layers": "1", "cache": "KV 256 B per token"}]
    ops = {(r["op"], r["layers"]): r["variant"] for r in report.ops}
    assert ops[("causal conv1d", "0,2")] == "depthwise causal conv1d over 64 channels, width 3, no activation"
    assert ops[("mlp", "0-2")] == "gated MLP x 128 (silu)"  # HF's sizing rule on intermediate_size 120
    assert report.memory["state_bytes"] == report.memory["state_slots"] * 2 * per_seq
    lfm3 = check_lib.check(tiny["lfm3"]["hf"], dtype="float32")
    assert lfm3.supported, lfm3.reasons
    assert lfm3.layers == [
        {"kind": "short convolution", "layers": "0,2", "cache": f"state {6 * 64 * 4 / 1024:.2f} KiB per sequence"},
        {"kind": "sliding attention (window 8)", "layers": "1", "cache": "KV 256 B per token"},
        {"kind": "full attention", "layers": "3", "cache": "KV 256 B per token"}]
    ops = {(r["op"], r["layers"]): r["variant"] for r in lfm3.ops}
    assert ops[("rope", "1")].startswith("default (theta 10000") and ops[("rope", "3")].startswith("proportional")
    legacy = variant(tiny["lfm2"]["hf"], tmp_path / "legacy", block_dim=64, conv_dim=64, conv_dim_out=64,
                     num_heads=4, theta=1000000.0, block_norm_eps=1e-5, block_ff_dim=120, tie_embedding=True,
                     block_use_swiglu=True, use_pos_enc=True, block_use_xavier_init=True, conv_use_xavier_init=True,
                     block_mlp_init_scale=1.0, block_out_init_scale=1.0)
    report = check_lib.check(legacy)
    assert report.supported, report.reasons
    assert {r["key"]: r["status"] for r in report.keys}["block_ff_dim"] == "used"


def test_kimi_linear_report(tiny):
    """Kimi Linear: its delta-attention layers are linear attention (decay per key channel) with their state, the
    MLA layer between them caches the latent and has no RoPE."""
    report = check_lib.check(tiny["kimi_linear"]["hf"], dtype="float32")
    assert report.supported, report.reasons
    # Layers 0 and 2: 2 heads x 16 for q, k and v; conv states [3, 2+2+2 heads, 16], recurrent [2, 16, 16].
    per_seq = (3 * (2 + 2 + 2) * 16 + 2 * 16 * 16) * 4
    assert report.layers == [
        {"kind": "linear attention", "layers": "0,2", "cache": f"state {per_seq / 1024:.2f} KiB per sequence"},
        {"kind": "MLA", "layers": "1", "cache": f"KV {2 * (16 + 8) * 4} B per token"}]
    ops = {(r["op"], r["layers"]): r["variant"] for r in report.ops}
    assert "2qk/2v heads x 16, per-channel decay" in ops[("gated delta rule (linear attention)", "0,2")]
    assert ops[("rope", "1")] == "none (NoPE layer)"
    assert "sigmoid_grouped" in ops[("moe grouped matmul", "1-2")] and ("mlp", "0") in ops


def test_sparse_attention_report(tiny):
    """DeepSeek-V3.2: every layer sparse, its indexer's keys cached beside the latent (and planned), the engine's
    paged decode on the gather path that reads only the selected keys."""
    report = check_lib.check(tiny["deepseek_v32"]["hf"], dtype="float32")
    assert report.supported, report.reasons
    per_token = 2 * (16 + 8) + 16  # latent + rope key, stored as key and value, and the indexer's key
    assert report.layers == [{"kind": "sparse attention (top-8 keys)", "layers": "0-1",
                              "cache": f"KV {per_token * 4} B per token"}]
    row = next(r for r in report.ops if r["op"] == "sparse attention (engine)")
    assert "top-8 keys of a 16-head indexer x 16" in row["variant"] and row["implementation"].startswith("gather")
    assert report.memory["kv_cache_bytes"] == 2 * report.memory["kv_slots"] * per_token * 4
    # GLM-5: the shared layer caches no indexer keys and says whose top-k it takes.
    glm = check_lib.check(tiny["glm_moe_dsa"]["hf"], dtype="float32")
    assert glm.supported, glm.reasons
    assert [(r["kind"], r["layers"]) for r in glm.layers] == [("sparse attention (top-8 keys)", "0-1"),
                                                              ("sparse attention (top-8 keys, shared)", "2")]
    assert glm.memory["kv_cache_bytes"] == glm.memory["kv_slots"] * (3 * per_token - 16) * 4
    assert any("an earlier layer's indexer" in r["variant"] for r in glm.ops)


def test_block_sparse_attention_report(tiny):
    """MiniMax-M3: block-sparse layers cache their indexer's key beside K and V (and are planned so), full layers
    only K and V; the engine's op says its blocks."""
    report = check_lib.check(tiny["minimax_m3"]["hf"], dtype="float32")
    assert report.supported, report.reasons
    kv = 2 * 2 * 16  # 2 kv heads x 16, key and value
    assert report.layers == [
        {"kind": "block-sparse attention (top-3 blocks of 4 keys)", "layers": "0,2",
         "cache": f"KV {(kv + 16) * 4} B per token"},
        {"kind": "full attention", "layers": "1", "cache": f"KV {kv * 4} B per token"}]
    row = next(r for r in report.ops if r["op"] == "block-sparse attention (engine)")
    assert row["variant"].endswith("top-3 blocks of 4 keys (2 local) of a 2-head indexer x 16")
    assert report.memory["kv_cache_bytes"] == report.memory["kv_slots"] * (3 * kv + 2 * 16) * 4

def test_hy_v4_report(tiny):
    """HY-V4: plain hyper-connections with post x hc_magnitude, sparse attention with sinks, the shared layers
    caching no indexer keys, dense and MoE layers where `mlp_layer_types` puts them."""
    report = check_lib.check(tiny["hy_v4"]["hf"], dtype="float32")
    assert report.supported, report.reasons
    per_token = 2 * (16 + 8)  # latent + rope key, stored as key and value; full layers add their 16 index dims
    assert report.layers == [
        {"kind": "sparse attention (top-8 keys)", "layers": "0-1,3", "cache": f"KV {(per_token + 16) * 4} B per token"},
        {"kind": "sparse attention (top-8 keys, shared)", "layers": "2,4", "cache": f"KV {per_token * 4} B per token"}]
    rows = {(r["op"], r["layers"]): r["variant"] for r in report.ops}
    assert rows[("hyper-connection", "0-4")].endswith("plain residual per stream, post x 1.5")
    assert rows[("sparse attention (engine)", "2,4")].endswith("an earlier layer's indexer, sinks")
    assert rows[("mlp", "0,3")] == "gated MLP x 128 (silu)"
    assert "top-2 sigmoid_grouped" in rows[("moe grouped matmul", "1-2,4")]


def test_glm5_next_report(tiny):
    """GLM-5-Next: the linear-attention layer's state, the indexed layers' latent with, for the layer with its own
    indexer, its keys and pooling logits per token; the pooled selection, the shared layer and the bounded decay."""
    report = check_lib.check(tiny["glm5_next"]["hf"], dtype="float32")
    assert report.supported, report.reasons
    latent = 2 * 16  # the latent as key and value
    assert report.layers[1:] == [
        {"kind": "block-sparse attention (top-2 blocks of 4 keys, learned-pooled)", "layers": "1",
         "cache": f"KV {(latent + 2 * 16) * 4} B per token"},
        {"kind": "block-sparse attention (top-2 blocks of 4 keys, learned-pooled, shared)", "layers": "2",
         "cache": f"KV {latent * 4} B per token"}]
    rows = {(r["op"], r["layers"]): r["variant"] for r in report.ops}
    assert rows[("gated delta rule (linear attention)", "0")].endswith("per-channel decay bounded below by -5")
    assert rows[("block-sparse attention (engine)", "1")].endswith("of a 8-head learned-pooled indexer x 16")
    assert rows[("block-sparse attention (engine)", "2")].endswith("of an earlier layer's indexer")
    assert "Sinkhorn" in rows[("hyper-connection", "0-2")]


def test_kv_sharing_report(tiny):
    """Gemma 4: the layers that read an earlier layer's keys and values cache nothing and say whose they read; the
    global layers' own head shape shows in their KV per token and operators, and the plan counts two layers' KV."""
    report = check_lib.check(tiny["gemma4"]["hf"], dtype="float32")
    assert report.supported, report.reasons
    sliding, full = 2 * 2 * 16 * 4, 1 * 2 * 32 * 4  # K x (key + value) x H x float32
    assert report.layers == [
        {"kind": "sliding attention (window 8)", "layers": "0", "cache": f"KV {sliding} B per token"},
        {"kind": "full attention", "layers": "1", "cache": f"KV {full} B per token"},
        {"kind": "sliding attention (window 8)", "layers": "2", "cache": "none: reads layer 0's KV"},
        {"kind": "full attention", "layers": "3", "cache": "none: reads layer 1's KV"}]
    ops = {(r["op"], r["layers"]): r["variant"] for r in report.ops}
    assert "4q/1kv heads x 32" in ops[("paged attention (engine)", "1,3")]
    assert ops[("rope", "1,3")].startswith("proportional")
    assert report.memory["kv_cache_bytes"] == report.memory["kv_slots"] * (sliding + full)


def test_kv_sharing_with_indexer_report(tiny):
    """Mistral Large 4: a layer that reads another's latent but has an indexer of its own caches that indexer's keys
    only, one without caches nothing; NoPE layers cache no roped key and report no RoPE; the plan counts it all."""
    report = check_lib.check(tiny["mistral_large4"]["hf"], dtype="float32")
    assert report.supported, report.reasons
    rope, nope, index = 2 * (16 + 8) * 4, 2 * 16 * 4, 16 * 4  # latent (+ rope key) as key and value; indexer key
    assert report.layers == [
        {"kind": "sparse attention (top-8 keys)", "layers": "0", "cache": f"KV {rope + index} B per token"},
        {"kind": "sparse attention (top-8 keys)", "layers": "1", "cache": f"KV {nope + index} B per token"},
        {"kind": "sparse attention (top-8 keys, shared)", "layers": "2", "cache": f"KV {rope} B per token"},
        {"kind": "sparse attention (top-8 keys)", "layers": "3",
         "cache": f"indexer keys {index} B per token: reads layer 0's KV"},
        {"kind": "sparse attention (top-8 keys, shared)", "layers": "4", "cache": "none: reads layer 1's KV"}]
    ops = {(r["op"], r["layers"]): r["variant"] for r in report.ops}
    assert ops[("rope", "1,4")] == "none (NoPE layer)" and ops[("rope", "0,2-3")].startswith("yarn")
    assert report.memory["kv_cache_bytes"] == report.memory["kv_slots"] * (2 * rope + nope + 3 * index)


def test_mistral_large4_derives_layer_lists_as_transformers(tiny):
    """Without the per-layer lists in config.json, the config derives what transformers wrote for the same keys
    (no_rope_layer_interval 2, index_topk_freq 2, first_k_dense_replace 2, no KV sharing)."""
    hf = json.loads((tiny["mistral_large4_derived"]["hf"] / "config.json").read_text())
    lists = ("no_rope_layers", "indexer_types", "kv_source_layers", "mlp_layer_types", "layer_types")
    config = models.config_from_hf(dict({k: v for k, v in hf.items() if k not in lists}, no_rope_layer_interval=2))
    assert config.uses_rope == tuple(bool(v) for v in hf["no_rope_layers"]) == (True, False, True, False)
    assert config.indexer_kinds == tuple(hf["indexer_types"]) and config.mlp_kinds == tuple(hf["mlp_layer_types"])
    assert config.kv_sources == tuple(None if s == i else s for i, s in enumerate(hf["kv_source_layers"]))


def test_mesh_spec_splits_memory(tiny):
    """A SPEC may ask for more devices than are visible: it is a plan. tp=2 halves the split weights."""
    one = check_lib.check(tiny["llama"]["hf"], mesh="tp=1").memory
    two = check_lib.check(tiny["llama"]["hf"], mesh="tp=2").memory
    assert two["sizes"] == {"pp": 1, "dp": 1, "ep": 1, "tp": 2}
    assert one["params_bytes"] / 2 < two["params_bytes"] < one["params_bytes"]  # norms stay replicated
    assert two["kv_cache_bytes"] == one["kv_cache_bytes"] / 2  # 2 kv heads split over tp=2
    bad = check_lib.check(tiny["llama"]["hf"], mesh="tp=3")
    assert not bad.supported and any("tp=3" in r for r in bad.reasons)


def test_reads_no_tensor_data(tiny, monkeypatch):
    from convert.safetensors_file import SafetensorsFile

    def boom(self, name):
        raise AssertionError(f"check read tensor {name}")
    monkeypatch.setattr(SafetensorsFile, "read", boom)
    assert check_lib.check(tiny["mixtral"]["hf"]).supported


def test_config_only_folder(tmp_path, tiny):
    """Before the weights are downloaded, config.json alone says whether the architecture will run."""
    cfg = json.loads((tiny["gemma3_text"]["hf"] / "config.json").read_text())
    report = check_lib.check(config_only(tmp_path / "cfg", cfg))
    assert report.supported and report.source == "config.json only" and report.notes


def test_kernel_chosen_or_fallback(tiny, monkeypatch):
    """The report traces the registry's candidates on the model's shapes: a kernel that declines is named."""
    from kernels_pallas.attention import api

    def picky(q, *args, **kwargs):
        raise NotImplementedError(f"head_dim {q.shape[-1]} below 64")

    def eager(q, k, v, **kwargs):
        return q

    backend = jax.default_backend()
    monkeypatch.setitem(api.IMPLEMENTATIONS, "picky", picky)
    monkeypatch.setitem(api.IMPLEMENTATIONS, "eager", eager)
    monkeypatch.setitem(api.CANDIDATES, backend, ("picky", "eager"))
    row = next(r for r in check_lib.check(tiny["llama"]["hf"]).ops if r["op"].startswith("attention"))
    assert row["implementation"].startswith("eager (kernel)") and "picky declined: head_dim 16 below 64" in \
        row["implementation"]
    monkeypatch.setitem(api.CANDIDATES, backend, ("picky",))
    row = next(r for r in check_lib.check(tiny["llama"]["hf"]).ops if r["op"].startswith("attention"))
    assert row["implementation"].startswith("reference (fallback")


def test_paged_attention_is_reported_per_phase(tiny):
    """Decode steps and prefill chunks may take different implementations (on the CPU, the C++ decode kernel and the
    key-block loop): the report names each."""
    row = next(r for r in check_lib.check(tiny["llama"]["hf"]).ops if r["op"].startswith("paged attention"))
    decode, prefill = row["implementation"].split(" | ")
    assert decode.startswith("decode: ") and prefill.startswith("prefill chunks: ")
    if jax.default_backend() == "cpu":
        assert decode == "decode: cpu_ffi (kernel)"
        assert prefill == ("prefill chunks: xla_blocks (kernel); cpu_ffi declined: 256 queries per row (the kernel "
                           "serves decode steps, one)")


# --- families and configs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", sorted(models.FAMILIES))
def test_family_registry_matches_family_objects(model_type):
    fam = models.family(model_type)  # the first model_type of a family is its config's default
    # Read off the dataclass: some configs refuse to be built without a sub-config (Gemma 4's vision_config).
    default = next(f.default for f in dataclasses.fields(fam.config) if f.name == "model_type")
    assert model_type in fam.model_types and default == fam.model_types[0]


def test_config_fields_keep_config_json_values():
    """Derived values are properties; the HF-key fields hold what config.json gave (or HF's default)."""
    llama = models.config_from_hf(dict(model_type="llama", hidden_size=64, num_attention_heads=4))
    assert (llama.num_key_value_heads, llama.head_dim) == (None, None)
    assert (llama.kv_heads, llama.head_size) == (4, 16) and llama.rope["rope_type"] == "default"
    qwen2 = models.config_from_hf(dict(model_type="qwen2", num_hidden_layers=2, sliding_window=8))
    assert qwen2.sliding_window == 8 and qwen2.layer_types is None and qwen2.window is None
    assert qwen2.layer_kinds == ("full_attention",) * 2 and qwen2.layer_window(1) is None
    deepseek = models.config_from_hf(dict(model_type="deepseek_v3", head_dim=7, qk_head_dim=9))
    assert (deepseek.head_dim, deepseek.qk_head_dim) == (7, 9)
    assert (deepseek.head_size, deepseek.qk_head_size) == (64, 192)  # HF recomputes both from the qk_* dims


def test_cohere2_reads_its_released_config_keys():
    """Command R7B's config.json: HF's Cohere2 keys plus switches no transformers code reads (declared, checked
    against the architecture HF computes); head_dim recomputed as HF does; three sliding layers in four, by default."""
    c = models.config_from_hf(dict(
        model_type="cohere2", hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        num_hidden_layers=8, rope_theta=50000, rope_scaling=None, sliding_window=4096, sliding_window_pattern=4,
        order_of_interleaved_layers="local_attn_first", position_embedding_type="rope_gptj", rotary_pct=1.0,
        use_embedding_sharing=True, use_gated_activation=True, use_parallel_block=True, use_parallel_embedding=True,
        cache_implementation="hybrid", logit_scale=0.25, layer_norm_eps=1e-5))
    assert c.head_size == 128 and c.rope["rope_theta"] == 50000 and c.logit_scale == 0.25
    assert [c.layer_window(i) for i in range(8)] == [4096, 4096, 4096, None] * 2


# --- refusals ----------------------------------------------------------------------------------------------------

def test_unknown_model_type_names_closest(tmp_path, tiny):
    cfg = json.loads((tiny["qwen3_moe"]["hf"] / "config.json").read_text())
    report = check_lib.check(config_only(tmp_path / "c", dict(cfg, model_type="qwen3_mo")))
    assert not report.supported and "closest supported family is 'qwen3_moe'" in report.reasons[0]
    with pytest.raises(UnsupportedArchitecture, match="'gemma3n'.*closest supported family is 'gemma3'"):
        models.family("gemma3n")


@pytest.mark.parametrize("name,changes,message", [
    ("llama", {"attention_chunk_size": 8}, "attention_chunk_size=8"),
    ("llama", {"rope_parameters": {"rope_type": "mrope", "rope_theta": 10000.0}}, "rope_type='mrope'"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4, "alpha": 3}},
     r"\['alpha'\]"),
    ("qwen3", {"hidden_act": "mish"}, "hidden_act='mish'"),
    ("gemma2", {"hidden_activation": "gelu_10"}, "hidden_activation='gelu_10'"),
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ("gemma3_text", {"layer_types": ["chunked_attention", "full_attention"]}, "chunked_attention"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
    ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob=True"),
    ("deepseek_v2", {"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ("deepseek_v2", {"topk_group": 3}, "topk_group=3"),
    ("dots1", {"use_sliding_window": False}, "use_sliding_window=False"),
    ("dots1", {"topk_method": "greedy"}, "topk_method='greedy'"),
    ("deepseek_v3", {"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ("phi3", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type"),
    ("smollm3", {"no_rope_layers": [1, 2]}, "no_rope_layers"),
    ("minimax_m2", {"attn_type_list": [0, 1]}, "attn_type_list"),
    ("minimax_m2", {"shared_intermediate_size": 64}, "shared_intermediate_size=64"),
    ("glm4_moe", {"n_group": 3}, "n_group=3"),
    ("olmo3", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters"),
    ("exaone4", {"sliding_window_pattern": "LLLG", "layer_types": None}, "sliding_window_pattern='LLLG'"),
    ("hunyuan_v1_dense", {"use_cla": True}, "use_cla=True"),
    ("hunyuan_v1_moe", {"num_shared_expert": [2, 2]}, r"num_shared_expert=\[2, 2\]"),
    ("hunyuan_v1_moe", {"moe_intermediate_size": 96}, "moe_intermediate_size=96 differs from intermediate_size"),
    ("hunyuan_v1_moe", {"moe_topk": [2]}, "fewer entries than num_hidden_layers"),
    ("hy_v3", {"mlp_layer_types": ["sparse", "moe", "dense"]}, "mlp_layer_types='moe'"),
    ("hy_v3", {"moe_router_enable_expert_bias": False}, "moe_router_enable_expert_bias=False"),
    ("kimi_linear", {"mla_use_nope": False}, "mla_use_nope=False"),
    ("kimi_linear", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
     "rope_scaling.rope_type='yarn'"),
    ("gemma4", {"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all'"),
    ("gemma4", {"num_kv_shared_layers": 4}, "num_kv_shared_layers=4"),
    ("gemma4", {"per_layer_config": {"1": {"head_dim": 32, "sliding_window": 4}}}, r"overrides \['sliding_window'\]"),
    ("mistral_large4", {"kv_source_layers": [0, 0, 2, 0, 1]}, "makes layer 1 read the latent of layer 0, of the other "
     "RoPE kind"),
    ("mistral_large4", {"kv_source_layers": [0, 1, 2, 0, 2], "no_rope_layers": [1, 0, 1, 1, 1]},
     "transformers hands layer 3 the latent of layer 2"),
    ("mistral_large4", {"kv_source_layers": [0, 1, 2, 4, 1]}, "gives layer 3 the source 4"),
    ("mistral_large4", {"no_rope_layers": [1, 0, 2, 1, 0]}, "no_rope_layers=2"),
    ("mistral_large4", {"indexer_types": ["shared", "full", "shared", "full", "shared"]}, "indexer_types='shared'"),
    ("mistral_large4", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                            "partial_rotary_factor": 0.5}}, "partial_rotary_factor=0.5"),
    ("mistral_large4", {"layer_types": ["sliding_attention"] * 5}, "layer_types='sliding_attention'"),
    ("mistral_large4", {"final_logit_softcapping": 0.0}, "final_logit_softcapping=0.0"),
    ("laguna", {"moe_apply_router_weight_on_input": True}, "moe_apply_router_weight_on_input=True"),
    ("laguna", {"gating": False}, "gating=False"),
    ("laguna", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
     "has no entry for 'full_attention'"),
    ("lfm2", {"layer_types": ["conv", "sliding_attention", "conv"]}, "layer_types='sliding_attention'"),
    ("lfm2", {"conv_dim": 32}, "conv_dim=32 differs from hidden_size=64"),
    ("lfm2", {"block_use_swiglu": False}, "block_use_swiglu=False"),
    ("lfm2", {"conv_L_cache": 1}, "conv_L_cache=1"),
    ("lfm2", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor=0.5"),
    ("lfm2_moe", {"use_expert_bias": False}, "use_expert_bias=False"),
    ("lfm3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, "has keys outside"),
    ("lfm3", {"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "no entry for the sliding_attention"),
    ("cohere", {"rotary_pct": 0.5}, "rotary_pct=0.5"),
    ("cohere", {"use_parallel_block": False}, "use_parallel_block=False"),
    ("cohere2", {"use_qk_norm": True}, "use_qk_norm=True"),
    ("cohere2", {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "chunked_attention"),
    ("olmoe", {"head_dim": 32}, "head_dim=32"),
    ("starcoder2", {"mlp_type": "moe"}, "mlp_type='moe'"),
])
def test_refused_config_values(name, changes, message, tiny, tmp_path):
    """Every math-changing value a family does not implement is refused by check, convert and load, by name."""
    folder = variant(tiny[name]["hf"], tmp_path / "v", **changes)
    report = check_lib.check(folder)
    assert not report.supported
    assert any(re.search(message, r) for r in report.reasons), report.reasons
    key = next(iter(changes))
    row = next(r for r in report.keys if r["key"] == key)
    assert row["status"] == ("unknown" if key == "attention_chunk_size" else "refused"), row
    from convert import convert_checkpoint
    with pytest.raises(UnsupportedArchitecture, match=message):
        convert_checkpoint(folder, tmp_path / "out", progress=False)


def test_load_refuses_unknown_key(tiny, converted, tmp_path):
    import day0jax

    ckpt = tmp_path / "ckpt"
    shutil.copytree(converted["mistral"], ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(dict(cfg, use_parallel_residual=True)))
    with pytest.raises(UnsupportedArchitecture, match="use_parallel_residual=True"):
        day0jax.load(ckpt)


def test_checkpoint_that_does_not_match(tiny, tmp_path):
    """Shapes come from the headers: a config that disagrees with the weights is caught before loading."""
    report = check_lib.check(variant(tiny["olmo2"]["hf"], tmp_path / "v", intermediate_size=96))
    assert not report.supported and any("mlp.down_proj.weight' has shape (64, 128), expected (64, 96)" in r
                                          for r in report.reasons), report.reasons


def test_an_unreadable_shard_does_not_hide_the_report(tiny, tmp_path):
    """A truncated or missing shard is listed as a problem (exit 2), and the family, the parameters the readable
    headers hold, the operators and the memory plan are still reported."""
    from safetensors.numpy import load_file, save_file

    src = tiny["llama"]["hf"]
    folder = tmp_path / "sharded"
    shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(folder / file))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: file for file, part in halves.items() for n in part}}))
    readable = sum(tensors[n].size for n in halves["model-00001-of-00002.safetensors"])
    broken = folder / "model-00002-of-00002.safetensors"
    broken.write_bytes(broken.read_bytes()[:100])
    for damage in ("truncated", "missing"):
        if damage == "missing":
            broken.unlink()
        report = check_lib.check(folder)
        assert not report.supported and report.family == "day0jax.models.llama", report.reasons
        assert any(r.startswith("unreadable weights:") and "model-00002-of-00002.safetensors" in r
                   for r in report.reasons), report.reasons
        assert report.parameters["checkpoint_elements"] == readable and report.parameters["model"] > readable
        assert report.ops and report.memory["kv_cache_bytes"] > 0 and report.memory["summary"], report.memory
        out = subprocess.run([sys.executable, "-m", "day0jax.check", str(folder)], capture_output=True, text=True,
                             cwd=ROOT) if damage == "missing" else None
    assert out.returncode == 2 and "unreadable weights" in out.stdout and "memory per device" in out.stdout


def test_cli_exit_codes_and_json(tiny, tmp_path):
    """`python -m day0jax.check` exits 0 for a model that will run and 2 for one that will not."""
    py = sys.executable
    ok = subprocess.run([py, "-m", "day0jax.check", str(tiny["gpt_oss"]["hf"]), "--json"], capture_output=True,
                        text=True, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr[-2000:]
    data = json.loads(ok.stdout)
    assert data["supported"] and data["family"] == "day0jax.models.gpt_oss" and data["memory"]["fits"]
    bad = variant(tiny["gpt_oss"]["hf"], tmp_path / "bad", swiglu_limit=None, experts_implementation_hint="x")
    text = subprocess.run([py, "-m", "day0jax.check", str(bad), "--mesh", "tp=2"], capture_output=True, text=True,
                          cwd=ROOT)
    assert text.returncode == 2, text.stderr[-2000:]
    assert "NOT SUPPORTED" in text.stdout and "experts_implementation_hint" in text.stdout
    assert "operators on" in text.stdout and "memory per device" in text.stdout


def test_gguf_header_only(monkeypatch):
    """The embedded SmolLM2 GGUF: config from its metadata, tensors from its header."""
    from conftest import smollm2_gguf
    from convert.gguf_source import GGUFSource

    monkeypatch.setattr(GGUFSource, "read", lambda self, name: pytest.fail(f"check read tensor {name}"))
    report = check_lib.check(smollm2_gguf())
    assert report.supported and report.source == "gguf", report.reasons
    assert report.parameters["model"] == 134_515_008
    assert set(report.parameters["checkpoint_bytes_by_dtype"]) >= {"Q4_1", "F32"}


def test_check_load_and_serve_plan_the_same(converted):
    """The same engine flags, read by the parser `serve` and `check` share, give `check` and `load` one plan."""
    import argparse

    import day0jax
    from day0jax import cli

    parser = argparse.ArgumentParser()
    cli.add_engine_arguments(parser)
    engine = cli.engine_config_from_args(parser.parse_args(
        ["--max-model-len", "96", "--max-num-seqs", "4", "--kv-cache-tokens", "512", "--chunk-sizes", "16,64"]))
    checked = check_lib.check(converted["llama"], engine=engine, dtype="float32").memory
    loaded = day0jax.load(converted["llama"], engine=engine, dtype="float32").memory_plan.to_dict()
    same = {k for k in loaded if k not in ("available_bytes", "fits")}  # free memory moves between the calls
    assert {k: checked[k] for k in same} == {k: loaded[k] for k in same}
    assert loaded["max_model_len"] == 96 and loaded["max_num_seqs"] == 4 and loaded["kv_slots"] == 512 + 16
