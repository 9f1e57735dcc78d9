"""GGUF files (version 2 and 3): header validation, config from metadata, dequantized tensors under HF names.

Our own parser reads the header (the `gguf` package's reader takes seconds over a large vocabulary's metadata) and
checks it, so a bad magic, a truncated or malformed header, an unknown tensor type or data past the end of the file
is reported precisely, naming the key or tensor; the `gguf` package dequantizes. llama.cpp's q/k
row permutation (for its interleaved RoPE) is undone to match Hugging Face's half-split layout.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

from convert.gguf_blocks import FORMATS, reblock
from day0jax.core.errors import CheckpointError, UnsupportedArchitecture

# Tensor types we read, by GGML type id: floats, and quantized types kept in a format of convert/gguf_blocks.py
# (dequantized by the `gguf` package with --dequantize).
SUPPORTED_TYPES = {0: "F32", 1: "F16", 30: "BF16", 8: "Q8_0", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1",
                   10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}

FLOAT_TYPES = {0, 1, 30}

# --- header -------------------------------------------------------------------------------------------------
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRUCTS = {t: struct.Struct(f) for t, f in _SCALAR.items()}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
MAX_HEADER_BYTES = 256 << 20  # a vocabulary of a million tokens takes tens of MB
MAX_ALIGNMENT = 1 << 16


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its GGUF name, dims (innermost first, as GGUF stores them), GGML type and where
    its bytes are (from the start of the file)."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    start: int
    n_bytes: int

    @property
    def type_name(self) -> str:
        return SUPPORTED_TYPES[self.type_id]

    @property
    def n_elements(self) -> int:
        return math.prod(self.dims)


class _Cursor:
    def __init__(self, path: Path, data: bytes):
        self.path, self.data, self.pos = path, data, 0

    def _need(self, size: int, what: str) -> None:
        if self.pos + size > len(self.data):
            raise CheckpointError(f"{self.path}: GGUF header is truncated (needed {size} bytes for {what} at offset "
                                  f"{self.pos}, the file has {len(self.data)})")

    def take(self, fmt: struct.Struct, what: str):
        self._need(fmt.size, what)
        value = fmt.unpack_from(self.data, self.pos)[0]
        self.pos += fmt.size
        return value

    def string(self, what: str) -> str:
        n = self.take(_U64, what)
        self._need(n, what)
        raw = self.data[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{self.path}: GGUF {what} is not UTF-8 ({e})") from None

    def value(self, type_id: int, what: str):
        if type_id in _STRUCTS:
            return self.take(_STRUCTS[type_id], what)
        if type_id == 8:
            return self.string(what)
        if type_id == 9:
            item_type, count = self.take(_U32, what), self.take(_U64, what)
            if item_type in _SCALAR:
                size = _STRUCTS[item_type].size * count
                self._need(size, what)
                values = np.frombuffer(self.data, np.dtype(_SCALAR[item_type]), count, self.pos).tolist()
                self.pos += size
                return values
            if item_type == 8:
                return [self.string(what) for _ in range(count)]
            raise CheckpointError(f"{self.path}: GGUF {what} is an array of type {item_type}, which is not "
                                  "supported (arrays of numbers and of strings are)")
        raise CheckpointError(f"{self.path}: GGUF {what} has value type {type_id}, which is unknown")


def read_header(path: Path) -> tuple[dict, list[GGUFTensor]]:
    """Parses and checks a GGUF file's header: its metadata (arrays as lists) and its tensors.

    Raises:
        CheckpointError: bad magic or version, truncated header, malformed metadata, unknown tensor type, or data
            past the end of file; each names the file and the key or tensor.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(min(size, MAX_HEADER_BYTES))
    cur = _Cursor(path, raw)
    if raw[:4] != b"GGUF":
        raise CheckpointError(f"{path}: bad magic {raw[:4]!r}, expected b'GGUF' (not a GGUF file)")
    cur.pos = 4
    version = cur.take(_U32, "version")
    if version not in (2, 3):
        raise CheckpointError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = cur.take(_U64, "tensor count"), cur.take(_U64, "metadata count")
    meta = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key {i}")
        meta[key] = cur.value(cur.take(_U32, f"metadata {key!r}"), f"metadata {key!r}")
    alignment = meta.get("general.alignment", 32)
    if not isinstance(alignment, int) or not 0 < alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
        raise CheckpointError(f"{path}: GGUF metadata 'general.alignment' is {alignment!r}; expected a power of two "
                              f"up to {MAX_ALIGNMENT}")
    entries = []
    for i in range(n_tensors):
        name = cur.string(f"tensor {i}'s name")
        n_dims = cur.take(_U32, f"tensor {name!r}")
        if n_dims > 8:
            raise CheckpointError(f"{path}: GGUF tensor {name!r} has {n_dims} dimensions (at most 8 are valid)")
        dims = tuple(cur.take(_U64, f"tensor {name!r}") for _ in range(n_dims))
        type_id, offset = cur.take(_U32, f"tensor {name!r}"), cur.take(_U64, f"tensor {name!r}")
        if type_id not in SUPPORTED_TYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has GGML type {type_id}, which is unknown or not "
                                  f"supported (supported: {', '.join(SUPPORTED_TYPES.values())})")
        entries.append((name, dims, type_id, offset))  # offset: from the start of the data section
    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, dims, type_id, offset in entries:
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
        if not dims or dims[0] % block:
            raise CheckpointError(f"{path}: tensor {name!r} has dims {dims}; its rows must be whole blocks of "
                                  f"{block} for type {SUPPORTED_TYPES[type_id]}")
        n_bytes = math.prod(dims) // block * type_size  # Python ints: huge dims cannot overflow
        start = data_start + offset
        if start + n_bytes > size:
            raise CheckpointError(f"{path}: tensor {name!r} data ends at byte {start + n_bytes}, "
                                  f"past the end of the {size}-byte file (truncated)")
        tensors.append(GGUFTensor(name, dims, type_id, start, n_bytes))
    return meta, tensors


