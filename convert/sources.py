"""What the converter reads from: one interface over Hugging Face folders and GGUF files.

Tensors go by their Hugging Face names, so one name mapping per family serves both kinds.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from convert.hf_source import HFSource
from day0jax.core.errors import CheckpointError


class Source(Protocol):
    kind: str  # "safetensors" or "gguf"
    path: Path

    def hf_config(self) -> dict: ...  # the HF-style config.json dict
    def tensor_names(self) -> list[str]: ...
    def tensor_shape(self, name: str) -> tuple[int, ...]: ...
    def tensor_nbytes(self, name: str) -> int: ...  # bytes stored in the source (for progress and throughput)
    def read(self, name: str) -> np.ndarray: ...  # the tensor in HF layout, dequantized to a float dtype
    # How a tensor stays quantized (a `day0jax.layers.quantized.QuantSpec`; None: a float tensor; raises
    # CheckpointError for a quantized type that is not kept), and its blocks as a `QuantizedWeight` of numpy arrays.
    def quant_spec(self, name: str): ...
    def read_quantized(self, name: str): ...
    def default_dtype(self) -> str: ...  # the checkpoint's dtype when the user names none
    def source_files(self) -> list[Path]: ...
    # Unmaps the pages read so far (the OS page cache keeps them). Tensors are memory-mapped views: without this,
    # every page touched stays resident and a conversion's RSS grows to the size of the source.
    def release(self) -> None: ...
    def write_tokenizer(self, dst: Path) -> list[str]: ...  # writes tokenizer and generation files; their names


def open_source(path: Path) -> Source:
    """A `Source` for a HF folder or a `.gguf` file.

    Raises:
        CheckpointError: the path is neither, or is malformed.
    """
    path = Path(path)
    if path.is_dir():
        return HFSource(path)
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF" or path.suffix == ".gguf":
            from convert.gguf_source import GGUFSource  # imports the `gguf` package: only for GGUF files

            return GGUFSource(path)
        raise CheckpointError(f"{path}: not a Hugging Face model folder or a GGUF file")
    raise CheckpointError(f"{path}: no such file or folder")


class RenamedSource:
    """`source` with its tensors under other names: each name through the first (regex, replacement) of `renames`
    that matches it (a family's older checkpoint layout read under the current names)."""

    def __init__(self, source: Source, renames: Sequence[tuple[str, str]]):
        self._source = source
        self._original: dict[str, str] = {}
        for name in source.tensor_names():
            new = next((re.sub(p, r, name, count=1) for p, r in renames if re.search(p, name)), name)
            if new in self._original:
                raise CheckpointError(f"{source.path}: tensors {self._original[new]!r} and {name!r} are the same "
                                      f"tensor {new!r} in two checkpoint layouts; keep one")
            self._original[new] = name

    def __getattr__(self, name: str):
        return getattr(self._source, name)

    def tensor_names(self) -> list[str]:
        return list(self._original)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self._source.tensor_shape(self._original[name])

    def tensor_nbytes(self, name: str) -> int:
        return self._source.tensor_nbytes(self._original[name])

    def read(self, name: str) -> np.ndarray:
        return self._source.read(self._original[name])

    def quant_spec(self, name: str):
        return self._source.quant_spec(self._original[name])

    def read_quantized(self, name: str):
        return self._source.read_quantized(self._original[name])
