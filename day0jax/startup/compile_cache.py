"""The persistent compilation cache: JAX's, in a folder per (jax version, backend, mesh, model), with checked entries.

Entries are `VerifiedFiles` (checksummed, atomically replaced), so servers can share a folder, also over NFS. JAX 0.11.2
hands entries unchecked to the XLA loader, and one flipped byte in a compressed entry (zstd frames carry no checksum)
crashed the process with SIGSEGV or SIGABRT in our tests; a damaged entry is now reported, removed and recompiled.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import platform
import secrets
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax
import jaxlib
from jax._src import compilation_cache as jax_cache
from jax._src.compilation_cache_interface import CacheInterface

log = logging.getLogger(__name__)

ENTRY_MAGIC = b"day0jax-cache-entry-1\n"
_DIGEST = 32
_LENGTH = 8


def default_root() -> Path:
    """`~/.cache/day0jax/compile` (or under $DAY0JAX_CACHE / $XDG_CACHE_HOME, like the default model)."""
    from day0jax.core.paths import cache_root

    return cache_root() / "compile"


@dataclass(frozen=True)
class CacheKey:
    """What a compiled program depends on beyond its own text; one cache folder per distinct key."""

    jax: str
    jaxlib: str
    platform: str  # "cpu", "gpu", "tpu"
    platform_version: str  # CUDA and driver versions on GPUs
    device_kind: str  # e.g. "NVIDIA H200" or "cpu"
    host: str  # CPUs: `host_fingerprint()` (code built for one CPU may not run on another); else empty
    mesh: str  # `normalize_mesh`: "dp=1,ep=1,tp=2" or "auto"
    devices: int  # global counts
    processes: int
    model: str  # `model_fingerprint`

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()

    def folder_name(self) -> str:
        """Readable and unique: `jax-0.11.2_cpu_dp=1,ep=1,tp=1_1dev-1proc_<hash>`."""
        kind = "".join(c if c.isalnum() else "-" for c in self.device_kind)[:24]
        plat = self.platform if kind.lower() == self.platform else f"{self.platform}-{kind}"
        return f"jax-{self.jax}_{plat}_{self.mesh}_{self.devices}dev-{self.processes}proc_{self.digest()[:16]}"


def normalize_mesh(mesh: Any) -> str:
    """'auto', or every axis size spelled out ('dp=1,ep=1,tp=2', with 'pp=2,' first when there are pipeline
    stages) for a spec string, a sizes dict or a Mesh."""
    from sharding.mesh import AUTO, AXES, mesh_sizes

    if mesh == AUTO:
        return AUTO
    sizes = mesh_sizes(mesh)
    return ",".join(f"{a}={sizes.get(a, 1)}" for a in AXES if a != "pp" or sizes.get(a, 1) > 1)


def host_fingerprint() -> str:
    """A short hash of the CPU's model and instruction-set flags (from /proc/cpuinfo; else `platform`)."""
    text = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    text += line
                elif not line.strip() and text:
                    break  # the first processor describes them all
    except OSError:
        pass
    text = text or f"{platform.machine()} {platform.processor()}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def model_fingerprint(path: str | Path, dtype: str) -> str:
    """SHA-256 of what fixes a model's compiled programs: the checkpoint's config.json, format and converter
    versions, parameter names, shapes and stored dtypes, and the compute dtype. Weights do not enter programs
    (they are arguments), so two checkpoints of one architecture share compiled programs.

    Raises:
        CheckpointError: `path` is not a readable day0jax checkpoint.
    """
    from day0jax.weights import checkpoint
    from day0jax.core.errors import CheckpointError

    path = Path(path)
    manifest = checkpoint.read_manifest(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path / 'config.json'}: cannot read ({e})") from None
    return fingerprint(config, manifest, dtype)


