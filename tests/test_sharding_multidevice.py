"""Sharded models on 8 simulated CPU devices, multi-host runs and the host memory of sharded loading.

Each check runs in a subprocess started with `XLA_FLAGS=--xla_force_host_platform_device_count=N` (the flag must
be set before jax starts; this test process keeps its single device) and `JAX_PLATFORMS=cpu`, so that on a GPU
machine too it gets N CPU devices. The subprocess is this file, run as a script with a job:
`python tests/test_sharding_multidevice.py JOB.json`.

Tolerances: logits on a mesh equal the single-device logits within max |mesh - one| <= 1e-5 * max |one|
(float32; the sums are split across devices, so only the order of additions differs: 6e-7 to 4e-6 observed); the
planner's per-device parameter and KV cache bytes are within 5% of the bytes placed on each device; sharded
loading's peak RSS growth stays under 1.5x the checkpoint's size (a replicated load over 8 devices needs 8x).
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
RTOL = 1e-5
PLAN_TOLERANCE = 0.05
RSS_LIMIT = 1.5
# Prompts of different lengths (a batch of 4 splits over dp=4 and over dp*ep=4) and a fixed token batch for logits.
PROMPTS = [[1, 17, 42, 5, 99], [1, 9, 8, 7, 6, 5, 4, 3, 33], [1, 200, 3],
           [1] + [(7 * i + 3) % 250 + 3 for i in range(13)]]
TOKENS = np.random.default_rng(0).integers(3, 250, (4, 12)).tolist()
NEW_TOKENS = 6
# Fine-tuning on meshes (batches of 8 rows): against one device, relative to the largest loss or parameter
# (measured: losses 2.3e-7, parameters 1.2e-6 to 1.4e-6 for LoRA, 6.6e-7 to 2.8e-6 for full fine-tuning).
TRAIN_MESHES = ["dp=2,tp=2", "dp=8"]
TRAIN_RTOL = 1e-5
# Generation (prefill + decode with the sharded KV cache) runs on the mesh that uses all three axes, and for llama
# also on tp=8, the multi-host test's mesh.
# (MLA's latent cache, one kv head replicated over tp, is exercised by deepseek_v3; qwen3_moe's is plain GQA.)
GENERATE_ON = {"llama": ["tp=2,ep=2,dp=2", "tp=8"], "deepseek_v3": ["tp=2,ep=2,dp=2"],
               "qwen3_5_moe_text": ["tp=2,ep=4"], "deepseek_v32": ["tp=2,ep=2,dp=2"], "gemma4_text": ["tp=2,dp=4"],
               "gemma3": ["tp=2,dp=4"], "qwen3_vl": ["tp=2,ep=2,dp=2"], "nemotron_h": ["tp=2,ep=4"],
               "kimi_k25": ["tp=8"], "mistral3": ["tp=8"]}
# A dense model whose linear weights and embeddings stay quantized (int4 with offsets, embeddings int8, groups of 16):
# codes and scales split over tp like the kernels they stand for. Hidden size 128, so that every projection's
# groups (128 / 16 = 8) split over tp=8.
# An MoE model likewise, its experts quantized too (each expert's [out, in] codes, split over ep and tp).
QUANTIZED = {"llama-int4": ("llama", dict(hidden_size=128, intermediate_size=256)),
             "qwen3_moe-int4": ("qwen3_moe", dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128))}
GENERATE_ON["llama-int4"] = ["tp=2,ep=2,dp=2", "tp=8"]
GENERATE_ON["qwen3_moe-int4"] = ["tp=2,ep=4"]
# The hyper-connected families (n residual streams; compressed, indexer and pooled caches beside the window's or the
# latent's) on one mesh each, where they also generate: deepseek_v4's experts over ep=4, glm5_next's (with its
# linear-attention state) on all three axes.
ONLY_ON = {"deepseek_v4": ["tp=2,ep=4"], "glm5_next_text": ["tp=2,ep=2,dp=2"]}
GENERATE_ON.update(ONLY_ON)
# The meshes each family is compared on: llama (and its int4 copy) on all four; a model with experts on the two
# that split them over ep, a dense one on the two without ep, each also on the meshes it generates on; a family of
# ONLY_ON on its one mesh. Every mesh still sees dense, MoE and vision-language models, at half the loads of all
# families on all meshes.
EXPERT_MESHES, DENSE_MESHES = ["tp=2,ep=4", "tp=2,ep=2,dp=2"], ["tp=2,dp=4", "tp=8"]
WITH_EXPERTS = {"qwen3_moe", "deepseek_v3", "qwen3_5_moe_text", "deepseek_v32", "nemotron_h", "kimi_k25",
                "qwen3_moe-int4", "deepseek_v4", "glm5_next_text"}


def meshes_of(model_type: str) -> list[str]:
    from test_sharding import MESHES

    if model_type.startswith("llama"):
        return list(MESHES)
    if model_type in ONLY_ON:
        return list(ONLY_ON[model_type])
    base = EXPERT_MESHES if model_type in WITH_EXPERTS else DENSE_MESHES
    return [m for m in MESHES if m in base or m in GENERATE_ON.get(model_type, [])]


MULTIHOST_MESH = "tp=8"  # tensor parallelism across both processes: all-reduces cross the process boundary
# Pipeline stages (a dense, an MoE and an MLA family, 4 layers each): pp=2 and pp=4 combined with tp, ep and dp, and
# pp=2 across two processes (one stage each, the residual stream crossing between them).
PIPELINE_LAYERS = 4
PIPELINE = {"llama": ["pp=2,tp=2,dp=2", "pp=4,tp=2"], "qwen3_moe": ["pp=2,tp=2,ep=2", "pp=4,ep=2"],
            "deepseek_v3": ["pp=2,ep=2,tp=2", "pp=4,tp=2"]}
PIPELINE_MULTIHOST_MESH = "pp=2,tp=4"
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=7)
# RSS test model: ~470 MB float32, every dimension divisible by tp=8, its largest array (the embeddings) 7% of it,
# about as in real models (Llama-3-8B: 6%).
BIG = dict(model_type="llama", vocab_size=8192, hidden_size=1024, intermediate_size=4096, num_hidden_layers=6,
           num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256, rms_norm_eps=1e-5)


# --- the subprocess side -------------------------------------------------------------------------------------

def _device_bytes(arrays, device) -> int:
    return sum(s.data.nbytes for a in arrays for s in a.addressable_shards if s.device == device)


def image_batch(model) -> tuple[np.ndarray, list[list[np.ndarray]]]:
    """A vision-language model's 4 rows of equal length: one image, two images, and text only twice."""
    rng = np.random.default_rng(0)
    images = [[rng.integers(0, 256, (40, 30, 3), dtype=np.uint8)],
              [rng.integers(0, 256, (21, 50, 3), dtype=np.uint8), rng.integers(0, 256, (33, 33, 3), dtype=np.uint8)],
              [], []]
    image = [[model.vision.image_token_id] * n for n in model.images.inputs(images[0] + images[1]).counts]
    rows = [[1, 17] + image[0] + [5, 9], [1] + image[1] + [3] + image[2], [1, 2, 3], [1, 200, 7, 8]]
    width = max(map(len, rows))
    tokens = np.array([r + [3] * (width - len(r)) for r in rows], np.int32)
    return tokens, images


