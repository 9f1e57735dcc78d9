"""Speculative decoding in the engine: greedy tokens with drafts equal those without, for the ngram and draft
proposers and 1 to k drafts, alone and in batches where some rows speculate and some do not, also through Mamba2
layers (the MTP proposer and Gated DeltaNet layers: test_mtp.py); sampled tokens are distributed as without drafts;
pages and state slots come back after accepts, rejections, preemptions and aborts, and the prefix cache never serves
a rejected draft's keys.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import jax.numpy as jnp
import pytest
from flax import nnx

from day0jax import models
from day0jax.engine.config import EngineConfig, SpeculativeConfig
from day0jax.engine.engine import Engine
from day0jax.engine.requests import SamplingParams
from day0jax.engine.sampling import accept_drafts
from day0jax.engine.speculative import Proposer, make_proposer, ngram_drafts
from sharding.mesh import make_mesh
from test_engine_paged import PROMPTS, cache_less_greedy, greedy

CONTEXT = 128
LLAMA = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT)
# Hybrid linear attention (test_mtp.py): Gated DeltaNet layers around a full-attention one.
QWEN3_NEXT = dict(model_type="qwen3_next", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=CONTEXT,
                  layer_types=["linear_attention", "full_attention", "linear_attention"], linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16, num_experts=0)


def build(hf: dict):
    cfg = models.config_from_hf(hf)
    with nnx.use_eager_sharding(False):
        return models.family(hf["model_type"]).model(cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def llama():
    return build(LLAMA)


@pytest.fixture(scope="module")
def llama_reference(llama):
    return cache_less_greedy(llama)


def make_engine(module, spec: SpeculativeConfig | None, **overrides) -> Engine:
    # One decode width, batches of 1 and 4, chunks of 8/32: few programs to compile.
    config = dict(page_size=8, max_num_seqs=4, batch_buckets=(1, 4), kv_cache_tokens=512, chunk_buckets=(8, 32),
                  min_width=CONTEXT, speculative=spec)
    config.update(overrides)
    engine = Engine(module, make_mesh(None), jnp.float32, context_length=CONTEXT, config=EngineConfig(**config))
    if engine.spec is not None:
        engine.spec.backoff = False  # every row drafts whenever it can: the point here is correctness
    return engine


class Oracle(Proposer):
    """A test proposer that knows each request's greedy continuation and drafts it with planted mistakes: at each
    row's drafting step, a pseudo-random number of leading drafts are right and the rest wrong, so every acceptance
    length occurs. Rows of requests in `silent` never draft (a mixed batch); `most` caps a request's drafts (rows
    with 1 to k drafts share a verify step)."""

    method = "oracle"

    def __init__(self, continuations: dict[str, list[int]], silent=(), most: dict[str, int] | None = None,
                 seed: int = 0, vocab: int = 256):
        self.continuations, self.silent, self.most, self.vocab = continuations, set(silent), most or {}, vocab
        self.rng = random.Random(seed)

    def propose(self, seq, limit):
        if seq.request_id in self.silent:
            return []
        limit = min(limit, self.most.get(seq.request_id, limit))
        truth = self.continuations[seq.request_id][seq.num_generated:][:limit]
        right = self.rng.randint(0, len(truth))
        return truth[:right] + [(t + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab for t in truth[right:]]


def collect(engine: Engine, requests: dict, stagger: int = 0, check=None, events=None) -> dict[str, list[int]]:
    """Runs requests to completion (one more every `stagger` steps if > 0); returns tokens per request id (and
    appends every event to `events`, if given)."""
    out: dict[str, list[int]] = {}
    pending = list(requests.items())
    step = 0
    while pending or engine.has_work():
        if pending and (stagger == 0 or step % stagger == 0):
            batch, pending = (pending, []) if stagger == 0 else (pending[:1], pending[1:])
            for rid, (prompt, params) in batch:
                engine.add_request(rid, prompt, params)
        for ev in engine.step():
            if ev.token is not None:
                out.setdefault(ev.request_id, []).append(ev.token)
            if events is not None:
                events.append(ev)
        if check is not None:
            check(engine)
        step += 1
    assert engine.scheduler.pool.num_used == 0
    return out


def test_ngram_drafts_continue_the_longest_most_recent_match():
    tokens = [5, 6, 7, 8, 1, 5, 6, 9, 2, 3, 5, 6]
    assert ngram_drafts(tokens, 1, 3, 3) == [9, 2, 3]  # "5 6" last seen before 9 (the 3-gram "3 5 6" never)
    assert ngram_drafts(tokens, 3, 3, 3) == []
    assert ngram_drafts([1, 2, 3, 1, 2, 3, 1, 2], 2, 4, 5) == [3, 1, 2]  # "3 1 2" most recently at 2..4, then 3 1 2
    assert ngram_drafts([4, 4, 4], 1, 2, 4) == [4]
    assert ngram_drafts([1, 2], 1, 2, 0) == []


def test_acceptance_keeps_the_greedy_run_and_adds_the_target_token():
    logits = jnp.full((2, 3, 8), -5.0).at[:, 0, 3].set(1.0).at[:, 1, 4].set(1.0).at[:, 2, 6].set(1.0)
    drafts = jnp.array([[3, 4], [3, 5]], jnp.int32)
    rows = dict(seeds=jnp.zeros(2, jnp.uint32), counters=jnp.zeros(2, jnp.int32), temperature=jnp.zeros(2),
                top_k=jnp.zeros(2, jnp.int32), top_p=jnp.ones(2), min_p=jnp.zeros(2))
    out = accept_drafts(logits, drafts, jnp.array([2, 2], jnp.int32), **rows)
    assert out["accepted"].tolist() == [2, 1]
    assert out["tokens"].tolist() == [[3, 4, 6], [3, 4, 0]]
    out = accept_drafts(logits, drafts, jnp.array([0, 1], jnp.int32), **rows)  # fewer drafts: the rest is padding
    assert out["accepted"].tolist() == [0, 1] and out["tokens"].tolist() == [[3, 0, 0], [3, 4, 0]]


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_tokens_equal_plain_decoding(llama, llama_reference, k):
    """Planted mistakes at every draft position; prompts join one by one, rows of two requests never draft and the
    others draft 1 to k tokens; then a prompt alone (batch 1). And prompt lookup (ngram) itself on the same
    prompts. The counts reach each request's events and /metrics; every speculative program lowers."""
    from types import SimpleNamespace

    from day0jax.serve.metrics import Metrics

    truth = {f"r{i}": ref for i, ref in enumerate(llama_reference)}
    engine = make_engine(llama, SpeculativeConfig("ngram", num_tokens=k))
    engine.spec.proposer = Oracle(truth, silent={"r1"}, most={"r0": 1, "r2": 2, "r3": 3}, seed=k)
    events = []
    out = collect(engine, {f"r{i}": (p, greedy()) for i, p in enumerate(PROMPTS)}, stagger=2, events=events)
    assert out == truth
    stats = engine.spec.stats
    assert stats.drafts > 0 and 0 < stats.accepted_tokens < stats.draft_tokens
    assert min(stats.accepted_per_position) > 0  # every draft position accepted sometimes
    last = {ev.request_id: ev for ev in events}
    assert sum(ev.num_draft_tokens for ev in last.values()) == stats.draft_tokens and last["r1"].num_draft_tokens == 0
    assert sum(ev.num_accepted_tokens for ev in last.values()) == stats.accepted_tokens
    metrics = Metrics(SimpleNamespace(engine=SimpleNamespace(engine=engine), timeline=None)).render().decode()
    assert f"day0jax_spec_decode_num_accepted_tokens_total {float(stats.accepted_tokens)}" in metrics
    assert f'day0jax_spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} ' \
           f"{float(stats.accepted_per_position[0])}" in metrics
    assert collect(engine, {"r3": (PROMPTS[3], greedy())}) == {"r3": truth["r3"]}
    engine.spec.proposer = make_proposer(engine.config.speculative)
    assert collect(engine, {f"r{i}": (p, greedy()) for i, p in enumerate(PROMPTS)}) == truth
    for program in engine.programs():
        if program.name in ("verify", "accept"):
            engine.runner.lower(program)


