"""The conversion: map every runtime parameter to its source tensors, check them all before writing, then stream."""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
from tqdm import tqdm

from convert.quantize import QuantPlan, plan_quantization, quantized_arrays
from convert.sources import RenamedSource, open_source
from convert.writer import FILE_HASH, CheckpointWriter, file_digest
from day0jax import models
from day0jax.core.errors import CheckpointError
from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.quantized import QUANT_METHOD, specs_to_json
from day0jax.models.contract import Family
from sharding.plan import stored_dtype

log = logging.getLogger(__name__)

CONVERTER_VERSION = "3"
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}


@dataclass(frozen=True)
class Summary:
    dst: Path
    parameters: int
    tensors: int
    bytes_in: int
    bytes_out: int
    seconds: float
    # Where the time went (seconds; the threads overlap each other and the wall time): the caller reading and
    # building tensors, the caller waiting for the writers, the writers' copy / fsync / digest, the source hashing.
    phases: dict[str, float] = field(default_factory=dict)

    def __str__(self) -> str:
        mb_s = self.bytes_in / 1e6 / max(self.seconds, 1e-9)
        phases = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in self.phases.items())
        return (f"converted {self.tensors} tensors ({self.parameters / 1e6:.1f}M parameters) into {self.dst}: "
                f"{self.bytes_in / 1e6:.1f} MB in, {self.bytes_out / 1e6:.1f} MB out, "
                f"{self.seconds:.2f} s, {mb_s:.0f} MB/s" + (f" (threads: {phases})" if phases else ""))


def plan_sources(fam: Family, config, infos, source) -> dict[str, Source]:
    """Runtime parameter path -> its Source, after checking names and shapes: every parameter must find its tensors
    and every source tensor must be used or explicitly dropped by the family.

    Args:
        fam: the model's family (its `hf_source` and dropped tensors).
        config: its config.
        infos: the runtime parameters (`models.param_infos`).
        source: the opened checkpoint (`convert.sources.open_source`).
    Raises:
        CheckpointError: a missing tensor, a shape mismatch, or a source tensor nothing uses.
    """
    available = {n: source.tensor_shape(n) for n in source.tensor_names()}
    plan, used = {}, set()
    for info in infos:
        src = (fam.hf_source(config, info.path, info.shape, info.metadata)
               or default_source(info.path, info.shape, info.metadata)).matching(available)
        for name, want in zip(src.names, src.shapes):
            if name not in available:
                hint = ("; the source's multi-token-prediction layers are incomplete (--no-mtp leaves them out)"
                        if info.path.startswith(models.MTP_PREFIX) else "")
                raise CheckpointError(f"{source.path}: tensor {name!r} (for parameter {info.path}, shape {want}) "
                                      f"is missing{hint}")
            if tuple(available[name]) != tuple(want):
                raise CheckpointError(f"{source.path}: tensor {name!r} has shape {tuple(available[name])}, "
                                      f"expected {tuple(want)} (for parameter {info.path})")
            used.add(name)
        plan[info.path] = src
    dropped = dropped_tensors(fam, config)
    counts: dict[str, int] = {}
    for name in available:
        if name in used:
            continue
        pattern = next((p for p in dropped if re.fullmatch(p, name)), None)
        if pattern is None:
            raise CheckpointError(f"{source.path}: tensor {name!r} (shape {tuple(available[name])}) is not used by "
                                  f"the {config.model_type} runtime; refusing to drop weights silently")
        counts[pattern] = counts.get(pattern, 0) + 1
    for pattern, n in counts.items():
        log.info("dropped %d tensor(s) matching %s: %s", n, pattern, dropped[pattern])
    return plan


def dropped_tensors(fam: Family, config) -> dict[str, str]:
    """regex -> why, for the HF tensors a conversion of this model leaves out on purpose."""
    dropped = {**fam.dropped, **fam.dropped_for(config)}
    if config.tie_word_embeddings:
        dropped[r"lm_head\.weight"] = "tied to model.embed_tokens.weight"
    return dropped


def check_destination(src: Path, dst: Path, verb: str = "convert") -> None:
    """Refuses a destination that is the source, lies inside it or contains it (a --force would delete the source,
    or the output would land among the files it is read from)."""
    s, d = src.resolve(), dst.resolve()
    if d == s or d.is_relative_to(s) or s.is_relative_to(d):
        where = "is" if d == s else "is inside" if d.is_relative_to(s) else "contains"
        raise CheckpointError(f"the destination {dst} {where} the source {src}; {verb} into another folder")


