"""Fault isolation in the engine: a step that raises ends only the request it fails on (found by stepping each
request alone), every other request continues and loses no token, no event is lost on the way, and an engine
that keeps failing stops serving and says so (/health 503).

The fault is injected, deterministically: the forward program raises whenever a batch holds a "poison" token id,
so only the request whose prompt holds it can make a step fail.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serve_tiny import write_tiny_chat_checkpoint  # noqa: E402

import day0jax  # noqa: E402
from day0jax.engine.async_engine import MAX_FAILED_STEPS, AsyncEngine, EngineDead  # noqa: E402
from day0jax.engine.config import EngineConfig  # noqa: E402
from day0jax.engine.requests import SamplingParams  # noqa: E402

ENGINE = EngineConfig(max_num_seqs=4, chunk_buckets=(32,), max_model_len=256, min_width=256)
POISON = 4242
GOOD = [[1, 5, 9, 13, 17], [1, 2, 3], [1, 7, 7, 7, 7, 7, 7, 8]]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=10, temperature=1.5, seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return day0jax.load(write_tiny_chat_checkpoint(tmp_path_factory.mktemp("faults")), dtype="float32",
                        engine=ENGINE)


@pytest.fixture
def poisoned(model, monkeypatch):
    """The model's engine, whose forward raises on any batch holding the POISON token."""
    runner = model.engine.runner
    real = runner.forward

    def forward(batch, previous=None):
        if (batch.tokens == POISON).any():
            raise RuntimeError("injected fault")
        return real(batch, previous)
    monkeypatch.setattr(runner, "forward", forward)
    return model.engine


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]], late: dict | None = None):
    """Steps `engine` until idle, recovering from failed steps; `late` requests are added right after the first
    failure, before the recovery. Returns the tokens and finish reason per request and the failed ids."""
    tokens = {rid: [] for rid in {**requests, **(late or {})}}
    finish, failed = {}, []
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    while engine.has_work():
        try:
            events = engine.step()
        except RuntimeError:
            for rid, (prompt, params) in (late or {}).items():
                engine.add_request(rid, prompt, params)
            late = None
            events, ids = engine.recover()
            failed += ids
        for ev in events:
            if ev.token is not None and not ev.stop_token:
                tokens[ev.request_id].append(ev.token)
            if ev.finish_reason is not None:
                finish[ev.request_id] = ev.finish_reason
    return tokens, finish, failed


def test_a_failing_request_is_ended_alone_and_the_others_lose_no_token(model, poisoned):
    alone = {f"g{i}": model.generate([p], 10, ignore_eos=True)[0] for i, p in enumerate(GOOD)}
    sampled_alone = model.generate([GOOD[0]], 10, temperature=1.5, seed=3, ignore_eos=True)[0]
    requests = {f"g{i}": (p, PARAMS) for i, p in enumerate(GOOD)}
    requests["bad"] = ([1, POISON, 2], PARAMS)
    requests["sampled"] = (GOOD[0], SAMPLED)  # the fifth waits for a row: it joins once the bad one is gone
    tokens, finish, failed = run(poisoned, requests, late={"late": (GOOD[1], PARAMS)})
    assert failed == ["bad"] and not tokens["bad"]
    for rid, expected in alone.items():
        assert tokens[rid] == expected and finish[rid] == "length", rid
    assert tokens["sampled"] == sampled_alone  # the same draws after recomputing
    assert tokens["late"] == alone["g1"] and finish["late"] == "length"  # added mid-recovery: not lost
    assert not poisoned.has_work() and poisoned.scheduler.pool.num_used == 0


def test_a_failure_in_decode_after_many_tokens_keeps_every_token(model, poisoned):
    """The poison is generated, not prompted: the failing step is a decode step with several rows in flight."""
    target = model.generate([GOOD[2]], 10, ignore_eos=True)[0]
    poison_at = target[4]
    runner = poisoned.runner
    forward = runner.forward

    def fails_on_generated(batch, previous=None):
        if batch.tokens.shape[1] == 1 and (batch.tokens == poison_at).any():
            raise RuntimeError("injected fault")
        return forward(batch, previous)
    runner.forward = fails_on_generated
    try:
        good = {f"g{i}": (p, PARAMS) for i, p in enumerate(GOOD[:2])}
        alone = {rid: model.generate([p], 10, ignore_eos=True)[0] for rid, (p, _) in good.items()}
        tokens, finish, failed = run(poisoned, {**good, "bad": (GOOD[2], PARAMS)})
    finally:
        runner.forward = forward
    assert failed == ["bad"] and tokens["bad"] == target[:len(tokens["bad"])]
    assert {rid: tokens[rid] for rid in good} == alone


def test_an_engine_that_keeps_failing_stops_serving_and_says_so(model, monkeypatch):
    runner = model.engine.runner

    def broken(batch, previous=None):
        raise RuntimeError("device lost")
    monkeypatch.setattr(runner, "forward", broken)

    async def main():
        engine = AsyncEngine(model.engine)
        engine.start(asyncio.get_running_loop())
        try:
            events = engine.submit("r", GOOD[0], PARAMS)
            with pytest.raises(EngineDead):
                async for _ in events:
                    pass
            engine.release("r", finished=False)
            while engine.dead is None:  # each request ends alone first: the engine dies after repeated failures
                more = engine.submit(f"r{engine._failed_steps}", GOOD[1], PARAMS)
                with pytest.raises(EngineDead):
                    async for _ in more:
                        pass
            assert engine._failed_steps > MAX_FAILED_STEPS
            with pytest.raises(EngineDead, match="stopped serving"):
                engine.submit("after", GOOD[0], PARAMS)
            return engine
        finally:
            engine.stop()
    engine = asyncio.run(main())

    from day0jax.serve import routes
    from day0jax.serve.errors import APIError

    state = SimpleNamespace(status="ready", detail="", engine=engine)
    response = asyncio.run(routes.health(state))
    assert response.status_code == 503 and state.status == "failed" and "device lost" in state.detail
    with pytest.raises(APIError) as e:
        routes.ready(state)
    assert e.value.status == 503
