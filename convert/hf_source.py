"""Hugging Face model folders: config.json, safetensors (single file or sharded with an index), tokenizer files.

Pickled weights (`pytorch_model.bin`) are refused: unpickling runs arbitrary code. FP8 weights with block scales
(`weight_scale_inv`, DeepSeek-V3 style) stay FP8 (`read_quantized`, one scale per row and block of columns), or are
dequantized by `read` (`--dequantize`, or where the runtime keeps the parameter in float); compressed-tensors int4
and int8 weights likewise (convert/compressed_tensors.py), and GPTQ and AWQ int4 weights (convert/gptq_awq.py).
Other quantization methods are refused by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

from convert.safetensors_file import SafetensorsFile
from day0jax.weights.hf_config import read_config_json
from day0jax.errors import CheckpointError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json",
                   # a vision-language checkpoint's image preprocessing: the converted folder stands alone
                   "preprocessor_config.json", "processor_config.json")
FP8 = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))


class HFSource:
    kind = "safetensors"

    def __init__(self, path: Path):
        self.path = Path(path)
        self.config = read_config_json(self.inside(self.path / "config.json", "config.json"))
        self.files = self._open_shards()
        self._where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for name in f.tensors:
                if name in self._where:
                    raise CheckpointError(f"{f.path}: tensor {name!r} also appears in {self._where[name].path}")
                self._where[name] = f
        q = self.config.get("quantization_config") or {}
        if q and q.get("quant_method") not in ("fp8", "compressed-tensors", "gptq", "awq"):
            raise CheckpointError(f"{self.path}: config.json's quantization_config has quant_method "
                                  f"{q.get('quant_method')!r}, which day0jax does not read (it reads 'fp8' block "
                                  "scales, 'compressed-tensors' int4/int8 weights, 'gptq' and 'awq' int4 weights, "
                                  "and GGUF files)")
        self.compressed = None  # integer-quantized weights, each seen as its float `X.weight`
        if q.get("quant_method") == "compressed-tensors":
            from convert.compressed_tensors import CompressedTensors

            self.compressed = CompressedTensors(self.path, q, list(self._where), self._read_stored,
                                                lambda n: self._where[n].tensors[n].dtype)
        elif q.get("quant_method") in ("gptq", "awq"):
            from convert.gptq_awq import GptqAwq

            self.compressed = GptqAwq(self.path, q, list(self._where), self._read_stored,
                                      lambda n: self._where[n].tensors[n].shape)
        self.fp8_block = tuple(q.get("weight_block_size") or (128, 128)) if q.get("quant_method") == "fp8" else None
        self._scales = {n for n in self._where if n.endswith(".weight_scale_inv")}

    def _open_shards(self) -> list[SafetensorsFile]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(self.inside(index, "model.safetensors.index.json").read_text())["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: malformed index ({e!r})") from None
            if not isinstance(weight_map, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
                raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names (strings)")
            shard_names = sorted(set(weight_map.values()))
            for name in shard_names:
                if Path(name).is_absolute() or not (self.path / name).is_file():
                    raise CheckpointError(f"{index}: names shard {name!r}, which is missing from {self.path}")
            files = [SafetensorsFile(self.inside(self.path / n, f"shard {n!r} named by the index"))
                     for n in shard_names]
            listed = {t for f in files for t in f.tensors}
            missing = sorted(set(weight_map) - listed)
            if missing:
                raise CheckpointError(f"{index}: tensor {missing[0]!r} is in the index but in no shard")
            return files
        shards = sorted(self.path.glob("*.safetensors"))
        if shards:
            return [SafetensorsFile(self.inside(p, p.name)) for p in shards]
        if any(self.path.glob("pytorch_model*.bin")) or any(self.path.glob("*.pt")) or any(self.path.glob("*.pth")):
            raise CheckpointError(f"{self.path}: holds only PyTorch pickle weights (pytorch_model*.bin); these are "
                                  "never unpickled because that can run arbitrary code. Convert them to safetensors "
                                  "first (e.g. with transformers' save_pretrained(safe_serialization=True)).")
        raise CheckpointError(f"{self.path}: no *.safetensors weights found")

    def inside(self, path: Path, what: str) -> Path:
        """`path`, once sure that it resolves (symlinks followed) inside the source folder, or for a snapshot of
        the Hugging Face hub cache (`<repo>/snapshots/<revision>/`) inside that repository's `blobs/`, where its
        symlinks point: a checkpoint names its own files, never others on the machine.

        Raises:
            CheckpointError: it resolves outside.
        """
        resolved, root = path.resolve(), self.path.resolve()
        allowed = [root]
        if self.path.absolute().parent.name == "snapshots":
            allowed.append((self.path.absolute().parent.parent / "blobs").resolve())
        if not any(resolved.is_relative_to(r) for r in allowed):
            raise CheckpointError(f"{self.path}: {what} resolves to {resolved}, outside the source folder; refusing "
                                  "to read it")
        return path

    # --- Source interface ---------------------------------------------------------------------------------
    def hf_config(self) -> dict:
        return dict(self.config)

    def tensor_names(self) -> list[str]:
        names = [n for n in self._where if n not in self._scales]
        if self.compressed is not None:  # each quantized weight as its float `X.weight`, its parts hidden
            names = [n for n in names if not self.compressed.hides(n)]
            names += [n for n in self.compressed.weights if n not in self._where]
        return names

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        if self.compressed is not None and name in self.compressed.weights:
            return self.compressed.weights[name]
        return self._where[name].tensors[name].shape

    def tensor_nbytes(self, name: str) -> int:
        if self.compressed is not None and name in self.compressed.weights:
            parts = [name] + [name[: -len("weight")] + p for p in self.compressed.PARTS]
            return sum(self._where[p].tensors[p].nbytes for p in parts if p in self._where)
        n = self._where[name].tensors[name].nbytes
        scale = name + "_scale_inv"
        return n + (self._where[scale].tensors[scale].nbytes if scale in self._where else 0)

    def _read_stored(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing (compressed-tensors weights need it)")
        return self._where[name].read(name)

    def read(self, name: str) -> np.ndarray:
        if self.compressed is not None and name in self.compressed.weights:
            return self.compressed.dequantize(name)
        arr = self._where[name].read(name)
        return self._dequantize_fp8(name, arr) if arr.dtype in FP8 else arr

    def quant_spec(self, name: str):
        """How tensor `name` stays quantized (a `QuantSpec`: FP8 with one scale per row and column block), or None
        for a float tensor.

        Raises:
            CheckpointError: an FP8 format or block layout the runtime does not keep (convert with --dequantize).
        """
        from day0jax.layers.quantized import QuantSpec

        if self.compressed is not None and name in self.compressed.weights:
            return self.compressed.spec(name)
        dtype = self._where[name].tensors[name].dtype
        if dtype not in FP8:
            return None
        shape = self.tensor_shape(name)
        _, bn = self.fp8_block or (128, 128)
        if dtype != np.dtype(ml_dtypes.float8_e4m3fn) or len(shape) != 2 or shape[1] % bn or bn % 16:
            raise CheckpointError(f"{self._where[name].path}: FP8 tensor {name!r} ({dtype}, shape {shape}, column "
                                  f"blocks of {bn}) is not kept quantized (float8_e4m3fn [out, in] with blocks "
                                  "dividing the inputs in multiples of 16 are); convert with --dequantize")
        return QuantSpec("fp8", bn, False, "float32")

    def read_quantized(self, name: str):
        """FP8 tensor `name` as a `QuantizedWeight` of numpy arrays: its codes, and its block scales repeated over
        each block's rows."""
        from kernels_pallas.quantized_linear.reference import QuantizedWeight

        if self.compressed is not None and name in self.compressed.weights:
            return self.compressed.read_quantized(name)
        spec, codes = self.quant_spec(name), self._where[name].read(name)
        scale = self._block_scales(name, codes.shape)
        bm, _ = self.fp8_block or (128, 128)
        return QuantizedWeight(np.ascontiguousarray(codes), np.repeat(scale, bm, axis=0)[:codes.shape[0]], None,
                               spec.kind, spec.group)

    def release(self) -> None:
        for f in self.files:
            f.release()

    def _block_scales(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        scale_name = name + "_scale_inv"
        if scale_name not in self._where:
            raise CheckpointError(f"{self._where[name].path}: FP8 tensor {name!r} has no {scale_name!r}")
        scale = self._where[scale_name].read(scale_name).astype(np.float32)
        bm, bn = self.fp8_block or (128, 128)
        rows, cols = shape
        want = (-(-rows // bm), -(-cols // bn))
        if scale.shape != want:
            raise CheckpointError(f"{self._where[scale_name].path}: {scale_name!r} has shape {scale.shape}, expected "
                                  f"{want} for blocks of {bm}x{bn} over {shape}")
        return scale

    def _dequantize_fp8(self, name: str, arr: np.ndarray) -> np.ndarray:
        scale = self._block_scales(name, arr.shape)
        bm, bn = self.fp8_block or (128, 128)
        rows, cols = arr.shape
        # Each (bm, bn) block of the weight shares one scale; expand scales to the weight's shape and multiply.
        full = np.repeat(np.repeat(scale, bm, axis=0), bn, axis=1)[:rows, :cols]
        return arr.astype(np.float32) * full  # float32; the converter casts to the checkpoint dtype

    def default_dtype(self) -> str:
        if self.fp8_block is not None:
            return "bfloat16"
        declared = self.config.get("dtype") or self.config.get("torch_dtype")
        return declared if declared in ("float32", "bfloat16", "float16") else "float32"

    def source_files(self) -> list[Path]:
        extra = [self.path / n for n in ("config.json", "model.safetensors.index.json") if (self.path / n).is_file()]
        return extra + [f.path for f in self.files]

    def write_tokenizer(self, dst: Path) -> list[str]:
        written = []
        for name in TOKENIZER_FILES:
            if (self.path / name).is_file():
                shutil.copyfile(self.inside(self.path / name, name), dst / name)
                written.append(name)
        return written
