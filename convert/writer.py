"""Writes a checkpoint folder atomically, streaming parameters into zarr arrays written by a pool of workers.

Each parameter is a zarr (v2) array under `params/NNNN/<name>/`: a `.zarray` header and raw, uncompressed C-order
chunk files of at most `CHUNK_BYTES`, cut along the first axes (so a chunk is one contiguous range of the array,
written with one call and read back with one: `day0jax/weights/stream.py`). Groups `NNNN` of about `GROUP_BYTES`
keep folders small. Workers write, hash (the manifest's `FILE_HASH` digest of every file) and fsync each array's
files while the caller prepares the next ones, with at most `PENDING_BYTES` of parameters waiting.

Everything goes into a hidden temporary folder beside the destination, renamed into place once complete: a killed
conversion leaves only the temporary folder, which the next conversion into the same place removes. With --force
the old output is renamed aside only once the new one is complete, and deleted after the new one is in place; a
crash in between leaves it aside, and the next conversion puts it back (or deletes it, if the new one made it).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import json
import math
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import blake3
import numpy as np

from day0jax.core.errors import CheckpointError
from day0jax.weights import checkpoint

GROUP_BYTES = 128 << 20  # parameters per params/NNNN folder
CHUNK_BYTES = 16 << 20  # a chunk file at most (a device reads whole chunks: small enough to read little beyond)
PENDING_BYTES = 384 << 20  # parameters handed to the workers and not yet on disk, at most (one larger goes alone)


def default_workers() -> int:
    """Writer threads: writes, hashing and fsync release the GIL, and most of a writer's time is spent waiting for
    its fsync, so more writers than cores keep the disk busy (on two cores, 8 converted 10-15% faster than 3)."""
    return max(8, min(16, 2 * (os.cpu_count() or 1)))


def chunk_cut(shape: tuple[int, ...], itemsize: int, limit: int | None = None) -> tuple[int, int]:
    """Where chunks cut an array of `shape`: (axis, rows). Chunks take one index of every axis before `axis`,
    `rows` indices of `axis` (as many as fit in `limit` bytes, default `CHUNK_BYTES`) and whole later axes, so every
    chunk is a contiguous range of the C-order array."""
    limit = CHUNK_BYTES if limit is None else limit
    for axis in range(len(shape)):
        inner = math.prod(shape[axis + 1:]) * itemsize  # bytes of one index along `axis`
        if inner <= limit or axis == len(shape) - 1:
            return axis, max(1, min(shape[axis], limit // max(inner, 1)))
    raise ValueError("a scalar has no chunks to cut")


def _zarr_dtype(dtype: np.dtype) -> str:
    # numpy's own string for standard types ('<f4', '|i1'); bfloat16 and the float8 kinds by name, as tensorstore's
    # zarr driver writes them.
    return dtype.str if dtype.kind in "biuf" and dtype.name in np.sctypeDict else dtype.name


def _replaceable(path: Path) -> bool:
    """Whether --force may delete `path`: a folder (not a link to one) holding a day0jax checkpoint's manifest, or
    nothing at all."""
    if path.is_symlink() or not path.is_dir():
        return False
    return (path / checkpoint.MANIFEST).is_file() or not any(path.iterdir())


# The digest of every file the manifest lists (its `file_hash`: the written files, which `convert --verify` checks,
# and the source's). BLAKE3, not sha256: a conversion hashes every byte it reads and every byte it writes, and on a
# CPU with SHA extensions sha256 still runs at about 1 GB/s per core, below what a disk durably takes (on two cores
# the two sha256 passes held a conversion to half the disk's rate); BLAKE3 runs at 3-4 GB/s per core (AVX-512 or
# AVX2). Manifests without `file_hash` (written before) list sha256 digests.
FILE_HASH = "blake3"
HASHES = {"blake3": blake3.blake3, "sha256": hashlib.sha256}


def file_digest(path: Path, algorithm: str = FILE_HASH, block: int = 8 << 20) -> str:
    """The hex digest of a file's bytes with `algorithm` ('blake3' or 'sha256'). The next block is read while this
    one is hashed (both release the GIL): on a file not yet in the page cache, reading and hashing in turn would
    take the sum of the two times, here the longer."""
    h = HASHES[algorithm]()
    with open(path, "rb", buffering=0) as f, concurrent.futures.ThreadPoolExecutor(1) as reader:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger read-ahead
        pending = reader.submit(f.read, block)
        while chunk := pending.result():
            pending = reader.submit(f.read, block)
            h.update(chunk)
    return h.hexdigest()


class WriteTimings:
    """Seconds the writer threads spent, summed over the threads (they overlap each other and the caller): copying
    into the page cache (`write`; for a memory-mapped source this includes reading it), waiting for the disk
    (`sync`), digesting (`digest`); and the caller's seconds waiting for them to take more (`waited`)."""

    def __init__(self):
        self.write = self.sync = self.digest = self.waited = 0.0
        self._lock = threading.Lock()

    def add(self, write: float, sync: float, digest: float) -> None:
        with self._lock:
            self.write += write
            self.sync += sync
            self.digest += digest


