"""The Mamba2 scan: the chunked form against the token-by-token form (chunk boundaries inside a call and between
calls), against a NumPy loop written from the definition, and against transformers' own torch functions (the chunked
scan, the single-token update, the gated RMSNorm in both orders), all in float32; the Mamba2 mixer's per-sequence
state (the convolution's and the scan's) carried across calls; then the shared contract test every implementation
runs.

Errors are max|out - ref| / max|ref| over outputs and states (`cases.max_relative_error`); the tolerance of each
test sits beside it. Shapes are tiny so the file runs in seconds on a 2-core CPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import needs_hopper, run_reference
from kernels_pallas import cases, registry
from kernels_pallas.mamba2_ssd import api, reference

# Float32 rounding of two different orders of the same sums (measured: about 3e-7).
SAME_MATH = 2e-5
NAMES = ("x", "dt", "A", "b", "c", "state")


def make(seed, B, T, N, H, G, Z, with_state=True):
    """Random float32 inputs as the models make them: A = -exp(.) < 0, a state ~ 0.3, D and dt_bias random."""
    rng = np.random.default_rng(seed)
    f = lambda *shape, s=1.0: (s * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    return dict(x=f(B, T, N, H), dt=f(B, T, N), A=-np.exp(f(N, s=0.5)), b=f(B, T, G, Z), c=f(B, T, G, Z),
                state=f(B, N, H, Z, s=0.3) if with_state else None, D=f(N), dt_bias=f(N, s=0.5))


def jnp_args(x):
    return [None if x[n] is None else jnp.asarray(x[n]) for n in NAMES]


def skip_args(x):
    return dict(D=jnp.asarray(x["D"]), dt_bias=jnp.asarray(x["dt_bias"]))


recurrent = jax.jit(reference.recurrent, static_argnames=("dt_limit",))
chunked = jax.jit(reference.chunked, static_argnames=("dt_limit", "chunk_size"))
mamba2_ssd = jax.jit(api.mamba2_ssd, static_argnames=("dt_limit", "chunk_size"))  # as layers call it, under jit

# (B, T, N, H, G, Z, initial state, chunk size)
CHUNKED = {
    "shorter-than-a-chunk": (2, 10, 2, 8, 1, 16, False, 64),
    "padded-last-chunk-two-groups-with-state": (2, 45, 4, 8, 2, 16, True, 16),
    "whole-chunks-one-head-per-group": (1, 64, 2, 16, 2, 8, True, 16),
}


@pytest.mark.parametrize("name", sorted(CHUNKED))
def test_chunked_equals_recurrent(name):
    B, T, N, H, G, Z, with_state, C = CHUNKED[name]
    x = make(sorted(CHUNKED).index(name), B, T, N, H, G, Z, with_state)
    out, state = chunked(*jnp_args(x), **skip_args(x), chunk_size=C)
    want = recurrent(*jnp_args(x), **skip_args(x))
    assert out.shape == (B, T, N, H) and out.dtype == jnp.float32 and state.shape == (B, N, H, Z)
    err = cases.max_relative_error((out, state), want)
    assert err <= SAME_MATH, f"{name}: chunked against recurrent, max relative error {err}"


def test_a_prompt_split_in_two_gives_the_whole():
    """A prefill in two calls, the split inside a chunk (neither piece a multiple of it), each from the state the
    previous one left: the chunk boundaries within and between calls give one call's result."""
    x = make(10, 1, 50, 4, 8, 2, 16)
    want = chunked(*jnp_args(x), **skip_args(x), chunk_size=16)
    t = 21
    first = {n: a if n in ("A", "state", "D", "dt_bias") else a[:, :t] for n, a in x.items()}
    second = dict({n: a if n in ("A", "D", "dt_bias") else a[:, t:] for n, a in x.items() if n != "state"})
    out1, state1 = chunked(*jnp_args(first), **skip_args(x), chunk_size=16)
    out2, state2 = chunked(*jnp_args(dict(second, state=None))[:5], state1, **skip_args(x), chunk_size=16)
    err = cases.max_relative_error((jnp.concatenate([out1, out2], axis=1), state2), want)
    assert err <= SAME_MATH, f"split at {t}: max relative error {err}"
    # Without the state the second piece starts from zeros: the carried state matters here.
    out2_zero, _ = chunked(*jnp_args(dict(second, state=None))[:5], None, **skip_args(x), chunk_size=16)
    assert cases.max_relative_error(out2_zero, want[0][:, t:]) > 1e-2


