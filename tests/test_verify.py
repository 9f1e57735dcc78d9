"""`day0jax.verify`: layer-by-layer precision against transformers, and that it catches and localizes errors.

Tolerances: the defaults of `verify.TOLERANCES` for float32 (logits max relative difference 1e-3, mean KL 1e-5,
top-1 agreement 1.0); observed figures for the tiny families are around 1e-7 relative.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from day0jax import verify as verify_lib
from families import PROMPTS

ROOT = Path(__file__).resolve().parent.parent


def test_matching_model_passes_per_layer(tiny, converted, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    result = verify_lib.verify(converted["deepseek_v3"], tiny["deepseek_v3"]["hf"], prompts=prompts)
    assert result.passed, result.failures
    assert [d.name for d in result.layers] == ["embeddings", "layer 1", "layer 2", "layer 3 + final norm"]
    # max_rel is max|diff| / max|ref|, mean_rel mean|diff| / mean|ref|: neither bounds the other (layer 2 here:
    # 6.0e-7 and 7.0e-7).
    assert all(d.max_rel < 1e-5 and d.mean_rel < 1e-5 for d in result.layers)
    assert result.tokens == sum(map(len, PROMPTS)) and result.top1_agreement == 1.0
    assert result.logits_max_rel < 1e-5 and 0 <= result.kl_mean < 1e-10


def test_quantized_checkpoint_reports_its_error_and_its_kernels(tiny, tmp_path):
    """int8 weights against their float source: quantization-sized differences within the int8 defaults, and the
    kernels' own error against their dequantized reference from the load's self-test (float32-tight)."""
    from convert import convert_checkpoint
    from convert.convert import Options

    ckpt = convert_checkpoint(tiny["llama"]["hf"], tmp_path / "int8", progress=False,
                              options=Options(quantize="int8", group_size=16)).dst
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    result = verify_lib.verify(ckpt, tiny["llama"]["hf"], prompts=prompts)
    assert result.passed, result.failures
    assert result.tolerance["kl_mean"] == verify_lib.QUANTIZED_TOLERANCES["int8"][1]
    assert 1e-7 < result.kl_mean and result.logits_max_rel > 1e-4  # the rounding shows, unlike float32's 1e-7
    assert result.kernel_checks and all(r["ok"] and r["max_rel_error"] < 1e-5 for r in result.kernel_checks)
    assert "quantized kernels against their dequantized reference" in verify_lib.render(result)


def test_wrong_math_fails_at_the_layer_it_starts(tiny, converted, tmp_path):
    """Mistral's window of 8 against the same weights run without a window (the llama reference, same seed):
    prompts longer than the window differ from layer 1 on, and the verdict is FAIL."""
    result = verify_lib.verify(converted["mistral"], tiny["llama"]["hf"],
                               prompts=_write(tmp_path / "long.json", PROMPTS[1:]))
    assert not result.passed and "logits max relative difference" in result.failures[0]
    assert result.layers[0].max_rel == 0.0  # same embeddings: the weights are the same
    assert result.layers[1].max_rel > 1e-3  # the first attention already differs


def _write(path: Path, prompts) -> Path:
    path.write_text(json.dumps(prompts))
    return path


def test_compare_localizes_a_perturbed_layer():
    rng = np.random.default_rng(0)
    ref = {"hidden_0": rng.standard_normal((4, 5, 8)).astype(np.float32),
           "logits_0": rng.standard_normal((5, 11)).astype(np.float32)}
    hidden = ref["hidden_0"].copy()
    hidden[2:] += 0.05  # layer 2 onwards departs
    result = verify_lib.compare([hidden], [ref["logits_0"] + 1e-6], ref, verify_lib.TOLERANCES["float32"])
    assert [d.max_rel == 0 for d in result.layers] == [True, True, False, False]
    assert result.passed  # the logits themselves agree within tolerance
    flipped = ref["logits_0"].copy()
    flipped[0] = -flipped[0]
    bad = verify_lib.compare([hidden], [flipped], ref, verify_lib.TOLERANCES["float32"])
    assert not bad.passed and bad.top1_agreement == 0.8 and len(bad.failures) == 3


def test_prompt_files(tmp_path):
    assert verify_lib.read_prompts(_write(tmp_path / "a.json", [[1, 2], [3]]), None, 10) == [[1, 2], [3]]
    with pytest.raises(verify_lib.VerifyError, match="need a tokenizer"):
        verify_lib.read_prompts(_write(tmp_path / "b.json", ["hello"]), None, 10)
    with pytest.raises(verify_lib.VerifyError, match="below the vocabulary size 10"):
        verify_lib.read_prompts(_write(tmp_path / "c.json", [[1, 12]]), None, 10)
    (tmp_path / "d.txt").write_text("one\n\ntwo\n")

    class Tok:
        def encode(self, text):
            return [len(text)]
    assert verify_lib.read_prompts(tmp_path / "d.txt", Tok(), 10) == [[3], [3]]


def test_cli_json_and_exit_codes(tiny, converted, tmp_path):
    prompts = _write(tmp_path / "p.json", PROMPTS[:2])
    cmd = [sys.executable, "-m", "day0jax.verify", str(converted["gpt_oss"]), "--reference",
           str(tiny["gpt_oss"]["hf"]), "--prompts", str(prompts)]
    ok = subprocess.run(cmd + ["--json"], capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr[-3000:]
    data = json.loads(ok.stdout)
    assert data["passed"] and len(data["layers"]) == 3
    strict = subprocess.run(cmd + ["--tolerance", "1e-12"], capture_output=True, text=True, cwd=ROOT)
    assert strict.returncode == 1 and "FAIL: logits max relative difference" in strict.stdout
    missing = subprocess.run(cmd + ["--reference-python", str(tmp_path / "no-python")], capture_output=True,
                             text=True, cwd=ROOT)
    assert missing.returncode == 2 and "reference Python" in missing.stderr


@pytest.mark.slow
def test_smollm2_layer_by_layer(smollm2):
    """The real 30-layer model (dequantized GGUF weights, as transformers saves them): every layer within 1e-4."""
    result = verify_lib.verify(smollm2["ckpt_hf"], smollm2["hf"])
    assert result.passed, result.failures
    assert len(result.layers) == 31 and max(d.max_rel for d in result.layers) < 1e-4