def job_meshes(job: dict) -> dict:
    """Per family: single-device logits/tokens, then per mesh: logits error, tokens, placed and planned bytes."""
    import jax

    import day0jax

    from families import parity_engine

    engine = parity_engine()  # the four prompts' decode batch only
    out = {}
    for model_type, ckpt in job["checkpoints"].items():
        one = day0jax.load(ckpt, engine=engine)
        ref = one.logits(np.array(TOKENS, np.int32))
        generate = job["generate_on"].get(model_type, [])
        res = {"one_device": {"tokens": one.generate(PROMPTS, NEW_TOKENS, ignore_eos=True) if generate else None},
               "meshes": {}}
        if one.vision is not None:  # the vision tower and projector on the mesh too, through logits and the engine
            image_tokens, images = image_batch(one)
            image_ref = one.logits(image_tokens, images=images)
            if generate:
                res["one_device"]["image_tokens"] = one.generate(image_tokens.tolist(), NEW_TOKENS, ignore_eos=True,
                                                                 images=images)
        del one
        for spec in job["meshes"][model_type]:
            model = day0jax.load(ckpt, mesh=spec, engine=engine)
            logits = model.logits(np.array(TOKENS, np.int32))
            runner = model.engine.runner  # the parameters it runs on and the KV page pool it allocated
            params = runner.params
            devices = list(model.mesh.devices.flat)
            plan = model.memory_plan
            # Each layer's first `stateful` pools are per-sequence state, the rest keys and values.
            cache_arrays = jax.tree.leaves([p[n:] for p, n in zip(runner.pools, runner.stateful)])
            state_arrays = jax.tree.leaves([p[:n] for p, n in zip(runner.pools, runner.stateful)])
            entry = {
                "rel_err": float(np.abs(logits - ref).max() / np.abs(ref).max()),
                "param_bytes_per_device": [_device_bytes(params, d) for d in devices],
                "kv_bytes_per_device": [_device_bytes(cache_arrays, d) for d in devices],
                "state_bytes_per_device": [_device_bytes(state_arrays, d) for d in devices],
                "model_bytes": sum(a.nbytes for a in params),
                "plan": plan.to_dict(),
            }
            if spec in generate:
                entry["tokens"] = model.generate(PROMPTS, NEW_TOKENS, ignore_eos=True)
            if model.vision is not None:
                got = model.logits(image_tokens, images=images)
                entry["image_rel_err"] = float(np.abs(got - image_ref).max() / np.abs(image_ref).max())
                if spec in generate:
                    entry["image_tokens"] = model.generate(image_tokens.tolist(), NEW_TOKENS, ignore_eos=True,
                                                           images=images)
            res["meshes"][spec] = entry
            del model, runner, cache_arrays, state_arrays, params
        out[model_type] = res
    return out


