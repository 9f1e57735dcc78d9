"""The engine on a real (tiny, random) model: its greedy tokens equal those of the cache-less forward pass,
whatever the batching, chunking, prefix reuse, preemption or reading of tokens a step late; per-request sampling
is seeded per request; the sampler's filters match a sort-based definition.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from day0jax import models
from day0jax.engine import sampling
from day0jax.engine.config import EngineConfig
from day0jax.engine.engine import Engine
from day0jax.engine.requests import SamplingParams
from kernels_pallas import registry
from sharding.mesh import make_mesh

CONTEXT = 128


@pytest.fixture(scope="module")
def module():
    cfg = models.config_from_hf(dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=CONTEXT))
    with nnx.use_eager_sharding(False):
        return models.family("llama").model(cfg, rngs=nnx.Rngs(0))


def make_engine(module, **overrides) -> Engine:
    # Few shapes (batch 1/2/4, chunks 8/32, one width) keep compilation short; page 8 makes pages matter.
    config = dict(page_size=8, max_num_seqs=4, kv_cache_tokens=512, chunk_buckets=(8, 32), min_width=CONTEXT)
    config.update(overrides)
    return Engine(module, make_mesh(None), jnp.float32, context_length=CONTEXT, config=EngineConfig(**config))


@pytest.fixture(scope="module")
def engine(module):
    return make_engine(module)


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]], stagger: int = 0):
    """Runs requests to completion (adding one every `stagger` steps if > 0); returns tokens per (id, index)."""
    out: dict[tuple[str, int], list[int]] = {}
    pending = list(requests.items())
    step = 0
    while pending or engine.has_work():
        if pending and (stagger == 0 or step % stagger == 0):
            for rid, (prompt, params) in (pending if stagger == 0 else pending[:1]):
                engine.add_request(rid, prompt, params)
            pending = [] if stagger == 0 else pending[1:]
        for ev in engine.step():
            if ev.token is not None:
                out.setdefault((ev.request_id, ev.index), []).append(ev.token)
        step += 1
    assert engine.scheduler.pool.num_used == 0
    return out


PROMPTS = [[1, 17, 42, 5, 99], [1] + [(7 * i + 3) % 250 + 3 for i in range(40)], [9],
           [1] + [(13 * i + 11) % 250 + 3 for i in range(70)], [4, 4, 4, 4, 4, 4, 4, 4, 4]]


def cache_less_greedy(module, prompts=PROMPTS, new_tokens=16, context=CONTEXT) -> list[list[int]]:
    """Greedy continuations by the cache-less forward pass: the whole sequence again for every token (padded
    to the context, which causal layers make harmless, so one program serves every length)."""
    graphdef, params = nnx.split(module)

    @jax.jit
    def logits(tokens):
        model = nnx.merge(graphdef, params)
        hidden, _ = model(tokens, jnp.arange(context, dtype=jnp.int32)[None])
        return model.logits(hidden)[0]

    out = []
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(new_tokens):
            padded = np.zeros((1, context), np.int32)
            padded[0, :len(seq)] = seq
            seq.append(int(np.argmax(np.asarray(logits(padded))[len(seq) - 1])))
        out.append(seq[len(prompt):])
    return out


@pytest.fixture(scope="module")
def reference(module):
    return cache_less_greedy(module)


def greedy(n=16):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_greedy_matches_the_cache_less_forward_with_continuous_batching(engine, reference):
    # Requests join one by one while others decode; the 41- and 71-token prompts are prefilled in chunks.
    out = run(engine, {f"r{i}": (p, greedy()) for i, p in enumerate(PROMPTS)}, stagger=3)
    for i, ref in enumerate(reference):
        assert out[(f"r{i}", 0)] == ref, f"prompt {i}"


def test_prefill_in_key_blocks_gives_the_same_tokens(module, reference):
    # 4-token pages make the prefill's tables 32 pages wide, two key blocks: on the CPU, chunks after the first page
    # take the key-block candidate, which stops at each chunk's last key. Under the default policy: another test in
    # this process may have installed the reference one (`load(kernels="reference")`).
    with registry.use_policy(registry.Policy()):
        engine = make_engine(module, page_size=4)
        if jax.default_backend() == "cpu":  # a 32-token chunk at positions 8..39, as this engine's program traces it
            q, pool = jnp.zeros((1, 32, 4, 16)), jnp.zeros((9, 4, 2, 16))
            tables = jnp.zeros((1, engine.layout.prefill_widths[-1]), jnp.int32)
            assert registry.chosen("paged_attention", q, pool, pool, tables, jnp.array([40]),
                                   jnp.arange(8, 40)[None]) == "xla_blocks"
        out = run(engine, {f"r{i}": (p, greedy()) for i, p in enumerate(PROMPTS)}, stagger=3)
    for i, ref in enumerate(reference):
        assert out[(f"r{i}", 0)] == ref, f"prompt {i}"


def test_prefix_reuse_gives_the_same_tokens(engine, reference):
    pool = engine.scheduler.pool
    before = pool.hits
    run(engine, {"warm": (PROMPTS[3], greedy(2))})
    out = run(engine, {"again": (PROMPTS[3], greedy())})
    assert pool.hits - before >= (len(PROMPTS[3]) - 1) // engine.page_size
    assert out[("again", 0)] == reference[3]


def test_preemption_recomputes_to_the_same_tokens(module, reference):
    # 12 usable pages of 8 tokens: the first three prompts fit at admission but not once they have grown.
    small = make_engine(module, kv_cache_tokens=96, max_model_len=96, max_num_seqs=4)
    out = run(small, {f"r{i}": (p, greedy()) for i, p in enumerate(PROMPTS)})
    assert small.scheduler.num_preemptions > 0
    for i, ref in enumerate(reference):
        assert out[(f"r{i}", 0)] == ref, f"prompt {i}"


def test_seeded_sampling_does_not_depend_on_the_batch(engine):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = run(engine, {"s": (PROMPTS[0], params)})[("s", 0)]
    crowd = run(engine, {"s": (PROMPTS[0], params), **{f"o{i}": (p, SamplingParams(max_tokens=12, seed=i))
                                                       for i, p in enumerate(PROMPTS[1:])}})
    assert crowd[("s", 0)] == alone
    other = run(engine, {"s": (PROMPTS[0], SamplingParams(max_tokens=12, temperature=1.0, seed=99,
                                                           ignore_eos=True))})[("s", 0)]
    assert other != alone  # a different seed draws differently (12 draws at temperature 1 over 256 tokens)


def test_n_choices_and_stop_tokens(engine, reference):
    out = run(engine, {"n": (PROMPTS[1], SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=3,
                                                         ignore_eos=True))})
    assert sorted(k[1] for k in out) == [0, 1, 2] and all(len(v) == 8 for v in out.values())
    assert len({tuple(v) for v in out.values()}) > 1  # seeds seed, seed+1, seed+2
    stop = reference[0][3]
    out = run(engine, {"stop": (PROMPTS[0], SamplingParams(max_tokens=16, temperature=0.0,
                                                            stop_token_ids=(stop,)))})
    assert out[("stop", 0)] == reference[0][:reference[0].index(stop) + 1]


def test_logprobs_and_penalties(engine, reference):
    events = []
    engine.add_request("lp", PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True))
    while engine.has_work():
        events += [e for e in engine.step() if e.token is not None]
    assert [e.token for e in events] == reference[0][:4]
    for e in events:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0][0] == e.token  # greedy = most likely
        assert e.logprob == pytest.approx(e.top_logprobs[0][1]) and e.logprob <= 0
    # A strong repetition penalty forbids (in practice) tokens already seen, which greedy repeats otherwise.
    rep = run(engine, {"rep": ([4] * 9, SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=10.0,
                                                       ignore_eos=True))})[("rep", 0)]
    assert reference[4] != rep and 4 not in rep


def test_rows_without_penalties_are_unchanged_beside_a_penalized_row(module):
    """Greedy and seeded rows give the same tokens alone and batched with a penalized row (whose own tokens are its
    tokens alone), and the penalty arrays are written per row when a sequence joins, not rebuilt every step."""
    engine = make_engine(module)
    plain = {"greedy": (PROMPTS[0], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)),
             "seeded": (PROMPTS[1], SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True))}
    penalized = {"rep": ([4] * 9, SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=10.0,
                                                 presence_penalty=1.5, frequency_penalty=0.5, ignore_eos=True))}
    alone = run(engine, plain) | run(engine, penalized)
    before = engine.runner.inputs.penalty_builds
    together = run(engine, plain | penalized)
    assert together == alone and 4 not in together[("rep", 0)]
    # The penalized sequence joins a row of its prefill's sampler and one of the decode batch's (4 here, with the
    # arrays of each row count kept from the first run): a rebuild per step would count at least its 16 tokens.
    assert engine.runner.inputs.penalty_builds - before <= 6, engine.runner.inputs.penalty_builds - before


def _reference_filter(x, top_k, top_p, min_p):
    """Sort-based definition (as transformers' processors): min_p, then top-k, then top-p on the rest."""
    x = x.astype(np.float64)
    p = np.exp(x - x.max()); p /= p.sum()
    keep = p >= min_p * p.max()
    order = np.argsort(-x, kind="stable")
    if top_k > 0:
        keep[order[top_k:]] = False
    q = np.where(keep, p, 0); q /= q.sum()
    mass_before = np.cumsum(q[order]) - q[order]
    drop = order[mass_before >= top_p]
    if top_p < 1:
        keep[drop] = False
    return keep


def test_filters_match_sort_based_definition():
    rng = np.random.default_rng(0)
    cases = [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.9, 0.0), (0, 0.5, 0.0), (20, 0.8, 0.0), (0, 1.0, 0.1),
             (3, 0.95, 0.05), (1, 1.0, 0.0)]
    x = rng.standard_normal((len(cases), 512)).astype(np.float32) * 3
    top_k, top_p, min_p = (np.array(c, dt) for c, dt in zip(zip(*cases), (np.int32, np.float32, np.float32)))
    got = np.isfinite(np.asarray(sampling.filter_logits(jnp.asarray(x), jnp.asarray(top_k), jnp.asarray(top_p),
                                                        jnp.asarray(min_p))))
    for i, (k, p, m) in enumerate(cases):
        np.testing.assert_array_equal(got[i], _reference_filter(x[i], k, p, m), err_msg=str(cases[i]))


