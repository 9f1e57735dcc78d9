"""The grouped matmul (MoE) op's shared contract test, run by every implementation that can run here.

bfloat16 inputs against the float32 reference on the same values; tolerance `cases.TOLERANCE["bfloat16"]`.
Group sizes include empty groups, groups that straddle row blocks and rows past sum(group_sizes) (must be 0).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import needs_hopper
from kernels_pallas import cases
from kernels_pallas.moe import api, pallas_mgpu, reference

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


class TestReference(GroupedMatmulContract):
    implementation = "reference"


class TestXlaRaggedDot(GroupedMatmulContract):
    implementation = "xla_ragged_dot"


@pytest.mark.usefixtures("interpreter_on_cpu")
class TestMosaicGpuInterpret(GroupedMatmulContract):
    implementation = "mosaic_gpu_interpret"


@needs_hopper
class TestMosaicGpu(GroupedMatmulContract):
    implementation = "mosaic_gpu"


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