@dataclass(frozen=True)
class Options:
    """What the user asked for beyond SRC and DST: `dtype` of float parameters (default: the source's own),
    `quantize` ('int8', 'int4', 'fp8', 'mxfp4', 'nvfp4') with `group_size`, `dequantize` (a quantized source stored as float), and
    `no_mtp` (leave out the multi-token-prediction layers a source ships for speculative decoding)."""

    dtype: str | None = None
    quantize: str | None = None
    group_size: int | None = None
    dequantize: bool = False
    no_mtp: bool = False  # drop the multi-token-prediction layers (kept by default, where the source has them)
    workers: int | None = None  # threads writing the checkpoint (default: `writer.default_workers()`)


@dataclass(frozen=True)
class _Plan:
    source: object
    hf: dict
    config: object
    infos: list  # the float model's parameters: what the sources map to
    stored: dict  # the stored model's parameters by path (quantized weights as codes, scales, offsets)
    sources: dict
    dtype: str
    quant: QuantPlan
    quantized: dict  # weight parameter path (`X.kernel`) -> the module path of each weight stored quantized
    mtp: bool = False  # the multi-token-prediction layers are kept (`mtp.*` parameters, written last)


def _plan(src: Path, options: Options) -> _Plan:
    """Everything a conversion decides before writing, all checked: the opened source, configs, the runtime
    parameters, their sources, the float dtype and what is stored quantized."""
    source = open_source(src)
    hf = source.hf_config()
    fam = models.family(hf.get("model_type"))
    config = fam.config.from_hf(hf)
    if fam.renames:
        source = RenamedSource(source, fam.renames)
    dtype = options.dtype or source.default_dtype()
    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    pattern = models.mtp_tensors(config)
    mtp = bool(pattern) and not options.no_mtp and any(re.fullmatch(pattern, n) for n in source.tensor_names())
    if mtp:
        log.info("keeping the multi-token-prediction layers (speculative decoding's 'mtp'; --no-mtp drops them)")
    abstract = models.abstract_model(config, mtp=mtp)
    # The multi-token-prediction layers last, in groups of their own: an optional part of the checkpoint.
    infos = sorted(models.param_infos(abstract), key=lambda i: i.path.startswith(models.MTP_PREFIX))
    sources = plan_sources(fam, config, infos, source)
    quant = plan_quantization(abstract, sources, source, quantize_kind=options.quantize, group=options.group_size,
                              dequantize=options.dequantize)
    stored = {i.path: i for i in models.param_infos(models.abstract_model(config, quantization=quant.specs, mtp=mtp))}
    return _Plan(source, hf, config, infos, stored, sources, dtype, quant, quant.weight_paths(abstract), mtp)


def _output_config(plan: _Plan) -> dict:
    out = dict(plan.hf)
    out.pop("quantization_config", None)  # the source's: what is stored now is described below
    if plan.quant.specs:
        out["quantization_config"] = {"quant_method": QUANT_METHOD, "modules": specs_to_json(plan.quant.specs)}
    out["dtype"] = plan.dtype
    return out


def planned_output(src: Path, dtype: str | None = None, options: Options | None = None) -> tuple[dict, dict]:
    """What converting `src` will write, from its headers alone (no tensor is read): the config.json, and the
    manifest's fields that describe the parameters (`format_version`, `converter_version`, `model_type`, `params`
    with each one's shape and dtype). Enough to build the model and name its compile cache while it converts.

    Raises:
        As `convert_checkpoint`, for a source it would refuse.
    """
    from day0jax.weights import checkpoint

    options = options or Options(dtype=dtype)
    plan = _plan(Path(src), options)
    manifest = {"format_version": checkpoint.FORMAT_VERSION, "converter_version": CONVERTER_VERSION,
                "model_type": plan.config.model_type,
                "params": {i.path: {"shape": list(i.shape), "dtype": str(stored_dtype(i, DTYPES[plan.dtype]))}
                           for i in plan.stored.values()}}
    return _output_config(plan), manifest


