"""Block accounting of the engine's scheduler under random admit / finish / abort sequences (hypothesis).

The model is replaced by a fake that returns random tokens, so thousands of steps run in seconds without
compiling anything; what is checked is the host-side bookkeeping: pages are free xor referenced, a page written
by a sequence is referenced by it alone, cached prefixes are shared, preemption happens instead of a crash when
pages run out, and every page comes back once all requests have ended.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from day0jax import models
from day0jax.core.errors import GenerationError
from day0jax.engine.block_pool import BlockPool, OutOfPages
from day0jax.engine.config import EngineConfig, first_chunk
from day0jax.engine.engine import Engine
from day0jax.engine.requests import ABORT, InvalidRequest, QueueFull, SamplingParams
from sharding.mesh import make_mesh

VOCAB = 64


@pytest.fixture(scope="module")
def module():
    cfg = models.config_from_hf(dict(model_type="llama", vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                     max_position_embeddings=96))
    with nnx.use_eager_sharding(False):
        return models.family("llama").model(cfg, rngs=nnx.Rngs(0))


def fake_engine(module, num_pages_tokens: int, max_num_seqs: int, seed: int, **config) -> Engine:
    config = dict(dict(page_size=4, max_num_seqs=max_num_seqs, kv_cache_tokens=num_pages_tokens,
                       chunk_buckets=(4, 8), min_width=16, max_waiting=64), **config)
    engine = Engine(module, make_mesh(None), jnp.float32, context_length=96, eos_token_ids=[1],
                    config=EngineConfig(**config))
    rng = np.random.default_rng(seed)
    forwards = []

    def random_tokens(rows):
        tokens = np.zeros(engine.layout.max_rows, np.int32)  # padded like the real programs' outputs
        tokens[:rows] = rng.integers(0, VOCAB, size=rows)
        return tokens

    def forward(batch, previous=None):
        # What a real step would touch: rows' pages for the positions they write.
        assert (previous is None) == bool((batch.token_source < 0).all()), "a row's input token is lost"
        forwards.append(batch)
        return np.zeros((batch.tokens.shape[0], 1)), random_tokens(batch.tokens.shape[0])

    def sample(logits, meta):
        return {"tokens": random_tokens(logits.shape[0])}

    engine.runner.forward, engine.runner.sample = forward, sample
    engine.forwards = forwards
    return engine


def check_invariants(engine: Engine) -> None:
    pool = engine.scheduler.pool
    pool.check()
    holders: dict[int, int] = {}
    for seq in engine.scheduler.running:
        # Prefill rows hold pages for all their tokens from admission; decode rows for what they computed (the
        # page for the pending token is taken when it is scheduled).
        covered = len(seq.tokens) if seq.pending > 1 else seq.num_computed
        assert len(seq.pages) * engine.page_size >= covered, seq
        for p in seq.pages:
            holders[p] = holders.get(p, 0) + 1
        # Pages past the shared (hashed) prefix are written by this sequence: nobody else may hold them.
        for p in seq.pages[seq.num_hashed:]:
            assert pool.ref[p] == 1, f"page {p} written by {seq.request_id} is shared"
    for page in range(1, pool.num_pages):
        assert pool.ref[page] == holders.get(page, 0), f"page {page}: ref {pool.ref[page]} holders {holders.get(page)}"
    assert pool.num_used == len(holders)
    for seq in engine.scheduler.waiting:
        assert seq.pages == [] and not seq.finished and not seq.in_flight


def check_writes(engine: Engine) -> None:
    """Every real token written by a forward goes to a page of its row (never the trash page 0 or a stranger's)."""
    for batch in engine.forwards:
        for b in range(batch.tokens.shape[0]):
            for t in range(batch.tokens.shape[1]):
                pos = batch.positions[b, t]
                block = pos // engine.page_size
                if block < batch.block_tables.shape[1] and pos < batch.kv_lengths[b]:
                    assert batch.block_tables[b, block] != 0, "a real token was routed to the trash page"
    engine.forwards.clear()


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 20), st.integers(1, 3), st.integers(0, 2)),
    st.tuples(st.just("abort"), st.integers(0, 40)),
    st.tuples(st.just("step"), st.integers(1, 4)),
), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, pool_tokens=st.sampled_from([96, 128, 256]), max_num_seqs=st.sampled_from([2, 4, 8]),
       seed=st.integers(0, 1000))