def test_padding_past_valid_leaves_the_state_unchanged():
    """The engine's padding: positions past a row's `valid` count neither decay nor write the state."""
    x = make(20, 2, 30, 2, 8, 1, 16)
    valid = np.array([30, 17], np.int32)
    _, state = chunked(*jnp_args(x), **skip_args(x), valid=jnp.asarray(valid), chunk_size=8)
    _, rec_state = recurrent(*jnp_args(x), **skip_args(x), valid=jnp.asarray(valid))
    for row, n in enumerate(valid):
        alone = {k: (a[row:row + 1, :n] if k not in ("A", "state", "D", "dt_bias") else
                     a[row:row + 1] if k == "state" else a) for k, a in x.items()}
        _, want = recurrent(*jnp_args(alone), **skip_args(x))
        # S * exp(0) and S + 0 are exact: the token-by-token form keeps the state bit for bit.
        np.testing.assert_array_equal(np.asarray(rec_state[row]), np.asarray(want[0]))
        err = cases.max_relative_error(state[row], want[0])
        assert err <= SAME_MATH, f"row {row}: chunked state with padding, max relative error {err}"


def naive(x, dt, A, b, c, state, D, dt_bias, limit=(0.0, np.inf)):
    """The definition, a float64 NumPy loop: dt = clip(softplus(dt + bias)); S = S exp(dt A) + dt x b^T;
    y = S c + D x, per head (b and c of the head's group)."""
    B, T, N, H = x.shape
    G = b.shape[2]
    S = state.astype(np.float64).copy()
    y = np.zeros(x.shape, np.float64)
    for bi in range(B):
        for n in range(N):
            g = n // (N // G)
            for t in range(T):
                d = np.clip(np.log1p(np.exp(np.float64(dt[bi, t, n]) + dt_bias[n])), *limit)
                S[bi, n] = S[bi, n] * np.exp(d * A[n]) + d * np.outer(x[bi, t, n], b[bi, t, g])
                y[bi, t, n] = S[bi, n] @ c[bi, t, g] + D[n] * x[bi, t, n]
    return y, S


def test_matches_the_definition_written_as_a_loop():
    x = make(30, 2, 12, 4, 4, 2, 8)
    step = {n: a if n in ("A", "state", "D", "dt_bias") else a[:, :1] for n, a in x.items()}
    limited = dict(dt_limit=(0.05, 1.5))
    for name, got, want in (
            ("api, prefill", mamba2_ssd(*jnp_args(x), **skip_args(x), chunk_size=8), naive(**x)),
            ("recurrent", recurrent(*jnp_args(x), **skip_args(x)), naive(**x)),
            ("api, decode step", mamba2_ssd(*jnp_args(step), **skip_args(x)), naive(**step)),
            ("api, dt limits", mamba2_ssd(*jnp_args(x), **skip_args(x), **limited, chunk_size=8),
             naive(**x, limit=(0.05, 1.5)))):
        err = cases.max_relative_error(got, want)
        assert err <= 1e-5, f"{name}: max relative error {err} against the float64 loop"


def test_the_api_takes_bfloat16_and_returns_its_dtype():
    x = make(40, 1, 20, 2, 8, 1, 8)
    args = jnp_args(x)
    low = [a.astype(jnp.bfloat16) if n in ("x", "dt", "b", "c") else a for n, a in zip(NAMES, args)]
    out, state = mamba2_ssd(*low, **skip_args(x))
    assert out.dtype == jnp.bfloat16 and state.dtype == jnp.float32
    want = recurrent(*cases.upcast(low), **skip_args(x))
    err = cases.max_relative_error((out, state), want)
    assert err <= cases.TOLERANCE["bfloat16"], f"bfloat16 output: max relative error {err}"


# --- against transformers -----------------------------------------------------------------------------------

