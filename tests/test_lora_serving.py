"""LoRA adapters served beside their base model, against PyTorch + PEFT: adapters made and saved by PEFT itself on the
tiny Llama, their logits and greedy tokens, rows of different adapters (and none) in one batch, the prefix cache kept
apart per adapter, and the refusals of adapters that cannot be served (float32)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import run_reference
from families import GENERATE, PROMPTS

# Two adapters of different ranks, scales and targets (slots are padded to the larger rank).
ADAPTERS = {"terse": dict(r=4, alpha=8, targets=["q_proj", "v_proj"], seed=1),
            "verbose": dict(r=8, alpha=32, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"], seed=2)}
# Measured on the CPU in float32: 7e-7 to 2e-6 of the largest logit (PEFT in torch against the served programs).
LOGITS_RTOL = 1e-5


@pytest.fixture(scope="module")
def served(tiny, converted, tmp_path_factory):
    """The tiny Llama loaded with both adapters (made by PEFT), and PEFT's logits and greedy tokens for each."""
    import day0jax
    from day0jax.engine.config import EngineConfig

    root = tmp_path_factory.mktemp("lora")
    folders = {name: root / name for name in ADAPTERS}
    run_reference([{"op": "peft_make", "model": str(tiny["llama"]["hf"]), "prompts": PROMPTS, "generate": GENERATE,
                    "adapters": [dict(spec, folder=str(folders[name])) for name, spec in ADAPTERS.items()],
                    "out": str(root / "peft.npz")}], root)
    ref = dict(np.load(root / "peft.npz"))
    engine = EngineConfig(max_num_seqs=8, chunk_buckets=(32,), max_model_len=96)
    model = day0jax.load(converted["llama"], dtype="float32", kernels="reference", engine=engine,
                         adapters={name: str(f) for name, f in folders.items()})
    return {"model": model, "folders": folders, "ref": ref, "base": tiny["llama"]["ref"], "root": root}


def padded(prompts) -> np.ndarray:
    tokens = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    return tokens


def test_adapters_give_peft_logits(served):
    """Model.logits with each adapter equals PEFT's on the HF model; without one, the base model's."""
    model, ref = served["model"], served["ref"]
    tokens = padded(PROMPTS)  # right-padded: attention is causal
    base = model.logits(tokens)
    for i, p in enumerate(PROMPTS):
        expected = served["base"][f"logits_{i}"]
        assert np.abs(base[i, :len(p)] - expected).max() <= LOGITS_RTOL * np.abs(expected).max()
    for k, name in enumerate(ADAPTERS):
        ours = model.logits(tokens, adapter=name)
        for i, p in enumerate(PROMPTS):
            expected = ref[f"{k}.logits_{i}"]
            err = np.abs(ours[i, :len(p)] - expected).max() / np.abs(expected).max()
            moved = np.abs(expected - served["base"][f"logits_{i}"]).max() / np.abs(expected).max()
            print(f"{name} prompt {i}: relative error {err:.1e}; the adapter moves the logits by {moved:.2f}")
            assert err < LOGITS_RTOL and moved > 1e-2


def test_rows_of_different_adapters_share_batches_and_match_peft(served):
    """Nine rows, each prompt with each adapter and with none, generated together: every row's greedy tokens equal
    PEFT's (or the base model's), and equal the row generated alone."""
    model, ref = served["model"], served["ref"]
    names = [None, *ADAPTERS]
    rows = [(i, names[(i + j) % 3]) for j in range(3) for i in range(len(PROMPTS))]
    together = model.generate([PROMPTS[i] for i, _ in rows], GENERATE, ignore_eos=True,
                              adapter=[name for _, name in rows])
    for (i, name), tokens in zip(rows, together):
        expected = served["base"][f"generated_{i}"] if name is None else \
            ref[f"{list(ADAPTERS).index(name)}.generated_{i}"]
        assert tokens == expected.tolist(), (i, name)
        assert model.generate([PROMPTS[i]], GENERATE, ignore_eos=True, adapter=name)[0] == tokens
    # The adapters change what is generated (else this test would not tell them apart).
    assert len({tuple(t) for (i, _), t in zip(rows, together) if i == 1}) == 3