class CheckpointWriter:
    """Context manager: `add(path, array)` streams parameters; `commit(...)` finishes atomically.

    Raises:
        CheckpointError: the destination exists (without `force`, or with it but is neither a checkpoint nor an
            empty folder) or cannot be written.
        OSError: a write failed on a worker (a full disk, say): raised by the next `add`, `flush` or `commit`.
    """

    def __init__(self, dst: Path, *, force: bool = False, on_saved: Callable[[], None] | None = None,
                 workers: int | None = None):
        self.dst = Path(dst).absolute()
        for old in self.dst.parent.glob(f".{self.dst.name}.old-*"):
            if self.dst.exists():  # a replaced output that a crash kept from being deleted
                shutil.rmtree(old, ignore_errors=True)
            else:  # a crash between the two renames of a --force: the old output is still the last complete one
                os.rename(old, self.dst)
        if self.dst.exists() and not force:
            raise CheckpointError(f"{self.dst}: already exists; pass --force to replace it")
        if self.dst.exists() and not _replaceable(self.dst):
            # --force deletes what it replaces: a mistyped destination must not take a home folder with it.
            raise CheckpointError(f"{self.dst}: --force replaces only a day0jax checkpoint folder (one with "
                                  f"{checkpoint.MANIFEST}) or an empty folder, and this is neither; remove it yourself "
                                  "or choose another destination")
        if workers is not None and workers < 1:
            raise CheckpointError(f"--workers must be at least 1, got {workers}")
        self.dst.parent.mkdir(parents=True, exist_ok=True)
        for stale in self.dst.parent.glob(f".{self.dst.name}.tmp-*"):
            pid = stale.name.rsplit("-", 2)[-2]
            if not (pid.isdigit() and _alive(int(pid))):
                shutil.rmtree(stale, ignore_errors=True)  # left by a killed conversion
        self.tmp = self.dst.parent / f".{self.dst.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir()
        (self.tmp / checkpoint.PARAMS_DIR).mkdir()
        self.params: dict[str, dict[str, Any]] = {}
        self.groups = 0  # groups started so far
        self._group_bytes = 0  # bytes in the current group
        self.bytes_written = 0
        self.on_saved = on_saved  # called (on a worker) after each GROUP_BYTES written: source pages may go
        self._pool = concurrent.futures.ThreadPoolExecutor(workers or default_workers(),
                                                           thread_name_prefix="day0jax-write")
        self._writes: list[concurrent.futures.Future] = []
        self._cond = threading.Condition()
        self.timings = WriteTimings()
        self._pending = 0  # bytes handed to the workers, not yet written
        self._since_saved = 0
        self._error: BaseException | None = None
        self._hashes: dict[str, str] = {}

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self._pool.shutdown(wait=True, cancel_futures=exc_type is not None)  # never remove files under a write
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return False

    def add(self, path: str, array: np.ndarray) -> None:
        """Hands one parameter to the workers, a task per chunk file (waiting while `PENDING_BYTES` are queued), so
        that the chunks of one large parameter are written and synced side by side; it joins the current group,
        which ends once it holds `GROUP_BYTES`."""
        array = np.asarray(array)
        if not array.flags.c_contiguous:  # (np.ascontiguousarray would make a scalar 1-d)
            array = array.copy(order="C")
        if self.groups == 0 or self._group_bytes >= GROUP_BYTES:
            self._start_group()
        group = self.groups - 1
        self._group_bytes += array.nbytes
        self.params[path] = {"shape": list(array.shape), "dtype": str(array.dtype), "group": group}
        folder = self.tmp / checkpoint.group_dir(group) / path
        folder.mkdir()
        axis, rows = chunk_cut(array.shape, array.itemsize) if array.shape else (0, 1)
        chunks = (1,) * axis + (rows,) + array.shape[axis + 1:] if array.shape else ()
        header = {"chunks": list(chunks), "compressor": None, "dimension_separator": ".",
                  "dtype": _zarr_dtype(array.dtype), "fill_value": None, "filters": None, "order": "C",
                  "shape": list(array.shape), "zarr_format": 2}
        self._submit(folder / ".zarray", np.frombuffer(json.dumps(header).encode(), np.uint8))
        if not array.shape:
            self._submit(folder / "0", array.reshape(1))
        for outer in (itertools.product(*map(range, array.shape[:axis])) if array.shape else ()):
            block = array[outer]
            for j in range(0, array.shape[axis], rows):
                name = ".".join(map(str, (*outer, j // rows) + (0,) * (len(chunks) - axis - 1)))
                self._submit(folder / name, block[j:j + rows], rows)
        self.bytes_written += array.nbytes

    def _submit(self, path: Path, data: np.ndarray, rows: int | None = None) -> None:
        """Queues one file's write, once the bytes queued leave room for it (or none are)."""
        t0 = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or self._pending == 0
                                or self._pending + data.nbytes <= PENDING_BYTES)
            self.timings.waited += time.perf_counter() - t0
            self._raise_failure()
            self._pending += data.nbytes
        if len(self._writes) >= 4096:  # a trillion parameters are 10^5 chunk files: keep only the unfinished
            self._writes = [f for f in self._writes if not f.done()]
        self._writes.append(self._pool.submit(self._write_chunk, path, data, rows))

    def flush(self) -> None:
        """Ends the current group: the next parameter starts a new one."""
        self._group_bytes = GROUP_BYTES

    def _wait(self) -> None:
        """Waits for every queued write; re-raises the first that failed."""
        for future in self._writes:
            future.result()
        self._writes = []
        self._raise_failure()  # one that failed among those already let go

    def _start_group(self) -> None:
        (self.tmp / checkpoint.group_dir(self.groups)).mkdir()
        self.groups += 1
        self._group_bytes = 0

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise self._error

    def _write_chunk(self, path: Path, data: np.ndarray, rows: int | None) -> None:
        """One file of a parameter's zarr array (its header, or a chunk padded to `rows` rows), hashed and fsynced."""
        try:
            payload = data
            if rows is not None and data.shape[0] < rows:  # zarr v2 stores edge chunks whole: the last one padded
                payload = np.concatenate([data, np.zeros((rows - data.shape[0],) + data.shape[1:], data.dtype)])
            digest = self._write_file(path, payload.reshape(-1).view(np.uint8).data)
            with self._cond:
                self._hashes[str(path.relative_to(self.tmp))] = digest
        except BaseException as e:
            with self._cond:
                self._error = self._error or e
                self._cond.notify_all()
            raise
        finally:
            with self._cond:
                self._pending -= data.nbytes
                self._since_saved += data.nbytes
                saved = self._since_saved >= GROUP_BYTES and self.on_saved is not None
                if saved:
                    self._since_saved = 0
                self._cond.notify_all()
        if saved:
            self.on_saved()

    def _write_file(self, path: Path, data) -> str:
        """Writes `data` to a new file durably (fsync) and returns its `FILE_HASH` digest."""
        t0 = time.perf_counter()
        with open(path, "xb", buffering=0) as f:
            view = memoryview(data).cast("B")
            done = 0
            while done < len(view):
                done += f.write(view[done:])
            t1 = time.perf_counter()
            os.fsync(f.fileno())
        t2 = time.perf_counter()
        digest = HASHES[FILE_HASH](data).hexdigest()
        self.timings.add(write=t1 - t0, sync=t2 - t1, digest=time.perf_counter() - t2)
        return digest

    def write_json(self, name: str, data: Any) -> None:
        (self.tmp / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")

    def commit(self, manifest: dict[str, Any]) -> Path:
        """Waits for the writes, hashes the other written files into the manifest, writes it last, and renames into
        place."""
        self._wait()
        files = self._hash_files(self.tmp, skip=self.tmp / checkpoint.PARAMS_DIR)
        files.update(self._hashes)
        manifest = dict(manifest, format_version=checkpoint.FORMAT_VERSION, params=self.params,
                        groups=self.groups, file_hash=FILE_HASH, files=dict(sorted(files.items())))
        self.write_json(checkpoint.MANIFEST, manifest)
        fsync_path(self.tmp / checkpoint.MANIFEST)
        fsync_path(self.tmp)
        if self.dst.exists():
            trash = self.dst.parent / f".{self.dst.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(self.dst, trash)
            os.rename(self.tmp, self.dst)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(self.tmp, self.dst)
        return self.dst

    def _hash_files(self, root: Path, skip: Path | None = None) -> dict[str, str]:
        """The digest of every file under root (except under `skip`), keyed by path in the checkpoint; fsyncs them."""
        out = {}
        for f in sorted(root.rglob("*")):
            if f.is_file() and f.name != checkpoint.MANIFEST and not (skip and f.is_relative_to(skip)):
                out[str(f.relative_to(self.tmp))] = file_digest(f)
                fsync_path(f)
        return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsync_path(path: Path) -> None:
    """Flushes a file (or a folder: its entries) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
