"""Conversion of Hugging Face folders, FP8 block-scaled weights and GGUF files, and the checkpoint it writes.

Read-back exactness: float32 sources exactly, bf16 -> bf16 bitwise. FP8 and GGUF: our dequantization equals
the reference's float32 values exactly (same formula, same bytes). GGUF model logits: 1e-3 relative to
transformers reading the same file.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

import day0jax
from conftest import ROOT, run_reference
from convert import convert_checkpoint
from convert.convert import Options, plan_sources
from convert.sources import open_source
from convert.verify import verify_checkpoint
from day0jax import models
from day0jax.core.errors import CheckpointError
from day0jax.weights import checkpoint
from families import FAMILIES, PROMPTS

GGUF_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]
GGUF_KEPT_TYPES = ["Q8_0", "Q4_0", "Q4_1", "F16"]  # the block formats day0jax keeps quantized, and a float one
GGUF_CONFIG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256)
SP_TEXTS = ["The quick brown fox", " leading space", "numbers 12345 and code def f(x): return x * 2",
            "unseen ünïcödé 日本 🤗", "multiple   spaces\n\nnewlines", "<s>special</s> tokens", ""]


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert-refs")
    llama = dict(FAMILIES["llama"][1])
    gguf = root / "tiny.gguf"
    run_reference([
        {"op": "tiny_hf", "family": "llama", "config": llama, "seed": 1, "dtype": "bfloat16",
         "out": str(root / "bf16")},
        {"op": "fp8_hf", "config": dict(llama, intermediate_size=96), "seed": 2, "block": [48, 48],
         "out": str(root / "fp8")},
        {"op": "tiny_gguf", "config": GGUF_CONFIG, "types": GGUF_TYPES, "seed": 3, "out": str(gguf)},
        {"op": "tiny_gguf", "config": GGUF_CONFIG, "types": GGUF_KEPT_TYPES, "seed": 4, "out": str(root / "kept.gguf")},
        {"op": "state", "model": str(root / "kept.gguf"), "out": str(root / "kept_state.npz")},
        {"op": "run", "model": str(root / "kept.gguf"), "prompts": [p[:12] for p in PROMPTS], "generate": 6,
         "out": str(root / "kept_run.npz")},
        {"op": "state", "model": str(gguf), "out": str(root / "gguf_state.npz")},
        {"op": "run", "model": str(gguf), "prompts": [p[:12] for p in PROMPTS], "generate": 6,
         "out": str(root / "gguf_run.npz")},
        {"op": "tiny_gguf", "config": GGUF_CONFIG, "types": ["Q2_K", "Q3_K"], "seed": 5,
         "out": str(root / "low_k.gguf")},
        {"op": "state", "model": str(root / "low_k.gguf"), "out": str(root / "low_k_state.npz")},
        {"op": "run", "model": str(root / "low_k.gguf"), "prompts": [p[:12] for p in PROMPTS], "generate": 6,
         "out": str(root / "low_k_run.npz")},
        {"op": "tokenize", "model": str(gguf), "texts": SP_TEXTS,
         "chats": [[{"role": "user", "content": "hi there"}]], "out": str(root / "gguf_tok.json")},
    ], root)
    return root


def expected_params(src, ckpt):
    """What each runtime parameter must be: the family's mapping applied to the source tensors (float32)."""
    source = open_source(src)
    config = models.config_from_hf(source.hf_config())
    infos = models.param_infos(models.abstract_model(config))
    plan = plan_sources(models.family(config.model_type), config, infos, source)
    return {i.path: plan[i.path].combine([source.read(n) for n in plan[i.path].names], i.shape) for i in infos}


def test_float32_params_read_back_exactly(tiny, converted):
    want = expected_params(tiny["llama"]["hf"], converted["llama"])
    got = checkpoint.read_params(converted["llama"])
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == np.float32
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_bf16_to_bf16_is_bitwise(refs, tmp_path):
    dst = convert_checkpoint(refs / "bf16", tmp_path / "ck", progress=False).dst
    manifest = checkpoint.read_manifest(dst)
    assert manifest["dtype"] == "bfloat16"
    got = checkpoint.read_params(dst)
    source = load_file(str(refs / "bf16" / "model.safetensors"))
    q = got["model.layers.0.self_attn.q_proj.kernel"]
    assert q.dtype == ml_dtypes.bfloat16
    src_q = source["model.layers.0.self_attn.q_proj.weight"]  # loaded by safetensors as bfloat16
    np.testing.assert_array_equal(q.view(np.uint16), src_q.reshape(q.shape).view(np.uint16))
    np.testing.assert_array_equal(got["model.norm.weight"].view(np.uint16),
                                  source["model.norm.weight"].view(np.uint16))