def test_prefix_cache_is_kept_apart_per_adapter(served):
    """A prompt's cached pages serve the same adapter again, never another adapter or the base model (their keys
    and values differ)."""
    from day0jax.engine.requests import SamplingParams

    engine = served["model"].engine
    prompt = [(11 * i + 5) % 200 + 3 for i in range(40)]  # two full pages of 16, not cached by other tests

    def cached(adapter):
        rid = f"cache-{adapter}-{engine.scheduler.pool.queries}"
        engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, adapter=adapter))
        hits = None
        while engine.has_work():
            for e in engine.step():
                if e.request_id == rid and e.token is not None:
                    hits = e.num_cached_tokens
        return hits

    assert cached("terse") == 0
    assert cached("terse") == 32
    assert cached("verbose") == 0
    assert cached(None) == 0
    assert cached("verbose") == 32


def test_unknown_adapter_is_refused_by_name(served):
    from day0jax.core.errors import GenerationError

    with pytest.raises(GenerationError, match="'chatty' is not served"):
        served["model"].generate([PROMPTS[0]], 2, adapter="chatty")
    with pytest.raises(GenerationError, match="2 adapters for 1 prompts"):
        served["model"].generate([PROMPTS[0]], 2, adapter=["terse", None])


def _copy(src: Path, dst: Path, config=None, tensors=None) -> Path:
    """A copy of an adapter folder with its config and tensors changed by the given functions."""
    shutil.copytree(src, dst)
    if config is not None:
        path = dst / "adapter_config.json"
        path.write_text(json.dumps(config(json.loads(path.read_text()))))
    if tensors is not None:
        path = dst / "adapter_model.safetensors"
        save_file(tensors(load_file(str(path))), str(path))
    return dst


def test_adapters_that_cannot_be_served_are_refused_naming_file_and_key(served, converted, tmp_path):
    """Each refusal comes before any weight is read (`ServedAdapters` on the abstract model, as `load` and the
    server's start make it) and names the file and the field or tensor."""
    from day0jax import models
    from day0jax.adapters import ServedAdapters
    from day0jax.core.errors import AdapterError

    model = served["model"]
    abstract = models.abstract_model(model.config)
    good = served["folders"]["terse"]
    q = "base_model.model.model.layers.0.self_attn.q_proj"

    def renamed(t):
        t[q.replace("q_proj", "qq_proj") + ".lora_A.weight"] = t.pop(f"{q}.lora_A.weight")
        t[q.replace("q_proj", "qq_proj") + ".lora_B.weight"] = t.pop(f"{q}.lora_B.weight")
        return t

    (tmp_path / "empty").mkdir()
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    (tmp_path / "pickled" / "adapter_model.bin").write_bytes(b"")
    cases = [
        ([("x", str(tmp_path / "missing"))], {}, "no such folder"),
        ([("x", str(tmp_path / "empty"))], {}, "adapter_config.json does not exist"),
        ([("x", str(tmp_path / "pickled"))], {}, "adapter_model.bin, a pickle, is not read"),
        ([("x", str(_copy(good, tmp_path / "prefix", config=lambda c: dict(c, peft_type="PREFIX_TUNING"))))], {},
         "adapter_config.json: peft_type is 'PREFIX_TUNING'"),
        ([("x", str(_copy(good, tmp_path / "dora", config=lambda c: dict(c, use_dora=True))))], {},
         "adapter_config.json: use_dora is set"),
        ([("x", str(good))], {"max_rank": 2}, "rank r=4 is over --max-lora-rank 2"),
        ([("x", str(_copy(good, tmp_path / "renamed", tensors=renamed)))], {},
         "adapter_model.safetensors: module 'model.layers.0.self_attn.qq_proj' is not one of this llama model's"),
        ([("x", str(_copy(good, tmp_path / "wide", tensors=lambda t: dict(t, **{
            f"{q}.lora_A.weight": np.zeros((4, 65), np.float32)}))))], {},
         "module 'model.layers.0.self_attn.q_proj' maps 65 -> "),
        ([("x", str(_copy(good, tmp_path / "half", tensors=lambda t: {k: v for k, v in t.items()
                                                                      if k != f"{q}.lora_B.weight"})))], {},
         "module 'model.layers.0.self_attn.q_proj' has no lora_B.weight"),
        ([("x", str(_copy(good, tmp_path / "rank", tensors=lambda t: dict(t, **{
            f"{q}.lora_B.weight": np.zeros((64, 3), np.float32)}))))], {},
         f"tensor '{q}.lora_B.weight' has shape [64, 3]; expected [out, r] with r=4"),
        ([("x", str(good)), ("y", str(good))], {"max_loras": 1}, "2 adapters, more than --max-loras 1"),
        ([("x", str(good)), ("x", str(good))], {}, "adapter name 'x' is given twice"),
    ]
    for modules, limits, said in cases:
        with pytest.raises(AdapterError) as e:
            ServedAdapters(modules, abstract, **limits)
        assert said in str(e.value), (said, str(e.value))
    from families import MULTIMODAL

    llava = MULTIMODAL["llava"]
    vision = models.abstract_model(models.config_from_hf(dict(llava.config, model_type=llava.model_type)))
    with pytest.raises(AdapterError, match="llava: serving LoRA adapters on a vision-language model is not"):
        ServedAdapters([("x", str(good))], vision)

    # `load` refuses before reading a weight; `check` reports the same refusal, and plans the good ones.
    import day0jax
    from day0jax.check import check
    from day0jax.engine.config import EngineConfig

    with pytest.raises(AdapterError, match="use_dora is set"):
        day0jax.load(converted["llama"], adapters={"x": str(tmp_path / "dora")})
    report = check(converted["llama"], engine=EngineConfig(lora_modules=(("x", str(tmp_path / "dora")),)))
    assert not report.supported and any("use_dora is set" in r for r in report.reasons)
    report = check(converted["llama"], engine=EngineConfig(lora_modules=tuple(
        (name, str(f)) for name, f in served["folders"].items())))
    assert report.adapters["padded_rank"] == 8 and report.adapters["modules"] == 7 * model.config.num_hidden_layers
    assert [a["rank"] for a in report.adapters["adapters"]] == [4, 8]