def convert_checkpoint(src: Path, dst: Path, *, dtype: str | None = None, force: bool = False,
                       progress: bool = True, options: Options | None = None) -> Summary:
    """Converts a HF folder or GGUF file at `src` into a day0jax checkpoint at `dst`; returns a printable `Summary`.

    Args:
        src: Hugging Face model folder or `.gguf` file.
        dst: checkpoint folder to create (atomically).
        dtype: 'float32', 'bfloat16' or 'float16'; default: the source's own (float32 for GGUF).
        force: replace an existing dst.
        progress: show a progress bar over bytes on stderr.
        options: quantization choices (`Options`; its dtype wins over `dtype`).
    Raises:
        CheckpointError, UnsupportedArchitecture, ConfigError: before anything is written where possible.
    """
    start = time.perf_counter()
    options = options or Options(dtype=dtype)
    check_destination(Path(src), Path(dst))
    plan = _plan(Path(src), options)
    source, out_dtype = plan.source, DTYPES[plan.dtype]
    total_in = sum(source.tensor_nbytes(n) for src_ in plan.sources.values() for n in src_.names)
    if plan.quant.specs:
        log.info("%s", plan.quant.summary())
    shapes = {path: info.shape for path, info in plan.stored.items()}

    # Once a group's worth is on disk the source pages are released, so resident memory stays near the writer's
    # pending bytes whatever the model's size; the source's digests are computed on the side meanwhile (hashing
    # releases the GIL), by half the cores (the other half writes): a trillion-parameter release is a thousand GB
    # of shards.
    source_files = source.source_files()
    hash_threads = max(1, min(len(source_files), (os.cpu_count() or 2) // 2))
    with concurrent.futures.ThreadPoolExecutor(hash_threads) as hasher, \
            CheckpointWriter(Path(dst), force=force, on_saved=source.release,
                             workers=options.workers) as writer:
        hashes = {p.name: hasher.submit(_timed, file_digest, p) for p in source_files}
        bar = tqdm(total=total_in, unit="B", unit_scale=True, unit_divisor=1024, desc=f"converting {Path(src).name}",
                   file=sys.stderr, dynamic_ncols=True, disable=not progress)
        n_params, mtp_params = 0, 0
        building = 0.0
        for info in plan.infos:
            t0 = time.perf_counter()
            s = plan.sources[info.path]
            if info.path.startswith(models.MTP_PREFIX) and not mtp_params:
                writer.flush()  # the main model's last group ends here
            if info.path.startswith(models.MTP_PREFIX):
                mtp_params += math.prod(info.shape)
            if info.path in plan.quantized:
                module = plan.quantized[info.path]
                arrays = quantized_arrays(info.path, info.shape, plan.quant.specs[module], s, source,
                                          module in plan.quant.from_source, shapes, module in plan.quant.experts)
            else:
                array = np.asarray(s.combine([source.read(n) for n in s.names], info.shape))
                arrays = {info.path: array.astype(stored_dtype(info, out_dtype), copy=False)}
            for path, array in arrays.items():
                if array.shape != plan.stored[path].shape:  # a family's combine is wrong: a bug, never write it
                    raise CheckpointError(f"parameter {path}: built shape {array.shape}, expected "
                                          f"{plan.stored[path].shape}")
            building += time.perf_counter() - t0
            for path, array in arrays.items():
                writer.add(path, array)
            n_params += math.prod(info.shape)
            bar.update(sum(source.tensor_nbytes(n) for n in s.names))
        writer.flush()
        bar.close()
        tokenizer_files = source.write_tokenizer(writer.tmp)
        writer.write_json("config.json", _output_config(plan))
        manifest = {
            "converter_version": CONVERTER_VERSION,
            "source": {"kind": source.kind, "path": str(Path(src).absolute()),
                       FILE_HASH: {k: f.result()[0] for k, f in hashes.items()}},
            "dtype": plan.dtype,
            "model_type": plan.config.model_type,
            "tokenizer_files": tokenizer_files,
        }
        if plan.quant.specs:
            manifest["quantization"] = plan.quant.summary()
        if plan.mtp:
            manifest["parts"] = {"mtp": {"prefix": models.MTP_PREFIX, "parameters": mtp_params}}
        writer.commit(manifest)
    t = writer.timings
    phases = {"read and build": building, "wait for writers": t.waited, "write": t.write, "fsync": t.sync,
              "digest": t.digest, "source digest": sum(f.result()[1] for f in hashes.values())}
    return Summary(Path(dst), n_params, len(plan.infos), total_in, writer.bytes_written, time.perf_counter() - start,
                   phases)


def _timed(fn, *args):
    """(fn(*args), the seconds it took)."""
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0