def test_block_accounting_random_sequences(module, ops, pool_tokens, max_num_seqs, seed):
    engine = fake_engine(module, pool_tokens, max_num_seqs, seed)
    prefixes = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23]]  # shared prompt heads, to exercise prefix reuse
    added, outputs, finished = [], {}, set()
    for op in ops:
        if op[0] == "add":
            _, length, max_tokens, n, prefix = op
            tail = np.random.default_rng(length).integers(2, VOCAB, length)
            prompt = (prefixes[prefix - 1] if prefix else []) + [int(x) for x in tail]
            prompt = prompt[:90]
            rid = f"r{len(added)}"
            try:
                engine.add_request(rid, prompt, SamplingParams(max_tokens=min(max_tokens, 96 - len(prompt)), n=n))
            except (InvalidRequest, QueueFull):
                continue
            added.append((rid, n))
        elif op[0] == "abort" and added:
            engine.abort(added[op[1] % len(added)][0])
        else:
            for _ in range(op[1]):
                for ev in engine.step():
                    outputs.setdefault((ev.request_id, ev.index), []).append(ev)
                    if ev.finish_reason:
                        finished.add((ev.request_id, ev.index))
                check_invariants(engine)
                check_writes(engine)
    # Drain: every request ends (finished or aborted), and every page is free again.
    for _ in range(2000):
        if not engine.has_work():
            break
        for ev in engine.step():
            outputs.setdefault((ev.request_id, ev.index), []).append(ev)
            if ev.finish_reason:
                finished.add((ev.request_id, ev.index))
        check_invariants(engine)
    assert not engine.has_work()
    pool = engine.scheduler.pool
    assert pool.num_used == 0 and pool.num_free == pool.usable
    for rid, n in added:
        for i in range(n):
            assert (rid, i) in finished, f"{rid}/{i} never finished"
            events = outputs[(rid, i)]
            assert [e.finish_reason is not None for e in events].count(True) == 1
            assert events[-1].finish_reason is not None


def test_short_prompts_take_the_chunks_that_compute_least():
    # Chunks of 32 and 256, each step costing 16 tokens more: 128 tokens in four 32-token steps (192) rather than one
    # 256-token step (272), 228 in one (272, against 8 x 48), and never a chunk longer than the tokens need.
    assert first_chunk(128, (32, 256), 16) == 32
    assert first_chunk(228, (32, 256), 16) == 228
    assert first_chunk(5, (32, 256), 16) == 5
    assert first_chunk(40, (32, 256), 256) == 40  # a step as dear as the largest chunk: no prompt is split
    assert EngineConfig().step_tokens("cpu") == 16 and EngineConfig().step_tokens("gpu") == 256
    assert EngineConfig(prefill_step_tokens=0).step_tokens("gpu") == 0
    with pytest.raises(GenerationError, match="prefill_step_tokens"):
        EngineConfig(prefill_step_tokens=-1).layout(96)


def test_the_engine_prefills_in_those_chunks(module):
    """A 13-token prompt, of which the prefill takes 12 (the last goes in with the first decode step), over chunks of
    4 and 32: with steps costing 2 tokens, three 4-token steps (18) rather than one 32-token step (34); with steps
    costing 32, one step."""
    for step_tokens, chunks in ((2, [4, 4, 4]), (32, [32])):
        engine = fake_engine(module, 256, 2, 0, chunk_buckets=(4, 32), prefill_step_tokens=step_tokens)
        engine.add_request("r", list(range(2, 15)), SamplingParams(max_tokens=2, ignore_eos=True))
        while engine.has_work():
            engine.step()
        assert [b.tokens.shape[1] for b in engine.forwards if b.tokens.shape[1] > 1] == chunks