def job_pipeline(job: dict) -> dict:
    """Per family: single-device logits and tokens (greedy and sampled), then per pipeline mesh the logits error,
    the tokens, the bytes on each device against the plan, and the layers each stage holds; for llama, programs
    compiled into a program store and loaded from it by a second load; a vision-language model refused."""
    import jax

    import day0jax
    from day0jax.engine.config import EngineConfig
    from day0jax.core.errors import MeshError
    from day0jax.startup import compile_cache
    from day0jax.startup.program_store import ProgramStore

    out = {}
    for model_type, ckpt in job["checkpoints"].items():
        one = day0jax.load(ckpt)
        ref = one.logits(np.array(TOKENS, np.int32))
        res = {"one_device": {"tokens": one.generate(PROMPTS, NEW_TOKENS, ignore_eos=True),
                              "sampled": one.generate(PROMPTS, NEW_TOKENS, ignore_eos=True, **SAMPLED)},
               "meshes": {}}
        del one
        for spec in job["meshes"][model_type]:
            model = day0jax.load(ckpt, mesh=spec)
            logits = model.logits(np.array(TOKENS, np.int32))
            runner = model.engine.runner
            devices = list(model.mesh.devices.flat)
            cache_arrays = jax.tree.leaves(runner.pools)
            layers_on = []  # per stage: the layers whose parameters lie on its devices
            for s, stage_mesh in enumerate(runner.meshes):
                on = set(stage_mesh.devices.flat)
                layers_on.append(sorted({int(p.split(".")[2]) for p, a in zip(runner._paths, runner.params)
                                         if p.startswith("model.layers.") and set(a.sharding.device_set) <= on}))
            entry = {  # bytes before generating: its steps donate (replace) the pools
                "rel_err": float(np.abs(logits - ref).max() / np.abs(ref).max()),
                "param_bytes_per_device": [_device_bytes(runner.params, d) for d in devices],
                "kv_bytes_per_device": [_device_bytes(cache_arrays, d) for d in devices],
                "plan": model.memory_plan.to_dict(), "layers_on": layers_on,
                "mesh_axes": list(model.mesh.axis_names)}
            entry["tokens"] = model.generate(PROMPTS, NEW_TOKENS, ignore_eos=True)
            entry["sampled"] = model.generate(PROMPTS, NEW_TOKENS, ignore_eos=True, **SAMPLED)
            res["meshes"][spec] = entry
            del model, runner, cache_arrays
        out[model_type] = res
    # Warm-up through a program store: the first load compiles each stage's programs, the second loads them all.
    ckpt, spec = job["checkpoints"]["llama"], job["meshes"]["llama"][0]
    cache = compile_cache.enable(Path(job["store"]), compile_cache.current_key(None, "pipeline"))
    store = ProgramStore(cache)
    runs = []
    for _ in range(2):
        model = day0jax.load(ckpt, mesh=spec, engine=EngineConfig(max_model_len=64))
        model.program_store = store
        records = model.engine.warm_up(store=store, warmup="ready")
        tokens = model.generate(PROMPTS, NEW_TOKENS, ignore_eos=True)
        runs.append({"sources": sorted({r.source for r in records}), "labels": [r.shape for r in records],
                     "traced": sorted(map(list, model.engine.runner.compiled)), "tokens": tokens})
        del model
    compile_cache.disable()
    try:
        day0jax.load(job["vision"], mesh="pp=2,tp=4")
        refusal = None
    except MeshError as e:
        refusal = str(e)
    return {"families": out, "store_runs": runs, "vision_refusal": refusal}


