"""Hugging Face model folders: config.json, safetensors (single file or sharded with an index), tokenizer files.

Pickled weights (`pytorch_model.bin`) are refused: unpickling runs arbitrary code. FP8 weights stay FP8
(`read_quantized`), or are dequantized by `read` (`--dequantize`, or where the runtime keeps the parameter in float),
with any of the scales checkpoints ship (w = code * scale in each):
- block scales `X.weight_scale_inv` [ceil(O / bm), ceil(I / bn)] (`quant_method` 'fp8' with `weight_block_size`,
  DeepSeek-V3 style): one scale per row and block of columns;
- one scale for the tensor, `X.weight_scale_inv` or `X.weight_scale` of one element ('fp8' with
  `weight_block_size: null`, or written by AutoFP8), and one per output channel, `X.weight_scale` [O] or [O, 1]
  ('fbgemm_fp8', 'fp8'): one scale per row, its group spanning the row.
Activation scales of FP8 checkpoints (`input_scale`, `activation_scale`, static or dynamic) are not applied: the
runtime multiplies float activations by the FP8 weights, as weight-only FP8 (vLLM does the same on GPUs without FP8
arithmetic), which is closer to the unquantized model than quantizing the activations too.
Compressed-tensors int4, int8 and FP8 weights are kept likewise (convert/compressed_tensors.py), GPTQ and AWQ
int4 weights (convert/gptq_awq.py), MXFP4 MoE experts (convert/mxfp4.py) and ModelOpt NVFP4 weights
(convert/modelopt.py). Other quantization methods are
refused by name.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

from convert.safetensors_file import SafetensorsFile
from day0jax.core.errors import CheckpointError
from day0jax.core.hf_config import read_config_json

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json",
                   # a vision-language checkpoint's image preprocessing: the converted folder stands alone
                   "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
FP8 = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
FP8_METHODS = ("fp8", "fbgemm_fp8")
# Per-tensor activation scales of FP8 checkpoints, which weight-only FP8 does not apply.
ACTIVATION_SCALES = (".input_scale", ".activation_scale", ".input_scale_ub")

log = logging.getLogger(__name__)


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
        if q and q.get("quant_method") not in FP8_METHODS + ("compressed-tensors", "gptq", "awq", "mxfp4", "modelopt"):
            raise CheckpointError(f"{self.path}: config.json's quantization_config has quant_method "
                                  f"{q.get('quant_method')!r}, which day0jax does not read (it reads 'fp8' and "
                                  "'fbgemm_fp8' weights with block, per-tensor or per-channel scales, "
                                  "'compressed-tensors' int4/int8/FP8 weights, 'gptq' and 'awq' int4 weights, "
                                  "'mxfp4' MoE experts, 'modelopt' NVFP4 weights, and GGUF files)")
        self.compressed = None  # integer-quantized weights, each seen as its float `X.weight`
        if q.get("quant_method") == "compressed-tensors":
            from convert.compressed_tensors import CompressedTensors

            self.compressed = CompressedTensors(self.path, q, list(self._where), self._read_stored,
                                                lambda n: self._where[n].tensors[n].dtype,
                                                lambda n: self._where[n].tensors[n].shape)
        elif q.get("quant_method") == "mxfp4":
            from convert.mxfp4 import Mxfp4

            self.compressed = Mxfp4(self.path, list(self._where), self._read_stored,
                                    lambda n: self._where[n].tensors[n].dtype,
                                    lambda n: self._where[n].tensors[n].shape)
        elif q.get("quant_method") == "modelopt":
            from convert.modelopt import ModelOpt

            self.compressed = ModelOpt(self.path, q, list(self._where), self._read_stored,
                                       lambda n: self._where[n].tensors[n].dtype,
                                       lambda n: self._where[n].tensors[n].shape)
        elif q.get("quant_method") in ("gptq", "awq"):
            from convert.gptq_awq import GptqAwq

            self.compressed = GptqAwq(self.path, q, list(self._where), self._read_stored,
                                      lambda n: self._where[n].tensors[n].shape)
        self.fp8 = q.get("quant_method") in FP8_METHODS
        # 'fp8' checkpoints name their blocks; without the key transformers' default, with null one scale per tensor
        block = q.get("weight_block_size", (128, 128)) if q.get("quant_method") == "fp8" else None
        self.fp8_block = tuple(block) if block else None
        fp8_weights = {n for n in self._where if n.endswith(".weight") and self._where[n].tensors[n].dtype in FP8}
        self._scales = {n for n in self._where if n.endswith(".weight_scale_inv")
                        or (n.endswith(".weight_scale") and n[: -len("_scale")] in fp8_weights)}
        if self.fp8:
            activation = {n for n in self._where if n.endswith(ACTIVATION_SCALES)}
            if activation:
                log.warning("%s: %d activation scales of the FP8 checkpoint are not applied: activations stay in "
                            "float, multiplied by the FP8 weights (weight-only FP8)", self.path, len(activation))
            self._scales |= activation

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
            parts = self.compressed.parts(name) if hasattr(self.compressed, "parts") else \
                [name] + [name[: -len("weight")] + p for p in self.compressed.PARTS]
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
        _, layout, (_, bn) = self._fp8_scale(name, shape)
        group = bn if layout == "block" else shape[-1]
        if dtype != np.dtype(ml_dtypes.float8_e4m3fn) or shape[1] % group or group % 16:
            scales = f"scale blocks of {bn} columns" if layout == "block" else f"one scale per {layout}"
            raise CheckpointError(f"{self._where[name].path}: FP8 tensor {name!r} ({dtype}, shape {shape}, "
                                  f"{scales}) is not kept quantized (float8_e4m3fn [out, in] whose scale groups "
                                  "divide the inputs in multiples of 16 are); convert with --dequantize")
        return QuantSpec("fp8", group, False, "float32")

    def read_quantized(self, name: str):
        """FP8 tensor `name` as a `QuantizedWeight` of numpy arrays: its codes, and one scale per row and group of
        columns (a block's repeated over its rows, a tensor's over every row)."""
        from kernels_pallas.quantized_linear.reference import QuantizedWeight

        if self.compressed is not None and name in self.compressed.weights:
            return self.compressed.read_quantized(name)
        spec, codes = self.quant_spec(name), self._where[name].read(name)
        return QuantizedWeight(np.ascontiguousarray(codes), self._row_scales(name, codes.shape)[0], None, spec.kind,
                               spec.group)

    def release(self) -> None:
        for f in self.files:
            f.release()

    def _fp8_scale(self, name: str, shape: tuple[int, ...]) -> tuple[str, str, tuple[int, int]]:
        """FP8 tensor `name`'s scale tensor, its layout ('block', 'tensor' or 'channel') and the rows and columns
        one scale covers, from the stored scale's shape.

        Raises:
            CheckpointError: not [out, in], no scale, or one whose shape fits none of the layouts.
        """
        if len(shape) != 2:
            raise CheckpointError(f"{self._where[name].path}: FP8 tensor {name!r} has shape {shape}; day0jax reads "
                                  "FP8 weights of shape [out, in]")
        rows, cols = shape
        for scale_name in (name + "_scale_inv", name + "_scale"):
            if scale_name in self._where:
                break
        else:
            raise CheckpointError(f"{self._where[name].path}: FP8 tensor {name!r} has no {name + '_scale_inv'!r} "
                                  f"or {name + '_scale'!r}")
        got = tuple(self._where[scale_name].tensors[scale_name].shape)
        if math.prod(got) == 1:
            return scale_name, "tensor", (rows, cols)
        if got in ((rows,), (rows, 1)):
            return scale_name, "channel", (1, cols)
        bm, bn = self.fp8_block or (128, 128)
        want = (-(-rows // bm), -(-cols // bn))
        if got != want:
            raise CheckpointError(f"{self._where[scale_name].path}: {scale_name!r} has shape {got}, which fits "
                                  f"none of the FP8 scale layouts of a {shape} weight: {want} (blocks of {bm}x{bn}), "
                                  f"({rows}, 1) (per channel) or one element (per tensor)")
        return scale_name, "block", (bm, bn)

    def _row_scales(self, name: str, shape: tuple[int, int]) -> tuple[np.ndarray, int]:
        """float32 [O, groups], each row's scale per group of columns, and the columns per group (the last group
        of blocks that do not divide the columns is cut short)."""
        scale_name, layout, (bm, bn) = self._fp8_scale(name, shape)
        scale = self._where[scale_name].read(scale_name).astype(np.float32)
        if layout == "block":
            return np.repeat(scale, bm, axis=0)[:shape[0]], bn
        return np.broadcast_to(scale.reshape(-1, 1), (shape[0], 1)).copy(), bn

    def _dequantize_fp8(self, name: str, arr: np.ndarray) -> np.ndarray:
        scale, group = self._row_scales(name, arr.shape)
        full = np.repeat(scale, group, axis=1)[:, :arr.shape[1]]
        return arr.astype(np.float32) * full  # float32; the converter casts to the checkpoint dtype

    def default_dtype(self) -> str:
        if self.fp8:
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
