"""What the converter reads from: a common interface over Hugging Face folders and GGUF files.

A source exposes the HF-style `config.json` dict, tensors under their Hugging Face names (so that one
name mapping per family serves both kinds), the files it was read from, and how to write its tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from convert.hf_source import HFSource
from day0jax.errors import CheckpointError

class Source(Protocol):
    kind: str  # "safetensors" or "gguf"
    path: Path

    def hf_config(self) -> dict: ...

    def tensor_names(self) -> list[str]: ...

    def tensor_shape(self, name: str) -> tuple[int, ...]: ...

    def tensor_nbytes(self, name: str) -> int:
        """Bytes stored in the source (for progress and throughput)."""
        ...

    def read(self, name: str) -> np.ndarray:
        """The tensor in HF layout, dequantized to a float dtype."""
        ...

    def default_dtype(self) -> str:
        """The dtype the checkpoint gets when the user names none."""
        ...

    def source_files(self) -> list[Path]: ...

    def release(self) -> None:
        """Unmaps the pages read so far from this process (the OS page cache keeps them).

        Tensors are memory-mapped views; every page touched counts in the converter's resident memory until it is
        released, so without this a conversion's RSS would grow to the size of the source.
        """
        ...

    def write_tokenizer(self, dst: Path) -> list[str]:
        """Writes tokenizer and generation files into dst; returns the names written."""
        ...


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
