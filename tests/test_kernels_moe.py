"""The grouped matmul (MoE) op's shared contract test, run by every implementation that can run here.

bfloat16 inputs against the float32 reference on the same values; tolerance `cases.TOLERANCE["bfloat16"]`.
Group sizes include empty groups, groups that straddle row blocks and rows past sum(group_sizes) (must be 0).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import needs_hopper
from kernels_pallas import cases, selfcheck
from kernels_pallas.moe import api, pallas_mgpu, reference, spec
from kernels_pallas.quantized_linear.reference import dequantize
from kernels_pallas.registry import KernelUnavailable

# (M, D, F, group sizes)
CASES = {
    "straddling-empty-trailing": (150, 128, 128, [40, 0, 70, 3, 30]),  # 143 rows used, 7 trailing
    "one-busy-expert-down-proj": (64, 256, 128, [0, 0, 64, 0, 0, 0, 0, 0]),
}


class GroupedMatmulContract:
    implementation: str

    @pytest.mark.parametrize("name", sorted(CASES))
    def test_matches_reference(self, name):
        M, D, F, sizes = CASES[name]
        rng = np.random.default_rng(sorted(CASES).index(name))
        lhs = jnp.asarray(rng.standard_normal((M, D), np.float32), jnp.bfloat16)
        rhs = jnp.asarray(rng.standard_normal((len(sizes), D, F), np.float32) / np.sqrt(D), jnp.bfloat16)
        group_sizes = jnp.asarray(sizes, jnp.int32)
        got = api.grouped_matmul(lhs, rhs, group_sizes, implementation=self.implementation)
        want = reference.grouped_matmul(lhs.astype(jnp.float32), rhs.astype(jnp.float32), group_sizes)
        assert got.shape == (M, F) and got.dtype == lhs.dtype
        err = cases.max_relative_error(got, want)
        assert err <= cases.TOLERANCE["bfloat16"], f"{self.implementation} on {name}: max relative error {err}"
        assert not np.any(np.asarray(got[sum(sizes):], np.float32)), "rows past the groups must be zero"




class QuantizedExpertsContract:
    """For the implementations that take quantized experts (the Mosaic GPU kernel declines them, tested below)."""

    implementation: str

    @pytest.mark.parametrize("fmt", ["int8/32", "int4/32+offset", "int4/16", "fp8/16", "mxfp4/32", "nvfp4/16", "nvfp4_modelopt/16", "mxfp8_e4m3/32"])
    def test_quantized_experts_compute_their_dequantized_values(self, fmt):
        """Quantized experts (each expert's [F, D] map, as quantized_linear stores it) against float64 products of
        their dequantized weights, row by row: float32-tight (float32 sums of 128 terms)."""
        M, D, F, sizes = CASES["straddling-empty-trailing"]
        (lhs, rhs, group_sizes), _ = spec.build(cases.Random(7, False), jnp.float32, M=M, G=len(sizes), D=D, F=F,
                                                k=2, quantized=fmt)
        group_sizes = jnp.asarray(sizes, jnp.int32)
        got = np.asarray(api.grouped_matmul(lhs, rhs, group_sizes, implementation=self.implementation))
        x = np.asarray(lhs, np.float64)
        row = 0
        for g, n in enumerate(sizes):
            one = type(rhs)(rhs.codes[g], rhs.scale[g], None if rhs.offset is None else rhs.offset[g], rhs.kind,
                            rhs.group, None if rhs.global_scale is None else rhs.global_scale[g])
            w = np.asarray(dequantize(one), np.float64)  # [F, D]
            want = x[row:row + n] @ w.T
            if n:
                assert np.abs(got[row:row + n] - want).max() <= 1e-5 * np.abs(want).max(), (fmt, g)
            row += n
        assert not np.any(got[row:]), "rows past the groups must be zero"


class TestReference(GroupedMatmulContract, QuantizedExpertsContract):
    implementation = "reference"


class TestXlaRaggedDot(GroupedMatmulContract, QuantizedExpertsContract):
    implementation = "xla_ragged_dot"


class TestTiles(GroupedMatmulContract, QuantizedExpertsContract):
    implementation = "tiles"

    @pytest.mark.parametrize("M, G", [(1024, 16), (40, 64), (64, 64), (333, 5)])
    def test_routed_shapes_against_the_reference(self, M, G):
        """A prefill's rows over few experts (tiles of 64), decode steps over many (tiles of 8, many experts
        unused), and rows left over past the groups, as the routers make them: float32 against the reference, each
        row's sum over D in another order (errors seen: 5.4e-7 relative)."""
        (lhs, rhs, sizes), _ = spec.build(cases.Random(M + G, False), jnp.float32, M=M, G=G, D=128, F=96, k=2)
        if M == 333:
            sizes = sizes.at[-1].add(-13)  # 13 rows past the groups: zero
        got = np.asarray(api.grouped_matmul(lhs, rhs, sizes, implementation="tiles"))
        want = np.asarray(reference.grouped_matmul(lhs, rhs, sizes))
        assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()
        assert not np.any(got[int(sizes.sum()):])


