"""`python -m convert --export-hf CKPT OUT`: a day0jax checkpoint (a conversion, or a full fine-tuning's output)
written back as a Hugging Face folder: safetensors under transformers' tensor names and layouts, config.json,
generation config and tokenizer files.

Each runtime parameter is made from HF tensors by its family's `Source.combine` (`day0jax.core.hf_tensors`), which
selects and moves elements: reshapes, transposes, slices, stacks of experts, rows split into gate and up. Its inverse
is found by running it on element numbers: the HF tensors filled with the odd numbers 2k + 1 (k numbering their
elements), combined, say which element each of the parameter's came from. A combine that computes (adds, scales,
rounds) shows: what it gives is not all element numbers, or combining 2x + 1 does not give 2y + 1. Such a parameter
is refused by name, and so is an HF tensor that the parameters do not cover whole.

Not exported: what the conversion dropped (the family's dropped tensors, logged: rotary tables transformers
recomputes, towers of a multimodal checkpoint run as its language model). Quantized checkpoints are refused.
Tensors come out under transformers' current names (a family whose older checkpoints the converter renamed, such as
EXAONE's `transformer.h.*`, is written as transformers loads it).
The export holds the model in memory once, plus the element numbers of its largest parameter.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from convert.convert import check_destination, dropped_tensors
from day0jax import models
from day0jax.core.errors import CheckpointError
from day0jax.core.hf_tensors import Source, default_source, same
from day0jax.weights.checkpoint import group_dir, read_manifest
from day0jax.weights.stream import StoredArray

log = logging.getLogger(__name__)

SHARD_BYTES = 4 << 30  # transformers' own save shards at 5 GB; below it, as released checkpoints mostly are
MARKER = "day0jax_export.json"  # what --force may replace: a folder this export wrote


@dataclass(frozen=True)
class ExportSummary:
    dst: Path
    tensors: int
    bytes_out: int
    files: int
    seconds: float

    def __str__(self) -> str:
        return (f"exported {self.tensors} tensors ({self.bytes_out / 1e6:.1f} MB, {self.files} safetensors "
                f"file{'s' if self.files != 1 else ''}) into {self.dst} in {self.seconds:.2f} s")


def element_sources(src: Source, shape: tuple[int, ...], path: str) -> tuple[np.ndarray, np.ndarray]:
    """For each element of the parameter `path` (flattened, C order), the index in `src.names` of the HF tensor it
    comes from and its flat index there.

    Raises:
        CheckpointError: `src.combine` does more than select and move elements.
    """
    if src.combine is same and len(src.names) == 1:  # most parameters: a reshape, no need to run it
        return np.zeros(math.prod(shape), np.int64), np.arange(math.prod(shape), dtype=np.int64)
    sizes = [math.prod(s) for s in src.shapes]
    offsets = np.cumsum([0, *sizes])
    numbers = [(np.arange(offsets[i], offsets[i + 1], dtype=np.int64) * 2 + 1).reshape(s)
               for i, s in enumerate(src.shapes)]
    refused = CheckpointError(f"{path}: made from {list(src.names)} by more than selecting their elements; "
                              "writing it back in Hugging Face's layout is not implemented")
    try:
        got = np.asarray(src.combine(numbers, shape))
        again = np.asarray(src.combine([2 * n + 1 for n in numbers], shape))
    except Exception as e:
        raise refused from e
    if got.shape != tuple(shape) or not np.issubdtype(got.dtype, np.integer) or \
            not np.array_equal(again, 2 * got + 1) or (got % 2 != 1).any() or \
            got.min() < 1 or got.max() >= 2 * offsets[-1]:
        raise refused
    k = (got.reshape(-1) - 1) // 2
    which = np.searchsorted(offsets, k, side="right") - 1
    return which, k - offsets[which]


def _refuse_destination(ckpt: Path, dst: Path, force: bool) -> None:
    check_destination(ckpt, dst, verb="export")
    if dst.exists():
        if not force:
            raise CheckpointError(f"{dst}: already exists; pass --force to replace it")
        if not dst.is_dir() or (any(dst.iterdir()) and not (dst / MARKER).is_file()):
            raise CheckpointError(f"{dst}: --force replaces only an empty folder or an earlier export (one with "
                                  f"{MARKER})")


def export_hf(ckpt: str | Path, dst: str | Path, *, force: bool = False, progress: bool = True) -> ExportSummary:
    """Writes the checkpoint `ckpt` as a Hugging Face folder at `dst` (atomically: a hidden folder beside it,
    renamed into place when complete).

    Raises:
        CheckpointError: not a float checkpoint, a parameter or HF tensor that cannot be written back, or `dst`
            exists (without `force`, or is not an earlier export).
    """
    start = time.perf_counter()
    ckpt, dst = Path(ckpt), Path(dst)
    manifest = read_manifest(ckpt)
    hf = json.loads((ckpt / "config.json").read_text())
    if "quantization_config" in hf:
        raise CheckpointError(f"{ckpt}: its weights are stored quantized; --export-hf writes float tensors "
                              "(convert the source without --quantize, or with --dequantize)")
    _refuse_destination(ckpt, dst, force)
    fam = models.family(hf.get("model_type"))
    config = fam.config.from_hf(hf)
    mtp = any(p.startswith(models.MTP_PREFIX) for p in manifest["params"])
    infos = models.param_infos(models.abstract_model(config, mtp=mtp))
    missing = [i.path for i in infos if i.path not in manifest["params"]]
    if missing:
        raise CheckpointError(f"{ckpt}: no parameter {missing[0]} (the {config.model_type} model has it)")

    tensors: dict[str, np.ndarray] = {}  # HF name -> flat array being filled
    filled: dict[str, np.ndarray] = {}  # HF name -> which of its elements are written
    shapes: dict[str, tuple[int, ...]] = {}
    bar = tqdm(total=len(infos), unit="param", desc=f"exporting {ckpt.name}", file=sys.stderr, dynamic_ncols=True,
               disable=not progress)
    for info in infos:
        value = StoredArray.open(ckpt / group_dir(manifest["params"][info.path]["group"]) / info.path).read()
        src = fam.hf_source(config, info.path, info.shape, info.metadata) or \
            default_source(info.path, info.shape, info.metadata)
        which, where = element_sources(src, info.shape, info.path)
        # The parameter's elements grouped by source tensor in one pass (E experts: not E passes over it).
        order = np.argsort(which, kind="stable")
        bounds = np.searchsorted(which[order], np.arange(len(src.names) + 1))
        flat = value.reshape(-1)
        for i, (name, shape) in enumerate(zip(src.names, src.shapes)):
            if name not in tensors:
                tensors[name] = np.zeros(math.prod(shape), value.dtype)
                filled[name], shapes[name] = np.zeros(math.prod(shape), bool), tuple(shape)
            elif shapes[name] != tuple(shape):
                raise CheckpointError(f"{info.path}: reads {name} as {tuple(shape)}, another parameter as "
                                      f"{shapes[name]}")
            mine = order[bounds[i]:bounds[i + 1]]
            tensors[name][where[mine]] = flat[mine]
            filled[name][where[mine]] = True
        bar.update(1)
    bar.close()
    partial = next((name for name, done in filled.items() if not done.all()), None)
    if partial is not None:
        raise CheckpointError(f"{ckpt}: HF tensor {partial} is only partly made from the parameters "
                              f"({int(filled[partial].sum())} of {filled[partial].size} elements); cannot write it")

    for pattern, why in dropped_tensors(fam, config).items():
        log.info("not exported, as the conversion dropped them: tensors matching %s (%s)", pattern, why)

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's is the owner's alone
        files = _write_safetensors(tmp, {name: a.reshape(shapes[name]) for name, a in tensors.items()})
        for f in tmp.iterdir():
            f.chmod(0o644)
        for name in ["generation_config.json", *manifest.get("tokenizer_files", [])]:
            if (ckpt / name).is_file():
                shutil.copy(ckpt / name, tmp / name)
        floats = [a.dtype for a in tensors.values() if np.issubdtype(a.dtype, np.floating)]
        config_out = dict(hf, dtype=str(max(floats, key=lambda d: d.itemsize))) if floats else hf
        (tmp / "config.json").write_text(json.dumps(config_out, indent=2) + "\n")
        (tmp / MARKER).write_text(json.dumps({"exported_from": str(ckpt.absolute()),
                                              "model_type": config.model_type}, indent=2) + "\n")
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    bytes_out = sum(a.nbytes for a in tensors.values())
    return ExportSummary(dst, len(tensors), bytes_out, files, time.perf_counter() - start)


def _write_safetensors(folder: Path, tensors: dict[str, np.ndarray]) -> int:
    """`model.safetensors`, or shards of at most SHARD_BYTES with transformers' index; the number of files."""
    from safetensors.numpy import save_file

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        if shards[-1] and size + tensors[name].nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += tensors[name].nbytes
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return 1
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(a.nbytes for a in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return len(shards)
