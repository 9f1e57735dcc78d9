"""`python -m convert --export-hf`: a checkpoint written back as a Hugging Face folder.

Every family's tiny conversion exports exactly the tensors it was converted from (bit for bit, under transformers'
current names, less what the family drops); transformers loads the exports of families whose parameters are built
by more than a rename (stacked and split experts, interleaved gate/up rows, older names) and gives the logits of
the original folder exactly; a GGUF conversion exports what transformers makes of the GGUF (llama.cpp's q/k row
permutation undone); refusals are named and leave nothing behind.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import run_reference
from convert.convert import dropped_tensors
from convert.export_hf import MARKER, element_sources, export_hf
from convert.sources import RenamedSource, open_source
from day0jax import models
from day0jax.core.errors import CheckpointError
from day0jax.core.hf_tensors import Source
from families import FAMILIES, PROMPTS

ROOT = Path(__file__).resolve().parent.parent


def exported_tensors(folder: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def source_tensors(hf: Path) -> dict[str, np.ndarray]:
    """The HF folder's tensors under the names the converter reads them by, less those its family drops."""
    source = open_source(hf)
    config_hf = source.hf_config()
    fam = models.family(config_hf["model_type"])
    config = fam.config.from_hf(config_hf)
    if fam.renames:
        source = RenamedSource(source, fam.renames)
    dropped = dropped_tensors(fam, config)
    return {n: source.read(n) for n in source.tensor_names() if not any(re.fullmatch(p, n) for p in dropped)}


def test_every_family_exports_the_tensors_it_was_converted_from(tiny, converted, tmp_path):
    problems = {}
    for name in FAMILIES:
        got = exported_tensors(export_hf(converted[name], tmp_path / name, progress=False).dst)
        want = source_tensors(tiny[name]["hf"])
        if set(got) != set(want):
            problems[name] = f"extra {sorted(set(got) - set(want))[:3]}, missing {sorted(set(want) - set(got))[:3]}"
            continue
        # Integer tensors (deepseek_v4's hash routing table) come out as the checkpoint stores them, int32, and
        # transformers reads them into its own; float ones keep their dtype.
        differ = [n for n in want if not np.array_equal(got[n], want[n]) or
                  (got[n].dtype != want[n].dtype and np.issubdtype(want[n].dtype, np.floating))]
        if differ:
            problems[name] = f"tensors differ: {differ[:3]}"
    assert not problems, problems


# Parameters built by more than a rename: stacked per-expert tensors (deepseek_v3, with MLA's split projections),
# gate/up rows interleaved in one transposed tensor (gpt_oss), EXAONE's older names, a fused gate_up split in two
# (phi3), a hybrid's gated delta rule projections (qwen3_next), and hyper-connections with an integer hash-routing
# table (deepseek_v4).
LOADED = ["llama", "deepseek_v3", "gpt_oss", "exaone", "phi3", "qwen3_next", "deepseek_v4"]


def test_transformers_loads_the_export_and_gives_the_same_logits(tiny, converted, tmp_path):
    jobs = []
    for name in LOADED:
        export_hf(converted[name], tmp_path / name, progress=False)
        jobs.append({"op": "run", "model": str(tmp_path / name), "prompts": PROMPTS,
                     "out": str(tmp_path / f"{name}.npz")})
    run_reference(jobs, tmp_path / "jobs")
    for name in LOADED:
        got = np.load(tmp_path / f"{name}.npz")
        for i in range(len(PROMPTS)):
            np.testing.assert_array_equal(got[f"logits_{i}"], tiny[name]["ref"][f"logits_{i}"], err_msg=name)


