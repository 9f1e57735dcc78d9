"""Weights kept quantized from the checkpoint to the device: `--quantize` at conversion, FP8 sources kept as FP8,
refusals by name, the readiness report and the memory plan.

The runtime's arithmetic on quantized weights is checked against the same model in float32 whose weights are the
dequantized values (written as an ordinary float checkpoint): logits within 1e-5 of the largest (float32 sums in
another order, through every layer), and the same greedy tokens through the engine. The quantization's own error
against the unquantized model is reported by `day0jax.verify`, and bounded here loosely (top-1 agreement).
"""

import json
import math
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import day0jax
from convert import convert_checkpoint
from convert.convert import Options
from day0jax.core.errors import CheckpointError
from day0jax.layers.quantized import specs_from_config
from day0jax.weights import checkpoint
from families import PROMPTS, parity_engine
from kernels_pallas.quantized_linear.reference import QuantizedWeight, dequantize

RTOL = 1e-5
NEW_TOKENS = 8


def dequantized_copy(src, quantized_ckpt, dst):
    """`src` (a HF folder) with every weight the quantized checkpoint stores quantized replaced by its dequantized
    values, as float32: the float model the quantized one must compute."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    params = checkpoint.read_params(quantized_ckpt)
    specs = specs_from_config(json.loads((quantized_ckpt / "config.json").read_text()))
    def restore(hf_name, name, index=()):
        rows = tensors[hf_name].shape[0]
        part = lambda suffix: params[f"{name}.{suffix}"][index].reshape(rows, -1)  # noqa: E731
        q = QuantizedWeight(part("codes"), part("scale"), part("offset") if spec.offset else None, spec.kind,
                            spec.group, part("global_scale") if spec.kind.startswith("nvfp4") else None)
        tensors[hf_name] = np.asarray(dequantize(q)).astype(tensors[hf_name].dtype)

    for key, spec in specs.items():
        if ".experts." in key:  # stacked experts [E, out, in'] <- each expert's HF tensor
            prefix, proj = key.rsplit(".experts.", 1)
            for e in range(params[f"{key}.codes"].shape[0]):
                restore(f"{prefix}.experts.{e}.{proj}.weight", key, e)
        else:
            restore(f"{key}.weight", f"{key}.weight" if key.endswith("embed_tokens") else f"{key}.kernel")
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def compare(quantized_ckpt, float_ckpt, rtol=RTOL):
    # Its quantized kernel, not a fallback; one decode batch size for the three prompts.
    q = day0jax.load(quantized_ckpt, dtype="float32", kernels="strict", engine=parity_engine())
    f = day0jax.load(float_ckpt, dtype="float32", kernels="strict", engine=parity_engine())
    for p in PROMPTS[:3]:
        want = f.logits([p])[0]
        assert np.abs(q.logits([p])[0] - want).max() <= rtol * np.abs(want).max()
    assert q.generate(PROMPTS[:3], NEW_TOKENS, ignore_eos=True) == f.generate(PROMPTS[:3], NEW_TOKENS, ignore_eos=True)
    return q


@pytest.mark.parametrize("name, kind, group", [("llama", "int8", 32), ("llama", "int4", 16), ("llama", "fp8", 16),
                                               ("qwen2_moe", "int4", 32)])
def test_quantize_at_conversion_computes_the_dequantized_model(tiny, converted, tmp_path, name, kind, group):
    src = tiny[name]["hf"]
    summary = convert_checkpoint(src, tmp_path / "q", progress=False,
                                 options=Options(quantize=kind, group_size=group))
    ckpt = summary.dst
    specs = specs_from_config(json.loads((ckpt / "config.json").read_text()))
    kinds = {m: s.kind for m, s in specs.items()}
    assert kinds["model.embed_tokens"] == ("int8" if kind == "int4" else kind)
    assert kinds["model.layers.0.mlp.down_proj" if name == "llama" else "model.layers.0.self_attn.q_proj"] == kind
    assert "model.layers.0.self_attn.o_proj" in specs  # groups of 32 over heads of 16: they span two heads
    stored = sum(a.nbytes for a in checkpoint.read_params(ckpt).values())
    assert stored < 0.6 * sum(a.nbytes for a in checkpoint.read_params(converted[name]).values())
    floats = convert_checkpoint(dequantized_copy(src, ckpt, tmp_path / "deq"), tmp_path / "f", progress=False).dst
    model = compare(ckpt, floats)
    # The quantization error itself: the quantized model mostly picks transformers' next tokens on the source.
    ref = tiny[name]["ref"]
    agree = np.mean([np.mean(np.argmax(model.logits([p])[0], -1) == np.argmax(ref[f"logits_{i}"], -1))
                     for i, p in enumerate(PROMPTS[:3])])
    assert agree >= 0.5, agree


def test_moe_experts_are_quantized_routers_stay_float(tiny):
    from convert.convert import _plan

    plan = _plan(tiny["qwen2_moe"]["hf"], Options(quantize="int8"))
    quantized = [p for p, info in plan.stored.items() if info.metadata.get("quantized")]
    assert any("self_attn" in p for p in quantized) and any("shared_expert." in p for p in quantized)
    # Each expert's [out, in] map, stacked: codes [E, out, in], one scale per group of inputs.
    assert plan.stored["model.layers.1.mlp.experts.gate_proj.codes"].shape == (4, 32, 64)
    assert plan.stored["model.layers.1.mlp.experts.down_proj.scale"].shape == (4, 64, 1)
    assert not any("gate.kernel" in p or "shared_expert_gate" in p for p in quantized)  # routers and 1-output gates


def fp8_source(tiny, dst, block=(32, 32), name="llama"):
    """Tiny `name` with its projections (each expert's too) as float8_e4m3fn and DeepSeek-V3-style block scales,
    written here."""
    shutil.copytree(tiny[name]["hf"], dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        w = tensors[name].astype(np.float32)
        rows, cols = w.shape
        br, bc = block
        scale = np.zeros((-(-rows // br), cols // bc), np.float32)
        codes = np.zeros_like(w)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                tile = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
                scale[i, j] = max(np.abs(tile).max(), 1e-12) / 448
                codes[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = tile / scale[i, j]
        tensors[name] = codes.astype(ml_dtypes.float8_e4m3fn)
        tensors[name + "_scale_inv"] = scale
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block),
                                     "activation_scheme": "dynamic", "fmt": "e4m3"}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_fp8_source_stays_fp8_and_computes_its_dequantized_model(tiny, tmp_path):
    src = fp8_source(tiny, tmp_path / "fp8", block=(48, 32))  # row blocks cut across the 64 and 128 rows
    kept = convert_checkpoint(src, tmp_path / "kept", progress=False, options=Options(dtype="float32")).dst
    params = checkpoint.read_params(kept)
    codes = params["model.layers.0.mlp.up_proj.kernel.codes"]
    assert codes.dtype == ml_dtypes.float8_e4m3fn and codes.shape == (128, 64)
    assert params["model.layers.0.mlp.up_proj.kernel.scale"].shape == (128, 2)
    floats = convert_checkpoint(src, tmp_path / "float", progress=False,
                                options=Options(dtype="float32", dequantize=True)).dst
    compare(kept, floats)


def test_fp8_moe_with_mla_keeps_experts_fp8_and_reads_kv_b_proj_dequantized(tiny, tmp_path):
    """DeepSeek-V3's FP8 layout: every projection FP8, the routed experts one tensor each. The experts are kept
    stacked as FP8; MLA's kv_b_proj, which the attention reads itself, is read dequantized and counted."""
    from convert.convert import _plan

    src = fp8_source(tiny, tmp_path / "fp8", block=(16, 16), name="deepseek_v3")
    plan = _plan(src, Options(dtype="float32"))
    assert plan.stored["model.layers.1.mlp.experts.gate_proj.codes"].dtype == ml_dtypes.float8_e4m3fn
    assert plan.stored["model.layers.1.mlp.experts.gate_proj.codes"].shape == (8, 32, 64)
    assert not plan.stored["model.layers.0.self_attn.kv_b_proj.kernel"].metadata.get("quantized")
    assert "3 quantized source tensors read dequantized (the runtime keeps them in float)" in plan.quant.summary()
    kept = convert_checkpoint(src, tmp_path / "kept", progress=False, options=Options(dtype="float32")).dst
    floats = convert_checkpoint(src, tmp_path / "float", progress=False,
                                options=Options(dtype="float32", dequantize=True)).dst
    compare(kept, floats)


# FP8 checkpoints with one scale per tensor or per output channel, as each format writes them:
# (quant_method, extra quantization_config keys, scale tensor suffix, scale shape: "tensor" or "channel",
#  activation scales written beside).
FP8_SCALED = {
    "fp8-per-tensor": ("fp8", {"weight_block_size": None}, "_scale_inv", "tensor", False),  # transformers' FP8
    "fp8-autofp8": ("fp8", {"activation_scheme": "static"}, "_scale", "tensor", True),
    "fbgemm-per-channel": ("fbgemm_fp8", {"activation_scale_ub": 1200.0}, "_scale", "channel", False),
}


def fp8_llama(tiny, dst, quantization_config, scales, *, seed, suffix="_scale", input_scales=False, replace=None):
    """Tiny llama whose projections are random float8_e4m3fn codes, each with the scale tensor `X.weight{suffix}`
    that `scales(O, I, rng)` returns as (stored scale, its expansion over [O, I] by broadcasting), and with
    `input_scales` an activation scale `X.input_scale` beside; tensors in `replace` written instead. Returns the
    folder and the float weights the stored values mean."""
    shutil.copytree(tiny["llama"]["hf"], dst)
    tensors = load_file(str(dst / "model.safetensors"))
    rng = np.random.default_rng(seed)
    meant = {}
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        O, I = tensors[name].shape
        codes = (rng.standard_normal((O, I)) * 64).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn)
        scale, full = scales(O, I, rng)
        tensors[name], tensors[name + suffix] = codes, scale
        if input_scales:
            tensors[name[: -len("weight")] + "input_scale"] = np.array(0.01, np.float32)
        meant[name] = codes.astype(np.float32) * full
    save_file({**tensors, **(replace or {})}, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst, meant


def fp8_scaled_source(tiny, dst, layout, replace=None):
    """Tiny llama with one FP8 scale per tensor or per row, in the `FP8_SCALED[layout]` format (see `fp8_llama`)."""
    method, extra, suffix, per, activations = FP8_SCALED[layout]

    def scales(O, I, rng):
        scale = np.asarray(rng.uniform(0.5, 1.5, (O, 1) if per == "channel" else ()) * 1e-4, np.float32)
        return scale, scale

    return fp8_llama(tiny, dst, {"quant_method": method, **extra}, scales, seed=7, suffix=suffix,
                     input_scales=activations, replace=replace)


def assert_kept_fp8_means(ckpt, meant, group, name="model.layers.1.mlp.down_proj"):
    """The kept FP8 weight `name`: groups of `group` inputs, dequantizing exactly to the values the source meant."""
    spec = specs_from_config(json.loads((ckpt / "config.json").read_text()))[name]
    assert (spec.kind, spec.group) == ("fp8", group)
    params = checkpoint.read_params(ckpt)
    q = QuantizedWeight(params[f"{name}.kernel.codes"], params[f"{name}.kernel.scale"], None, "fp8", group)
    np.testing.assert_array_equal(np.asarray(dequantize(q)), meant[f"{name}.weight"])


@pytest.mark.parametrize("layout", sorted(FP8_SCALED))
def test_fp8_per_tensor_and_per_channel_scales_stay_fp8(tiny, tmp_path, layout):
    src, meant = fp8_scaled_source(tiny, tmp_path / "src", layout)
    kept = convert_checkpoint(src, tmp_path / "kept", progress=False, options=Options(dtype="float32")).dst
    assert_kept_fp8_means(kept, meant, group=128)  # one group spanning each row of down_proj's 128 inputs
    floats = convert_checkpoint(src, tmp_path / "float", progress=False,
                                options=Options(dtype="float32", dequantize=True)).dst
    name = "model.layers.1.mlp.down_proj"
    np.testing.assert_array_equal(checkpoint.read_params(floats)[f"{name}.kernel"], meant[f"{name}.weight"])
    if layout == "fbgemm-per-channel":  # the arithmetic of row-spanning FP8 groups, against the float model
        compare(kept, floats)
        from day0jax import check

        report = check.check(str(src), dtype="float32")  # before conversion: the operators the weights will take
        assert "fp8/128" in report.quantization
        assert any(op["op"] == "quantized_linear" and "groups of 128" in op["variant"] for op in report.ops)


def test_other_quantization_methods_are_refused_by_name(tiny, tmp_path):
    src = tmp_path / "hqq"
    shutil.copytree(tiny["llama"]["hf"], src)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "hqq", "nbits": 4, "group_size": 64}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quant_method 'hqq'"):
        convert_checkpoint(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_quantize_refuses_a_quantized_source_and_bad_groups(tiny, tmp_path):
    src = fp8_source(tiny, tmp_path / "fp8")
    with pytest.raises(CheckpointError, match="already quantized.*--dequantize"):
        convert_checkpoint(src, tmp_path / "a", progress=False, options=Options(quantize="int8"))
    with pytest.raises(CheckpointError, match="--group-size 0"):
        convert_checkpoint(tiny["llama"]["hf"], tmp_path / "b", progress=False,
                           options=Options(quantize="int8", group_size=0))
    # --dequantize then --quantize: FP8 read as float, rounded to int8
    ckpt = convert_checkpoint(src, tmp_path / "c", progress=False,
                              options=Options(quantize="int8", dequantize=True)).dst
    assert {s.kind for s in specs_from_config(json.loads((ckpt / "config.json").read_text())).values()} == {"int8"}


def test_check_and_the_planner_count_quantized_bytes(tiny, converted, tmp_path):
    from day0jax import check

    ckpt = convert_checkpoint(tiny["llama"]["hf"], tmp_path / "q", progress=False,
                              options=Options(quantize="int4", group_size=16)).dst
    report = check.check(str(ckpt), dtype="float32")
    assert report.supported and "int4/16+offset" in report.quantization
    assert any(op["op"] == "quantized_linear" for op in report.ops)
    plain = check.check(str(converted["llama"]), dtype="float32")
    assert report.parameters["model"] == plain.parameters["model"]  # weights counted as weights, not bytes
    stored = sum(a.nbytes for a in checkpoint.read_params(ckpt).values())
    model = day0jax.load(ckpt, dtype="float32")
    assert math.isclose(model.memory_plan.params_bytes, stored, rel_tol=0.01)
    assert "int4" in check.render(report)


def compressed_tensors_source(tiny, dst, *, bits: int, group: int | None, symmetric: bool = True):
    """Tiny llama as llm-compressor writes it (format documented by compressed-tensors): 4-bit values v (signed,
    or unsigned with zero points) packed as v + 8, eight per int32 from the lowest bits, zero points packed the same
    way along the rows; 8-bit values in an int8 `weight`; lm_head left float ("ignore"). Returns the folder and the
    float weights the stored values mean."""
    shutil.copytree(tiny["llama"]["hf"], dst)
    tensors = load_file(str(dst / "model.safetensors"))
    rng = np.random.default_rng(5)
    meant = {}
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        O, I = tensors[name].shape
        g = group or I
        scale = (rng.uniform(0.5, 1.5, (O, I // g)) * 0.02).astype(np.float16)
        base = name[: -len("weight")]
        del tensors[name]
        if bits == 4:
            low, high = (-8, 8) if symmetric else (0, 16)
            v = rng.integers(low, high, (O, I))
            zero = np.zeros((O, I // g), np.int64) if symmetric else rng.integers(0, 16, (O, I // g))
            stored = (v + 8 if symmetric else v).astype(np.uint32)  # unsigned values as packed
            words = (stored.reshape(O, I // 8, 8) << (np.arange(8, dtype=np.uint32) * 4)).sum(-1, dtype=np.uint32)
            tensors[base + "weight_packed"] = words.view(np.int32)
            tensors[base + "weight_shape"] = np.array([O, I], np.int64)
            if not symmetric:
                zp = zero.astype(np.uint32).reshape(O // 8, 8, I // g)
                tensors[base + "weight_zero_point"] = (zp << (np.arange(8, dtype=np.uint32) * 4)[None, :, None]) \
                    .sum(1, dtype=np.uint32).view(np.int32)
            w = ((v - zero.repeat(g, 1)) if not symmetric else v) * scale.astype(np.float32).repeat(g, 1)
        else:
            v = rng.integers(-127, 128, (O, I)).astype(np.int8)
            tensors[base + "weight"] = v
            w = v.astype(np.float32) * scale.astype(np.float32).repeat(g, 1)
        tensors[base + "weight_scale"] = scale
        meant[name] = w.astype(np.float32)
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    strategy = {"strategy": "group", "group_size": group} if group else {"strategy": "channel"}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized" if bits == 4 else "int-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                      "weights": {"num_bits": bits, "type": "int", "symmetric": symmetric,
                                                  **strategy}}},
        "ignore": ["lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    return dst, meant


@pytest.mark.parametrize("bits, group, symmetric", [(4, 32, True), (4, 16, False), (8, None, True)])
def test_compressed_tensors_stay_quantized_and_compute_their_values(tiny, tmp_path, bits, group, symmetric):
    src, meant = compressed_tensors_source(tiny, tmp_path / "ct", bits=bits, group=group, symmetric=symmetric)
    kept = convert_checkpoint(src, tmp_path / "kept", progress=False, options=Options(dtype="float32")).dst
    specs = specs_from_config(json.loads((kept / "config.json").read_text()))
    assert {s.kind for s in specs.values()} == {"int4" if bits == 4 else "int8"}
    assert all(s.offset == (not symmetric) for s in specs.values())
    params = checkpoint.read_params(kept)
    name = "model.layers.1.mlp.down_proj"
    spec = specs[name]
    q = QuantizedWeight(params[f"{name}.kernel.codes"], params[f"{name}.kernel.scale"],
                        params.get(f"{name}.kernel.offset"), spec.kind, spec.group)
    np.testing.assert_array_equal(np.asarray(dequantize(q)), meant[f"{name}.weight"])
    floats = convert_checkpoint(src, tmp_path / "float", progress=False,
                                options=Options(dtype="float32", dequantize=True)).dst
    np.testing.assert_array_equal(checkpoint.read_params(floats)[f"{name}.kernel"], meant[f"{name}.weight"])
    # Random int8 codes over whole rows make weights up to 127 x 0.03, a hundred times the model's own: activations
    # far larger than the logits they end in, so float32 sums in another order differ by up to 1.2e-5 of them here
    # (a 2-core AVX-512 Xeon, the same with the reference kernel); the other formats stay within RTOL.
    compare(kept, floats, rtol=3e-5 if bits == 8 else RTOL)


def test_fp8_scales_of_unknown_layouts_are_refused_by_name(tiny, tmp_path):
    src, _ = fp8_scaled_source(tiny, tmp_path / "src", "fbgemm-per-channel",
                               replace={"model.layers.0.mlp.up_proj.weight_scale": np.ones((128, 2), np.float32)})
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.up_proj.weight_scale' has shape \(128, 2\)"):
        convert_checkpoint(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# compressed-tensors FP8 strategies: (weights entry beyond type/bits, the scale's shape for an [O, I] weight, the
# group the runtime keeps).
FP8_STRATEGIES = {
    "tensor": ({"strategy": "tensor"}, lambda O, I: (1,), lambda I: I),
    "channel": ({"strategy": "channel"}, lambda O, I: (O, 1), lambda I: I),
    "group": ({"strategy": "group", "group_size": 32}, lambda O, I: (O, I // 32), lambda I: 32),
    "block": ({"strategy": "block", "block_structure": [48, 32]}, lambda O, I: (-(-O // 48), I // 32),
              lambda I: 32),
}


def compressed_fp8_source(tiny, dst, strategy):
    """Tiny llama as llm-compressor's FP8 schemes write it ('float-quantized': float8_e4m3fn `weight`, float32
    `weight_scale` per tensor, channel, group or block), with dynamic FP8 input activations as FP8_DYNAMIC and
    FP8_BLOCK do (see `fp8_llama`)."""
    entry, scale_shape, _ = FP8_STRATEGIES[strategy]

    def scales(O, I, rng):
        scale = (rng.uniform(0.5, 1.5, scale_shape(O, I)) * 1e-4).astype(np.float32)
        if strategy == "block":
            return scale, np.repeat(np.repeat(scale, 48, 0), 32, 1)[:O]
        if strategy == "group":
            return scale, np.repeat(scale, 32, 1)
        return scale, scale.reshape(-1, 1)  # one per tensor or per row, over the whole row

    config = {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "input_activations": {"num_bits": 8, "type": "float", "dynamic": True,
                                                            "strategy": "token", "symmetric": True},
                                      "weights": {"num_bits": 8, "type": "float", "symmetric": True, **entry}}},
        "ignore": ["lm_head"]}
    return fp8_llama(tiny, dst, config, scales, seed=9)


@pytest.mark.parametrize("strategy", sorted(FP8_STRATEGIES))
def test_compressed_tensors_fp8_stays_fp8_and_its_activations_stay_float(tiny, tmp_path, strategy, caplog):
    src, meant = compressed_fp8_source(tiny, tmp_path / "ct", strategy)
    with caplog.at_level("WARNING"):
        kept = convert_checkpoint(src, tmp_path / "kept", progress=False, options=Options(dtype="float32")).dst
    assert "stay in float" in caplog.text
    if strategy == "tensor":  # FP4 and other float widths are refused by name
        config = json.loads((src / "config.json").read_text())
        config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
        (src / "config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointError, match="float weights .*'num_bits': 4.* not supported"):
            convert_checkpoint(src, tmp_path / "fp4", progress=False)
    assert_kept_fp8_means(kept, meant, group=FP8_STRATEGIES[strategy][2](128))
    if strategy == "block":  # row blocks of 48 cut across the 64 and 128 rows
        floats = convert_checkpoint(src, tmp_path / "float", progress=False,
                                    options=Options(dtype="float32", dequantize=True)).dst
        compare(kept, floats)


def test_compressed_tensors_with_quantized_activations_are_refused(tiny, tmp_path):
    src, _ = compressed_tensors_source(tiny, tmp_path / "ct", bits=8, group=None)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quantizes input_activations.*weight-only"):
        convert_checkpoint(src, tmp_path / "out", progress=False)


def gptq_awq_source(tiny, dst, method: str, group: int, *, fmt: str = "gptq", shuffled_groups: bool = False):
    """Tiny llama as AutoGPTQ (`method` 'gptq', checkpoint format `fmt`) or AutoAWQ ('awq', version gemm) write
    it: 4-bit values q, zero points z and float16 scales s per group of inputs, w = (q - z) * s, packed eight to an
    int32 as each format documents (convert/gptq_awq.py); lm_head left float. Returns the folder and the float
    weights [out, in] the stored values mean."""
    from convert.gptq_awq import AWQ_ORDER

    shutil.copytree(tiny["llama"]["hf"], dst)
    tensors = load_file(str(dst / "model.safetensors"))
    rng = np.random.default_rng(7)
    shifts = np.arange(8, dtype=np.uint32) * 4

    def pack_cols(v):  # [r, 8c] -> [r, c], AWQ's column order within a word
        v = v.astype(np.uint32).reshape(v.shape[0], -1, 8)
        if method == "awq":
            v = v[:, :, AWQ_ORDER]  # bits 4j hold column AWQ_ORDER[j]
        return (v << shifts).sum(-1, dtype=np.uint32).view(np.int32)

    meant = {}
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        O, I = tensors[name].shape
        G = I // group
        q = rng.integers(0, 16, (I, O))
        z = rng.integers(1 if fmt == "gptq" else 0, 16, (G, O))  # the original format cannot store z = 0 (as -1)
        scale = (rng.uniform(0.5, 1.5, (G, O)) * 0.01).astype(np.float16)
        g_idx = np.arange(I) // group
        if shuffled_groups:
            g_idx = rng.permutation(g_idx)
        w = (q - z[g_idx]) * scale.astype(np.float32)[g_idx]  # [I, O]
        base = name[: -len("weight")]
        del tensors[name]
        if method == "gptq":
            tensors[base + "qweight"] = (q.astype(np.uint32).reshape(I // 8, 8, O) << shifts[None, :, None]) \
                .sum(1, dtype=np.uint32).view(np.int32)
            tensors[base + "qzeros"] = pack_cols(z - (1 if fmt == "gptq" else 0))
            tensors[base + "g_idx"] = g_idx.astype(np.int32)
        else:
            tensors[base + "qweight"] = pack_cols(q)
            tensors[base + "qzeros"] = pack_cols(z)
        tensors[base + "scales"] = scale
        meant[name] = np.ascontiguousarray(w.T.astype(np.float32))
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": shuffled_groups, "sym": False,
         "checkpoint_format": fmt} if method == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"})
    (dst / "config.json").write_text(json.dumps(config))
    return dst, meant


@pytest.mark.parametrize("method, group, fmt", [("gptq", 32, "gptq"), ("gptq", 16, "gptq_v2"), ("awq", 32, "")])
def test_gptq_and_awq_stay_int4_and_compute_their_values(tiny, tmp_path, method, group, fmt):
    src, meant = gptq_awq_source(tiny, tmp_path / method, method, group, fmt=fmt)
    kept = convert_checkpoint(src, tmp_path / "kept", progress=False, options=Options(dtype="float32")).dst
    specs = specs_from_config(json.loads((kept / "config.json").read_text()))
    assert {s.describe() for s in specs.values()} == {f"int4/{group}+offset"} and len(specs) == 14
    params = checkpoint.read_params(kept)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        spec = specs[name]
        q = QuantizedWeight(params[f"{name}.kernel.codes"].reshape(meant[f"{name}.weight"].shape[0], -1),
                            params[f"{name}.kernel.scale"].reshape(meant[f"{name}.weight"].shape[0], -1),
                            params[f"{name}.kernel.offset"].reshape(meant[f"{name}.weight"].shape[0], -1),
                            spec.kind, spec.group)
        np.testing.assert_array_equal(np.asarray(dequantize(q)), meant[f"{name}.weight"], err_msg=name)
    floats = convert_checkpoint(src, tmp_path / "float", progress=False,
                                options=Options(dtype="float32", dequantize=True)).dst
    name = "model.layers.1.mlp.down_proj"
    np.testing.assert_array_equal(checkpoint.read_params(floats)[f"{name}.kernel"].reshape(meant[f"{name}.weight"].shape),
                                  meant[f"{name}.weight"])
    compare(kept, floats)


def test_gptq_activation_order_is_refused_unless_dequantized(tiny, tmp_path):
    src, meant = gptq_awq_source(tiny, tmp_path / "gptq", "gptq", 32, shuffled_groups=True)
    with pytest.raises(CheckpointError, match="g_idx puts inputs out of order.*--dequantize"):
        convert_checkpoint(src, tmp_path / "kept", progress=False)
    assert not (tmp_path / "kept").exists()
    floats = convert_checkpoint(src, tmp_path / "float", progress=False,
                                options=Options(dtype="float32", dequantize=True)).dst
    name = "model.layers.0.mlp.up_proj"
    got = checkpoint.read_params(floats)[f"{name}.kernel"]
    np.testing.assert_array_equal(got.reshape(meant[f"{name}.weight"].shape), meant[f"{name}.weight"])
    bad = tmp_path / "awq-gemv"
    shutil.copytree(src, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="AWQ version 'gemv'"):
        convert_checkpoint(bad, tmp_path / "gemv", progress=False)


def mxfp4_gpt_oss(tiny, dst):
    """Tiny gpt_oss in the MXFP4 layout gpt-oss ships: each layer's experts as `*_blocks` [E, out, in/32, 16] and
    E8M0 `*_scales` [E, out, in/32] (the float experts rounded by the MX rule), quant_method 'mxfp4'."""
    from kernels_pallas.quantized_linear.reference import quantize_mxfp4

    shutil.copytree(tiny["gpt_oss"]["hf"], dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = np.swapaxes(tensors.pop(name).astype(np.float32), 1, 2)  # [E, out, in]: each expert's map
        E, O, I = w.shape
        q = quantize_mxfp4(w.reshape(E * O, I))
        tensors[name + "_blocks"] = q.codes.reshape(E, O, I // 32, 16)
        tensors[name + "_scales"] = q.scale.reshape(E, O, I // 32)
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    return dst, tensors


def test_mxfp4_gpt_oss_stays_mxfp4_and_computes_its_dequantized_model(tiny, tmp_path):
    from conftest import run_reference

    src, source = mxfp4_gpt_oss(tiny, tmp_path / "src")
    kept = convert_checkpoint(src, tmp_path / "kept", progress=False).dst
    specs = specs_from_config(json.loads((kept / "config.json").read_text()))
    assert {k: s.kind for k, s in specs.items()} == {f"model.layers.{i}.mlp.experts.{w}": "mxfp4"
                                                     for i in range(2) for w in ("gate_proj", "up_proj", "down_proj")}
    params = checkpoint.read_params(kept)
    # The source's bytes as they are (gate and up: gate_up's alternate rows), the scales not widened.
    assert sum(a.nbytes for a in params.values()) <= 1.05 * sum(a.nbytes for a in source.values())
    prefix = "model.layers.1.mlp.experts"
    blocks, scales = source[f"{prefix}.gate_up_proj_blocks"], source[f"{prefix}.gate_up_proj_scales"]
    E, O2 = blocks.shape[:2]
    for half, w in ((0, "gate_proj"), (1, "up_proj")):
        np.testing.assert_array_equal(params[f"{prefix}.{w}.codes"], blocks[:, half::2].reshape(E, O2 // 2, -1))
        np.testing.assert_array_equal(params[f"{prefix}.{w}.scale"], scales[:, half::2])
        assert params[f"{prefix}.{w}.scale"].dtype == np.uint8
    # --dequantize stores transformers' dequantization, bitwise.
    floats = convert_checkpoint(src, tmp_path / "float", progress=False,
                                options=Options(dtype="float32", dequantize=True)).dst
    run_reference([{"op": "mxfp4_dequantize", "model": str(src), "out": str(tmp_path / "ref.npz")}], tmp_path)
    ref, stored = np.load(tmp_path / "ref.npz"), checkpoint.read_params(floats)
    for i in range(2):
        p = f"model.layers.{i}.mlp.experts"
        want = {"gate_proj": ref[f"{p}.gate_up_proj"][:, :, 0::2], "up_proj": ref[f"{p}.gate_up_proj"][:, :, 1::2],
                "down_proj": ref[f"{p}.down_proj"]}
        for w, values in want.items():
            got = stored[f"{p}.{w}"]
            assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), values.view(np.uint32)), w
    model = compare(kept, floats)
    # The planner counts the codes and scales as stored; the readiness report names the kind, source and converted.
    assert math.isclose(model.memory_plan.params_bytes, sum(a.nbytes for a in params.values()), rel_tol=0.01)
    from day0jax import check

    (tmp_path / "config-only").mkdir()
    shutil.copy(src / "config.json", tmp_path / "config-only")
    for path in (kept, src, tmp_path / "config-only"):
        report = check.check(str(path), dtype="float32")
        assert report.supported and "6 x mxfp4/32" in report.quantization, (path, report.quantization)
        assert "mxfp4" in check.render(report)


def ocp_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The OCP Microscaling (MX) v1.0 spec's MXFP4 quantization, element by element: (e2m1 codes [O, I] 0..15,
    E8M0 scale bytes [O, I/32]). Per block of 32: shared exponent floor(log2(max |v|)) - emax_elem (2 for e2m1),
    clamped to [-127, 127] (a block of zeros takes -127); each v / 2^X rounded to the nearest e2m1 value, ties to
    the even mantissa, magnitudes past 6 clamped to 6; the sign bit kept (negative zero included)."""
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # magnitude by code 0..7; mantissa bit = code & 1
    O, I = w.shape
    codes, scales = np.zeros((O, I), np.uint8), np.zeros((O, I // 32), np.uint8)
    for o in range(O):
        for b in range(I // 32):
            block = [float(v) for v in w[o, 32 * b:32 * (b + 1)]]
            amax = max(abs(v) for v in block)
            X = max(-127, min(127, math.floor(math.log2(amax)) - 2)) if amax > 0 else -127
            scales[o, b] = X + 127
            for j, v in enumerate(block):
                m = min(abs(v) / 2.0 ** X, 6.0)
                best = min(range(8), key=lambda c: (abs(grid[c] - m), c & 1))
                codes[o, 32 * b + j] = best | (8 if math.copysign(1.0, v) < 0 else 0)
    return codes, scales


def test_quantize_mxfp4_follows_the_ocp_mx_spec_and_computes_its_dequantized_model(tiny, tmp_path):
    src = tiny["llama"]["hf"]
    ckpt = convert_checkpoint(src, tmp_path / "q", progress=False, options=Options(quantize="mxfp4")).dst
    specs = specs_from_config(json.loads((ckpt / "config.json").read_text()))
    assert specs["model.layers.0.mlp.down_proj"].kind == "mxfp4" and specs["model.embed_tokens"].kind == "int8"
    params = checkpoint.read_params(ckpt)
    name = "model.layers.1.mlp.up_proj"
    w = load_file(str(src / "model.safetensors"))[f"{name}.weight"].astype(np.float32)
    codes, scales = ocp_mxfp4(w)
    packed = params[f"{name}.kernel.codes"]
    np.testing.assert_array_equal(packed & 15, codes[:, 0::2])
    np.testing.assert_array_equal(packed >> 4, codes[:, 1::2])
    np.testing.assert_array_equal(params[f"{name}.kernel.scale"], scales)
    # Ties, saturation, signed zeros, zero blocks and tiny blocks, against the spec's rendering.
    from kernels_pallas.quantized_linear.reference import quantize

    edge = np.array([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.0, 0.1, -6.0, 6.0, 5.9, 0.74, 2.9, 4.9] * 2,
                     [0.0] * 32, [1e-40] * 16 + [-3e-39] * 16, [7.5] + [0.01] * 31], np.float32)
    q = quantize(edge, "mxfp4", 32)
    codes, scales = ocp_mxfp4(edge)
    np.testing.assert_array_equal(np.stack([q.codes & 15, q.codes >> 4], -1).reshape(edge.shape), codes)
    np.testing.assert_array_equal(q.scale, scales)
    with pytest.raises(CheckpointError, match="mxfp4 shares one scale per block of 32"):
        convert_checkpoint(src, tmp_path / "g16", progress=False, options=Options(quantize="mxfp4", group_size=16))
    compare(ckpt, convert_checkpoint(dequantized_copy(src, ckpt, tmp_path / "deq"), tmp_path / "f",
                                     progress=False).dst)


def nvfp4_source(tiny, dst, name="llama"):
    """Tiny `name` with its projections as compressed-tensors NVFP4 ('nvfp4-pack-quantized', W4A4 as llm-compressor's
    NVFP4 scheme writes it): random e2m1 codes, positive float8_e4m3fn scales per 16 and a float32 global scale per
    weight; and the float32 weights they mean, rendered here from the format's layout."""
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    shutil.copytree(tiny[name]["hf"], dst)
    tensors = load_file(str(dst / "model.safetensors"))
    rng, meant = np.random.default_rng(11), {}
    for n in [n for n in tensors if n.endswith("proj.weight")]:
        O, I = tensors.pop(n).shape
        packed = rng.integers(0, 256, (O, I // 2)).astype(np.uint8)
        scale = (rng.uniform(0.5, 4.0, (O, I // 16)) * 64).astype(ml_dtypes.float8_e4m3fn)
        glob = np.array([rng.uniform(2000, 4000)], np.float32)  # weights of about the float model's size
        base = n[: -len("weight")]
        tensors.update({base + "weight_packed": packed, base + "weight_scale": scale,
                        base + "weight_global_scale": glob})
        codes = np.stack([packed & 15, packed >> 4], -1).reshape(O, I)  # element 2i low, 2i + 1 high
        step = scale.astype(np.float32) / glob[0]  # float32, compressed-tensors' order: q * (scale / global)
        meant[n] = e2m1[codes] * np.repeat(step, 16, axis=1)
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    fp4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": fp4,
                                      "input_activations": dict(fp4, dynamic="local")}},
        "ignore": ["lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    return dst, meant, {n: a for n, a in tensors.items() if n.endswith("weight_packed")}


def test_nvfp4_stays_nvfp4_and_computes_its_values(tiny, tmp_path, caplog):
    from conftest import run_reference

    src, meant, packed = nvfp4_source(tiny, tmp_path / "src")
    with caplog.at_level("WARNING"):
        kept = convert_checkpoint(src, tmp_path / "kept", progress=False, options=Options(dtype="float32")).dst
    assert "weight-only, as on hardware without FP4 arithmetic" in caplog.text
    specs = specs_from_config(json.loads((kept / "config.json").read_text()))
    assert specs["model.layers.0.mlp.down_proj"].describe() == "nvfp4/16"
    params = checkpoint.read_params(kept)
    name = "model.layers.1.self_attn.o_proj"
    np.testing.assert_array_equal(params[f"{name}.kernel.codes"].reshape(packed[f"{name}.weight_packed"].shape),
                                  packed[f"{name}.weight_packed"])
    assert params[f"{name}.kernel.scale"].dtype == ml_dtypes.float8_e4m3fn  # the block scales stay 8-bit
    floats = convert_checkpoint(src, tmp_path / "float", progress=False,
                                options=Options(dtype="float32", dequantize=True)).dst
    run_reference([{"op": "nvfp4_dequantize", "model": str(src), "out": str(tmp_path / "ref.npz")}], tmp_path)
    ref, stored = np.load(tmp_path / "ref.npz"), checkpoint.read_params(floats)
    for n, want in meant.items():  # exact in float32: the layout's rendering and compressed-tensors' own, bitwise
        got = stored[n[: -len("weight")] + "kernel"].reshape(want.shape)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), n
        assert np.array_equal(ref[n].view(np.uint32), want.view(np.uint32)), n
    compare(kept, floats)


def test_quantize_nvfp4_follows_its_rule_and_computes_its_dequantized_model(tiny, tmp_path):
    src = tiny["llama"]["hf"]
    ckpt = convert_checkpoint(src, tmp_path / "q", progress=False, options=Options(quantize="nvfp4")).dst
    specs = specs_from_config(json.loads((ckpt / "config.json").read_text()))
    assert specs["model.layers.0.mlp.down_proj"].describe() == "nvfp4/16" and specs["model.embed_tokens"].kind == "int8"
    params = checkpoint.read_params(ckpt)
    name = "model.layers.1.mlp.gate_proj"
    w = load_file(str(src / "model.safetensors"))[f"{name}.weight"].astype(np.float32)
    # NVFP4 as llm-compressor makes it, rendered here: global 448 * 6 / max |w|; per block of 16, scale
    # max |v| / 6 * global rounded to float8_e4m3fn; each v / (scale / global) to the nearest e2m1 (ties to even,
    # saturating at 6).
    O, I = w.shape
    glob = np.float32(448 * 6) / np.abs(w).max()
    blocks = w.reshape(O, I // 16, 16)
    scale = (np.abs(blocks).max(-1) / np.float32(6) * glob).astype(ml_dtypes.float8_e4m3fn)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    m = np.minimum(np.abs(blocks / (scale.astype(np.float32) / glob)[..., None]), 6).reshape(O, I)
    dist = np.abs(m[..., None] - grid)
    best = np.where(dist == dist.min(-1, keepdims=True), np.arange(8) + 16 * (np.arange(8) & 1), 99).argmin(-1)
    codes = best | np.where(np.signbit(w), 8, 0)
    np.testing.assert_array_equal(params[f"{name}.kernel.global_scale"], np.full((O, 1), glob))
    np.testing.assert_array_equal(params[f"{name}.kernel.scale"].view(np.uint8), scale.view(np.uint8))
    packed = params[f"{name}.kernel.codes"]
    np.testing.assert_array_equal(np.stack([packed & 15, packed >> 4], -1).reshape(O, I), codes)
    with pytest.raises(CheckpointError, match="nvfp4 shares one scale per block of 16"):
        convert_checkpoint(src, tmp_path / "g32", progress=False, options=Options(quantize="nvfp4", group_size=32))
    compare(ckpt, convert_checkpoint(dequantized_copy(src, ckpt, tmp_path / "deq"), tmp_path / "f",
                                     progress=False).dst)


def test_modelopt_nvfp4_stays_nvfp4_and_computes_its_values(tiny, tmp_path, caplog):
    """ModelOpt's NVFP4 export: `X.weight` uint8 codes, float8_e4m3fn `X.weight_scale` per 16, a float32
    `X.weight_scale_2` that multiplies, `X.input_scale` (FP4 activations, run weight-only)."""
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    src = tmp_path / "src"
    shutil.copytree(tiny["llama"]["hf"], src)
    tensors = load_file(str(src / "model.safetensors"))
    rng, meant = np.random.default_rng(12), {}
    for n in [n for n in tensors if n.endswith("proj.weight")]:
        O, I = tensors[n].shape
        packed = rng.integers(0, 256, (O, I // 2)).astype(np.uint8)
        scale = (rng.uniform(0.5, 4.0, (O, I // 16)) * 64).astype(ml_dtypes.float8_e4m3fn)
        scale_2 = np.array(1 / rng.uniform(2000, 4000), np.float32)
        base = n[: -len("weight")]
        tensors.update({n: packed, base + "weight_scale": scale, base + "weight_scale_2": scale_2,
                        base + "input_scale": np.array(0.01, np.float32)})
        codes = np.stack([packed & 15, packed >> 4], -1).reshape(O, I)
        meant[n] = e2m1[codes] * np.repeat(scale.astype(np.float32) * scale_2, 16, axis=1)
    save_file(tensors, str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                     "exclude_modules": ["lm_head"]}
    (src / "config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING"):
        kept = convert_checkpoint(src, tmp_path / "kept", progress=False, options=Options(dtype="float32")).dst
    assert "weight-only, as on hardware without FP4 arithmetic" in caplog.text
    specs = specs_from_config(json.loads((kept / "config.json").read_text()))
    assert specs["model.layers.1.mlp.up_proj"].describe() == "nvfp4_modelopt/16"
    floats = convert_checkpoint(src, tmp_path / "float", progress=False,
                                options=Options(dtype="float32", dequantize=True)).dst
    stored = checkpoint.read_params(floats)
    for n, want in meant.items():  # exact in float32: the layout's rendering, bitwise
        got = stored[n[: -len("weight")] + "kernel"].reshape(want.shape)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), n
    compare(kept, floats)
    config["quantization_config"]["quant_algo"] = "W4A8_AWQ"  # other ModelOpt formats are refused by name
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="ModelOpt quantization 'W4A8_AWQ'"):
        convert_checkpoint(src, tmp_path / "awq", progress=False)


@pytest.mark.parametrize("fmt", ["mxfp8-quantized", "mxfp4-pack-quantized"])
def test_compressed_tensors_mx_formats_stay_as_codes_and_compute_their_values(tiny, tmp_path, fmt):
    """compressed-tensors' MX formats: float8_e4m3fn values in `weight` (MXFP8) or e2m1 codes two per byte in
    `weight_packed` (MXFP4), a uint8 E8M0 `weight_scale` per 32; the float32 weights they mean rendered here."""
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    src = tmp_path / "src"
    shutil.copytree(tiny["llama"]["hf"], src)
    tensors = load_file(str(src / "model.safetensors"))
    rng, meant = np.random.default_rng(13), {}
    for n in [n for n in tensors if n.endswith("proj.weight")]:
        O, I = tensors[n].shape
        scale = rng.integers(118, 124, (O, I // 32)).astype(np.uint8)
        step = np.ldexp(np.float32(1), scale.astype(np.int32) - 127).repeat(32, axis=1)
        base = n[: -len("weight")]
        if fmt == "mxfp8-quantized":
            tensors[n] = (rng.standard_normal((O, I)) * 64).astype(ml_dtypes.float8_e4m3fn)
            meant[n] = tensors[n].astype(np.float32) * step
        else:
            del tensors[n]
            packed = rng.integers(0, 256, (O, I // 2)).astype(np.uint8)
            tensors[base + "weight_packed"] = packed
            meant[n] = e2m1[np.stack([packed & 15, packed >> 4], -1).reshape(O, I)] * step * 4
            scale = scale + 2  # times 4, as meant
        tensors[base + "weight_scale"] = scale
    save_file(tensors, str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    bits = 8 if fmt == "mxfp8-quantized" else 4
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": fmt,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": bits, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32}}},
        "ignore": ["lm_head"]}
    (src / "config.json").write_text(json.dumps(config))
    kept = convert_checkpoint(src, tmp_path / "kept", progress=False, options=Options(dtype="float32")).dst
    specs = specs_from_config(json.loads((kept / "config.json").read_text()))
    kind = "mxfp8_e4m3" if bits == 8 else "mxfp4"
    assert specs["model.layers.0.self_attn.q_proj"].describe() == f"{kind}/32"
    assert checkpoint.read_params(kept)["model.layers.0.self_attn.q_proj.kernel.scale"].dtype == np.uint8
    floats = convert_checkpoint(src, tmp_path / "float", progress=False,
                                options=Options(dtype="float32", dequantize=True)).dst
    stored = checkpoint.read_params(floats)
    for n, want in meant.items():  # exact in float32, bitwise
        got = stored[n[: -len("weight")] + "kernel"].reshape(want.shape)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), n
    # The CPU kernel sums the (same) products in another order than XLA's product of the float weights, and these
    # weights of unit scale grow that rounding layer by layer: logits 1.4e-5 apart (mxfp8), the greedy tokens equal.
    compare(kept, floats, rtol=3e-5)


def test_every_quantized_kind_has_a_verify_tolerance():
    from day0jax import verify
    from kernels_pallas.quantized_linear.reference import KINDS

    assert set(verify.COARSENESS) == set(verify.QUANTIZED_TOLERANCES) == set(KINDS)


@pytest.mark.parametrize("kind, emax", [("mxfp8_e4m3", 8), ("mxfp8_e5m2", 15)])
def test_mxfp8_quantization_follows_the_ocp_mx_rule(kind, emax):
    """Shared exponent floor(log2(max |v|)) - emax per 32 (a zero block -127); each v / 2^X in the element format
    (ml_dtypes' round to nearest even), saturating at its largest normal."""
    from kernels_pallas.quantized_linear.reference import quantize

    rng = np.random.default_rng(3)
    w = np.concatenate([rng.standard_normal((3, 64)) * 10.0 ** rng.integers(-6, 6, (3, 1)), np.zeros((1, 64))])
    w = w.astype(np.float32)
    q = quantize(w, kind, 32)
    dtype = ml_dtypes.float8_e4m3fn if kind == "mxfp8_e4m3" else ml_dtypes.float8_e5m2
    top = float(ml_dtypes.finfo(dtype).max)
    for o in range(4):
        for b in range(2):
            block = w[o, 32 * b:32 * (b + 1)].astype(np.float64)
            amax = np.abs(block).max()
            X = max(-127, min(127, math.floor(math.log2(amax)) - emax)) if amax > 0 else -127
            assert q.scale[o, b] == X + 127
            want = np.clip(block / 2.0 ** X, -top, top).astype(np.float32).astype(dtype)
            np.testing.assert_array_equal(q.codes[o, 32 * b:32 * (b + 1)].view(np.uint8), want.view(np.uint8))