def test_gumbel_sampling_follows_softmax():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]], jnp.float32))
    n = 4000
    draws = jax.jit(jax.vmap(lambda c: jnp.argmax(logits[0] + sampling.gumbel_noise(
        jnp.asarray([7], jnp.uint32), c[None], 4)[0])))(jnp.arange(n))
    freq = np.bincount(np.asarray(draws), minlength=4) / n
    # 4000 draws: standard error <= 0.008; 4 sigma.
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.032)


def test_gumbel_uniforms_stay_inside_zero_and_one():
    """Every uint32 maps strictly inside (0, 1) in float32, so the noise is finite: an infinite draw would pick its
    token whatever the logits, and meet a grammar's -inf as NaN."""
    edges = jnp.asarray([0, 1, 511, 512, 2 ** 31, 2 ** 32 - 513, 2 ** 32 - 1], jnp.uint32)
    u = np.asarray(sampling.uniform(edges))
    assert (u > 0).all() and (u < 1).all() and u.dtype == np.float32
    assert np.isfinite(-np.log(-np.log(u))).all()


def test_penalty_formula():
    logits = jnp.asarray([[2.0, -1.0, 0.5, 1.0]])
    counts = jnp.asarray([[2.0, 1.0, 0.0, 0.0]])
    seen = jnp.asarray([[True, True, True, False]])
    out = sampling.apply_penalties(logits, counts, seen, jnp.asarray([0.5]), jnp.asarray([0.25]), jnp.asarray([2.0]))
    # token 0: 2 - 0.25*2 - 0.5 = 1.0 -> /2; token 1: -1 - 0.25 - 0.5 = -1.75 -> *2; token 2: 0.5 seen -> /2.
    np.testing.assert_allclose(np.asarray(out), [[0.5, -3.5, 0.25, 1.0]], rtol=1e-6)