def test_a_gguf_conversion_exports_what_transformers_reads_from_the_gguf(smollm2, tmp_path):
    """The SmolLM2 GGUF converted dequantized, then exported: transformers' own dequantization of the GGUF, bit for
    bit, q and k projections included (llama.cpp stores their rows permuted)."""
    from convert import convert_checkpoint
    from convert.convert import Options

    ckpt = convert_checkpoint(smollm2["gguf"], tmp_path / "ckpt", progress=False,
                              options=Options(dequantize=True)).dst
    got = exported_tensors(export_hf(ckpt, tmp_path / "hf", progress=False).dst)
    want = exported_tensors(smollm2["hf"])
    assert set(got) == set(want)
    assert all(np.array_equal(got[n], want[n]) for n in want), [n for n in want if not np.array_equal(got[n], want[n])]


def test_element_sources_invert_moves_and_refuse_arithmetic():
    # Two [2, 3] tensors stacked and transposed into a [3, 2, 2] parameter.
    moved = Source(("a", "b"), lambda arrays, shape: np.stack(arrays).transpose(2, 0, 1).reshape(shape),
                   ((2, 3), (2, 3)))
    which, where = element_sources(moved, (3, 2, 2), "p")
    a, b = np.arange(6.0).reshape(2, 3), np.arange(6.0, 12.0).reshape(2, 3)
    param = moved.combine([a, b], (3, 2, 2)).reshape(-1)
    rebuilt = [np.zeros(6), np.zeros(6)]
    for i in range(2):
        rebuilt[i][where[which == i]] = param[which == i]
    assert np.array_equal(rebuilt[0].reshape(2, 3), a) and np.array_equal(rebuilt[1].reshape(2, 3), b)
    for computing in (lambda arrays, shape: arrays[0] + 1, lambda arrays, shape: arrays[0] * 2,
                      lambda arrays, shape: -arrays[0], lambda arrays, shape: arrays[0].astype(np.float32) / 3):
        with pytest.raises(CheckpointError, match="p: made from \\['a'\\] by more than selecting"):
            element_sources(Source(("a",), computing, ((2, 3),)), (2, 3), "p")


def test_a_refused_parameter_leaves_nothing_behind(converted, tmp_path, monkeypatch):
    """A parameter whose source computes (here: one patched to double its tensor) is refused by name, before
    anything is written."""
    fam = models.family("llama")
    doubled = dataclasses.replace(fam, hf_source=lambda config, path, shape, metadata: Source(
        (path,), lambda arrays, s: arrays[0] * 2, (shape,)) if path == "model.norm.weight" else None)
    monkeypatch.setattr(models, "family", lambda model_type: doubled)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="model.norm.weight: made from"):
        export_hf(converted["llama"], out, progress=False)
    assert list(tmp_path.iterdir()) == []


def cli(*args):
    proc = subprocess.run([sys.executable, "-m", "convert", *map(str, args)], capture_output=True, text=True, cwd=ROOT)
    return proc.returncode, proc.stdout + proc.stderr


def test_cli_writes_refuses_and_replaces(converted, smollm2, tmp_path):
    out = tmp_path / "hf"
    rc, text = cli("--export-hf", converted["llama"], out, "--quiet")
    assert rc == 0 and "exported 21 tensors" in text, text
    assert (out / MARKER).is_file() and (out / "config.json").is_file()
    rc, text = cli("--export-hf", converted["llama"], out, "--quiet")
    assert rc == 2 and "already exists; pass --force" in text, text
    rc, text = cli("--export-hf", converted["llama"], out, "--quiet", "--force")
    assert rc == 0, text
    other = tmp_path / "notes"
    other.mkdir()
    (other / "mine.txt").write_text("keep")
    rc, text = cli("--export-hf", converted["llama"], other, "--quiet", "--force")
    assert rc == 2 and "replaces only an empty folder or an earlier export" in text and (other / "mine.txt").exists()
    rc, text = cli("--export-hf", smollm2["ckpt_gguf"], tmp_path / "q", "--quiet")
    assert rc == 2 and "stored quantized" in text and not (tmp_path / "q").exists(), text
    rc, text = cli("--export-hf", converted["llama"], tmp_path / "b", "--dtype", "bfloat16")
    assert rc == 2 and "--dtype does not apply" in text, text
