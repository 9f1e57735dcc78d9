"""The gated delta rule: the chunked form against the token-by-token form, against a NumPy loop written from the
definition, and against transformers' own torch functions (Qwen3-Next's per-head decay, Kimi Linear's per-channel
decay, and the causal conv1d op in front of both, which rides along on the same reference run), all in float32;
then the shared contract test
every implementation runs (the Mosaic GPU kernel in the interpreter on the CPU, compiled on a Hopper GPU).

Errors are max|out - ref| / max|ref| over outputs and states (`cases.max_relative_error`); the tolerance of each
test sits beside it. Shapes are tiny (head dims 8 to 128) so the file runs in seconds on a 2-core CPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import needs_hopper, run_reference
from kernels_pallas import cases, registry
from kernels_pallas.causal_conv1d import reference as conv_reference
from kernels_pallas.gated_delta_rule import api, reference
from test_kernels_causal_conv1d import conv_inputs

# Float32 rounding of two different orders of the same sums (measured: about 3e-7).
SAME_MATH = 2e-5


def make(seed, B, T, Nk, Nv, Hk, Hv, channel=False, with_state=True):
    """Random float32 inputs as the models make them: g = -softplus(.) <= 0, beta = sigmoid(.), state ~ 0.3."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, B, T, Nk, Hk), np.float32)
    v = rng.standard_normal((B, T, Nv, Hv), np.float32)
    g = -np.log1p(np.exp(rng.standard_normal((B, T, Nv, Hk) if channel else (B, T, Nv)))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((B, T, Nv))))).astype(np.float32)
    state = (0.3 * rng.standard_normal((B, Nv, Hk, Hv))).astype(np.float32) if with_state else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, state=state)