# --- architectures -------------------------------------------------------------------------------------------

def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation (interleaved rotary pairs -> HF's half split)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LLAMA_NAMES = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"blk\.(\d+)\.attn_output\.(weight|bias)", r"model.layers.\1.self_attn.o_proj.\2"),
    (r"blk\.(\d+)\.ffn_gate\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", r"model.layers.\1.mlp.down_proj.weight"),
    # llama.cpp stores Llama 3.1 frequency factors; HF recomputes them from rope_scaling.
    (r"rope_freqs\.weight", None),
]


def _llama_config(meta: dict, arch: str, tensor_names: set[str]) -> dict:
    key = lambda k, default=None: meta.get(f"{arch}.{k}", default)  # noqa: E731
    heads = key("attention.head_count")
    cfg = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": key("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": key("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if key("rope.dimension_count") is not None:
        cfg["head_dim"] = key("rope.dimension_count")
    if "blk.0.attn_q.bias" in tensor_names:
        cfg["attention_bias"] = True
    scaling = key("rope.scaling.type")
    if scaling and scaling != "none":
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": key("rope.scaling.factor")}
        if key("rope.scaling.original_context_length"):
            cfg["rope_scaling"]["original_max_position_embeddings"] = key("rope.scaling.original_context_length")
    return cfg


def _llama_fix(cfg: dict) -> Callable[[str, np.ndarray], np.ndarray]:
    def fix(hf_name: str, w: np.ndarray) -> np.ndarray:
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            return _unpermute_qk(w, cfg["num_attention_heads"])
        if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            return _unpermute_qk(w, cfg["num_key_value_heads"])
        return w
    return fix


@dataclass(frozen=True)
class Arch:
    names: list[tuple[str, str | None]]  # GGUF name regex -> HF name template (None: dropped)
    config: Callable[[dict, str, set[str]], dict]
    fix: Callable[[dict], Callable[[str, np.ndarray], np.ndarray]]