def test_tiles_leave_few_rows_over_many_experts_to_the_reference():
    (lhs, rhs, sizes), _ = spec.build(cases.Random(0, False), jnp.float32, M=8, G=64, D=128, F=96, k=8)
    with pytest.raises(KernelUnavailable, match="8 rows over 64 groups"):
        api.grouped_matmul(lhs, rhs, sizes, implementation="tiles")


def test_tiles_read_each_used_expert_once_per_tile():
    """The tiles' bound covers every routing (all rows in one expert, one row per expert, the rest), and a tile's
    rows all belong to its expert: an expert whose weights are NaN poisons its own rows only."""
    from kernels_pallas.moe import tiles

    M, G, D, F = 48, 12, 32, 16
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.standard_normal((M, D), np.float32))
    rhs = np.asarray(rng.standard_normal((G, D, F), np.float32))
    rhs[5] = np.nan
    for sizes in ([M] + [0] * (G - 1), [4] * G, [0] * 5 + [13, 1, 9, 0, 0, 25, 0]):
        out = np.asarray(tiles.grouped_matmul(lhs, jnp.asarray(rhs), jnp.asarray(sizes, jnp.int32)))
        start = sum(sizes[:5])
        poisoned = np.zeros(M, bool)
        poisoned[start:start + sizes[5]] = True
        assert np.isnan(out[poisoned]).all() and np.isfinite(out[~poisoned]).all(), sizes


def test_mosaic_gpu_declines_quantized_experts():
    (lhs, rhs, sizes), _ = spec.build(cases.Random(0, False), jnp.bfloat16, M=32, G=4, D=128, F=128, k=2,
                                      quantized="int8/32")
    with pytest.raises(KernelUnavailable, match="quantized"):
        api.grouped_matmul(lhs, rhs, sizes, implementation="mosaic_gpu_interpret")


# Serving-sized: 16 contraction steps through 4 shared-memory slots, 2 column blocks, 64 experts; the shape at
# which an asynchronous wgmma still reading a slot that the pipeline refills shows (small shapes never refill).
SERVING = dict(M=512, G=64, D=1024, F=256, k=4)
# The same slot reuse (8 contraction steps through 2 slots) at a size the interpreter runs in seconds.
SLOT_REUSE = (dict(M=80, G=3, D=512, F=128, k=1), pallas_mgpu.Blocks(64, 64, 64, 2))


def check_against_reference(spec, implementation, **kwargs):
    case = cases.Case("moe", "slots", "bfloat16", spec)
    args, _ = case.build(0)
    got = pallas_mgpu.grouped_matmul(*args, **kwargs) if implementation is None else \
        api.grouped_matmul(*args, implementation=implementation)
    lhs, rhs, sizes = args
    want = reference.grouped_matmul(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes)
    err = cases.max_relative_error(got, want)
    assert err <= cases.TOLERANCE["bfloat16"], f"max relative error {err} at {spec}"


@pytest.mark.usefixtures("interpreter_on_cpu")
class TestMosaicGpuInterpret(GroupedMatmulContract):
    implementation = "mosaic_gpu_interpret"

    def test_refilled_slots_give_the_reference(self):
        spec, blocks = SLOT_REUSE
        check_against_reference(spec, None, blocks=blocks, interpret=True)


