"""Ready fast, then complete: the ready set compiled before /health turns 200, the rest compiled in the background
most-likely-needed first, steps whose program is missing run padded on a larger compiled one or make their own
ready (waiting for the background thread when it has it), and `serve --warmup all|ready|none`.

Nothing here depends on timing: the background thread is either not started (the step's path is then the only
one) or driven by events.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serve_tiny import write_tiny_chat_checkpoint  # noqa: E402

import day0jax  # noqa: E402
from day0jax.engine.config import EngineConfig  # noqa: E402
from day0jax.engine.programs import Program  # noqa: E402
from day0jax.startup.warmup import BackgroundCompiler, compile_programs  # noqa: E402
from launch import ServerProcess  # noqa: E402

# Decode spans of 8 and 16 pages of 16 tokens for 1, 2 and 4 rows; prefill chunks of 32 tokens over 16 pages.
ENGINE = EngineConfig(max_num_seqs=4, chunk_buckets=(32,), max_model_len=256, min_width=128)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_chat_checkpoint(tmp_path_factory.mktemp("warmup"))


@pytest.fixture(scope="module")
def reference(ckpt):
    """Greedy continuations from a model whose engine traces every program it needs inline (no warm-up)."""
    model = day0jax.load(ckpt, dtype="float32", engine=ENGINE)
    return lambda prompts, n: model.generate(prompts, n, ignore_eos=True)


def test_ready_set_and_background_order(ckpt):
    runner = day0jax.load(ckpt, dtype="float32", engine=ENGINE).engine.runner
    ready = runner.catalog.ready()
    assert [p.label for p in ready if p.name == "forward"] == ["1x1x8", "4x1x8", "1x32x16"]
    assert [p.label for p in ready if p.name == "sample"] == ["1", "4"]
    rest = runner.catalog.background(ready)
    assert set(rest) == set(runner.catalog.all()) - set(ready) and len(rest) == len(set(rest))
    kinds = [("sampler+extras" if p.penalized or p.guided else "sampler") if p.name == "sample" else "forward"
             for p in rest]
    # Plain samplers (cheap) first, then forward programs, then the samplers taking penalties or grammar masks.
    assert kinds == sorted(kinds, key=["sampler", "forward", "sampler+extras"].index)
    forward = [p.shape for p in rest if p.name == "forward"]
    # By span; at each span the most rows first (padded, it serves every smaller batch).
    assert forward[:3] == [(2, 1, 8), (4, 1, 16), (2, 1, 16)]
    assert [w for _, _, w in forward] == sorted(w for _, _, w in forward)


def test_missing_programs_run_padded_on_larger_ones_or_compile_on_the_step(ckpt, reference):
    """With only the ready set compiled, short greedy requests (a batch of 3 rows, spans up to 8 pages) run on it,
    padded, and compile nothing; longer ones compile exactly the program no compiled one covers, on their own path.
    The tokens equal those of inline-traced programs."""
    model = day0jax.load(ckpt, dtype="float32", engine=ENGINE)
    # The server's path: nothing made ready ahead of the steps.
    model._compile_for = lambda prompts, params, images=(): None
    runner = model.engine.runner
    compile_programs(runner, runner.catalog.ready())
    compiler = BackgroundCompiler(runner, [])  # never started: the steps' own path is the only one
    asked = []
    runner.ensure = lambda p: (asked.append(p), compiler.ensure(p))
    short = [[1, 5, 9, 13], [1, 7, 3], [1, 2, 3, 4, 5, 6]]  # three rows: padded to the 4-row decode program
    assert model.generate(short, 8, ignore_eos=True) == reference(short, 8)
    assert asked == [] and compiler.made == {"background": 0, "request": 0}
    long = [[1] + [(5 * i + j) % 200 + 3 for i in range(150)] for j in range(2)]  # 2 rows past 8 pages
    assert model.generate(long, 16, ignore_eos=True) == reference(long, 16)
    # Their prefill ran on the ready set; their joint decode steps (2 rows over 16 pages) had no compiled program
    # at least that large: compiled once, on the step's path.
    assert [p.label for p in asked] == ["2x1x16"] and compiler.made == {"background": 0, "request": 1}
    assert runner.installed(asked[0])

class FakeOwner:
    """A program owner whose compile of `slow` blocks until `release` is set."""

    def __init__(self, slow):
        self.slow, self.release, self.compiling = slow, threading.Event(), threading.Event()
        self.programs, self.compiles = {}, []

    def installed(self, p):
        return p in self.programs

    def signature(self, p):
        return p.label

    def lower(self, p):
        return p

    def compile(self, p):
        self.compiles.append(p)
        if p == self.slow:
            self.compiling.set()
            assert self.release.wait(60)
        return f"compiled {p.label}"

    def install(self, p, compiled):
        self.programs[p] = compiled


def test_a_step_needing_a_program_the_background_is_compiling_waits_for_it():
    first, slow, last = Program("forward", (1, 1, 8)), Program("forward", (4, 1, 8)), Program("sample", (1,), True)
    owner = FakeOwner(slow)
    compiler = BackgroundCompiler(owner, [first, slow, last])
    compiler.start()
    assert owner.compiling.wait(60)  # the background thread is inside slow's compile
    waiter = threading.Thread(target=compiler.ensure, args=(slow,))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not owner.installed(slow)  # the step waits for the compile in progress...
    owner.release.set()
    waiter.join(60)
    assert compiler.done.wait(60) and not waiter.is_alive()
    # ... and does not compile it again: every program compiled once, all by the background thread.
    assert owner.compiles == [first, slow, last] and compiler.made == {"background": 3, "request": 0}
    assert compiler.pending == 0


def test_a_program_the_background_failed_to_compile_is_compiled_again_by_the_step_that_needs_it(caplog):
    flaky = Program("forward", (1, 1, 8))
    owner = FakeOwner(slow=None)
    failures = [RuntimeError("out of memory while compiling")]
    compile_once = owner.compile

    def compile(p):
        if failures:
            raise failures.pop()
        return compile_once(p)
    owner.compile = compile
    compiler = BackgroundCompiler(owner, [flaky])
    compiler.start()
    assert compiler.done.wait(60)
    assert "background compile of forward 1x1x8 failed" in caplog.text and not owner.installed(flaky)
    compiler.ensure(flaky)
    assert owner.installed(flaky) and compiler.made == {"background": 0, "request": 1}


def metric(text: str, name: str, **labels) -> float:
    sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}{{{sel}}} ([0-9.e+-]+)$" if labels else rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name}{{{sel}}} not in /metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    """One compile cache for both modes: the second loads from what the first compiled."""
    return tmp_path_factory.mktemp("warmup-cache")


@pytest.mark.parametrize("warmup", ["ready", "none"])
def test_serve_warmup_modes(ckpt, cache_root, warmup, reference):
    """`--warmup ready` compiles the ready set before ready and a request it covers compiles nothing on its path;
    `--warmup none` compiles nothing before ready and still answers. Either way the rest compiles in the background
    until nothing is pending, and the answer is the same greedy continuation."""
    flags = ["--model", str(ckpt), "--compile-cache", str(cache_root), "--warmup", warmup,
             "--max-num-seqs", "4", "--chunk-sizes", "32", "--max-model-len", "256", "--min-width", "128"]
    proc = ServerProcess(flags)
    try:
        proc.wait_ready(600)
        r = httpx.post(proc.url + "/v1/completions", timeout=300, json={
            "model": "tiny-chat", "prompt": [1, 5, 9, 13], "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        metrics = httpx.get(proc.url + "/metrics").text
        ready_set = 3 + 2  # forward programs, then one sampler for 1 and for 4 rows
        made = sum(metric(metrics, "day0jax_startup_programs_total", cache=c, source=s)
                   for c, s in (("miss", "compiled"), ("hit", "xla-cache"), ("hit", "program-store")))
        assert made == (ready_set if warmup == "ready" else 0)
        if warmup == "ready":
            assert metric(metrics, "day0jax_compiles_after_ready_total", kind="compile", path="request") == 0
        while metric(httpx.get(proc.url + "/metrics").text, "day0jax_programs_pending") > 0:
            time.sleep(0.2)
        assert "background compile done" in proc.log_text()
    finally:
        assert proc.terminate() == 0, proc.log_text()[-3000:]
    text = r.json()["choices"][0]["text"]
    assert model_tokens(ckpt, text) == reference([[1, 5, 9, 13]], 6)[0]


def model_tokens(ckpt, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(ckpt) / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def test_first_use_converts_the_default_model_while_its_ready_set_compiles(tmp_path, monkeypatch, caplog):
    """A first start (nothing converted yet) plans the default model's config from the GGUF header, compiles the
    ready set on a side thread while the converter runs, then restores into the engine those programs were made
    for: it answers with the embedded model's known greedy continuation."""
    from day0jax.serve.__main__ import parse_args
    from day0jax.startup import timeline as tl
    from day0jax.start import start_engine
    from day0jax import default_model

    monkeypatch.setenv("DAY0JAX_CACHE", str(tmp_path))
    args = parse_args(["--no-compile-cache", "--dtype", "float32", "--max-num-seqs", "2", "--chunk-sizes", "32",
                       "--max-model-len", "256", "--min-width", "256"])
    assert not default_model.is_converted()
    timeline = tl.Timeline()
    with caplog.at_level(logging.INFO, logger="day0jax"):
        started = start_engine(args, timeline, warmup="ready")
    assert default_model.is_converted()
    ready = started.engine.runner.catalog.ready()
    assert f"compiling {len(ready)} programs meanwhile" in caplog.text
    assert {"default model", "compile", "restore parameters"} <= {p.name for p in timeline.phases}
    assert [(r.program, r.shape) for r in started.records] == [(p.name, p.label) for p in ready]
    assert all(started.engine.runner.installed(p) for p in ready)
    model = started.model
    assert model.engine is started.engine
    ids = model.tokenizer.encode("Once upon a time,")
    text = model.tokenizer.decode(model.generate([ids], 8)[0])
    assert text == " the city of Nova Haven was a thriving", text
