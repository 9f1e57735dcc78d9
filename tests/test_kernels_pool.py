"""The candidate pool: ordering per backend, the process-wide policy, and the startup self-test.

Fake kernels stand in for GPU ones so the behaviour is exercised on the CPU: a correct one, a wrong one (off by
10%, far past the float32 tolerance of 2e-3) and one that declines.
"""

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import cases, registry, selftest, tuning
from kernels_pallas.rms_norm import api as rms_api
from kernels_pallas.rms_norm import reference as rms_reference

BACKEND = jax.default_backend()


def wrong(x, weight, **kwargs):
    normed, h = rms_reference.rms_norm(x, weight, **kwargs)
    return normed * 1.1, h


def declining(x, weight, **kwargs):
    raise NotImplementedError("declines everything")


@pytest.fixture
def fake_pool(monkeypatch):
    calls = []

    def spy(name, fn):
        def run(*a, **k):
            calls.append(name)
            return fn(*a, **k)
        return run

    monkeypatch.setitem(rms_api.IMPLEMENTATIONS, "declining", declining)
    monkeypatch.setitem(rms_api.IMPLEMENTATIONS, "wrong", spy("wrong", wrong))
    monkeypatch.setitem(rms_api.IMPLEMENTATIONS, "right", spy("right", rms_reference.rms_norm))
    monkeypatch.setitem(rms_api.CANDIDATES, BACKEND, ("declining", "wrong", "right"))
    with registry.use_policy(registry.Policy()):
        yield calls


RMS_CASE = [cases.Case("rms_norm", "fake", "float32", dict(M=8, D=128, eps=1e-6, offset=0.0))]


def test_order_honours_backend_mode_and_disabled():
    cands = {"gpu": ("a", "b"), "tpu": ("c",)}
    assert registry.order(cands, "gpu") == ("a", "b", "reference")
    assert registry.order(cands, "cpu") == ("reference",)
    assert registry.order(cands, "gpu", op="x", policy=registry.Policy("reference")) == ("reference",)
    off = registry.Policy().without("x", "a")
    assert registry.order(cands, "gpu", op="x", policy=off) == ("b", "reference")
    assert registry.order(cands, "gpu", op="y", policy=off) == ("a", "b", "reference")
    with pytest.raises(ValueError, match="kernels mode 'fast'"):
        registry.Policy("fast")


def test_dispatch_takes_the_first_candidate_that_accepts(fake_pool):
    x = jnp.ones((4, 128))
    normed, _ = rms_api.rms_norm(x, jnp.ones(128), eps=1e-6)
    assert fake_pool == ["wrong"]  # 'declining' said no at trace time; 'wrong' was next
    assert registry.chosen("rms_norm", x, jnp.ones(128), eps=1e-6) == "wrong"  # traced abstractly: one more call
    with registry.use_policy(registry.Policy("reference")):
        rms_api.rms_norm(x, jnp.ones(128), eps=1e-6)
        assert registry.chosen("rms_norm", x, jnp.ones(128), eps=1e-6) == "reference"
    assert fake_pool == ["wrong", "wrong"]  # mode 'reference' called no kernel


def test_selftest_auto_replaces_a_disagreeing_kernel(fake_pool):
    report = selftest.startup([], dtype="float32", mode="auto", case_list=RMS_CASE)
    assert report.disabled == [("rms_norm", "wrong")]
    assert report.chosen == {"rms_norm": ["right"]}
    assert [r["implementation"] for r in report.rows] == ["wrong", "right"]
    assert report.rows[0]["ok"] is False and report.rows[0]["max_rel_error"] > 0.05
    assert report.rows[1]["ok"] is True and report.rows[1]["max_rel_error"] < 1e-6
    # The installed policy now routes every later trace past the wrong kernel.
    assert registry.chosen("rms_norm", jnp.ones((2, 128)), jnp.ones(128), eps=1e-6) == "right"
    assert "rms_norm=right" in report.summary() and "rms_norm.wrong" in report.summary()


def test_selftest_checks_a_case_once_per_process(fake_pool, monkeypatch):
    """A second model with the same case (another family's name for it) runs no check again and gets the same rows;
    an implementation replaced by another function is checked anew."""
    checked, check = [], selftest.Trial.check
    monkeypatch.setattr(selftest.Trial, "check", lambda trial, name: checked.append(name) or check(trial, name))
    first = selftest.startup([], dtype="float32", mode="auto", case_list=RMS_CASE)
    assert checked == ["wrong", "right"]
    renamed = [cases.Case("rms_norm", "another family", "float32", dict(RMS_CASE[0].spec))]
    again = selftest.startup([], dtype="float32", mode="auto", case_list=renamed)
    assert checked == ["wrong", "right"]
    assert [{**r, "case": "fake"} for r in again.rows] == first.rows and again.chosen == first.chosen
    assert again.rows[0]["case"] == "another family"
    monkeypatch.setitem(rms_api.IMPLEMENTATIONS, "right",
                        lambda x, weight, **kw: rms_reference.rms_norm(x, weight, **kw))
    selftest.startup([], dtype="float32", mode="auto", case_list=renamed)
    assert checked == ["wrong", "right", "right"]