# name -> (B, T, N, H, G, Z, chunk, dt limit): chunks shorter than the sequence, T not a multiple of them.
HF_CASES = {
    "two-groups-padded-last-chunk": (2, 45, 4, 8, 2, 16, 16, (0.0, float("inf"))),
    "one-group-dt-limits": (1, 37, 2, 16, 1, 8, 8, (0.01, 2.0)),
}
NORM = (2, 5, 4, 8, 2)  # B, T, N, H, G of the gated norms' inputs


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """Inputs and transformers' outputs per case (one reference subprocess for the module)."""
    root = tmp_path_factory.mktemp("mamba2")
    jobs, inputs = [], {}
    for i, (name, (B, T, N, H, G, Z, chunk, limit)) in enumerate(sorted(HF_CASES.items())):
        x = make(60 + i, B, T, N, H, G, Z)
        x.update(chunk=np.int32(chunk), limit=np.array(limit, np.float32))
        if i == 0:  # the gated norms ride along with the first case
            rng = np.random.default_rng(70)
            B, T, N, H, G = NORM
            x.update(y=rng.standard_normal((B, T, N * H)).astype(np.float32),
                     z=rng.standard_normal((B, T, N * H)).astype(np.float32),
                     norm_weight=(1 + 0.2 * rng.standard_normal(N * H)).astype(np.float32), norm_groups=np.int32(G))
        inputs[name] = x
        np.savez(root / f"{name}.in.npz", **{n: a for n, a in x.items() if a is not None})
        jobs.append({"op": "mamba2", "inputs": str(root / f"{name}.in.npz"), "out": str(root / f"{name}.out.npz")})
    run_reference(jobs, root)
    return {name: (inputs[name], dict(np.load(root / f"{name}.out.npz"))) for name in HF_CASES}


@pytest.mark.parametrize("name", sorted(HF_CASES))
def test_mamba2_ssd_matches_transformers(hf, name):
    x, ref = hf[name]
    *_, chunk, limit = HF_CASES[name]
    args, kwargs = jnp_args(x), dict(skip_args(x), dt_limit=limit)
    for ours_name, ours in (("chunked", chunked(*args, **kwargs, chunk_size=chunk)),
                            ("recurrent", recurrent(*args, **kwargs))):
        err = cases.max_relative_error(ours, (ref["chunk_out"], ref["chunk_state"]))
        assert err <= SAME_MATH, f"{name}: our {ours_name} against transformers' chunked scan: {err}"
    if limit == (0.0, float("inf")):  # transformers' single-token update does not clip dt
        step = {n: a if n in ("A", "state", "D", "dt_bias") else a[:, :1] for n, a in x.items() if n in NAMES}
        out, state = mamba2_ssd(*jnp_args(step), **skip_args(x))
        err = cases.max_relative_error((out[:, 0], state), (ref["step_out"], ref["step_state"]))
        assert err <= SAME_MATH, f"{name}: decode step against transformers' selective_state_update: {err}"


@pytest.mark.parametrize("order,theirs", [("gate_then_norm", "gated_norm"), ("norm_before_gate", "norm_gated")])
def test_gated_rms_norm_matches_transformers(hf, order, theirs):
    """NemotronH's and Granite 4's gate-then-norm and Falcon-H1's norm-before-gate, each normalized over G groups of
    heads; the same norm over all channels at once differs (so the grouping is what the comparison checks)."""
    from day0jax.layers.mamba2 import GatedRMSNorm

    x, ref = hf[sorted(HF_CASES)[0]]
    B, T, N, H, G = NORM
    y, z = (jnp.asarray(x[k]).reshape(B, T, N, H) for k in ("y", "z"))
    outs = {}
    for groups in (G, 1):
        with nnx.use_eager_sharding(False):
            norm = GatedRMSNorm(N, H, groups, 1e-5, order, rngs=nnx.Rngs(0))
        norm.weight[...] = jnp.asarray(x["norm_weight"]).reshape(N, H)
        outs[groups] = np.asarray(norm(y, z)).reshape(B, T, N * H)
    assert cases.max_relative_error(outs[G], ref[theirs]) <= 1e-6
    assert cases.max_relative_error(outs[1], ref[theirs]) > 1e-3


# --- the layer's state ---------------------------------------------------------------------------------------

