"""Generation API behaviour: sampling parameters, stop tokens, EOS, input validation, load errors, the CLI."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

import day0jax
from conftest import ROOT
from day0jax.core.errors import CheckpointError, GenerationError, MeshError
from families import PROMPTS


@pytest.fixture(scope="module")
def model(converted):
    return day0jax.load(converted["llama"], dtype="float32")  # as on the CPU; a GPU's default is bfloat16


def test_seeded_sampling_is_reproducible_and_seed_dependent(model):
    a = model.generate(PROMPTS, 8, temperature=1.0, seed=7, ignore_eos=True)
    b = model.generate(PROMPTS, 8, temperature=1.0, seed=7, ignore_eos=True)
    c = model.generate(PROMPTS, 8, temperature=1.0, seed=8, ignore_eos=True)
    assert a == b and a != c


def test_generate_makes_every_program_ready_before_the_first_token(converted):
    """A generation whose span crosses several width buckets runs only programs made ready before its first token
    (none traced on first use midway, as `ModelRunner.compiled` would record), the same tokens as before; the
    second call needs nothing new."""
    from day0jax.engine.config import EngineConfig

    m = day0jax.load(converted["llama"], dtype="float32",
                     engine=EngineConfig(max_num_seqs=2, min_width=16, chunk_buckets=(16,), max_model_len=96))
    runner = m.engine.runner
    prompts = [p[:6] for p in PROMPTS[:2]]
    out = m.generate(prompts, 60, ignore_eos=True)  # 66 tokens: spans of 1, 2, 4 and 6 pages of 16
    assert runner.compiled == set()
    widths = {p.shape[2] for p in runner.programs if p.name == "forward" and p.shape[1] == 1}
    assert widths >= {1, 2, 4, 6} and not any(p.name == "sample" for p in runner.programs)  # greedy: no sampler
    ready = set(runner.programs)
    assert m.generate(prompts, 60, ignore_eos=True) == out and set(runner.programs) == ready
    m.generate(prompts[:1], 4, temperature=1.0, seed=1)  # sampling: the sampler too, before the first token
    assert any(p.name == "sample" for p in runner.programs) and runner.compiled == set()


def test_top_k_1_and_tiny_top_p_are_greedy(model):
    greedy = model.generate(PROMPTS, 8, ignore_eos=True)
    assert model.generate(PROMPTS, 8, temperature=1.5, top_k=1, seed=3, ignore_eos=True) == greedy
    assert model.generate(PROMPTS, 8, temperature=1.5, top_p=1e-6, seed=3, ignore_eos=True) == greedy


def test_top_k_keeps_samples_among_the_k_best(model):
    prompt = PROMPTS[1]
    out = model.generate([prompt], 8, temperature=2.0, top_k=3, seed=11, ignore_eos=True)[0]
    logits = model.logits([prompt + out])[0]
    for i, token in enumerate(out):
        top3 = np.argsort(-logits[len(prompt) - 1 + i])[:3]
        assert token in top3


def test_stop_tokens_and_eos(model, converted, tmp_path):
    greedy = model.generate([PROMPTS[0]], 10, ignore_eos=True)[0]
    stop = greedy[3]
    out = model.generate([PROMPTS[0]], 10, stop_token_ids=[stop], ignore_eos=True)[0]
    assert out == greedy[:greedy.index(stop) + 1]  # the stop token is the last one returned
    # The same token as the checkpoint's EOS (generation_config.json): generation ends there unless ignore_eos.
    eos = tmp_path / "eos"
    shutil.copytree(converted["llama"], eos)
    (eos / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop]}))
    with_eos = day0jax.load(eos, dtype="float32")
    assert with_eos.eos_token_ids == (stop,)
    assert with_eos.generate([PROMPTS[0]], 10)[0] == out
    assert with_eos.generate([PROMPTS[0]], 10, ignore_eos=True)[0] == greedy


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompts=[[1, 2]], max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(prompts=[], max_new_tokens=4), "non-empty list"),
    (dict(prompts=[[1], []], max_new_tokens=4), "non-empty list"),
    (dict(prompts=[[1] * 120], max_new_tokens=20), "maximum context length is 128 tokens; the prompt has 120 "
                                                   "tokens and 20 more were asked for"),
    (dict(prompts=[[1]], max_new_tokens=2, temperature=-1.0), r"temperature must be in \[0, 100\], got -1.0"),
    (dict(prompts=[[1]], max_new_tokens=2, top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(prompts=[[1]], max_new_tokens=2, top_k=-2), "top_k must be -1, 0 \\(off\\) or a positive integer"),
])
def test_invalid_requests(model, kwargs, match):
    with pytest.raises(GenerationError, match=match):
        model.generate(**kwargs)


def test_load_errors(tiny, converted, tmp_path):
    with pytest.raises(CheckpointError, match="not a day0jax checkpoint.*convert it first"):
        day0jax.load(tiny["llama"]["hf"])
    with pytest.raises(CheckpointError, match="not a folder"):
        day0jax.load(tmp_path / "missing")
    newer = tmp_path / "newer"
    shutil.copytree(converted["llama"], newer)
    manifest = json.loads((newer / "day0jax.json").read_text())
    manifest["format_version"] = 99
    (newer / "day0jax.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="format version 99 is newer"):
        day0jax.load(newer)
    with pytest.raises(MeshError, match="'xp=2' is not AXIS=SIZE"):
        day0jax.load(converted["llama"], mesh="xp=2")
    with pytest.raises(MeshError, match="needs 4 devices but only 1"):
        day0jax.load(converted["llama"], mesh="tp=4")


def test_cli_generate_reports_errors(converted):
    proc = subprocess.run([sys.executable, "-m", "day0jax.generate", "--model", str(converted["llama"]),
                           "--prompt", "hi"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "no tokenizer.json" in proc.stderr


def test_cli_generate_chat(smollm2):
    proc = subprocess.run([sys.executable, "-m", "day0jax.generate", "--model", str(smollm2["ckpt_gguf"]),
                           "--prompt", "What is the capital of France?", "--chat", "--max-tokens", "12",
                           "--dtype", "float32"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "prompt tokens" in proc.stderr and "tokens/s" in proc.stderr


def test_default_model_converts_once_as_planned(tmp_path):
    """Converted once and reused; what the converter planned from the GGUF header alone (the config and compile
    cache a first start prepares while it converts) is what it wrote."""
    from day0jax.startup.compile_cache import fingerprint, model_fingerprint
    from day0jax import default_model
    from day0jax.default_model import default_checkpoint

    assert not default_model.is_converted(tmp_path)
    config, manifest = default_model.planned_output()
    first = default_checkpoint(tmp_path, progress=False)
    assert first == default_model.checkpoint_dir(tmp_path) and default_model.is_converted(tmp_path)
    assert json.loads((first / "config.json").read_text()) == config
    assert model_fingerprint(first, "float32") == fingerprint(config, manifest, "float32")
    stamp = (first / "day0jax.json").stat().st_mtime_ns
    assert default_checkpoint(tmp_path, progress=False) == first
    assert (first / "day0jax.json").stat().st_mtime_ns == stamp  # reused, not converted again
    assert day0jax.load(first).tokenizer.encode("Once upon a time,") == [6403, 1980, 253, 655, 28]