def fingerprint(config: dict, manifest: dict, dtype: str) -> str:
    """`model_fingerprint` of a checkpoint with this config.json and manifest (for one being converted: the
    converter's `planned_output`)."""
    payload = {
        "format_version": manifest.get("format_version"),
        "converter_version": manifest.get("converter_version"),
        "model_type": manifest.get("model_type"),
        "params": {name: [p["shape"], p["dtype"]] for name, p in sorted(manifest.get("params", {}).items())},
        "config": config,
        "dtype": dtype,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def current_key(mesh: Any, model: str) -> CacheKey:
    """The key for this process's backend and devices (starts the backend)."""
    device = jax.devices()[0]
    return CacheKey(jax=jax.__version__, jaxlib=jaxlib.__version__, platform=device.platform,
                    platform_version=str(getattr(device.client, "platform_version", "")),
                    device_kind=str(device.device_kind), host=host_fingerprint() if device.platform == "cpu" else "",
                    mesh=normalize_mesh(mesh), devices=jax.device_count(), processes=jax.process_count(), model=model)


class CorruptEntry(Exception):
    """A cache file whose header or checksum does not match its content."""


class VerifiedFiles:
    """Files in one folder, each stored as header + SHA-256 + length + payload and replaced atomically.

    Args:
        folder: where the files live (created by the caller).
        writable: False for a cache on a read-only file system: `write` does nothing.
    """

    def __init__(self, folder: Path, writable: bool = True):
        self.folder, self.writable = Path(folder), writable
        self.corrupt: list[str] = []  # entries found damaged (and removed) in this process
        self._lock = threading.Lock()

    def path(self, name: str) -> Path:
        return self.folder / name

    def read(self, name: str) -> bytes | None:
        """The payload, or None if the entry is missing or damaged (damaged ones are reported and removed)."""
        path = self.path(name)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("compile cache: cannot read %s (%s); compiling instead", path, e)
            return None
        try:
            return unpack(raw)
        except CorruptEntry as e:
            with self._lock:
                self.corrupt.append(name)
            log.warning("compile cache: entry %s is damaged (%s); removing it, the program is compiled again", path, e)
            if self.writable:
                with contextlib.suppress(OSError):
                    path.unlink()
            return None

    def write(self, name: str, payload: bytes) -> None:
        """Stores `payload` under `name`, atomically (see `atomic_write`)."""
        if self.writable:
            atomic_write(self.path(name), pack(payload))


def atomic_write(path: Path, data: bytes) -> None:
    """Writes a temporary file beside `path`, flushes it, renames it over `path`: readers see the old file or
    the whole new one, never a part. Failures are logged, not raised (a cache that cannot be written still works)."""
    tmp = path.parent / f".tmp-{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}"
    try:
        # 0o666 less the umask, like any user file: mkstemp's 0o600 would hide it from other accounts sharing the cache.
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        log.warning("compile cache: cannot write %s (%s)", path, e)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def pack(payload: bytes) -> bytes:
    return ENTRY_MAGIC + hashlib.sha256(payload).digest() + len(payload).to_bytes(_LENGTH, "little") + payload


def unpack(raw: bytes) -> bytes:
    """The payload of a packed entry.

    Raises:
        CorruptEntry: wrong header, wrong length or wrong checksum.
    """
    head = len(ENTRY_MAGIC)
    if not raw.startswith(ENTRY_MAGIC):
        raise CorruptEntry("not a day0jax cache entry" if len(raw) >= head else f"only {len(raw)} bytes")
    digest, length = raw[head:head + _DIGEST], raw[head + _DIGEST:head + _DIGEST + _LENGTH]
    payload = raw[head + _DIGEST + _LENGTH:]
    if len(length) < _LENGTH or int.from_bytes(length, "little") != len(payload):
        raise CorruptEntry(f"truncated: {len(payload)} payload bytes, header says "
                           f"{int.from_bytes(length, 'little') if len(length) == _LENGTH else '?'}")
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptEntry("checksum mismatch")
    return payload


_thread = threading.local()


def entry_name(jax_key: str) -> str:
    """The file holding JAX's cache entry `jax_key`."""
    return f"{jax_key}-cache"


def reset_last_key() -> None:
    _thread.last_key = None


def last_key() -> str | None:
    """The JAX cache key this thread last looked up or stored since `reset_last_key` (for the program store)."""
    return getattr(_thread, "last_key", None)


class JaxCacheAdapter(CacheInterface):
    """JAX's `CacheInterface` (get/put of serialized executables by JAX's key) over `VerifiedFiles`. `put` always
    replaces: JAX calls it only after compiling, when `get` found nothing or returned an executable that would not
    load; either way the new one belongs on disk."""

    def __init__(self, files: VerifiedFiles):
        self.files = files
        self.path = self._path = files.folder  # as JAX's own file cache has them (its log lines read `_path`)

    def get(self, key: str) -> bytes | None:
        _thread.last_key = key
        return self.files.read(entry_name(key))

    def put(self, key: str, value: bytes) -> None:
        _thread.last_key = key
        self.files.write(entry_name(key), value)

    def clear(self) -> None:  # part of the interface; a shared cache is never cleared by one process
        pass


@dataclass
class CompileCache:
    """An enabled cache: its key, folder (JAX's entries, `programs/` for the program store) and state."""

    key: CacheKey
    folder: Path
    files: VerifiedFiles
    writable: bool


def enable(root: str | Path | None, key: CacheKey) -> CompileCache | None:
    """Enables JAX's persistent compilation cache in `root/<key folder>`; programs compiled before are not cached.

    Args:
        root: the cache root (default: `default_root()`).
        key: from `current_key`.
    Returns:
        The `CompileCache` (read-only on a read-only file system), or None: the folder is unusable (a warning says).
    """
    root = Path(root).expanduser() if root else default_root()
    folder = root / key.folder_name()
    writable = True
    try:
        for path in (root, folder):
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.mkdir(mode=0o700, exist_ok=True)
        for path in (root, folder):
            problem = untrusted(path)
            if problem:
                log.warning("compile cache: not using %s: %s. A compile cache is as trusted as code (JAX and the "
                            "program store load executables from it); starting without one", path, problem)
                return None
        _probe_write(folder)
    except OSError as e:
        if folder.is_dir() and os.access(folder, os.R_OK | os.X_OK) and any(folder.iterdir()):
            log.warning("compile cache: %s is not writable (%s); using what it holds, new programs are not saved",
                        folder, e)
            writable = False
        else:
            log.warning("compile cache: cannot use %s (%s); starting without a compilation cache", folder, e)
            return None
    files = VerifiedFiles(folder, writable)
    if writable:  # for people: what this folder is for
        atomic_write(folder / "key.json", json.dumps(asdict(key), indent=1, sort_keys=True).encode())
    others = _siblings(root, folder)
    if others:
        log.info("compile cache: %d other key folder(s) in %s (other jax versions, backends, meshes or models) are "
                 "not used", len(others), root)
    _install(files)
    log.info("compile cache: %s%s", folder, "" if writable else " (read-only)")
    return CompileCache(key, folder, files, writable)


def untrusted(path: Path) -> str | None:
    """Why another user could have put what is in `path` there (None: they could not): it belongs to someone else,
    or its group or others may write to it."""
    st = path.stat()
    if st.st_uid != os.getuid():
        return f"it belongs to user id {st.st_uid}, not to this user ({os.getuid()})"
    if st.st_mode & 0o022:
        return f"its group or other users may write to it (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _probe_write(folder: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".probe-", dir=folder)
    os.close(fd)
    os.unlink(tmp)


def _siblings(root: Path, folder: Path) -> list[Path]:
    try:
        return [d for d in root.iterdir() if d.is_dir() and d != folder and (d / "key.json").is_file()]
    except OSError:
        return []


def _install(files: VerifiedFiles) -> None:
    # No thresholds: every engine program is cached, however fast it compiled or small it is (-1 also stops
    # JAX from raising the size minimum for the file system).
    jax.config.update("jax_compilation_cache_dir", str(files.folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_enable_compilation_cache", True)
    # JAX builds its own file cache on first use; ours replaces it before that (same folder, checked entries).
    with jax_cache._cache_initialized_mutex:
        jax_cache._cache = JaxCacheAdapter(files)
        jax_cache._cache_initialized = True


def disable() -> None:
    """Turns JAX's persistent cache off again in this process (tests, and a CLI's --no-compile-cache)."""
    with jax_cache._cache_initialized_mutex:
        jax_cache._cache = None
        jax_cache._cache_initialized = False
    jax.config.update("jax_compilation_cache_dir", None)
