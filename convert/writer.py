"""Writes a checkpoint folder atomically, streaming parameters into Orbax groups of bounded size.

Everything goes into a hidden temporary folder beside the destination, which is renamed into place only when
complete (manifest last). A conversion killed at any point leaves no destination folder, only the temporary one,
which the next conversion into the same place removes.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from day0jax import checkpoint
from day0jax.errors import CheckpointError

GROUP_BYTES = 256 << 20  # parameters per Orbax save; bounds the converter's memory
# Storage chunk target: large arrays are split (largest dimension first) so a device reads little beyond its
# slice. Orbax's `shard_axes` is not used: it splits those axes down to size 1, making thousands of tiny chunks.
CHUNK_BYTES = 16 << 20


def _checkpointer():
    import orbax.checkpoint as ocp

    # Weights barely compress; zstd would only cost time.
    return ocp.PyTreeCheckpointer(use_compression=False)


def sha256_file(path: Path, block: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


class CheckpointWriter:
    """Context manager: `add(path, array)` streams parameters; `commit(...)` finishes atomically.

    Raises:
        CheckpointError: the destination exists (without `force`) or cannot be written.
    """

    def __init__(self, dst: Path, *, force: bool = False, group_bytes: int = GROUP_BYTES):
        self.dst = Path(dst).absolute()
        if self.dst.exists() and not force:
            raise CheckpointError(f"{self.dst}: already exists; pass --force to replace it")
        self.dst.parent.mkdir(parents=True, exist_ok=True)
        for stale in self.dst.parent.glob(f".{self.dst.name}.tmp-*"):
            pid = stale.name.rsplit("-", 2)[-2]
            if not (pid.isdigit() and _alive(int(pid))):
                shutil.rmtree(stale, ignore_errors=True)  # left by a killed conversion
        self.tmp = self.dst.parent / f".{self.dst.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir()
        (self.tmp / checkpoint.PARAMS_DIR).mkdir()
        self.group_bytes = group_bytes
        self._pending: dict[str, np.ndarray] = {}
        self._pending_bytes = 0
        self.params: dict[str, dict[str, Any]] = {}
        self.groups = 0
        self.bytes_written = 0
        # Each written group is hashed and fsynced on the side while the next one is being built.
        self._hasher = concurrent.futures.ThreadPoolExecutor(1)
        self._hashes: list[concurrent.futures.Future] = []

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self._hasher.shutdown(wait=True)
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return False

    def add(self, path: str, array: np.ndarray) -> None:
        """Queues one parameter; writes a group once the queue holds `group_bytes`."""
        self._pending[path] = array
        self._pending_bytes += array.nbytes
        self.params[path] = {"shape": list(array.shape), "dtype": str(array.dtype), "group": self.groups}
        if self._pending_bytes >= self.group_bytes:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        import orbax.checkpoint as ocp

        tree = checkpoint.nest(self._pending)
        save_args = checkpoint.nest({p: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES) for p in self._pending})
        group = self.tmp / checkpoint.group_dir(self.groups)
        _checkpointer().save(group, tree, save_args=save_args)
        self._hashes.append(self._hasher.submit(self._hash_files, group))
        self.bytes_written += self._pending_bytes
        self._pending.clear()
        self._pending_bytes = 0
        self.groups += 1

    def write_json(self, name: str, data: Any) -> None:
        (self.tmp / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")

    def commit(self, manifest: dict[str, Any]) -> Path:
        """Flushes, hashes the written files into the manifest, writes it last, and renames into place."""
        self.flush()
        files = self._hash_files(self.tmp, skip=self.tmp / checkpoint.PARAMS_DIR)
        for future in self._hashes:
            files.update(future.result())
        manifest = dict(manifest, format_version=checkpoint.FORMAT_VERSION, params=self.params,
                        groups=self.groups, files=dict(sorted(files.items())))
        self.write_json(checkpoint.MANIFEST, manifest)
        _fsync(self.tmp / checkpoint.MANIFEST)
        if self.dst.exists():
            trash = self.dst.parent / f".{self.dst.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(self.dst, trash)
            os.rename(self.tmp, self.dst)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(self.tmp, self.dst)
        return self.dst

    def _hash_files(self, root: Path, skip: Path | None = None) -> dict[str, str]:
        """sha256 of every file under root (except under `skip`), keyed by path in the checkpoint; fsyncs them."""
        out = {}
        for f in sorted(root.rglob("*")):
            if f.is_file() and f.name != checkpoint.MANIFEST and not (skip and f.is_relative_to(skip)):
                out[str(f.relative_to(self.tmp))] = sha256_file(f)
                _fsync(f)
        return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