def test_state_layers_that_keep_only_the_last_state_are_refused():
    """Per-layer embeddings write only the state after a step's last token, so a verify step would leave rejected
    drafts in it: the engine refuses speculation for such a model, naming the layer; Gated DeltaNet, short
    convolutions, Mamba2 and compressed attention's buffers keep the state after each token and pass."""
    from day0jax.core.errors import GenerationError
    from day0jax.engine.speculative import refuse_unverifiable_state
    from families import FAMILIES

    shapes = lambda hf: models.abstract_model(models.config_from_hf(hf))  # noqa: E731  (the layers' types suffice)
    model_type, config, _ = FAMILIES["qwen4_exp"]
    with pytest.raises(GenerationError, match="PLELayer"):
        refuse_unverifiable_state(shapes(dict(config, model_type=model_type)))
    for family in ("lfm2", "nemotron_h", "deepseek_v4"):
        model_type, config, _ = FAMILIES[family]
        refuse_unverifiable_state(shapes(dict(config, model_type=model_type)))
    refuse_unverifiable_state(shapes(QWEN3_NEXT))


@pytest.mark.parametrize("family", ["nemotron_h", "falcon_h1"])
def test_mamba2_hybrids_keep_the_state_after_each_verified_token(family):
    """Mamba2 layers (NemotronH's beside attention and MoE layers, Falcon-H1's in parallel with attention in each
    layer): a verify step scans its tokens one at a time and keeps the state after each, and the accepted one becomes
    the sequence's. With planted drafts (every acceptance length) in rows that join one by one beside a row that never
    drafts, greedy tokens equal plain decoding's, and every state slot comes back."""
    from families import FAMILIES

    model_type, config, _ = FAMILIES[family]
    module = build(dict(config, model_type=model_type, max_position_embeddings=CONTEXT))
    truth = {f"r{i}": ref for i, ref in enumerate(cache_less_greedy(module))}
    engine = make_engine(module, SpeculativeConfig("ngram", num_tokens=3), batch_buckets=(4,), chunk_buckets=(32,))
    engine.spec.proposer = Oracle(truth, silent={"r1"}, seed=3)
    out = collect(engine, {f"r{i}": (p, greedy()) for i, p in enumerate(PROMPTS)}, stagger=2)
    assert out == truth
    stats = engine.spec.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens and min(stats.accepted_per_position) > 0
    assert engine.scheduler.state_copies == 4
    assert sorted(engine.scheduler.free_slots) == list(range(1, engine.layout.state_slots))


