"""`python -m day0jax.profile`: the operator groups read from a compiled program's HLO, the time attribution of a
trace (overlapping operations share their time), and the CLI end to end on a tiny model: every phase's operations
fit in its measured step time and host overhead is the rest, the model's own scopes (MLP, attention, norms,
vocabulary projection) are found, and the Perfetto traces parse."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serve_tiny import write_tiny_chat_checkpoint  # noqa: E402

from day0jax import profile as P  # noqa: E402

HLO = """HloModule jit_step, is_scheduled=true

%fused_computation (param_0: f32[4,8]) -> f32[4,8] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  ROOT %tanh.1 = f32[4,8]{1,0} tanh(%param_0), metadata={op_name="jit(step)/mlp/tanh"}
}

ENTRY %main (p0: f32[4,8], p1: f32[8,16]) -> f32[4,16] {
  %p0 = f32[4,8]{1,0} parameter(0), metadata={op_name="x"}
  %p1 = f32[8,16]{1,0} parameter(1), metadata={op_name="w"}
  %fusion = f32[4,8]{1,0} fusion(%p0), kind=kLoop, calls=%fused_computation
  %norm.1 = f32[4,8]{1,0} multiply(%fusion, %fusion), metadata={op_name="jit(step)/layer/norm/mul"}
  ROOT %dot.2 = f32[4,16]{1,0} dot(%norm.1, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_groups_and_bytes_from_hlo():
    ops = P.hlo_ops(HLO)
    assert ops["norm.1"] == P.HloOp("norms", 3 * 4 * 8 * 4)  # two operands read, one result written
    assert ops["fusion"].group == "MLP projections"  # metadata only inside the fused computation
    assert ops["dot.2"].group == "norms"  # no metadata, no users: its operand's group
    assert ops["dot.2"].bytes == (4 * 16 + 4 * 8 + 8 * 16) * 4
    assert P.group_of("jit(f)/mlp/projection/dot_general") == "MLP projections"  # the first listed scope wins
    assert P.group_of("jit(f)/embed/take") == "other ops"


def test_overlapping_operations_share_their_time():
    ops = {"a": P.HloOp("attention", 100), "b": P.HloOp("norms", 10)}
    events = [{"ph": "X", "ts": 0, "dur": 10, "args": {"hlo_op": "a", "run_id": 1}},
              {"ph": "X", "ts": 5, "dur": 10, "args": {"hlo_op": "b", "run_id": 1}}]
    seconds, moved = P.attribute(events, [ops], steps=1, step_s=20e-6)
    assert seconds["attention"] == pytest.approx(7.5e-6) and seconds["norms"] == pytest.approx(7.5e-6)
    assert seconds[P.HOST] == pytest.approx(5e-6) and moved == {"attention": 100, "norms": 10}


def test_profile_cli_on_a_tiny_model(tmp_path, capsys):
    ckpt = write_tiny_chat_checkpoint(tmp_path, name="tiny")
    assert P.main(["--model", str(ckpt), "--dtype", "float32", "--batch", "2", "--prompt-len", "24",
                   "--new-tokens", "6", "--trace", str(tmp_path / "trace")]) == 0
    out = capsys.readouterr().out
    assert "copy bandwidth" in out and "prefill: " in out and "decode: " in out

    import day0jax
    from day0jax.engine.config import EngineConfig

    model = day0jax.load(ckpt, dtype="float32", engine=EngineConfig(max_num_seqs=2, max_model_len=32, min_width=32))
    phases = P.profile(model, batch=2, prompt_len=24, new_tokens=6, trace_dir=tmp_path / "again")
    assert [p.name for p in phases] == ["prefill", "decode"]
    for phase in phases:
        # The operations' time comes from the trace, the step time from the wall clock around the same steps: the
        # operations may not cover more than the step (10% for the two clocks), host overhead is what they leave.
        assert 0 < phase.busy_s <= 1.1 * phase.step_s
        assert phase.busy_s + phase.groups[P.HOST] == pytest.approx(phase.step_s)
        for group in ("MLP projections", "attention", "norms", "vocabulary projection", "other projections"):
            assert phase.groups.get(group, 0) > 0 and phase.bytes.get(group, 0) > 0, (phase.name, group)
        trace = next(Path(phase.trace).rglob("*.trace.json.gz"))
        assert json.load(gzip.open(trace))["traceEvents"]
