"""The attention op's shared contract test, run by every implementation of the pool that can run here.

Each implementation computes bfloat16 inputs; the expectation is the reference on the same values in float32.
Pallas kernels run in the Mosaic GPU interpreter on the CPU (`mosaic_gpu_interpret`, on the CPU device on every
machine); the compiled kernel joins on a Hopper GPU and cuDNN on an NVIDIA GPU (skipped elsewhere, with the
reason). Inputs an implementation refuses (cuDNN: soft-cap, sinks) must be refused by name. Tolerance:
`cases.TOLERANCE["bfloat16"]` (2e-2 of the largest output magnitude), written beside the cases in
kernels_pallas/cases.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TARGET, needs_hopper, needs_nvidia_gpu
from kernels_pallas import cases, registry, selftest
from kernels_pallas.attention import api, reference

# Small enough for the interpreter (a handful of CUDA blocks each), covering every variant of the contract.
CASES = {
    "gqa-causal-prefill": dict(B=1, T=128, S=128, N=4, K=2, H=64, scale=None, window=None, softcap=None,
                               sinks=False, offsets=False),
    "ragged-window-softcap-sinks": dict(B=2, T=64, S=192, N=2, K=1, H=128, scale=0.1, window=50, softcap=30.0,
                                        sinks=True, offsets=True),
    "mqa-headdim-256": dict(B=1, T=32, S=128, N=2, K=1, H=256, scale=None, window=None, softcap=None,
                            sinks=False, offsets=True),
    # Chunked local attention (Llama 4): no kernel takes it yet; each must decline it, leaving it to the reference.
    "gqa-chunked": dict(B=2, T=64, S=128, N=4, K=2, H=64, scale=None, window=None, softcap=None, sinks=False,
                        offsets=True, chunk=32),
}
CHUNKED = {"gqa-chunked": "chunk"}


class AttentionContract:
    """Every implementation of `attention` must match the float32 reference on these cases."""

    implementation: str
    declines: dict[str, str] = {}  # case -> what the refusal (`KernelUnavailable`) says: inputs it does not take

    @pytest.mark.parametrize("name", sorted(CASES))
    def test_matches_reference(self, name):
        case = cases.Case("attention", name, "bfloat16", CASES[name])
        (q, k, v), kwargs = case.build(sorted(CASES).index(name))
        run = functools.partial(api.attention, implementation=self.implementation)
        if name in self.declines:
            with pytest.raises(registry.KernelUnavailable, match=self.declines[name]):
                selftest.run(run, (q, k, v), kwargs)
            return
        got = selftest.run(run, (q, k, v), kwargs)
        want = selftest.run(reference.attention, cases.upcast((q, k, v)), kwargs)
        assert got.shape == q.shape and got.dtype == q.dtype
        err = cases.max_relative_error(got, want)
        assert err <= case.tolerance, f"{self.implementation} on {name}: max relative error {err}"


class TestReference(AttentionContract):
    implementation = "reference"


@pytest.mark.usefixtures("interpreter_on_cpu")
class TestMosaicGpuInterpret(AttentionContract):
    implementation = "mosaic_gpu_interpret"
    declines = CHUNKED


@needs_hopper
class TestMosaicGpu(AttentionContract):
    implementation = "mosaic_gpu"
    declines = CHUNKED


@needs_nvidia_gpu
class TestCudnn(AttentionContract):
    implementation = "cudnn"
    # jax's cuDNN attention has neither soft-cap nor sinks; head dim 256 needs Hopper or newer.
    declines = {"ragged-window-softcap-sinks": "soft-cap nor sinks", **CHUNKED,
                **({} if TARGET.is_hopper else {"mqa-headdim-256": "head dim"})}


def test_the_pool_chooses_by_device_and_named_kernels_refuse_where_they_cannot_run():
    q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
    pos = jnp.arange(128)[None]
    if not TARGET.is_hopper:
        with pytest.raises(registry.KernelUnavailable, match="Hopper"):
            api.attention(q, q, q, q_positions=pos, implementation="mosaic_gpu")
    if TARGET.platform != "cuda":
        with pytest.raises(registry.KernelUnavailable, match="NVIDIA GPU"):
            api.attention(q, q, q, q_positions=pos, implementation="cudnn")
    # Hopper: the Mosaic GPU kernel; another NVIDIA GPU: cuDNN; the CPU (no candidates): the reference.
    want = "mosaic_gpu" if TARGET.is_hopper else "cudnn" if TARGET.platform == "cuda" else "reference"
    assert registry.chosen("attention", q, q, q, q_positions=pos) == want
    # Inputs no kernel takes (float32, head dim 8) still run: the reference ends every pool.
    small = jnp.ones((1, 4, 2, 8), jnp.float32)
    assert api.attention(small, small, small, q_positions=jnp.arange(4)[None]).shape == small.shape


def test_kernel_declines_what_it_cannot_take():
    q = jnp.ones((1, 128, 2, 96), jnp.bfloat16)  # head dim 96: not a multiple of 64
    with pytest.raises(registry.KernelUnavailable, match="head dim 96"):
        api.attention(q, q, q, q_positions=jnp.arange(128)[None], implementation="mosaic_gpu_interpret")
    f32 = jnp.ones((1, 128, 2, 64), jnp.float32)
    with pytest.raises(registry.KernelUnavailable, match="bfloat16"):
        api.attention(f32, f32, f32, q_positions=jnp.arange(128)[None], implementation="mosaic_gpu_interpret")


def _plain_attention(q, k, v, *, q_positions, kv_lengths, sliding_window, logit_softcap, sinks, scale):
    """Attention written out head by head in float32, differentiated by autodiff: what the reference's hand-written
    gradient must equal."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    heads = []
    for n in range(N):
        s = jnp.einsum("bth,bsh->bts", q[:, :, n], k[:, :, n // (N // K)]) * scale
        if logit_softcap is not None:
            s = logit_softcap * jnp.tanh(s / logit_softcap)
        key, pos = jnp.arange(S)[None, None], q_positions[:, :, None]
        seen = (key <= pos) & (pos - key < sliding_window) & (key < kv_lengths[:, None, None])
        s = jnp.where(seen, s, reference.FLOOR)
        if sinks is not None:
            s = jnp.concatenate([s, jnp.broadcast_to(sinks[n], (B, T, 1))], axis=-1)
        w = jax.nn.softmax(s, axis=-1)[..., :S]
        heads.append(jnp.einsum("bts,bsh->bth", w, v[:, :, n // (N // K)]))
    return jnp.stack(heads, axis=2)


@pytest.mark.parametrize("softcap,with_sinks", [(None, False), (5.0, True)])
def test_reference_gradient_equals_autodiff_of_the_plain_formula(softcap, with_sinks):
    """The reference's gradient is written by hand (weights recomputed in the backward pass, as flash attention
    does): q, k, v and sink gradients equal autodiff's through a head-by-head formula, over GQA, a causal sliding
    window, soft-capping, sinks, and a batch row whose keys are all hidden (kv_lengths 0). Measured: at most 4e-7 of
    each gradient's largest magnitude."""
    rng = np.random.default_rng(3)
    B, T, N, K, H = 2, 9, 6, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, H)), jnp.float32) for n in (N, K, K))
    sinks = jnp.asarray(rng.normal(size=(N,)), jnp.float32) if with_sinks else None
    cotangent = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
    kwargs = dict(q_positions=jnp.broadcast_to(jnp.arange(T), (B, T)), kv_lengths=jnp.array([T, 0]),
                  sliding_window=4, logit_softcap=softcap, scale=0.3)

    def loss(fn, q, k, v, sinks):
        return jnp.sum(fn(q, k, v, sinks=sinks, **kwargs) * cotangent)

    wrt = (0, 1, 2, 3) if with_sinks else (0, 1, 2)
    got = jax.grad(functools.partial(loss, reference.attention), wrt)(q, k, v, sinks)
    want = jax.grad(functools.partial(loss, _plain_attention), wrt)(q, k, v, sinks)
    for name, g, w in zip("qkvs", got, want):
        assert float(jnp.abs(g - w).max()) <= 2e-6 * float(jnp.abs(w).max()), name