def test_manifest_records_sources_params_and_written_files(tiny, converted):
    dst = converted["llama"]
    m = checkpoint.read_manifest(dst)
    assert m["format_version"] == checkpoint.FORMAT_VERSION and m["source"]["kind"] == "safetensors"
    from convert.writer import file_digest
    assert m["source"]["blake3"]["model.safetensors"] == file_digest(tiny["llama"]["hf"] / "model.safetensors")
    assert m["params"]["model.layers.1.mlp.down_proj.kernel"]["shape"] == [64, 128]
    assert all((dst / f).is_file() for f in m["files"]) and any(f.startswith("params/") for f in m["files"])
    assert json.loads((dst / "config.json").read_text())["model_type"] == "llama"


def test_verify_detects_modified_and_missing_files(converted, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(converted["llama"], dst)
    assert verify_checkpoint(dst) == []
    victim = next(p for p in sorted(dst.rglob("*")) if p.is_file() and "params/" in str(p) and p.stat().st_size > 64)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    (dst / "tokenizer_config.json").unlink(missing_ok=True)
    (dst / "config.json").unlink()
    problems = verify_checkpoint(dst)
    assert any(str(victim) in p and "blake3 digest differs" in p for p in problems)
    assert any("config.json: missing" in p for p in problems)
    cli = subprocess.run([sys.executable, "-m", "convert", "--verify", str(dst)], capture_output=True, text=True)
    assert cli.returncode == 1 and "blake3 digest differs" in cli.stderr


def test_verify_reads_the_digest_the_manifest_names(converted, tmp_path):
    """Manifests written before `file_hash` existed list sha256 digests and still verify; a digest this version does
    not know is refused by name, never reported as damage."""
    from convert.writer import file_digest

    dst = tmp_path / "copy"
    shutil.copytree(converted["llama"], dst)
    manifest_path = dst / checkpoint.MANIFEST
    m = json.loads(manifest_path.read_text())
    assert m["file_hash"] == "blake3"
    m.pop("file_hash")
    m["files"] = {rel: file_digest(dst / rel, "sha256") for rel in m["files"]}
    manifest_path.write_text(json.dumps(m))
    assert verify_checkpoint(dst) == []
    m["files"]["config.json"] = "0" * 64
    manifest_path.write_text(json.dumps(m))
    assert verify_checkpoint(dst) == [f"{dst / 'config.json'}: sha256 digest differs from the manifest "
                                      "(modified or corrupt)"]
    manifest_path.write_text(json.dumps(dict(m, file_hash="md5")))
    with pytest.raises(CheckpointError, match="file_hash 'md5' is not one this version checks"):
        verify_checkpoint(dst)


def test_transformers4_style_config_converts_to_the_same_model(tiny, tmp_path):
    """rope_theta + rope_scaling (transformers 4.x) and rope_parameters (5.x) describe the same model."""
    src = tmp_path / "v4"
    shutil.copytree(tiny["llama_yarn"]["hf"], src)
    cfg = json.loads((src / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = dict(rope, type=rope.pop("rope_type"))
    (src / "config.json").write_text(json.dumps(cfg))
    model = day0jax.load(convert_checkpoint(src, tmp_path / "ck", progress=False).dst, dtype="float32")
    ref = tiny["llama_yarn"]["ref"]["logits_2"]
    assert np.abs(model.logits([PROMPTS[2]])[0] - ref).max() <= 1e-3 * np.abs(ref).max()


def test_fp8_block_scaled_weights_are_dequantized_on_request(refs, tmp_path):
    dst = convert_checkpoint(refs / "fp8", tmp_path / "ck", progress=False,
                             options=Options(dtype="float32", dequantize=True)).dst
    reference = load_file(str(refs / "fp8.reference.safetensors"))
    got = checkpoint.read_params(dst)
    w = reference["model.layers.0.mlp.down_proj.weight"]  # [64, 96]: blocks of 48 leave partial edge blocks
    np.testing.assert_array_equal(got["model.layers.0.mlp.down_proj.kernel"], w)
    q = reference["model.layers.1.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(got["model.layers.1.self_attn.q_proj.kernel"], q.reshape(4, 16, 64))
    assert "quantization_config" not in json.loads((dst / "config.json").read_text())
    dst = convert_checkpoint(refs / "fp8", tmp_path / "ck2", progress=False, options=Options(dequantize=True)).dst
    assert checkpoint.read_manifest(dst)["dtype"] == "bfloat16"  # FP8 sources default to bf16


def test_fp8_blocks_that_straddle_a_weights_inputs_are_refused_by_name(refs, tmp_path):
    """Blocks of 48 columns over 64 inputs: not kept quantized, and never silently dequantized."""

    with pytest.raises(CheckpointError,
                       match=r"FP8 tensor .model\.layers\.0\.\w+\.\w+_proj\.weight.*blocks of 48.*--dequantize"):
        convert_checkpoint(refs / "fp8", tmp_path / "ck", progress=False)
    assert not (tmp_path / "ck").exists()


@pytest.fixture(scope="module")
def gguf_ckpt(refs, tmp_path_factory):
    return convert_checkpoint(refs / "tiny.gguf", tmp_path_factory.mktemp("gguf") / "ck", progress=False,
                              options=Options(dequantize=True)).dst


@pytest.fixture(scope="module")
def kept_ckpt(refs, tmp_path_factory):
    return convert_checkpoint(refs / "kept.gguf", tmp_path_factory.mktemp("gguf-kept") / "ck", progress=False).dst


@pytest.fixture(scope="module")
def kquant_ckpt(refs, tmp_path_factory):
    """Every GGUF type, K-quants included, kept quantized (re-blocked: convert/gguf_blocks.py)."""
    return convert_checkpoint(refs / "tiny.gguf", tmp_path_factory.mktemp("gguf-kq") / "ck", progress=False).dst


@pytest.fixture(scope="module")
def low_k_ckpt(refs, tmp_path_factory):
    """Q2_K and Q3_K, kept as 4-bit codes in groups of 16."""
    return convert_checkpoint(refs / "low_k.gguf", tmp_path_factory.mktemp("gguf-lowk") / "ck", progress=False).dst


KEPT = {"Q8_0/Q4_0/Q4_1": ("kept_ckpt", "kept", {"int8/32", "int4/32", "int4/32+offset"}),
        "K-quants": ("kquant_ckpt", "gguf", {"int8/32", "int4/32", "int4/32+offset", "int8/16", "int8/32+offset"}),
        "Q2_K/Q3_K": ("low_k_ckpt", "low_k", {"int4/16", "int4/16+offset"})}


@pytest.mark.parametrize("name", sorted(KEPT))
def test_gguf_blocks_stay_quantized_and_dequantize_like_transformers(refs, request, name):
    from day0jax.layers.quantized import specs_from_config
    from kernels_pallas.quantized_linear.reference import QuantizedWeight, dequantize

    fixture, ref, formats = KEPT[name]
    ckpt = request.getfixturevalue(fixture)
    hf = json.loads((ckpt / "config.json").read_text())
    specs = specs_from_config(hf)
    assert {s.describe() for s in specs.values()} == formats
    state = dict(np.load(refs / f"{ref}_state.npz"))
    got = checkpoint.read_params(ckpt)
    for module, spec in specs.items():
        name = f"{module}.weight" if module.endswith("embed_tokens") else f"{module}.kernel"
        rows = state[name.replace(".kernel", ".weight")].shape[0]
        q = QuantizedWeight(got[f"{name}.codes"].reshape(rows, -1), got[f"{name}.scale"].reshape(rows, -1),
                            got[f"{name}.offset"].reshape(rows, -1) if spec.offset else None, spec.kind, spec.group)
        np.testing.assert_array_equal(np.asarray(dequantize(q)), state[name.replace(".kernel", ".weight")],
                                      err_msg=name)
    stored = sum(a.nbytes for a in got.values())
    assert stored < 0.4 * sum(a.size * 4 for a in state.values())  # kept as blocks, not float32


@pytest.mark.parametrize("name", sorted(KEPT))
def test_gguf_quantized_model_matches_transformers(refs, request, name):
    """Kept in blocks, computed by the quantized op: transformers' logits (which dequantizes to float32) within
    the float32 tolerance of the other GGUF test, and its greedy tokens through the engine."""
    fixture, ref, _ = KEPT[name]
    model = day0jax.load(request.getfixturevalue(fixture), dtype="float32")
    assert any(call.op == "quantized_linear" for _, call in model.module.op_calls())
    ref = dict(np.load(refs / f"{ref}_run.npz"))
    for i, p in enumerate(PROMPTS):
        ours = model.logits([p[:12]])[0]
        assert np.abs(ours - ref[f"logits_{i}"]).max() <= 1e-3 * np.abs(ref[f"logits_{i}"]).max()
        assert model.generate([p[:12]], 6, ignore_eos=True)[0] == ref[f"generated_{i}"].tolist()


def test_gguf_every_type_dequantizes_like_transformers(refs, gguf_ckpt):
    state = dict(np.load(refs / "gguf_state.npz"))
    got = checkpoint.read_params(gguf_ckpt)
    for name, value in got.items():
        hf = name.replace(".kernel", ".weight")
        want = state[hf]
        if name.endswith(".kernel"):
            want = want.reshape(value.shape)
        np.testing.assert_array_equal(value, want, err_msg=name)
    assert len(got) == len(state)


def test_gguf_model_matches_transformers(refs, gguf_ckpt):
    model = day0jax.load(gguf_ckpt, dtype="float32")  # transformers' dtype; a GPU's default is bfloat16
    ref = dict(np.load(refs / "gguf_run.npz"))
    for i, p in enumerate(PROMPTS):
        prompt = p[:12]
        ours = model.logits([prompt])[0]
        assert np.abs(ours - ref[f"logits_{i}"]).max() <= 1e-3 * np.abs(ref[f"logits_{i}"]).max()
        assert model.generate([prompt], 6, ignore_eos=True)[0] == ref[f"generated_{i}"].tolist()


def test_gguf_sentencepiece_tokenizer_matches_transformers(refs, gguf_ckpt):
    ref = json.loads((refs / "gguf_tok.json").read_text())
    tok = day0jax.load(gguf_ckpt).tokenizer
    for text, ids, decoded in zip(SP_TEXTS, ref["texts"], ref["decoded"]):
        assert tok.encode(text) == ids, repr(text)
        assert tok.decode(ids) == decoded, repr(text)
    assert tok.render_chat([{"role": "user", "content": "hi there"}]) == ref["chat_texts"][0]
    assert tok.apply_chat_template([{"role": "user", "content": "hi there"}]) == ref["chats"][0]


def test_existing_destination_needs_force(converted, tiny, tmp_path):

    dst = tmp_path / "ck"
    convert_checkpoint(tiny["llama"]["hf"], dst, progress=False)
    with pytest.raises(CheckpointError, match="already exists.*--force"):
        convert_checkpoint(tiny["llama"]["hf"], dst, progress=False)
    convert_checkpoint(tiny["mistral"]["hf"], dst, force=True, progress=False)
    assert json.loads((dst / "config.json").read_text())["model_type"] == "mistral"
    assert verify_checkpoint(dst) == []


def test_cli_prints_progress_and_summary(tiny, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "convert", str(tiny["llama"]["hf"]), str(tmp_path / "ck")],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "converting llama" in proc.stderr and "100%" in proc.stderr  # the tqdm bar over bytes
    assert "M parameters" in proc.stdout and "MB/s" in proc.stdout and "MB in" in proc.stdout
    # Where the time went, phase by phase.
    phases = dict(re.findall(r"([a-z][a-z0-9 ]*) ([0-9.]+)s", proc.stdout.split("(threads: ")[1]))
    assert set(phases) == {"read and build", "wait for writers", "write", "fsync", "digest", "source digest"}


def test_sigkill_midway_leaves_no_destination(tiny, tmp_path):
    """A conversion killed half-way leaves no DST; the next one cleans its temporary folder and succeeds."""
    from conftest import smollm2_gguf

    dst = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-m", "convert", "--quiet", str(smollm2_gguf()), str(dst)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline:  # wait until the first parameter group is being written
        tmp = list(tmp_path.glob(".ck.tmp-*"))
        if tmp and list((tmp[0] / "params").glob("*")):
            break
        time.sleep(0.05)
    else:
        pytest.fail("conversion never started writing")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not dst.exists()
    assert list(tmp_path.glob(".ck.tmp-*"))  # the debris is hidden, not a checkpoint
    convert_checkpoint(tiny["llama"]["hf"], dst, progress=False)  # same destination, killed run's debris removed
    assert not list(tmp_path.glob(".ck.tmp-*"))
    assert verify_checkpoint(dst) == []


def test_deepseek_multi_token_prediction_layers_are_dropped_by_config(tiny, tmp_path):
    """Released DeepSeek-V3 checkpoints carry `num_nextn_predict_layers` extra layers after the last one: kept by
    default (whole, or the conversion names what is missing; tests/test_mtp.py), dropped with `--no-mtp`, and a
    layer past them is no MTP layer."""
    from safetensors.numpy import save_file

    from convert.convert import Options

    src = tmp_path / "src"
    shutil.copytree(tiny["deepseek_v3"]["hf"], src)
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    tensors = load_file(str(src / "model.safetensors"))
    mtp = {f"model.layers.{layers}.eh_proj.weight": np.ones((4, 8), np.float32)}
    save_file(dict(tensors, **mtp), str(src / "model.safetensors"))
    convert_checkpoint(src, tmp_path / "ok", progress=False, options=Options(no_mtp=True))
    with pytest.raises(CheckpointError, match=rf"tensor 'model\.layers\.{layers}\..*is missing"):
        convert_checkpoint(src, tmp_path / "partial", progress=False)
    save_file(dict(tensors, **{f"model.layers.{layers + 1}.eh_proj.weight": np.ones((4, 8), np.float32)}),
              str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"model\.layers\.{layers + 1}\.eh_proj\.weight.*is not used"):
        convert_checkpoint(src, tmp_path / "bad", progress=False, options=Options(no_mtp=True))


def test_kimi_linear_moonshot_layout_converts_to_the_same_model(tiny, tmp_path):
    """Kimi Linear as Moonshot publishes it: the layer kinds and linear-attention sizes only in `linear_attn_config`
    (1-indexed), the dense MLP under `mlp` (transformers' own save moves it under `block_sparse_moe`, with the MoE
    layers), and Moonshot's keys transformers does not read. The same weights give transformers' logits."""
    from safetensors.numpy import save_file

    src = tmp_path / "src"
    shutil.copytree(tiny["kimi_linear"]["hf"], src)
    cfg = json.loads((src / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim"):
        del cfg[key]
    cfg.update(linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2], "num_heads": 2, "head_dim": 16,
                                   "short_conv_kernel_size": 4},
               head_dim=72, mla_use_nope=True, moe_router_activation_func="sigmoid", moe_layer_freq=1,
               use_grouped_topk=True, num_nextn_predict_layers=0, rope_theta=10000.0, rope_scaling=None)
    (src / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(src / "model.safetensors"))
    dense = "model.layers.0.block_sparse_moe."
    save_file({k.replace(dense, "model.layers.0.mlp.") if k.startswith(dense) else k: v for k, v in tensors.items()},
              str(src / "model.safetensors"))
    model = day0jax.load(convert_checkpoint(src, tmp_path / "d0", progress=False).dst, dtype="float32")
    assert model.config.layer_kinds == ("linear_attention", "full_attention", "linear_attention")
    assert model.config.mlp_kinds == ("dense", "sparse", "sparse") and model.config.kda_shape == (2, 16, 4)
    for i, prompt in enumerate(PROMPTS):
        ours, ref = model.logits([prompt])[0], tiny["kimi_linear"]["ref"][f"logits_{i}"]
        assert np.abs(ours - ref).max() <= 1e-3 * np.abs(ref).max(), f"prompt {i}"


def test_deepseek_v4_released_tensor_names_convert_to_the_same_model(tiny, tmp_path):
    """DeepSeek-V4 as DeepSeek publishes it: transformers' own save without the `model.` prefix, the embeddings as
    `embed`, the hyper head's tensors as `hc_head_fn|base|scale`, and multi-token-prediction layers (`mtp.*`,
    kept by default: tests/test_mtp.py), left out with --no-mtp; an incomplete MTP layer is refused, naming the
    tensor and --no-mtp. The same weights give transformers' logits."""
    from safetensors.numpy import save_file

    src = tmp_path / "src"
    shutil.copytree(tiny["deepseek_v4"]["hf"], src)

    def released(name: str) -> str:
        name = "embed.weight" if name == "model.embed_tokens.weight" else name
        return re.sub(r"^model\.", "", re.sub(r"^model\.hc_head\.hc_", "hc_head_", name))

    tensors = {released(k): v for k, v in load_file(str(src / "model.safetensors")).items()}
    assert {"embed.weight", "hc_head_fn", "layers.0.attn.wq_a.weight", "layers.0.ffn.experts.0.w1.weight"} <= set(
        tensors)
    tensors["mtp.0.emb.tok_emb.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"mtp\.0\..* is missing; .*incomplete \(--no-mtp"):
        convert_checkpoint(src, tmp_path / "with", progress=False)
    model = day0jax.load(convert_checkpoint(src, tmp_path / "d0", progress=False, options=Options(no_mtp=True)).dst,
                         dtype="float32")
    for i, prompt in enumerate(PROMPTS):
        ours, ref = model.logits([prompt])[0], tiny["deepseek_v4"]["ref"][f"logits_{i}"]
        # Float32, as test_models.py's parity (about 1.6e-6 relative seen).
        assert np.abs(ours - ref).max() <= 1e-5 * np.abs(ref).max(), f"prompt {i}"


def test_hy_v3_transformers5_layout_converts_to_the_same_model(tiny, tmp_path):
    """HY-V3 in the transformers 5 layout Tencent converts its release to: HF's module names (`mlp.gate`,
    `mlp.e_score_correction_bias`, `mlp.shared_experts`), each layer's experts fused (`gate_up_proj` [E, 2F, D], gate
    rows first, `down_proj` [E, D, F]), Tencent's own config keys with the values transformers' model runs, and a
    multi-token-prediction layer after the last one (kept by default: tests/test_mtp.py), left out with --no-mtp.
    The same weights give transformers' logits."""
    from safetensors.numpy import save_file

    src = tmp_path / "src"
    shutil.copytree(tiny["hy_v3"]["hf"], src)
    cfg = json.loads((src / "config.json").read_text())
    L = cfg["num_hidden_layers"]
    cfg.update(moe_router_use_sigmoid=True, moe_router_enable_expert_bias=True, route_norm=True, qk_norm=True,
               expert_hidden_dim=cfg["moe_intermediate_size"], num_nextn_predict_layers=1,
               enable_attention_fp32_softmax=True, enable_lm_head_fp32=True, use_grouped_mm=True, eod_token_id=2)
    (src / "config.json").write_text(json.dumps(cfg))
    saved = load_file(str(src / "model.safetensors"))
    tensors = {k.replace(".mlp.router.gate.", ".mlp.gate.").replace(".mlp.expert_bias", ".mlp.e_score_correction_bias")
               .replace(".mlp.shared_mlp.", ".mlp.shared_experts."): v
               for k, v in saved.items() if ".mlp.experts." not in k}
    for layer in (0, 2):
        p = f"model.layers.{layer}.mlp.experts"
        E = cfg["num_experts"]
        tensors[f"{p}.gate_up_proj"] = np.stack([np.concatenate([saved[f"{p}.{e}.gate_proj.weight"],
                                                                 saved[f"{p}.{e}.up_proj.weight"]]) for e in range(E)])
        tensors[f"{p}.down_proj"] = np.stack([saved[f"{p}.{e}.down_proj.weight"] for e in range(E)])
    tensors[f"model.layers.{L}.eh_proj.weight"] = np.ones((64, 128), np.float32)
    save_file(tensors, str(src / "model.safetensors"))
    model = day0jax.load(convert_checkpoint(src, tmp_path / "d0", progress=False, options=Options(no_mtp=True)).dst,
                         dtype="float32")
    for i, prompt in enumerate(PROMPTS):
        ours, ref = model.logits([prompt])[0], tiny["hy_v3"]["ref"][f"logits_{i}"]
        # Float32, as test_models.py's parity (about 1e-6 relative seen).
        assert np.abs(ours - ref).max() <= 1e-5 * np.abs(ref).max(), f"prompt {i}"