def test_speculative_flags():
    import argparse

    from day0jax import cli

    parser = argparse.ArgumentParser()
    cli.add_engine_arguments(parser)
    args = parser.parse_args(["--speculative", "ngram", "--num-speculative-tokens", "3", "--ngram-max", "5",
                              "--spec-max-batch", "2"])
    assert cli.engine_config_from_args(args).speculative == SpeculativeConfig("ngram", num_tokens=3, ngram_min=2,
                                                                             ngram_max=5, max_batch=2)
    assert cli.engine_config_from_args(parser.parse_args([])).speculative is None
    assert EngineConfig(speculative="mtp").speculative == SpeculativeConfig("mtp")
    with pytest.raises(SystemExit):
        cli.engine_config_from_args(parser.parse_args(["--speculative", "draft"]))


def test_usage_reports_the_drafts_of_each_choice():
    from types import SimpleNamespace

    from day0jax.serve.format import usage

    choices = [SimpleNamespace(draft_tokens=8, accepted_tokens=5), SimpleNamespace(draft_tokens=4, accepted_tokens=1)]
    out = SimpleNamespace(run=SimpleNamespace(prompt_tokens=10), generated=20, cached_tokens=0, choices=choices,
                          reasoning=None)
    assert usage(out).speculative.model_dump() == {"draft_tokens": 12, "accepted_tokens": 6}
    assert usage(SimpleNamespace(**{**vars(out), "choices": []})).speculative is None


def total_variation(a: Counter, b: Counter) -> float:
    n, m = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a[x] / n - b[x] / m) for x in set(a) | set(b))


class Fixed(Proposer):
    """Drafts the same tokens whatever the context (a test proposer: often right for a peaked model, often not)."""

    method = "fixed"

    def __init__(self, tokens):
        self.tokens = list(tokens)

    def propose(self, seq, limit):
        return self.tokens[:limit]


