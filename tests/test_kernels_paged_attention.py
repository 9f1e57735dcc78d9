"""The paged decode attention op's shared contract test, run by every implementation that can run here.

bfloat16 inputs against the float32 reference on the same values; tolerance `cases.TOLERANCE["bfloat16"]`
(2e-2 of the largest output magnitude). The Mosaic GPU kernel runs in the interpreter on the CPU (on every
machine) and, compiled, on a Hopper GPU; the cases make it split rows' keys (some splits empty), gather several
pages per key block, and need two query tiles.
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import needs_hopper
from kernels_pallas import cases, registry, selftest
from kernels_pallas.paged_attention import api, pallas_mgpu, reference

CASES = {
    # 2 rows of very different lengths over 16-token pages: 4 pages per key block, splits with no work.
    "gqa-decode-pages16": dict(B=2, T=1, N=8, K=2, H=64, page=16, max_len=150, scale=None, window=None,
                               softcap=None, sinks=False),
    # 3 new tokens x 32 heads on one kv head: 96 query rows, two 64-row tiles; window, soft-cap, sinks.
    "mqa-multitoken-window-softcap-sinks": dict(B=1, T=3, N=32, K=1, H=128, page=64, max_len=150, scale=0.1,
                                                window=40, softcap=20.0, sinks=True),
}


class PagedAttentionContract:
    implementation: str

    @pytest.mark.parametrize("name", sorted(CASES))
    def test_matches_reference(self, name):
        case = cases.Case("paged_attention", name, "bfloat16", CASES[name])
        args, kwargs = case.build(10 + sorted(CASES).index(name))
        got = selftest.run(functools.partial(api.paged_attention, implementation=self.implementation), args, kwargs)
        want = selftest.run(reference.paged_attention, cases.upcast(args), kwargs)
        assert got.shape == args[0].shape and got.dtype == args[0].dtype
        err = cases.max_relative_error(got, want)
        assert err <= case.tolerance, f"{self.implementation} on {name}: max relative error {err}"


class TestReference(PagedAttentionContract):
    implementation = "reference"


@pytest.mark.usefixtures("interpreter_on_cpu")
class TestMosaicGpuInterpret(PagedAttentionContract):
    implementation = "mosaic_gpu_interpret"


@needs_hopper
class TestMosaicGpu(PagedAttentionContract):
    implementation = "mosaic_gpu"


def test_split_count_fills_the_chip_but_never_exceeds_the_blocks():
    assert pallas_mgpu.num_splits(batch=1, kv_heads=8, num_blocks=64, cores=132, max_splits=16) == 16
    assert pallas_mgpu.num_splits(batch=256, kv_heads=8, num_blocks=64, cores=132, max_splits=16) == 1
    assert pallas_mgpu.num_splits(batch=1, kv_heads=1, num_blocks=3, cores=132, max_splits=16) == 3


def test_declines_chunked_attention_and_falls_back():
    """Chunked local attention (Llama 4) is not in the kernel: it declines it by name, and the op runs the reference."""
    args, kwargs = cases.Case("paged_attention", "chunked", "bfloat16", dict(CASES["gqa-decode-pages16"], chunk=32)
                              ).build(0)
    assert kwargs["chunk_size"] == 32
    with pytest.raises(registry.KernelUnavailable, match="chunk"):
        api.paged_attention(*args, **kwargs, implementation="mosaic_gpu_interpret")
    got = selftest.run(api.paged_attention, args, kwargs)
    want = selftest.run(reference.paged_attention, cases.upcast(args), kwargs)
    assert cases.max_relative_error(got, want) <= cases.TOLERANCE["bfloat16"]


def test_declines_mla_pools_and_falls_back():
    q = jnp.ones((1, 1, 4, 64), jnp.bfloat16)
    k_pages, v_pages = jnp.ones((3, 16, 1, 64), jnp.bfloat16), jnp.ones((3, 16, 1, 128), jnp.bfloat16)
    tables, lengths, pos = jnp.array([[1, 2]]), jnp.array([20]), jnp.array([[19]])
    with pytest.raises(registry.KernelUnavailable, match="one shape"):
        api.paged_attention(q, k_pages, v_pages, tables, lengths, pos, implementation="mosaic_gpu_interpret")
    out = api.paged_attention(q, k_pages, v_pages, tables, lengths, pos)  # value head dim 128 (MLA): reference
    assert out.shape == (1, 1, 4, 128)
    np.testing.assert_allclose(np.asarray(out, np.float32), 1.0)
