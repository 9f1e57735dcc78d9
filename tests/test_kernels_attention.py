"""The attention op's shared contract test, run by every implementation of the pool that can run here.

Each implementation computes bfloat16 inputs; the expectation is the reference on the same values in float32.
Pallas kernels run in the Mosaic GPU interpreter on the CPU (`mosaic_gpu_interpret`); on a machine with a
Hopper GPU the compiled kernel and cuDNN join. Tolerance: `cases.TOLERANCE["bfloat16"]` (2e-2 of the largest
output magnitude), written beside the cases in kernels_pallas/cases.py.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

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
}


class AttentionContract:
    """Every implementation of `attention` must match the float32 reference on these cases."""

    implementation: str

    @pytest.mark.parametrize("name", sorted(CASES))
    def test_matches_reference(self, name):
        case = cases.Case("attention", name, "bfloat16", CASES[name])
        (q, k, v), kwargs = case.build(sorted(CASES).index(name))
        got = selftest.run(functools.partial(api.attention, implementation=self.implementation), (q, k, v), kwargs)
        want = selftest.run(reference.attention, cases.upcast((q, k, v)), kwargs)
        assert got.shape == q.shape and got.dtype == q.dtype
        err = cases.max_relative_error(got, want)
        assert err <= case.tolerance, f"{self.implementation} on {name}: max relative error {err}"


class TestReference(AttentionContract):
    implementation = "reference"


class TestMosaicGpuInterpret(AttentionContract):
    implementation = "mosaic_gpu_interpret"


if jax.default_backend() == "gpu":  # the compiled kernels, where a GPU runs the suite
    class TestMosaicGpu(AttentionContract):
        implementation = "mosaic_gpu"

    class TestCudnn(AttentionContract):
        implementation = "cudnn"


def test_off_gpu_the_pool_falls_back_and_named_kernels_refuse():
    q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
    pos = jnp.arange(128)[None]
    if jax.default_backend() != "gpu":
        with pytest.raises(registry.KernelUnavailable, match="Hopper"):
            api.attention(q, q, q, q_positions=pos, implementation="mosaic_gpu")
        with pytest.raises(registry.KernelUnavailable, match="NVIDIA GPU"):
            api.attention(q, q, q, q_positions=pos, implementation="cudnn")
        assert registry.chosen("attention", q, q, q, q_positions=pos) == "reference"
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