def test_sampled_tokens_are_distributed_as_without_drafts():
    """Temperature 1 with top-p 0.9, on the tiny model with its logits scaled up 8 times (peaked, as trained models
    are, so that a few thousand draws tell distributions apart): tokens 2 and 3 after a fixed prompt (one verify
    step scores both drafts) over N seeded draws each way. With P = Q, TV(P_N, Q_N) <= TV(P_N, P) + TV(Q_N, P),
    each of mean at most 1/2 sum_i sqrt(p_i / N) and within sqrt(ln(1/delta) / 2N) of it but for probability delta
    (McDiarmid: one draw moves it by 1/N at most); so TV <= sum_i sqrt(p_i / N) + 2 sqrt(ln(1/delta) / 2N) but for
    probability 2 delta, p estimated by the pooled frequencies, delta = 1e-3. Keeping every draft instead (the test
    hook) is far outside the bound."""
    N = 1600
    prompt = PROMPTS[0]
    llama = build(LLAMA)
    llama.lm_head.kernel[...] = llama.lm_head.kernel[...] * 8.0
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_p=0.9, seed=4 * j, n=4, ignore_eos=True)
              for j in range(N // 4)]

    def draws(engine) -> Counter:
        out = Counter()
        pending = list(enumerate(params))
        tokens: dict[tuple, list[int]] = {}
        while pending or engine.has_work():
            while pending and engine.num_waiting < 8:
                j, p = pending.pop(0)
                engine.add_request(f"d{j}", prompt, p)
            for ev in engine.step():
                if ev.token is not None:
                    tokens.setdefault((ev.request_id, ev.index), []).append(ev.token)
        assert len(tokens) == N and all(len(t) == 3 for t in tokens.values())
        out.update(tuple(t[1:]) for t in tokens.values())
        return out

    plain = draws(make_engine(llama, None))
    (second, third), _ = plain.most_common(1)[0]
    engine = make_engine(llama, SpeculativeConfig("ngram", num_tokens=2))
    engine.spec.proposer = Fixed([second, third])
    speculative = draws(engine)
    stats = engine.spec.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens  # drafts both kept and rejected
    pooled = plain + speculative
    delta = 1e-3
    bound = sum(math.sqrt(c / (2 * N) / N) for c in pooled.values()) + 2 * math.sqrt(math.log(1 / delta) / (2 * N))
    tv = total_variation(plain, speculative)
    assert tv <= bound, (tv, bound)
    engine.spec.force_accept = True
    assert total_variation(plain, draws(engine)) > bound


def test_pages_and_slots_come_back_and_the_prefix_cache_serves_only_verified_tokens(llama, llama_reference):
    """Random accepts, rejections, preemptions (a pool of 12 pages) and aborts; the pool is checked after every
    step. Then prompts that extend finished sequences (their pages cached, some of which held rejected drafts
    before being rewritten) decode to the cache-less forward's tokens, from cached pages."""
    truth = {f"r{i}": ref for i, ref in enumerate(llama_reference)}
    rng = random.Random(7)
    engine = make_engine(llama, SpeculativeConfig("ngram", num_tokens=3), kv_cache_tokens=96, max_model_len=96)
    slots = sorted(engine.scheduler.free_slots)
    aborted = set()
    for round_ in range(3):
        requests = {f"a{round_}-{i}": (PROMPTS[i], greedy()) for i in rng.sample(range(len(PROMPTS)), 5)}
        engine.spec.proposer = Oracle({rid: truth["r" + rid.split("-")[1]] for rid in requests}, seed=round_)

        def check(e, requests=requests):
            e.scheduler.pool.check()
            running = [s.request_id for s in e.scheduler.running]
            if running and rng.random() < 0.08:
                rid = rng.choice(running)
                aborted.add(rid)
                e.abort(rid)

        out = collect(engine, requests, check=check)
        for rid in requests:
            ref = truth["r" + rid.split("-")[1]]
            assert out.get(rid, []) == (ref[:len(out.get(rid, []))] if rid in aborted else ref), rid
    assert engine.scheduler.num_preemptions > 0 and aborted
    pool = engine.scheduler.pool
    assert pool.num_free == pool.usable and sorted(engine.scheduler.free_slots) == slots
    # Longer prompts over what the sequences generated: their leading blocks come from the cache.
    extended = [PROMPTS[1] + truth["r1"][:12], PROMPTS[3] + truth["r3"][:9]]
    hits = pool.hits
    engine.spec.proposer = make_proposer(engine.config.speculative)
    out = collect(engine, {f"x{i}": (p, greedy(8)) for i, p in enumerate(extended)})
    assert pool.hits > hits
    assert [out[f"x{i}"] for i in range(2)] == cache_less_greedy(llama, extended, new_tokens=8)


def test_penalties_logprobs_and_stop_tokens_follow_plain_decoding(llama):
    """Penalties count the drafts before each position, logprobs are the target's, and a stop token ends the
    accepted run where plain decoding ends."""
    prompts = [PROMPTS[1], PROMPTS[4]]
    params = SamplingParams(max_tokens=14, temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.6,
                            presence_penalty=0.3, logprobs=2, ignore_eos=True)

    def run(engine, params):
        out: dict[str, list] = {}
        for i, p in enumerate(prompts):
            engine.add_request(f"p{i}", p, params)
        while engine.has_work():
            for ev in engine.step():
                if ev.token is not None:
                    out.setdefault(ev.request_id, []).append((ev.token, ev.logprob, ev.top_logprobs))
        return out

    plain = run(make_engine(llama, None), params)
    truth = {rid: [t for t, _, _ in v] for rid, v in plain.items()}
    engine = make_engine(llama, SpeculativeConfig("ngram", num_tokens=3))
    engine.spec.proposer = Oracle(truth, seed=3)
    ours = run(engine, params)
    assert {rid: [t for t, _, _ in v] for rid, v in ours.items()} == truth
    assert engine.spec.stats.accepted_tokens > 0
    for rid in truth:
        for (_, lp, top), (_, lp0, top0) in zip(ours[rid], plain[rid]):
            assert lp == pytest.approx(lp0, abs=1e-4) and [t for t, _ in top] == [t for t, _ in top0]
    # A stop token in the middle of a run the proposer drafts past: the run ends on it.
    stop = truth["p0"][5]
    cut = dataclasses.replace(params, stop_token_ids=(stop,))
    plain = run(make_engine(llama, None), cut)
    engine.spec.proposer = Oracle({rid: [t for t, _, _ in v] + [0] * 14 for rid, v in plain.items()}, seed=4)
    tokens = lambda out: {rid: [t for t, _, _ in v] for rid, v in out.items()}  # noqa: E731
    assert tokens(run(engine, cut)) == tokens(plain) and plain["p0"][-1][0] == stop


@pytest.fixture(scope="module")
def chat_checkpoints(tmp_path_factory):
    """The tiny random Llama with SmolLM2's tokenizer (serve_tiny.py), as the target and as its own draft model."""
    from serve_tiny import write_tiny_chat_checkpoint

    return write_tiny_chat_checkpoint(tmp_path_factory.mktemp("spec-chat"), name="target")


def test_a_draft_model_drafts_what_it_would_generate(chat_checkpoints):
    """The target as its own draft model: every draft it makes must be accepted, also after the test spoils the
    tail of some drafts (the draft model then catches up over what the target kept). Through `day0jax.load`,
    `Model.generate(..., speculative=False)` for the plain tokens, a grammar (a regex) and a mixed batch."""
    import day0jax

    spec = SpeculativeConfig("draft", num_tokens=3, draft_model=str(chat_checkpoints))
    model = day0jax.load(chat_checkpoints, dtype="float32", engine=EngineConfig(
        max_num_seqs=4, batch_buckets=(1, 4), chunk_buckets=(32,), max_model_len=256, min_width=256,
        speculative=spec))
    prompts = [model.tokenizer.encode(t) for t in ("The sea is", "Once upon a time, in a land far away")]
    plain = model.generate(prompts, 24, ignore_eos=True, speculative=False)
    engine = model.engine
    assert engine.spec.stats.drafts == 0
    spoiled, rng = {}, random.Random(0)
    propose, record = engine.spec.propose, engine.spec.record

    def spoiling_propose(seq):
        propose(seq)
        spoiled[seq] = cut = rng.randint(0, len(seq.drafts))
        seq.drafts = seq.drafts[:cut] + [(t + 1) % 49152 for t in seq.drafts[cut:]]

    def checked_record(seq, drafted, accepted):
        if drafted:
            assert accepted == spoiled.pop(seq), (drafted, accepted)
        record(seq, drafted, accepted)

    engine.spec.propose, engine.spec.record = spoiling_propose, checked_record
    assert model.generate(prompts, 24, ignore_eos=True) == plain
    stats = engine.spec.stats
    assert stats.drafts > 0 and 0 < stats.accepted_tokens < stats.draft_tokens
    engine.spec.propose, engine.spec.record = propose, record
    before = dataclasses.replace(stats)
    assert model.generate(prompts, 24, ignore_eos=True) == plain
    assert stats.accepted_tokens - before.accepted_tokens == stats.draft_tokens - before.draft_tokens > 0
    # A grammar: the drafts are scored against its mask position by position.
    digits = dict(regex=r"[0-9]{3}(-[0-9]{2}){2,6}")
    assert model.generate(prompts, 20, **digits) == model.generate(prompts, 20, speculative=False, **digits)