ARCHS = {"llama": Arch(_LLAMA_NAMES, _llama_config, _llama_fix)}


class GGUFSource:
    kind = "gguf"

    def __init__(self, path: Path):
        self.path = Path(path)
        self.meta, self.tensors = read_header(self.path)
        arch = self.meta.get("general.architecture")
        if arch not in ARCHS:
            raise UnsupportedArchitecture(f"{self.path}: GGUF architecture {arch!r} is not supported "
                                          f"(supported: {', '.join(sorted(ARCHS))})")
        self.arch = ARCHS[arch]
        gguf_names = {t.name for t in self.tensors}
        self.config = self.arch.config(self.meta, arch, gguf_names)
        self._fix = self.arch.fix(self.config)
        self._tensors = {}  # HF name -> GGUFTensor
        for t in self.tensors:
            hf = self._hf_name(t.name)
            if hf is not None:
                self._tensors[hf] = t
        self._map: np.memmap | None = None  # the file, mapped on the first read

    def _hf_name(self, gguf_name: str) -> str | None:
        for pattern, template in self.arch.names:
            m = re.fullmatch(pattern, gguf_name)
            if m:
                return None if template is None else m.expand(template)
        raise CheckpointError(f"{self.path}: GGUF tensor {gguf_name!r} has no known Hugging Face counterpart")

    # --- Source interface ---------------------------------------------------------------------------------
    def hf_config(self) -> dict:
        return dict(self.config)

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return tuple(reversed(self._tensors[name].dims))

    def tensor_nbytes(self, name: str) -> int:
        return self._tensors[name].n_bytes

    def read(self, name: str) -> np.ndarray:
        t = self._tensors[name]
        if self._map is None:
            self._map = np.memmap(self.path, np.uint8, mode="r")
        rows = self._map[t.start:t.start + t.n_bytes].reshape(math.prod(t.dims[1:]), -1)  # one GGUF row each
        w = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(t.type_id)).reshape(self.tensor_shape(name))
        return self._fix(name, w)

    def quant_spec(self, name: str):
        """How tensor `name` stays quantized (a `QuantSpec`), or None for a float tensor.

        Rows are whole blocks (the header's parser checks it), and every quantized type it accepts has a kept
        format.
        """
        from day0jax.layers.quantized import QuantSpec

        t = self._tensors[name]
        if t.type_id in FLOAT_TYPES:
            return None
        f = FORMATS[t.type_id]
        return QuantSpec(f.kind, f.group, f.offset, f.scale_dtype)

    def read_quantized(self, name: str):
        """Tensor `name`'s blocks as a `QuantizedWeight` of numpy arrays [O, ...] in its kept format
        (`convert.gguf_blocks`), rows in HF order."""
        from kernels_pallas.quantized_linear.reference import QuantizedWeight

        spec, t = self.quant_spec(name), self._tensors[name]
        if self._map is None:
            self._map = np.memmap(self.path, np.uint8, mode="r")
        O, _ = self.tensor_shape(name)
        codes, scale, offset = reblock(t.type_id, np.asarray(self._map[t.start:t.start + t.n_bytes]).reshape(O, -1))
        fix = lambda a: None if a is None else np.ascontiguousarray(self._fix(name, a))  # noqa: E731
        return QuantizedWeight(fix(codes), fix(scale), fix(offset), spec.kind, spec.group)

    def release(self) -> None:
        mapped = getattr(self._map, "_mmap", None)
        if mapped is not None:
            mapped.madvise(mmap.MADV_DONTNEED)

    def default_dtype(self) -> str:
        # Dequantized values (d * q + m) are not bf16-representable; float32 keeps them exact.
        return "float32"

    def source_files(self) -> list[Path]:
        return [self.path]

    def write_tokenizer(self, dst: Path) -> list[str]:
        from convert.gguf_tokenizer import write_tokenizer

        return write_tokenizer(self.meta, self.config, dst)