def job_multihost(job: dict) -> dict:
    """One process of a multi-host run: start the distributed runtime, load over every process's devices.

    The job gives the coordinator either as arguments (the CLI flags' path) or in the environment variables.
    """
    from sharding import distributed

    if job["via"] == "env":
        cluster = distributed.initialize()
    else:
        cluster = distributed.initialize(job["coordinator"], job["num_processes"], job["process_id"])
    import jax

    import day0jax

    model = day0jax.load(job["checkpoint"], mesh=job["mesh"])
    processes = sorted({d.process_index for d in model.mesh.devices.flat})
    stages = getattr(model.engine.runner, "meshes", [model.mesh])
    return {"process_id": cluster.process_id, "process_count": jax.process_count(),
            "stage_processes": [sorted({d.process_index for d in m.devices.flat}) for m in stages],
            "global_devices": jax.device_count(), "local_devices": jax.local_device_count(),
            "mesh_processes": processes,
            "tokens": model.generate(PROMPTS, NEW_TOKENS, ignore_eos=True),
            "sampled": model.generate(PROMPTS, NEW_TOKENS, ignore_eos=True, **SAMPLED) if job.get("sampled") else None,
            "logits": model.logits(np.array(TOKENS, np.int32)).tolist()}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def job_rss(job: dict) -> dict:
    """Peak RSS growth while loading `checkpoint` on tp=8, after a warm-up load has brought in every library.

    The peak is this process's VmHWM, reset just before loading. (Not getrusage's ru_maxrss: Linux carries that
    over exec from the forked parent, here the pytest process that has just written the checkpoint.)
    """
    import gc

    import jax
    from flax import nnx

    import day0jax

    day0jax.load(job["warmup"], mesh=job["mesh"])
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _status_bytes("VmRSS")
    model = day0jax.load(job["checkpoint"], mesh=job["mesh"])
    peak = _status_bytes("VmHWM")
    params = jax.tree.leaves(nnx.state(model.module))
    return {"before": before, "peak": peak, "model_bytes": sum(a.nbytes for a in params),
            "device0_bytes": _device_bytes(params, model.mesh.devices.flat[0]),
            "planned_per_device": model.memory_plan.params_bytes}