def test_the_mixer_carries_its_convolution_and_scan_state_across_calls():
    """The Mamba2 mixer over a prompt in three calls (a chunk, a padded chunk, a decode step) through the engine's
    state cache equals the whole prompt in one cache-less call; dropping the convolution's state between calls (the
    scan's kept) changes the outputs."""
    from day0jax.engine.state_cache import StateCache
    from day0jax.layers.mamba2 import Mamba2Mixer

    with nnx.use_eager_sharding(False):
        mixer = Mamba2Mixer(hidden_size=32, num_heads=4, head_dim=8, n_groups=2, state_size=8, conv_kernel=4,
                            chunk_size=8, eps=1e-5, rngs=nnx.Rngs(3))
    T = 13
    x = jax.random.normal(jax.random.key(4), (1, T, 32))
    whole, _ = mixer(x, None, {})
    pools = tuple(jnp.zeros((2,) + shape) for shape, _ in mixer.state_layout().arrays)

    def run(drop_conv):
        cache, outs, start = StateCache(pools, jnp.array([1]), jnp.array([True]), jnp.array([5])), [], 0
        for end, width in ((5, 8), (12, 8), (13, 1)):  # the second call is padded past its 7 real tokens
            piece = jnp.zeros((1, width, 32)).at[:, :end - start].set(x[:, start:end])
            cache = StateCache(cache.pools, cache.slots, jnp.array([start == 0]), jnp.array([end - start]))
            if drop_conv:
                cache = StateCache(tuple(jnp.zeros_like(p) for p in cache.pools[:3]) + cache.pools[3:],
                                   cache.slots, cache.fresh, cache.valid)
            out, cache = mixer(piece, None, {}, cache)
            outs.append(out[:, :end - start])
            start = end
        return jnp.concatenate(outs, axis=1)

    assert cases.max_relative_error(run(False), whole) <= SAME_MATH
    assert cases.max_relative_error(run(True), whole) > 1e-2


# --- the contract every implementation runs ------------------------------------------------------------------

# name -> (B, T, N, H, G, Z, chunk): bfloat16 inputs against the float32 chunked reference on the same values,
# tolerance `cases.TOLERANCE["bfloat16"]`.
CONTRACT = {
    "grouped-padded-with-state": (1, 80, 4, 64, 2, 64, 64),
    "one-group-two-rows": (2, 70, 2, 64, 1, 128, 64),
}


class Mamba2SsdContract:
    implementation: str

    @pytest.mark.parametrize("name", sorted(CONTRACT))
    def test_matches_reference(self, name):
        B, T, N, H, G, Z, chunk = CONTRACT[name]
        spec = dict(B=B, T=T, N=N, H=H, G=G, Z=Z, chunk=chunk, limit=None)
        args, kwargs = cases.Case("mamba2_ssd", name, "bfloat16", spec).build(sorted(CONTRACT).index(name))
        out, final = jax.jit(api.mamba2_ssd, static_argnames=("dt_limit", "chunk_size", "implementation"))(
            *args, **kwargs, implementation=self.implementation)
        want = reference.chunked(*cases.upcast(args), **cases.upcast(kwargs))
        assert out.shape == (B, T, N, H) and out.dtype == args[0].dtype and final.dtype == jnp.float32
        err = cases.max_relative_error((out, final), want)
        assert err <= cases.TOLERANCE["bfloat16"], f"{self.implementation} on {name}: max relative error {err}"


class TestReference(Mamba2SsdContract):
    implementation = "reference"


@pytest.mark.usefixtures("interpreter_on_cpu")
class TestMosaicGpuInterpret(Mamba2SsdContract):
    implementation = "mosaic_gpu_interpret"


@needs_hopper
class TestMosaicGpu(Mamba2SsdContract):
    implementation = "mosaic_gpu"


def test_the_kernel_declines_a_decode_step_and_float32():
    x = make(80, 1, 1, 2, 64, 1, 64)
    low = [a.astype(jnp.bfloat16) if n in ("x", "b", "c") else a for n, a in zip(NAMES, jnp_args(x))]
    with pytest.raises(registry.KernelUnavailable, match="decode step"):
        api.mamba2_ssd(*low, implementation="mosaic_gpu_interpret")
    with pytest.raises(registry.KernelUnavailable, match="bfloat16 or all float16"):
        api.mamba2_ssd(*jnp_args(make(81, 1, 8, 2, 64, 1, 64)), implementation="mosaic_gpu_interpret")