def jnp_args(x):
    return [None if x[n] is None else jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta", "state")]


recurrent = jax.jit(reference.recurrent)
chunked = jax.jit(reference.chunked, static_argnames=("chunk_size",))
gated_delta_rule = jax.jit(api.gated_delta_rule)  # the op as layers call it, under jit as they do


# (B, T, Nk, Nv, Hk, Hv, per-channel decay, initial state, chunk size)
CHUNKED = {
    "shorter-than-a-chunk": (2, 10, 1, 2, 16, 8, False, False, 64),
    "padded-last-chunk-with-state": (2, 100, 2, 4, 16, 8, False, True, 64),
    "whole-chunks-one-head-per-value": (1, 128, 2, 2, 8, 16, False, True, 64),
    "per-channel-padded-no-state": (2, 45, 1, 2, 16, 8, True, False, 16),
}


@pytest.mark.parametrize("name", sorted(CHUNKED))
def test_chunked_equals_recurrent(name):
    B, T, Nk, Nv, Hk, Hv, channel, with_state, C = CHUNKED[name]
    args = jnp_args(make(sorted(CHUNKED).index(name), B, T, Nk, Nv, Hk, Hv, channel, with_state))
    out, state = chunked(*args, chunk_size=C)
    want_out, want_state = recurrent(*args)
    assert out.shape == (B, T, Nv, Hv) and out.dtype == jnp.float32 and state.shape == (B, Nv, Hk, Hv)
    err = cases.max_relative_error((out, state), (want_out, want_state))
    assert err <= SAME_MATH, f"{name}: chunked against recurrent, max relative error {err}"


@pytest.mark.parametrize("channel", [False, True], ids=["per-head", "per-channel"])
def test_a_prompt_split_in_two_gives_the_whole(channel):
    x = make(10 + channel, 1, 100, 1, 2, 16, 8, channel)
    args = jnp_args(x)
    want_out, want_state = chunked(*args, chunk_size=32)
    t = 50  # neither piece a multiple of the chunk; both of one shape, one compilation
    first = jnp_args({n: a if n == "state" else a[:, :t] for n, a in x.items()})
    second = jnp_args({n: a[:, t:] for n, a in x.items() if n != "state"} | {"state": None})
    out1, state1 = chunked(*first, chunk_size=32)
    out2, state2 = chunked(*second[:5], state1, chunk_size=32)
    err = cases.max_relative_error((jnp.concatenate([out1, out2], axis=1), state2), (want_out, want_state))
    assert err <= SAME_MATH, f"split at {t}: max relative error {err}"


@pytest.mark.parametrize("channel", [False, True], ids=["per-head", "per-channel"])
def test_positions_with_zero_decay_and_zero_beta_leave_the_state_unchanged(channel):
    """The engine's padding marks: such positions, anywhere in the sequence, act as if absent."""
    x = make(20 + channel, 2, 30, 1, 2, 16, 8, channel)
    marked = np.zeros(30, bool)
    marked[[0, 7, 8, 9, 20]] = True
    marked[25:] = True  # trailing padding too
    x["g"][:, marked], x["beta"][:, marked] = 0.0, 0.0
    kept = jnp_args({n: a if n == "state" else a[:, ~marked] for n, a in x.items()})
    _, want = recurrent(*kept)
    _, rec_state = recurrent(*jnp_args(x))
    # S * exp(0) and S + k * 0 are exact: the token-by-token form reproduces the state bit for bit.
    np.testing.assert_array_equal(np.asarray(rec_state), np.asarray(want))
    _, chunk_state = chunked(*jnp_args(x), chunk_size=16)
    err = cases.max_relative_error(chunk_state, want)
    assert err <= SAME_MATH, f"chunked state with marked positions: max relative error {err}"


def naive(q, k, v, g, beta, state):
    """The definition, a float64 NumPy loop: S = S exp(g); S += k (beta (v - S^T k))^T; o = S^T q per value head."""
    B, T, Nk, Hk = q.shape
    Nv = v.shape[2]
    rep = Nv // Nk
    S = state.astype(np.float64).copy()
    out = np.zeros(v.shape, np.float64)
    for b in range(B):
        for n in range(Nv):
            for t in range(T):
                qt, kt = q[b, t, n // rep].astype(np.float64), k[b, t, n // rep].astype(np.float64)
                qt = qt / np.sqrt(qt @ qt + 1e-6) * Hk ** -0.5
                kt = kt / np.sqrt(kt @ kt + 1e-6)
                decay = np.exp(np.float64(g[b, t, n]))  # a scalar, or [Hk] scaling the rows of S
                S[b, n] = S[b, n] * (decay[:, None] if np.ndim(decay) else decay)
                S[b, n] += np.outer(kt, beta[b, t, n] * (v[b, t, n] - S[b, n].T @ kt))
                out[b, t, n] = S[b, n].T @ qt
    return out, S


NAMES = ("q", "k", "v", "g", "beta", "state")


@pytest.mark.parametrize("channel", [False, True], ids=["per-head", "per-channel"])
def test_matches_the_definition_written_as_a_loop(channel):
    x = make(30 + channel, 2, 12, 1, 2, 8, 4, channel)
    step = {n: a if n == "state" else a[:, :1] for n, a in x.items()}  # one token: the api's decode path
    for name, got, want in (("api, prefill", gated_delta_rule(*jnp_args(x)), naive(*(x[n] for n in NAMES))),
                            ("recurrent", recurrent(*jnp_args(x)), naive(*(x[n] for n in NAMES))),
                            ("api, decode step", gated_delta_rule(*jnp_args(step)),
                             naive(*(step[n] for n in NAMES)))):
        err = cases.max_relative_error(got, want)
        assert err <= 1e-5, f"{name}: max relative error {err} against the float64 loop"


def test_the_api_takes_bfloat16_and_returns_its_dtype():
    q, k, v, g, beta, state = jnp_args(make(40, 1, 20, 1, 2, 16, 8))
    low = [a.astype(jnp.bfloat16) for a in (q, k, v, beta)]
    out, new_state = gated_delta_rule(*low[:3], g, low[3], state)  # g and the state stay float32
    assert out.dtype == jnp.bfloat16 and new_state.dtype == jnp.float32
    want = recurrent(*[a.astype(jnp.float32) for a in low[:3]], g, low[3].astype(jnp.float32), state)
    err = cases.max_relative_error((out, new_state), want)
    assert err <= cases.TOLERANCE["bfloat16"], f"bfloat16 output: max relative error {err}"


# --- against transformers -----------------------------------------------------------------------------------

# name -> (family, B, T, Nk, Nv, Hk, Hv, per-channel decay, initial state)
HF_CASES = {
    "qwen3-next-grouped-padded": ("qwen3_next", 2, 70, 2, 4, 16, 8, False, True),
    "qwen3-next-short-zero-state": ("qwen3_next", 1, 5, 1, 1, 8, 16, False, False),
    "kimi-linear-per-channel": ("kimi_linear", 1, 70, 2, 2, 16, 8, True, True),
}
CONV = (2, 9, 6, 4)  # B, T, C, W


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """Inputs and transformers' outputs per case (one reference subprocess for the module)."""
    root = tmp_path_factory.mktemp("gdn")
    jobs, inputs = [], {}
    for i, (name, (family, *shape, channel, with_state)) in enumerate(sorted(HF_CASES.items())):
        x = make(60 + i, *shape, channel, with_state)
        if i == 0:  # the convolutions ride along with the first case
            cx, cw, cstate = conv_inputs(70, *CONV)
            x.update(x=cx, weight=cw, x_step=cx[:, :1], conv_state=cstate)
        inputs[name] = x
        np.savez(root / f"{name}.in.npz", **{n: a for n, a in x.items() if a is not None})
        jobs.append({"op": "gdn", "family": family, "inputs": str(root / f"{name}.in.npz"),
                     "out": str(root / f"{name}.out.npz")})
    run_reference(jobs, root)
    return {name: (inputs[name], dict(np.load(root / f"{name}.out.npz"))) for name in HF_CASES}


@pytest.mark.parametrize("name", sorted(HF_CASES))
def test_gated_delta_rule_matches_transformers(hf, name):
    x, ref = hf[name]
    args = jnp_args(x)
    # transformers' chunked and recurrent forms disagree with each other by float32 rounding only.
    for ours_name, ours in (("chunked", chunked(*args, chunk_size=64)), ("recurrent", recurrent(*args))):
        for theirs in ("chunk", "recurrent"):
            err = cases.max_relative_error(ours, (ref[f"{theirs}_out"], ref[f"{theirs}_state"]))
            assert err <= SAME_MATH, f"{name}: our {ours_name} against transformers' {theirs}: {err}"


def test_causal_conv1d_matches_transformers(hf):
    x, ref = hf[sorted(HF_CASES)[0]]
    out, state = conv_reference.causal_conv1d(jnp.asarray(x["x"]), jnp.asarray(x["weight"]))
    err = cases.max_relative_error(out, ref["conv_out"])
    assert err <= 1e-6, f"causal_conv1d_fn: max relative error {err}"
    np.testing.assert_array_equal(np.asarray(state), x["x"][:, -(CONV[3] - 1):])
    out, state = conv_reference.causal_conv1d(jnp.asarray(x["x_step"]), jnp.asarray(x["weight"]),
                                              jnp.asarray(x["conv_state"]))
    err = cases.max_relative_error(out, ref["step_out"])
    assert err <= 1e-6, f"causal_conv1d_update: max relative error {err}"
    np.testing.assert_array_equal(np.asarray(state), ref["step_state"])


# --- the contract every implementation runs ------------------------------------------------------------------

# name -> (B, T, Nk, Nv, Hk, Hv, decay, initial state): bfloat16 inputs against the float32 chunked reference on
# the same values, tolerance `cases.TOLERANCE["bfloat16"]` (the kernel's matmuls take 16-bit operands).
CONTRACT = {
    "grouped-padded-with-state": (1, 80, 1, 2, 64, 64, "head", True),
    "per-channel-no-state-two-column-blocks": (2, 70, 1, 1, 128, 128, "channel", False),
}


class GatedDeltaRuleContract:
    implementation: str

    @pytest.mark.parametrize("name", sorted(CONTRACT))
    def test_matches_reference(self, name):
        B, T, Nk, Nv, Hk, Hv, decay, with_state = CONTRACT[name]
        spec = dict(B=B, T=T, Nk=Nk, Nv=Nv, Hk=Hk, Hv=Hv, decay=decay)
        (q, k, v, g, beta, state), _ = cases.Case("gated_delta_rule", name, "bfloat16", spec).build(
            sorted(CONTRACT).index(name))
        state = state if with_state else None
        out, final = jax.jit(api.gated_delta_rule, static_argnames="implementation")(
            q, k, v, g, beta, state, implementation=self.implementation)
        want = chunked(*cases.upcast((q, k, v, g, beta)), state)
        assert out.shape == (B, T, Nv, Hv) and out.dtype == q.dtype and final.dtype == jnp.float32
        err = cases.max_relative_error((out, final), want)
        assert err <= cases.TOLERANCE["bfloat16"], f"{self.implementation} on {name}: max relative error {err}"


class TestReference(GatedDeltaRuleContract):
    implementation = "reference"


@pytest.mark.usefixtures("interpreter_on_cpu")
class TestMosaicGpuInterpret(GatedDeltaRuleContract):
    implementation = "mosaic_gpu_interpret"


@needs_hopper
class TestMosaicGpu(GatedDeltaRuleContract):
    implementation = "mosaic_gpu"


def test_the_kernel_declines_a_decode_step_and_float32():
    x = make(80, 1, 1, 1, 1, 64, 64)
    one = jnp_args(x)
    with pytest.raises(registry.KernelUnavailable, match="decode step"):
        api.gated_delta_rule(*[a.astype(jnp.bfloat16) if n in "qkv" else a for n, a in zip(NAMES, one)],
                             implementation="mosaic_gpu_interpret")
    with pytest.raises(registry.KernelUnavailable, match="bfloat16 or all float16"):
        api.gated_delta_rule(*jnp_args(make(81, 1, 8, 1, 1, 64, 64)), implementation="mosaic_gpu_interpret")