def test_memory_plan_reserves_the_adapters(served, converted):
    """The adapters' stacks (every device holds them whole) come off each device's budget before the plan: a budget
    the model fits alone with less room than they take is refused with them, and accepted without."""
    from day0jax import loader
    from day0jax.adapters import ServedAdapters
    from day0jax.core.errors import OutOfMemoryPlan
    from day0jax.engine.config import EngineConfig

    _, hf = loader.read_checkpoint_config(converted["llama"])
    modules = tuple((name, str(f)) for name, f in served["folders"].items())
    engine = EngineConfig(max_num_seqs=8, chunk_buckets=(32,), max_model_len=96)
    alone = loader.prepare(hf, dtype="float32", kernels="reference", engine=engine)
    need = ServedAdapters(modules, alone.abstract).nbytes(alone.abstract, 4)
    budget = alone.memory_plan.total_bytes + need // 2
    loader.prepare(hf, dtype="float32", kernels="reference", engine=engine, memory_budget=budget)
    with pytest.raises(OutOfMemoryPlan):
        loader.prepare(hf, dtype="float32", kernels="reference", memory_budget=budget,
                       engine=EngineConfig(max_num_seqs=8, chunk_buckets=(32,), max_model_len=96, lora_modules=modules))


def test_server_refuses_a_bad_adapter_at_start(served, converted, tmp_path):
    """The server exits non-zero, naming the adapter's file and field, without serving the model alone."""
    from launch import ServerProcess

    bad = _copy(served["folders"]["terse"], tmp_path / "dora", config=lambda c: dict(c, use_dora=True))
    proc = ServerProcess(["--model", str(converted["llama"]), "--lora-modules", f"x={bad}"])
    assert proc.proc.wait(300) == 1
    assert f"loading failed: {bad / 'adapter_config.json'}: use_dora is set" in proc.log_text()
    named = ServerProcess(["--model", str(converted["llama"]), "--served-model-name", "base",
                           "--lora-modules", f"base={served['folders']['terse']}"])
    assert named.proc.wait(300) == 2 and "is the base model's served name" in named.log_text()