def job_train(job: dict) -> dict:
    """Three steps of LoRA (SGD) and of full fine-tuning (AdamW) of `checkpoint` on one device, then on each mesh
    (LoRA's B starts at zero, where AdamW's first step would move each element by the learning rate whatever its
    gradient's size: a near-zero gradient's rounding would flip a whole step):
    per mesh and kind, the largest relative difference to one device of the losses and of the trained parameters,
    and into how many shards the steps left a trained kernel and each of its optimizer moments."""
    import jax
    from flax import nnx

    import day0jax
    from day0jax.train import Example, LoRAConfig, TrainConfig, adapter_arrays, apply_lora, collate, train

    rng = np.random.default_rng(0)
    batches = [collate([Example(tuple(int(t) for t in rng.integers(3, 250, 12 - i % 3)), 3 * (i % 2))
                        for i in range(8)]) for _ in range(3)]

    def run(spec, kind):
        model = day0jax.load(job["checkpoint"], dtype="float32", kernels="reference", mesh=spec)
        if kind == "lora":
            adapters = apply_lora(model.module, LoRAConfig(rank=4, alpha=8), seed=0)
            config = TrainConfig(iters=3, optimizer="sgd", learning_rate=0.5, steps_per_report=3)
        else:
            config = TrainConfig(iters=3, optimizer="adamw", learning_rate=1e-3, steps_per_report=3)
        result = train(model.module, batches, config, report=lambda line: None)
        params = adapter_arrays(model.module, adapters) if kind == "lora" else {
            ".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model.module))}
        q = model.module.model.layers[0].self_attn.q_proj.kernel[...]
        moments = [x for x in jax.tree.leaves(result.opt_state) if getattr(x, "shape", None) == q.shape]
        shards = min(x.size // x.addressable_shards[0].data.size for x in [q, *moments])
        return np.array(result.losses), params, shards

    out = {}
    one = {kind: run(None, kind) for kind in ("lora", "full")}
    for spec in job["meshes"]:
        out[spec] = {}
        for kind, (losses, params, _) in one.items():
            got_losses, got, shards = run(spec, kind)
            out[spec][kind] = {
                "loss_err": float(np.max(np.abs(got_losses - losses) / losses)),
                "param_err": max(float(np.abs(got[k] - v).max() / max(np.abs(v).max(), 1e-30))
                                 for k, v in params.items()),
                "shards": shards}
    return out


JOBS = {"meshes": job_meshes, "multihost": job_multihost, "rss": job_rss, "pipeline": job_pipeline,
        "train": job_train}


# --- the pytest side -----------------------------------------------------------------------------------------

def run_job(job: dict, workdir: Path, devices: int, name: str = "job", env: dict | None = None
            ) -> subprocess.Popen:
    """Starts this file on `job` in a subprocess with `devices` simulated CPU devices (and `env` added to its
    environment); the result is `workdir/<name>.out.json`."""
    spec = workdir / f"{name}.json"
    spec.write_text(json.dumps(dict(job, out=str(workdir / f"{name}.out.json"))))
    # LLVM optimization level 0 makes XLA:CPU compile 2-3x faster; the SPMD partitioning under test is an HLO
    # pass, unaffected, and both sides of every comparison run under the same flags.
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"{flags} --xla_backend_optimization_level=0".strip(),
               **(env or {}))
    log = open(workdir / f"{name}.log", "w")
    return subprocess.Popen([sys.executable, __file__, str(spec)], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def wait_job(proc: subprocess.Popen, workdir: Path, name: str, timeout: int = 900) -> dict:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    log = (workdir / f"{name}.log").read_text()
    if proc.returncode:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{log[-6000:]}")
    return json.loads((workdir / f"{name}.out.json").read_text())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from test_sharding import MULTI_DEVICE_FAMILIES, sharding_config, synthetic_checkpoint

    from families import MULTIMODAL

    processors = {case.model_type: case.processor for case in MULTIMODAL.values()}
    root = tmp_path_factory.mktemp("sharded")
    out = {mt: str(synthetic_checkpoint(sharding_config(mt), root / mt, processor=processors.get(mt)))
           for mt in MULTI_DEVICE_FAMILIES}
    for name, (model_type, overrides) in QUANTIZED.items():
        out[name] = str(quantized_checkpoint(dict(sharding_config(model_type), **overrides), root / name))
    return out


def quantized_checkpoint(hf: dict, dst: Path) -> Path:
    """A random-weight llama or Qwen-MoE written as a Hugging Face folder, converted with `--quantize int4
    --group-size 16`."""
    from safetensors.numpy import save_file
    from test_sharding import synthetic_checkpoint

    from convert import convert_checkpoint
    from convert.convert import Options
    from day0jax import models
    from day0jax.weights import checkpoint

    floats = checkpoint.read_params(synthetic_checkpoint(hf, dst.with_name(dst.name + "-float")))
    infos = models.param_infos(models.abstract_model(models.config_from_hf(hf)))
    tensors = {}
    for info in infos:  # the plain mapping: `X.kernel` [*out, *in] <- `X.weight` [out, in]
        array = floats[info.path]
        experts = re.fullmatch(r"(.*)\.experts\.(gate_proj|up_proj|down_proj)", info.path)
        if experts:  # stacked [E, in, out] <- each expert's `.experts.<e>.<name>.weight` [out, in]
            for e, w in enumerate(array):
                tensors[f"{experts[1]}.experts.{e}.{experts[2]}.weight"] = np.ascontiguousarray(w.T)
            continue
        if info.path.endswith(".kernel"):
            n_out = len(info.shape) - info.metadata["in_ndim"]
            array = array.reshape(math.prod(info.shape[:n_out]), -1)
        tensors[info.path.removesuffix(".kernel") + ".weight" if info.path.endswith(".kernel") else info.path] = array
    src = dst.with_name(dst.name + "-hf")
    src.mkdir()
    save_file(tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(hf))
    return convert_checkpoint(src, dst, progress=False, options=Options(quantize="int4", group_size=16)).dst


@pytest.fixture(scope="module")
def meshes(checkpoints, tmp_path_factory):
    work = tmp_path_factory.mktemp("meshes")
    meshes = {mt: meshes_of(mt) for mt in checkpoints}
    proc = run_job({"job": "meshes", "checkpoints": checkpoints, "meshes": meshes, "generate_on": GENERATE_ON},
                   work, devices=8, name="meshes")
    return wait_job(proc, work, "meshes")


def _cases():
    from test_sharding import MULTI_DEVICE_FAMILIES

    return [(mt, spec) for mt in MULTI_DEVICE_FAMILIES + list(QUANTIZED) for spec in meshes_of(mt)]


@pytest.mark.parametrize("model_type, spec", _cases())
def test_same_logits_on_every_mesh(meshes, model_type, spec):
    entry = meshes[model_type]["meshes"][spec]
    err = entry["rel_err"]
    assert err <= RTOL, f"{model_type} on {spec}: relative logits error {err:.2e}"
    if "image_rel_err" in entry:  # a vision-language model: with images, the tower split like the text model
        assert entry["image_rel_err"] <= RTOL, f"{model_type} on {spec} with images: {entry['image_rel_err']:.2e}"


@pytest.mark.parametrize("model_type, spec", _cases())
def test_each_device_holds_its_share_as_planned(meshes, model_type, spec):
    entry = meshes[model_type]["meshes"][spec]
    placed, planned = entry["param_bytes_per_device"], entry["plan"]["params_bytes"]
    # Device 0 holds its share, not the model: on these meshes (tp >= 2) at least 40% of it lives elsewhere
    # (norms, MLA's low-rank projections and kv heads fewer than tp stay whole on every device).
    assert placed[0] <= 0.6 * entry["model_bytes"], (placed[0], entry["model_bytes"])
    for d, got in enumerate(placed):
        assert abs(got - planned) <= PLAN_TOLERANCE * planned, f"device {d}: placed {got}, planned {planned}"
    for d, got in enumerate(entry["kv_bytes_per_device"]):
        want = entry["plan"]["kv_cache_bytes"]
        assert abs(got - want) <= PLAN_TOLERANCE * want, f"device {d}: KV cache {got}, planned {want}"
    for d, got in enumerate(entry["state_bytes_per_device"]):  # linear-attention state, split like its heads
        assert got == entry["plan"]["state_bytes"], f"device {d}: state {got}, planned {entry['plan']['state_bytes']}"


@pytest.mark.parametrize("model_type", list(GENERATE_ON))
def test_same_tokens_on_meshes(meshes, model_type):
    ref = meshes[model_type]["one_device"]["tokens"]
    assert all(len(t) == NEW_TOKENS for t in ref)
    for spec in GENERATE_ON[model_type]:
        assert meshes[model_type]["meshes"][spec]["tokens"] == ref, f"{model_type} on {spec}"
    if "image_tokens" in meshes[model_type]["one_device"]:
        for spec in GENERATE_ON[model_type]:
            want = meshes[model_type]["one_device"]["image_tokens"]
            assert meshes[model_type]["meshes"][spec]["image_tokens"] == want, f"{model_type} on {spec} with images"


def test_multihost_two_processes_generate_like_one(checkpoints, meshes, tmp_path):
    """2 processes x 4 CPU devices on localhost, one tp=8 mesh over both, gloo collectives. Process 0 is given the
    coordinator as arguments (what the CLI flags pass), process 1 through JAX_COORDINATOR_ADDRESS & co."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    job = {"job": "multihost", "checkpoint": checkpoints["llama"], "mesh": MULTIHOST_MESH}
    procs = [run_job(dict(job, via="args", coordinator=address, num_processes=2, process_id=0), tmp_path,
                     devices=4, name="process0"),
             run_job(dict(job, via="env"), tmp_path, devices=4, name="process1",
                     env={"JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"})]
    try:
        results = [wait_job(p, tmp_path, f"process{i}", timeout=600) for i, p in enumerate(procs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    one = meshes["llama"]
    assert [r["process_id"] for r in results] == [0, 1]
    for r in results:
        assert (r["process_count"], r["global_devices"], r["local_devices"]) == (2, 8, 4)
        assert r["mesh_processes"] == [0, 1]  # the mesh spans both processes' devices
        assert r["tokens"] == one["meshes"][MULTIHOST_MESH]["tokens"] == one["one_device"]["tokens"]
    np.testing.assert_allclose(results[0]["logits"], results[1]["logits"], rtol=0, atol=0)


@pytest.fixture(scope="module")
def pipeline(checkpoints, tmp_path_factory):
    from test_sharding import sharding_config, synthetic_checkpoint

    root = tmp_path_factory.mktemp("pipeline")
    ckpts = {mt: str(synthetic_checkpoint(dict(sharding_config(mt), num_hidden_layers=PIPELINE_LAYERS), root / mt))
             for mt in PIPELINE}
    job = {"job": "pipeline", "checkpoints": ckpts, "meshes": PIPELINE, "store": str(root / "store"),
           "vision": checkpoints["qwen3_vl"]}
    return dict(wait_job(run_job(job, root, devices=8, name="pipeline"), root, "pipeline"), checkpoints=ckpts)


@pytest.mark.parametrize("model_type, spec", [(mt, spec) for mt, specs in PIPELINE.items() for spec in specs])
def test_pipeline_stages_give_the_logits_and_tokens_of_one_device(pipeline, model_type, spec):
    family = pipeline["families"][model_type]
    entry = family["meshes"][spec]
    assert entry["mesh_axes"] == ["pp", "dp", "ep", "tp"]
    assert entry["rel_err"] <= RTOL, f"{model_type} on {spec}: relative logits error {entry['rel_err']:.2e}"
    assert entry["tokens"] == family["one_device"]["tokens"], f"{model_type} on {spec}: greedy tokens differ"
    # Sampling runs once per step on the whole batch, after the micro-batches: the same seed, the same tokens.
    assert entry["sampled"] == family["one_device"]["sampled"], f"{model_type} on {spec}: sampled tokens differ"


@pytest.mark.parametrize("model_type, spec", [(mt, spec) for mt, specs in PIPELINE.items() for spec in specs])
def test_pipeline_stages_hold_their_layers_as_planned(pipeline, model_type, spec):
    entry = pipeline["families"][model_type]["meshes"][spec]
    plan = entry["plan"]
    pp = plan["sizes"]["pp"]
    assert [list(range(a, b)) for a, b in plan["stages"]] == entry["layers_on"]  # contiguous, as planned
    assert len(plan["stages"]) == pp and plan["stages"][-1][1] == PIPELINE_LAYERS
    # The plan is the fullest stage's device; the others hold no more.
    placed, kv = entry["param_bytes_per_device"], entry["kv_bytes_per_device"]
    assert abs(max(placed) - plan["params_bytes"]) <= PLAN_TOLERANCE * plan["params_bytes"], (placed, plan)
    assert abs(max(kv) - plan["kv_cache_bytes"]) <= PLAN_TOLERANCE * plan["kv_cache_bytes"], (kv, plan)
    # Each device holds about 1/pp of the layers: well under what one stage holding them all would.
    assert max(placed) < 0.8 * sum(placed) / len(placed) * pp


def test_pipeline_programs_load_from_the_program_store(pipeline):
    first, second = pipeline["store_runs"]
    assert first["sources"] != ["program-store"] and second["sources"] == ["program-store"]
    assert any(label.endswith("stage 1") for label in first["labels"])  # one program per stage
    assert second["traced"] == []  # nothing traced on the second load: every stage's program came from the store
    assert first["tokens"] == second["tokens"] == pipeline["families"]["llama"]["one_device"]["tokens"]


def test_pipeline_refuses_vision_language_models(pipeline):
    assert "pipeline stages (pp > 1) are not implemented for qwen3_vl" in pipeline["vision_refusal"]


def test_pipeline_across_two_processes_generates_like_one(pipeline, tmp_path):
    """2 processes x 4 CPU devices, pp=2,tp=4: each process holds one stage (reads only its parameters), the
    residual stream crosses between them and the tokens come back, both processes reading the same."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    job = {"job": "multihost", "checkpoint": pipeline["checkpoints"]["llama"], "mesh": PIPELINE_MULTIHOST_MESH,
           "via": "args", "coordinator": address, "num_processes": 2, "sampled": True}
    procs = [run_job(dict(job, process_id=i), tmp_path, devices=4, name=f"process{i}") for i in range(2)]
    try:
        results = [wait_job(p, tmp_path, f"process{i}", timeout=600) for i, p in enumerate(procs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    one = pipeline["families"]["llama"]["one_device"]
    for r in results:
        assert r["mesh_processes"] == [0, 1] and r["stage_processes"] == [[0], [1]]
        assert r["tokens"] == one["tokens"] and r["sampled"] == one["sampled"]
    np.testing.assert_allclose(results[0]["logits"], results[1]["logits"], rtol=0, atol=0)


@pytest.fixture(scope="module")
def trained(checkpoints, tmp_path_factory):
    work = tmp_path_factory.mktemp("train")
    proc = run_job({"job": "train", "checkpoint": checkpoints["llama"], "meshes": TRAIN_MESHES}, work, devices=8,
                   name="train")
    return wait_job(proc, work, "train")


@pytest.mark.parametrize("spec", TRAIN_MESHES)
@pytest.mark.parametrize("kind", ["lora", "full"])
def test_training_on_a_mesh_equals_one_device(trained, spec, kind):
    """Fine-tuning with --mesh: rows split over dp, weights over tp as inference splits them; three steps give the
    losses and trained parameters of one device within float32 rounding. Full fine-tuning splits each trained
    weight and its optimizer moments over every device (tp and, FSDP, dp)."""
    r = trained[spec][kind]
    print(f"{kind} on {spec}: losses within {r['loss_err']:.1e}, parameters within {r['param_err']:.1e}; "
          f"q_proj and its moments in {r['shards']} shards")
    assert r["loss_err"] <= TRAIN_RTOL and r["param_err"] <= TRAIN_RTOL
    if kind == "full":
        assert r["shards"] == math.prod(int(x.split("=")[1]) for x in spec.split(","))


def test_sharded_loading_keeps_host_memory_near_the_checkpoint_size(tmp_path):
    from test_sharding import sharding_config, synthetic_checkpoint

    big = synthetic_checkpoint(BIG, tmp_path / "big")
    warm = synthetic_checkpoint(sharding_config("llama"), tmp_path / "warm")
    ckpt_bytes = sum(f.stat().st_size for f in (big / "params").rglob("*") if f.is_file())
    r = wait_job(run_job({"job": "rss", "checkpoint": str(big), "warmup": str(warm), "mesh": "tp=8"}, tmp_path,
                         devices=8, name="rss"), tmp_path, "rss")
    growth = r["peak"] - r["before"]
    assert r["model_bytes"] > 0.9 * ckpt_bytes
    assert r["device0_bytes"] == r["planned_per_device"] <= r["model_bytes"] / 7  # tp=8 splits everything large
    assert growth < RSS_LIMIT * ckpt_bytes, (
        f"peak RSS grew by {growth / 2**20:.0f} MiB while loading a {ckpt_bytes / 2**20:.0f} MiB checkpoint "
        f"({growth / ckpt_bytes:.2f}x, limit {RSS_LIMIT}x)")


if __name__ == "__main__":
    job = json.loads(Path(sys.argv[1]).read_text())
    sys.path.insert(0, str(ROOT / "tests"))
    result = JOBS[job["job"]](job)
    Path(job["out"]).write_text(json.dumps(result))
