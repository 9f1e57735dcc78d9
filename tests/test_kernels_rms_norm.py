"""The fused RMSNorm op's shared contract test, run by every implementation that can run here.

Expectation: the reference on the same inputs (its own dtype rules: a float32 weight promotes Llama-style
outputs, Gemma-style outputs keep x's dtype). Tolerance per dtype from `cases.TOLERANCE`; h = x + residual must
be identical (one rounding of one add).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import needs_hopper
from kernels_pallas import cases, registry
from kernels_pallas.rms_norm import api, reference

# (rows, D, x dtype, weight dtype, offset, with residual); 7 rows: not a multiple of the block.
CASES = {
    "llama-bf16-residual": (7, 256, "bfloat16", "bfloat16", 0.0, True),
    "f32-weight-promotes": (5, 384, "bfloat16", "float32", 0.0, False),
    "gemma-offset-f32": (3, 128, "float32", "float32", 1.0, True),
}


class RMSNormContract:
    implementation: str

    @pytest.mark.parametrize("name", sorted(CASES))
    def test_matches_reference(self, name):
        M, D, xdt, wdt, offset, with_res = CASES[name]
        rng = np.random.default_rng(sorted(CASES).index(name))
        x = jnp.asarray(rng.standard_normal((2, M, D), np.float32), xdt)
        res = jnp.asarray(rng.standard_normal((2, M, D), np.float32), xdt) if with_res else None
        w = jnp.asarray(1 - offset + 0.1 * rng.standard_normal(D), wdt)
        got, h = api.rms_norm(x, w, eps=1e-6, offset=offset, residual=res, implementation=self.implementation)
        want, want_h = reference.rms_norm(x, w, eps=1e-6, offset=offset, residual=res)
        assert got.shape == want.shape and got.dtype == want.dtype and h.dtype == want_h.dtype
        np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(want_h, np.float32))
        err = cases.max_relative_error(got, want)
        assert err <= cases.TOLERANCE[xdt], f"{self.implementation} on {name}: max relative error {err}"


class TestReference(RMSNormContract):
    implementation = "reference"


@pytest.mark.usefixtures("interpreter_on_cpu")
class TestMosaicGpuInterpret(RMSNormContract):
    implementation = "mosaic_gpu_interpret"


@needs_hopper
class TestMosaicGpu(RMSNormContract):
    implementation = "mosaic_gpu"


def test_hidden_size_not_a_multiple_of_128_is_declined():
    x = jnp.ones((4, 100), jnp.bfloat16)
    with pytest.raises(registry.KernelUnavailable, match="multiple of 128"):
        api.rms_norm(x, jnp.ones(100, jnp.bfloat16), eps=1e-6, implementation="mosaic_gpu_interpret")
    normed, _ = api.rms_norm(x, jnp.ones(100, jnp.bfloat16), eps=1e-6)  # the pool still answers
    np.testing.assert_allclose(np.asarray(normed, np.float32), 1.0, rtol=1e-2)