def test_selftest_strict_raises_and_reference_runs_nothing(fake_pool):
    with pytest.raises(registry.KernelMismatch, match="rms_norm.wrong"):
        selftest.startup([], dtype="float32", mode="strict", case_list=RMS_CASE)
    report = selftest.startup([], dtype="float32", mode="reference", case_list=RMS_CASE)
    assert report.chosen == {"rms_norm": ["reference"]} and report.rows == []
    assert registry.get_policy().mode == "reference"
    with pytest.raises(ValueError, match="kernels='sometimes'"):
        selftest.startup([], dtype="float32", mode="sometimes", case_list=RMS_CASE)


def test_selftest_on_this_backend():
    """On a GPU every chosen kernel must agree; on the CPU the candidates the flagship's cases reach (the C++ decode
    attention, the MoE tiles on its prefill and decode cases, and the C++ dense projections on one row and on five
    rows of three weights) are checked and chosen, every other op runs its reference."""
    with registry.use_policy(registry.Policy()):
        report = selftest.startup(cases.flagships()["qwen3-30b-a3b"], dtype="bfloat16")
    assert set(report.chosen) == {"attention", "paged_attention", "rms_norm", "moe", "linear"}
    if BACKEND == "gpu":
        assert report.disabled == [] and all(r["ok"] for r in report.rows), report.rows
    else:
        assert [(r["op"], r["implementation"], r["ok"]) for r in report.rows] == [
            ("paged_attention", "cpu_ffi", True), *[("moe", "tiles", True)] * 3, ("linear", "cpu_ffi", True),
            ("linear", "cpu_ffi", True)]
        assert report.chosen == {"attention": ["reference"], "paged_attention": ["cpu_ffi"], "rms_norm": ["reference"],
                                 "moe": ["tiles"], "linear": ["cpu_ffi"]}


def test_startup_cases_keep_the_models_real_dims():
    by_op = {}
    flagships = cases.flagships()
    for c in cases.cases_from_calls(flagships["gpt-oss-20b"], "bfloat16", scale="startup"):
        by_op.setdefault(c.op, c)
    attn = by_op["attention"].spec
    assert (attn["N"], attn["K"], attn["H"], attn["window"], attn["sinks"]) == (64, 8, 64, 128, True)
    assert by_op["moe"].spec["G"] == 32 and by_op["rms_norm"].spec["D"] == 2880
    mla = cases.cases_from_calls(flagships["deepseek-v3"], scale="startup", ops=("attention",))[0].spec
    assert (mla["K"], mla["H"]) == (1, 576)
    halved = cases.cases_from_calls(flagships["llama-3-8b"], scale="startup", tp=2, ops=("attention",))
    assert (halved[0].spec["N"], halved[0].spec["K"]) == (16, 4)


def test_built_inputs_are_random_and_every_query_sees_a_key():
    for case in cases.flagship_cases(("gemma-2-9b", "gpt-oss-20b"), scale="tiny"):
        args, kwargs = case.build(3)
        floats = [a for a in jax.tree.leaves((args, kwargs))
                  if isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jnp.floating)]
        assert floats and all(float(jnp.std(a.astype(jnp.float32))) > 0.05 for a in floats), case.name
        if case.op in ("attention", "paged_attention"):
            lengths = kwargs["kv_lengths"] if case.op == "attention" else args[4]
            positions = kwargs["q_positions"] if case.op == "attention" else args[5]
            assert bool(jnp.all((positions >= 0) & (positions < lengths[:, None]))), case.name


def test_block_tables_prefer_entries_then_heuristics():
    table = tuning.BlockTable("k", lambda cls, *, n: ("heuristic", cls, n),
                              {("h100", "big"): tuning.Entry("tuned", "seed")})
    assert table.lookup("h100", "big", n=1) == "tuned"
    assert table.lookup("h200", "big", n=1) == ("heuristic", "big", 1)
    from kernels_pallas import platform
    assert platform.short_kind("NVIDIA H100 80GB HBM3") == "h100"
    assert platform.short_kind("NVIDIA GH200 480GB") == "gh200"
    assert platform.short_kind("NVIDIA H200") == "h200"
