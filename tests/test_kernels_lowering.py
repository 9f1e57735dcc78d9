"""Every Pallas kernel lowers for CUDA (`jax.export`, platforms=("cuda",)) on serving-sized shapes, on a
machine without a GPU: the Mosaic GPU lowering (layout inference, wgmma/TMA constraints, shared-memory
budget) runs fully here, so most of what would break the GPU build breaks this test.

The shapes are flagship models' own op calls (`kernels_pallas/flagships.json`): Llama-3-8B and Qwen3-30B-A3B layers,
Gemma 2 (head dim 256, window, soft-cap) and gpt-oss (head dim 64, sinks, window); the gated delta rule's prefill
at Qwen3-Next's (per-head decay) and Kimi Linear's (per-channel decay) shapes and the Mamba2 scan's prefill at
Nemotron 3 Nano's (`cases.PENDING_FAMILIES`).
DeepSeek-V3's absorbed MLA attention (head dim 576) must be declined, not mis-lowered.
"""

import pytest

from kernels_pallas import cases, ops, registry, selfcheck

PALLAS_OPS = tuple(op for op in ops.kernel_ops() if registry.api(op).PALLAS)  # the ops with Pallas kernels
LOWERED = [c for c in cases.flagship_cases(("llama-3-8b", "qwen3-30b-a3b", "gemma-2-9b", "gpt-oss-20b"),
                                           scale="full", ops=PALLAS_OPS)
           if not (c.name.startswith(("gemma", "gpt-oss")) and c.op in ("moe", "rms_norm"))]
LOWERED += [c for c in cases.flagship_cases(tuple(cases.PENDING_FAMILIES), scale="full",
                                            ops=("gated_delta_rule", "mamba2_ssd"))
            if c.spec["T"] > 1]  # the kernels are the prefill's; a decode step is declined (below)


@pytest.mark.parametrize("case", LOWERED, ids=lambda c: f"{c.op}:{c.name}")
def test_pallas_kernel_lowers_for_cuda(case):
    rows = selfcheck.lower_rows([case], "cuda")
    assert rows, f"{case.op} has no Pallas kernel"
    for row in rows:
        assert row["ok"] is True, row


@pytest.mark.parametrize("kind, group, offset, scale_dtype", [("int4", 128, True, "float16"),
                                                             ("int8", 32, False, "float16"),
                                                             ("fp8", 128, False, "float32"),
                                                             ("mxfp4", 32, False, "uint8"),
                                                             ("nvfp4", 16, False, "float8_e4m3fn")])
def test_quantized_linear_lowers_for_cuda(kind, group, offset, scale_dtype):
    """The XLA program quantized weights take on GPUs, at Llama-3-8B's MLP shapes, bfloat16 activations."""
    from kernels_pallas.calls import OpCall

    call = OpCall.of("quantized_linear", O=14336, I=4096, kind=kind, group=group, offset=offset,
                     scale_dtype=scale_dtype)
    rows = selfcheck.lower_rows(cases.cases_from_calls([call], "bfloat16", scale="full"), "cuda")
    assert [r["implementation"] for r in rows] == ["xla_dot", "xla_dot"]  # one row and sixteen
    assert all(r["ok"] is True for r in rows), rows


def test_unsupported_shapes_are_declined_not_mislowered():
    rows = selfcheck.lower_rows(cases.flagship_cases(("deepseek-v3",), scale="full",
                                                     ops=("attention", "paged_attention")), "cuda")
    assert rows and all(r["ok"] is None and "576" in r["detail"] for r in rows), rows


def test_gated_delta_rule_and_mamba2_decode_steps_are_declined():
    decode = [c for c in cases.flagship_cases(("qwen3-next-80b-a3b", "nemotron-3-nano-30b-a3b"), scale="full",
                                              ops=("gated_delta_rule", "mamba2_ssd"))
              if c.spec["T"] == 1]
    rows = selfcheck.lower_rows(decode, "cuda")
    assert rows and all(r["ok"] is None and "decode step" in r["detail"] for r in rows), rows