def test_prefix_reuse_counts_hits_and_shares_pages(module):
    engine = fake_engine(module, 256, 4, 0)
    system = list(range(10, 30))  # 20 tokens = 5 full pages
    engine.add_request("a", system + [40, 41], SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_work():
        engine.step()
    pool = engine.scheduler.pool
    hits_before = pool.hits
    engine.add_request("b", system + [50, 51, 52], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    seq = engine.scheduler.running[0]
    assert pool.hits - hits_before == 5 and seq.cached_tokens == 20 and seq.num_computed >= 20
    assert engine.scheduler.prefix_hit_tokens >= 20
    while engine.has_work():
        engine.step()
    assert pool.num_used == 0


def test_a_cache_salt_keeps_prefix_hits_among_its_own_requests(module):
    """Requests with another salt (or none) never hit a salted request's blocks, nor it theirs; the same salt does."""
    engine = fake_engine(module, 256, 4, 0)
    system = list(range(10, 30))  # 20 tokens = 5 full pages

    def cached(rid: str, salt: str | None) -> int:
        engine.add_request(rid, system + [40, 41], SamplingParams(max_tokens=1, ignore_eos=True, cache_salt=salt))
        engine.step()
        tokens = engine.scheduler.running[0].cached_tokens
        while engine.has_work():
            engine.step()
        return tokens
    assert cached("alice-1", "alice") == 0
    assert cached("bob", "bob") == 0 and cached("anyone", None) == 0
    assert cached("alice-2", "alice") == 20 and cached("anyone-2", None) == 20


def test_n_sequences_share_prompt_pages(module):
    engine = fake_engine(module, 256, 8, 0)
    prompt = list(range(2, 19))  # 17 tokens: 4 full pages and one partial
    engine.add_request("n", prompt, SamplingParams(max_tokens=4, n=3, ignore_eos=True))
    seen_shared = False
    while engine.has_work():
        engine.step()
        check_invariants(engine)
        running = engine.scheduler.running
        if len(running) == 3:
            firsts = [tuple(s.pages[:4]) for s in running]
            seen_shared |= len(set(firsts)) == 1
    assert seen_shared, "the n sequences did not share the prompt's full pages"
    assert engine.scheduler.pool.num_used == 0


def test_preemption_instead_of_crash(module):
    # 24 usable pages of 4 tokens; four sequences that each grow to 40 tokens cannot all fit.
    engine = fake_engine(module, 96, 4, 1)
    for i in range(4):
        engine.add_request(f"p{i}", [2 + i] * 8, SamplingParams(max_tokens=32, ignore_eos=True))
    done = {}
    while engine.has_work():
        for ev in engine.step():
            done.setdefault(ev.request_id, []).append(ev)
        check_invariants(engine)
    assert engine.scheduler.num_preemptions > 0
    assert all(len(evs) == 32 and evs[-1].finish_reason == "length" for evs in done.values())
    assert engine.scheduler.pool.num_used == 0


def test_abort_frees_pages_at_once(module):
    engine = fake_engine(module, 256, 4, 2)
    engine.add_request("x", list(range(2, 30)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.scheduler.pool.num_used > 0
    engine.abort("x")
    events = engine.step()
    assert [(e.request_id, e.finish_reason) for e in events] == [("x", ABORT)]
    assert engine.scheduler.pool.num_used == 0 and not engine.has_work()


def test_validation_names_parameters(module):
    engine = fake_engine(module, 256, 4, 0)
    with pytest.raises(InvalidRequest, match="96") as e:
        engine.add_request("long", [3] * 90, SamplingParams(max_tokens=10))
    assert e.value.param == "max_tokens" and "90" in str(e.value) and "10" in str(e.value)
    for bad, param in [(dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                       (dict(max_tokens=0), "max_tokens"), (dict(logprobs=21), "logprobs"), (dict(n=0), "n")]:
        with pytest.raises(InvalidRequest) as e:
            engine.add_request("bad", [3], SamplingParams(**bad))
        assert e.value.param == param
    with pytest.raises(InvalidRequest, match="empty"):
        engine.add_request("empty", [], SamplingParams())


def test_block_pool_lru_and_errors():
    pool = BlockPool(4, 2)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    with pytest.raises(OutOfPages):
        pool.allocate()
    pool.register(a, b"h1")
    pool.release([a, b, c])  # c freed first (tail first), then b, then a
    assert list(pool.free) == [c, b, a]
    assert pool.lookup([b"h1"]) == [a]
    pool.allocate(), pool.allocate()
    assert pool.allocate() == a and pool.lookup([b"h1"]) == []  # evicted when reused
    pool.check()


def test_shape_buckets_and_warmup_subset():
    cfg = models.config_from_hf(dict(model_type="llama", vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                     max_position_embeddings=8192))
    with nnx.use_eager_sharding(False):
        big = models.family("llama").model(cfg, rngs=nnx.Rngs(0))
    engine = Engine(big, make_mesh(None), jnp.float32, context_length=8192,
                    config=EngineConfig(max_num_seqs=12, kv_cache_tokens=8192))
    layout = engine.layout
    assert layout.batch_buckets == (1, 2, 4, 8, 12)  # every running batch fits a bucket
    assert [w * 16 for w in layout.decode_widths] == [128, 256, 512, 1024, 4096, 8192]
    assert [w * 16 for w in layout.prefill_widths] == [256, 1024, 4096, 8192]
    subset = layout.forward_shapes(2048)
    assert subset and all(width * 16 <= 2048 for _, _, width in subset)
    assert len(layout.forward_shapes()) == 6 * 5 + 4 * 2 and len(subset) == 4 * 5 + 2 * 2
