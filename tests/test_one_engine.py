"""One decode path: `Model.generate`, `python -m day0jax.generate` and the server (completions and chat) run the
same engine and sampler, so the same request with the same seed gives the same tokens from each, greedy and
sampled. Compared as text through the same tokenizer (the CLI and the server answer text).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serve_tiny import write_tiny_chat_checkpoint  # noqa: E402

import day0jax  # noqa: E402
from conftest import ROOT  # noqa: E402
from day0jax.engine.config import EngineConfig  # noqa: E402
from launch import ServerProcess  # noqa: E402

# The same engine flags everywhere: the same shape buckets give the same programs, hence the same logits.
FLAGS = ["--max-num-seqs", "4", "--chunk-sizes", "32,128", "--max-model-len", "256", "--min-width", "256"]
ENGINE = EngineConfig(max_num_seqs=4, chunk_buckets=(32, 128), max_model_len=256, min_width=256)
PROMPT = "Tell me about the sea"
# (temperature, top_p, top_k, seed): greedy, plain sampling, filtered sampling.
# The tiny random model is sharply peaked: the API's highest temperature makes sampling visibly differ from greedy.
SETTINGS = [(0.0, 1.0, 0, None), (2.0, 1.0, 0, 11), (2.0, 0.95, 500, 12345)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_chat_checkpoint(tmp_path_factory.mktemp("one-engine"))


@pytest.fixture(scope="module")
def model(ckpt):
    return day0jax.load(ckpt, engine=ENGINE)


@pytest.fixture(scope="module")
def server(ckpt):
    proc = ServerProcess(["--model", str(ckpt), "--served-model-name", "tiny", *FLAGS])
    try:
        yield proc.wait_ready(900)
    finally:
        proc.terminate()


def text_of(model, ids: list[int]) -> str:
    """What the CLI and the server make of generated ids: EOS and stop tokens dropped, special tokens skipped."""
    return model.tokenizer.decode([t for t in ids if t not in model.eos_token_ids], skip_special_tokens=True)


def cli(ckpt, temperature, top_p, top_k, seed, chat: bool) -> str:
    args = [sys.executable, "-m", "day0jax.generate", "--model", str(ckpt), "--prompt", PROMPT, "--max-tokens", "24",
            "--temperature", str(temperature), "--top-p", str(top_p), "--top-k", str(top_k), *FLAGS]
    args += (["--seed", str(seed)] if seed is not None else []) + (["--chat"] if chat else [])
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout[:-1]  # print's newline


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_generate_cli_and_server_give_the_same_tokens(model, ckpt, server, chat):
    messages = [{"role": "user", "content": PROMPT}]
    ids = model.tokenizer.apply_chat_template(messages) if chat else model.tokenizer.encode(PROMPT)
    texts = set()
    for temperature, top_p, top_k, seed in SETTINGS:
        ours = text_of(model, model.generate([ids], 24, temperature=temperature, top_p=top_p, top_k=top_k,
                                             seed=seed)[0])
        body = dict(model="tiny", max_tokens=24, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        if chat:
            r = httpx.post(server.url + "/v1/chat/completions", json=dict(body, messages=messages), timeout=300)
            served = r.json()["choices"][0]["message"]["content"]
        else:
            r = httpx.post(server.url + "/v1/completions", json=dict(body, prompt=PROMPT), timeout=300)
            served = r.json()["choices"][0]["text"]
        assert r.status_code == 200, r.text
        assert served == ours, (temperature, seed)
        if (temperature == 0) != chat:  # the CLI (a process per call): greedy completion, sampled chat
            assert cli(ckpt, temperature, top_p, top_k, seed, chat) == ours, (temperature, seed)
        texts.add(ours)
    assert len(texts) >= 2  # sampling really draws something other than the greedy text


def test_the_server_plans_what_load_plans(model, server):
    """The server, given the same engine flags, logs the memory plan `load` made (free memory aside)."""
    assert model.memory_plan.summary().rsplit("; ", 1)[0] in server.log_text()


def test_batched_generate_equals_one_request_per_prompt(model):
    """Prompts generated together, each its own engine request, give what each gives alone."""
    prompts = [model.tokenizer.encode(p) for p in ("The sea", "A long time ago in a faraway land", "Hi")]
    together = model.generate(prompts, 16, temperature=0.9, seed=7, ignore_eos=True)
    alone = [model.generate([p], 16, temperature=0.9, seed=7, ignore_eos=True)[0] for p in prompts]
    assert together == alone and all(len(t) == 16 for t in together)
