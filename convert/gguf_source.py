"""GGUF files (version 2 and 3): header validation, config from metadata, dequantized tensors under HF names.

Our own small parser checks the header first, so a bad magic, a truncated header, an unknown tensor type or data
past the end of the file is reported precisely; the `gguf` package then reads and dequantizes. llama.cpp's q/k
row permutation (for its interleaved RoPE) is undone to match Hugging Face's half-split layout.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

from day0jax.errors import CheckpointError, UnsupportedArchitecture

# Tensor types we dequantize (through the `gguf` package), by GGML type id.
SUPPORTED_TYPES = {0: "F32", 1: "F16", 30: "BF16", 8: "Q8_0", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1",
                   10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}

# --- header validation ---------------------------------------------------------------------------------------
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class _Cursor:
    def __init__(self, path: Path, data: bytes):
        self.path, self.data, self.pos = path, data, 0

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise CheckpointError(f"{self.path}: GGUF header is truncated (needed {size} bytes at offset {self.pos}, "
                                  f"file has {len(self.data)})")
        value = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.data):
            raise CheckpointError(f"{self.path}: GGUF header is truncated (a {n}-byte string at offset {self.pos})")
        s = self.data[self.pos:self.pos + n]
        self.pos += n
        return s.decode("utf-8", errors="replace")

    def value(self, type_id: int):
        if type_id in _SCALAR:
            return self.take(_SCALAR[type_id])
        if type_id == 8:
            return self.string()
        if type_id == 9:
            item_type, count = self.take("<I"), self.take("<Q")
            if item_type in _SCALAR:  # skip fixed-size arrays without decoding them
                size = struct.calcsize(_SCALAR[item_type]) * count
                if self.pos + size > len(self.data):
                    raise CheckpointError(f"{self.path}: GGUF header is truncated (array at offset {self.pos})")
                self.pos += size
                return None
            return [self.value(item_type) for _ in range(count)]
        raise CheckpointError(f"{self.path}: GGUF metadata value type {type_id} at offset {self.pos} is unknown")


def validate_header(path: Path) -> None:
    """Parses and checks the header.

    Raises:
        CheckpointError: bad magic or version, truncated header, unknown tensor type, or data past the end of file.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(min(size, 64 << 20))  # headers with large vocabularies take a few MB
    cur = _Cursor(path, raw)
    if raw[:4] != b"GGUF":
        raise CheckpointError(f"{path}: bad magic {raw[:4]!r}, expected b'GGUF' (not a GGUF file)")
    cur.pos = 4
    version = cur.take("<I")
    if version not in (2, 3):
        raise CheckpointError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    alignment = 32
    for _ in range(n_kv):
        key, type_id = cur.string(), cur.take("<I")
        value = cur.value(type_id)
        if key == "general.alignment":
            alignment = int(value)
    tensors = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.take("<I")
        dims = tuple(cur.take("<Q") for _ in range(n_dims))
        type_id, offset = cur.take("<I"), cur.take("<Q")
        if type_id not in SUPPORTED_TYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has GGML type {type_id}, which is unknown or not "
                                  f"supported (supported: {', '.join(SUPPORTED_TYPES.values())})")
        tensors.append((name, dims, type_id, offset))  # offset: from the start of the data section
    data_start = -(-cur.pos // alignment) * alignment
    for name, dims, type_id, offset in tensors:
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
        end = data_start + offset + int(np.prod(dims, dtype=np.int64)) * type_size // block
        if end > size:
            raise CheckpointError(f"{path}: tensor {name!r} data ends at byte {end}, "
                                  f"past the end of the {size}-byte file (truncated)")


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
        validate_header(self.path)
        try:
            self.reader = gguf.GGUFReader(self.path)
        except (ValueError, KeyError, IndexError) as e:
            raise CheckpointError(f"{self.path}: unreadable GGUF ({e})") from None
        try:
            self.meta = {k: _field_value(f) for k, f in self.reader.fields.items()}
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{self.path}: GGUF metadata holds a string that is not UTF-8 ({e})") from None
        arch = self.meta.get("general.architecture")
        if arch not in ARCHS:
            raise UnsupportedArchitecture(f"{self.path}: GGUF architecture {arch!r} is not supported "
                                          f"(supported: {', '.join(sorted(ARCHS))})")
        self.arch = ARCHS[arch]
        gguf_names = {t.name for t in self.reader.tensors}
        self.config = self.arch.config(self.meta, arch, gguf_names)
        self._fix = self.arch.fix(self.config)
        self._tensors = {}  # HF name -> ReaderTensor
        for t in self.reader.tensors:
            hf = self._hf_name(t.name)
            if hf is not None:
                self._tensors[hf] = t

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
        return tuple(int(d) for d in reversed(self._tensors[name].shape))

    def tensor_nbytes(self, name: str) -> int:
        return int(self._tensors[name].n_bytes)

    def read(self, name: str) -> np.ndarray:
        t = self._tensors[name]
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(self.tensor_shape(name))
        return self._fix(name, w)

    def release(self) -> None:
        mapped = getattr(self.reader.data, "_mmap", None)  # gguf's reader maps the whole file with np.memmap
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


def _field_value(field):
    """A reader field as a plain Python value (arrays of strings as lists)."""
    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        if types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]
