"""Every Pallas kernel runs race-free in the Mosaic GPU interpreter's happens-before race detector.

A missing barrier wait, a slot refilled while a matmul still reads it, or an output stored before its shared
memory is committed would be reported here as a race; on a GPU it would be an error that changes from run to
run. The first test plants such a race to show the detector sees one. The interpreter runs on the CPU device on
every machine (`interpreter_on_cpu`).
"""

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import pytest
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

from kernels_pallas import cases
from kernels_pallas.attention import pallas_mgpu as attention
from kernels_pallas.gated_delta_rule import pallas_mgpu as gdn
from kernels_pallas.moe import pallas_mgpu as moe
from kernels_pallas.paged_attention import pallas_mgpu as paged
from kernels_pallas.rms_norm import pallas_mgpu as rms

DETECT = plgpu.InterpretGPUParams(detect_races=True)
pytestmark = pytest.mark.usefixtures("interpreter_on_cpu")


def races_found() -> bool:
    return bool(gpu_callbacks.get_races().races_found)


def test_the_detector_sees_a_planted_race():
    def body(x_ref, o_ref, smem, bar):
        plgpu.copy_gmem_to_smem(x_ref, smem, bar.at[0])
        o_ref[...] = smem[...] + 1.0  # read before waiting for the copy
        plgpu.barrier_wait(bar.at[0])

    racy = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), jnp.float32), interpret=DETECT,
                        scratch_types=(plgpu.SMEM((128,), jnp.float32), plgpu.Barrier(num_barriers=1)))
    jax.block_until_ready(racy(jnp.ones(128)))
    assert races_found()


SPECS = {
    "attention": (attention.attention, dict(B=1, T=64, S=192, N=1, K=1, H=64, scale=None, window=40,
                                            softcap=None, sinks=True, offsets=True), {}),
    "paged_attention": (paged.paged_attention, dict(B=1, T=1, N=2, K=1, H=64, page=16, max_len=150, scale=None,
                                                    window=None, softcap=None, sinks=False), dict(splits=1)),
    "moe": (moe.grouped_matmul, dict(M=80, G=3, D=128, F=64, k=1), dict(blocks=moe.Blocks(64, 64, 64, 2))),
    "rms_norm": (rms.rms_norm, dict(M=8, D=256, eps=1e-6, offset=0.0), {}),
    "gated_delta_rule": (gdn.gated_delta_rule, dict(B=1, T=150, Nk=1, Nv=1, Hk=64, Hv=64, decay="channel"), {}),
}


@pytest.mark.parametrize("op", sorted(SPECS))
def test_kernel_is_race_free(op):
    kernel, spec, extra = SPECS[op]
    args, kwargs = cases.Case(op, "race", "bfloat16", spec).build(0)
    jax.block_until_ready(kernel(*args, **kwargs, **extra, interpret=DETECT))
    assert not races_found(), f"{op}: the race detector reported a race (see the printed RACE DETECTED lines)"