def test_one_sampler_program_picks_each_mode_at_run_time():
    """The folded sampler (mode and logprobs chosen on the device) gives what the static mode for the batch gives."""
    rng = np.random.default_rng(1)
    B, V = 4, 300
    logits = jnp.asarray(rng.standard_normal((B, V)).astype(np.float32) * 2)
    seeds, counters = jnp.arange(B, dtype=jnp.uint32) + 11, jnp.arange(B, dtype=jnp.int32)
    folded = jax.jit(lambda *a: sampling.sample(*a[:7], None, None, a[7]))
    batches = {"greedy": ([0.0] * 4, [0] * 4, [1.0] * 4),
               "random": ([0.0, 0.8, 0.0, 1.3], [0] * 4, [1.0] * 4),
               "filtered": ([0.0, 0.8, 0.7, 1.3], [0, 0, 5, 0], [1.0, 0.9, 1.0, 1.0])}
    for mode, (temperature, top_k, top_p) in batches.items():
        rows = (jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k, jnp.int32),
                jnp.asarray(top_p, jnp.float32), jnp.zeros(B, jnp.float32))
        assert sampling.sampler_mode(*rows) == mode
        assert int(sampling.mode_index(*rows)) == sampling.MODES.index(mode)
        static = sampling.sample(logits, seeds, counters, *rows, None, None, True, mode=mode)
        for want_logprobs in (True, False):
            got = folded(logits, seeds, counters, *rows, jnp.asarray(want_logprobs))
            np.testing.assert_array_equal(got["tokens"], static["tokens"], err_msg=mode)
            for key in ("logprob", "top_ids", "top_logprobs"):
                want = static[key] if want_logprobs else np.zeros_like(static[key])
                np.testing.assert_allclose(got[key], want, rtol=1e-6, err_msg=f"{mode} {key}")
    # The other modes really differ on these rows: the switch is not a no-op.
    rows = (jnp.asarray([0.0, 0.8, 0.7, 1.3]), jnp.asarray([0, 0, 5, 0]), jnp.asarray([1.0, 0.9, 1.0, 1.0]),
            jnp.zeros(B))
    assert not np.array_equal(sampling.sample(logits, seeds, counters, *rows, mode="greedy")["tokens"],
                              folded(logits, seeds, counters, *rows, jnp.asarray(False))["tokens"])