@needs_hopper
class TestMosaicGpu(GroupedMatmulContract):
    implementation = "mosaic_gpu"

    def test_serving_sized_shape(self):
        check_against_reference(SERVING, "mosaic_gpu")


def test_serving_sized_shape_lowers_for_cuda():
    rows = selfcheck.lower_rows([cases.Case("moe", "serving", "bfloat16", SERVING)], "cuda")
    assert [r["ok"] for r in rows] == [True], rows


def test_pipeline_waits_for_the_previous_wgmma_before_its_slot_is_refilled():
    """The interpreter runs a wgmma synchronously, so it cannot show this race: the kernel's program must hold
    the wait (the slots' one-step-late release, delay_release=1, relies on it)."""
    spec, blocks = SLOT_REUSE
    (lhs, rhs, sizes), _ = cases.Case("moe", "slots", "bfloat16", spec).build(0)
    pair_block, pair_group, pair_valid, _, _ = pallas_mgpu.pair_table(sizes, spec["M"], blocks.block_m)
    lhs = jnp.pad(lhs, ((0, -spec["M"] % blocks.block_m), (0, 0)))
    program = str(jax.make_jaxpr(lambda *a: pallas_mgpu._call(*a, blocks=blocks, interpret=True))(
        lhs, rhs, pair_block, pair_group, pair_valid))
    assert "wgmma_wait[n=1]" in program


def test_one_slot_is_declined():
    (lhs, rhs, sizes), _ = cases.Case("moe", "slots", "bfloat16", SLOT_REUSE[0]).build(0)
    with pytest.raises(NotImplementedError, match="steps 1"):
        pallas_mgpu.grouped_matmul(lhs, rhs, sizes, blocks=pallas_mgpu.Blocks(64, 64, 64, 1), interpret=True)


def test_pair_table_maps_every_row_to_its_own_groups_tile():
    sizes = np.array([5, 0, 9, 0, 2, 14], np.int32)
    M, bm = 36, 8  # 30 rows used
    block, group, valid, source, row_valid = map(np.asarray, pallas_mgpu.pair_table(jnp.asarray(sizes), M, bm))
    assert len(block) == -(-M // bm) + len(sizes) - 1
    pairs = [(b, g) for b, g, v in zip(block, group, valid) if v]
    ends = np.cumsum(sizes)
    starts = ends - sizes
    want = sorted({(r // bm, g) for g in range(len(sizes)) for r in range(starts[g], ends[g])})
    assert pairs == want  # exactly the overlapping (row block, group) pairs, in row order, empty groups absent
    for r in range(M):
        if r >= ends[-1]:
            assert not row_valid[r]
            continue
        p, within = divmod(source[r], bm)
        assert within == r % bm and block[p] == r // bm and starts[group[p]] <= r < ends[group[p]]


def test_ragged_dot_on_a_gpu_declines_a_dense_expansion_too_large_for_it(monkeypatch):
    """Without cuDNN 9.22 XLA:GPU expands ragged_dot over every expert: at DeepSeek-V3's prefill (32768 rows, 256
    experts of width 2048) that is 32 GiB: declined, the op takes the reference; small shapes and newer cuDNN keep
    it."""
    from kernels_pallas import platform, registry

    def shapes(M, G, D, F):
        return (jax.ShapeDtypeStruct((M, D), jnp.bfloat16), jax.ShapeDtypeStruct((G, D, F), jnp.bfloat16),
                jax.ShapeDtypeStruct((G,), jnp.int32))

    deepseek, small = shapes(32768, 256, 7168, 2048), shapes(256, 8, 128, 128)
    assert registry.accepts("moe", "xla_ragged_dot", *deepseek) is None  # the CPU: not XLA:GPU's expansion
    with platform.assume(platform.HOPPER):
        monkeypatch.setattr(api, "cudnn_version", lambda: 91000)
        assert "32.0 GiB" in registry.accepts("moe", "xla_ragged_dot", *deepseek)
        assert registry.accepts("moe", "xla_ragged_dot", *small) is None
        monkeypatch.setattr(api, "cudnn_version", lambda: api.CUDNN_RAGGED_DOT)
        assert registry.accepts("moe", "xla_ragged_dot", *deepseek) is None
