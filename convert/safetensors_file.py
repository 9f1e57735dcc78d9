"""A strict, memory-mapped safetensors reader.

The header is validated before any tensor is touched (length, JSON, dtypes, offsets inside the file, no overlaps),
so a truncated or corrupt file is reported by name, not as a crash later. Reading a tensor never loads the others.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from day0jax.core.errors import CheckpointError

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
MAX_HEADER = 100 << 20  # the safetensors format caps the header at 100 MB


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """One `.safetensors` file: `tensors` (name -> TensorInfo), `metadata`, and `read(name)`.

    Raises:
        CheckpointError: on any malformed header, naming the file and the problem.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{self.path}: not a safetensors file (only {size} bytes)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > MAX_HEADER or 8 + header_len > size:
                raise CheckpointError(f"{self.path}: header length {header_len} runs past the end of the "
                                      f"{size}-byte file (truncated or not safetensors)")
            raw = f.read(header_len)
        try:
            header = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise CheckpointError(f"{self.path}: header is not JSON (not a safetensors file?)") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        if not isinstance(self.metadata, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.metadata.items()):
            raise CheckpointError(f"{self.path}: header field __metadata__ must map strings to strings")
        self.tensors = {name: self._parse_entry(name, entry, 8 + header_len, size) for name, entry in header.items()}
        spans = sorted(self.tensors.values(), key=lambda t: (t.begin, t.end))
        for a, b in zip(spans, spans[1:]):
            if b.begin < a.end:
                raise CheckpointError(f"{self.path}: tensors {a.name!r} and {b.name!r} overlap "
                                      f"(bytes {a.begin}-{a.end} and {b.begin}-{b.end})")
        self._mmap = None

    def _parse_entry(self, name: str, entry, data_start: int, size: int) -> TensorInfo:
        def bad(field: str, value) -> CheckpointError:
            return CheckpointError(f"{self.path}: tensor {name!r} has an invalid {field} in its header: "
                                   f"{str(value)[:200]}")

        if not isinstance(entry, dict):
            raise bad("entry", entry)
        dtype_name, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype_name, str):
            raise bad("dtype", dtype_name)
        if dtype_name not in DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype_name!r}")
        dtype = DTYPES[dtype_name]
        # type() and not isinstance: a JSON true is a Python bool, which is an int.
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise bad("shape", shape)
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets) \
                or not 0 <= offsets[0] <= offsets[1]:
            raise bad("data_offsets", offsets)
        shape, (begin, end) = tuple(shape), offsets
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"{self.path}: tensor {name!r} of shape {shape} {dtype_name} needs "
                                  f"{math.prod(shape) * dtype.itemsize} bytes but its offsets span {end - begin}")
        if data_start + end > size:
            raise CheckpointError(f"{self.path}: tensor {name!r} ends at byte {data_start + end}, past the end of "
                                  f"the {size}-byte file (truncated)")
        return TensorInfo(name, dtype, shape, data_start + begin, data_start + end)

    def read(self, name: str) -> np.ndarray:
        """The tensor as a read-only array backed by the memory map."""
        info = self.tensors[name]
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        # Ask the kernel to start reading it now: the pages arrive while the previous group is being written.
        start = info.begin - info.begin % mmap.PAGESIZE
        if info.end > start:
            self._mmap._mmap.madvise(mmap.MADV_WILLNEED, start, info.end - start)
        return self._mmap[info.begin:info.end].view(info.dtype).reshape(info.shape)

    def release(self) -> None:
        """Drops this file's mapped pages from the process; later reads fault them in again from the page cache."""
        if self._mmap is not None:
            self._mmap._mmap.madvise(mmap.MADV_DONTNEED)
