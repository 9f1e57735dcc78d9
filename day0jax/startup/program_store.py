"""The program store: how to rebuild each compiled engine program without tracing it, on the next start.

A hit in JAX's persistent cache still pays for tracing and lowering: for SmolLM2 (30 unrolled layers) about 1.5 s a
program on a CPU, twice the loading, most of a warm start of ~100 programs. The store keeps what JAX needs around each
executable (`serialize_executable`'s pickled metadata) and the key of its entry in JAX's cache, never the executable
(re-serializing one loaded from JAX's cache gives one that fails on XLA:CPU with "Function ... not found"). Entries
are keyed by everything the traced program depends on, known without tracing; a missing, stale or unloadable one is
traced as usual. Single-process meshes only: multi-host starts rely on JAX's cache, which coordinates its writers.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import os
import pickle
import re
import sys
from importlib import metadata
from pathlib import Path

import jax
from jax.experimental import serialize_executable

from day0jax.startup import compile_cache
from kernels_pallas import cpu_build
from day0jax.startup.compile_cache import CompileCache, VerifiedFiles, untrusted

log = logging.getLogger(__name__)

SOURCE_PACKAGES = ("day0jax", "kernels_pallas", "sharding")
# The HTTP layer and the command-line front ends do not shape any program: editing them keeps the store valid.
_NOT_TRACED = ("day0jax/serve/", "day0jax/compile.py", "day0jax/cli.py", "day0jax/check.py", "day0jax/verify.py",
               "day0jax/startup/timeline.py")
LIBRARIES = ("jax", "jaxlib", "flax", "numpy", "ml_dtypes")


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """SHA-256 over the path and content of every .py, .json and .cc (CPU kernel) file of the packages that build
    programs."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for package in SOURCE_PACKAGES:
        for path in sorted((root / package).rglob("*")):
            rel = path.relative_to(root).as_posix()
            if path.suffix not in (".py", ".json", ".cc") or "__pycache__" in rel or rel.startswith(_NOT_TRACED):
                continue
            h.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def environment_fingerprint() -> str:
    """Library versions, XLA flags and JAX's trace-affecting configuration, as one hash."""
    from jax._src import config as jax_config

    parts = [sys.version]
    for lib in LIBRARIES:
        try:
            parts.append(f"{lib}={metadata.version(lib)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{lib}=?")
    parts.append(os.environ.get("XLA_FLAGS", ""))
    # The values jit itself keys its trace cache on; object addresses are dropped so the text is stable.
    parts.append(re.sub(r" at 0x[0-9a-f]+", "", repr(jax_config.trace_context())))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


class ProgramStore:
    """Program entries in `cache.folder / "programs"`, pointing at JAX's cache entries in `cache.folder`.

    Args:
        cache: the enabled compile cache (its key, folder and JAX's entries).
    """

    def __init__(self, cache: CompileCache):
        folder = cache.folder / "programs"
        writable = cache.writable
        if writable:
            try:
                folder.mkdir(mode=0o700, exist_ok=True)
            except OSError as e:
                log.warning("program store: cannot create %s (%s); programs will be traced on every start", folder, e)
                writable = False
        self.trusted = True
        problem = untrusted(folder) if folder.is_dir() else None
        if problem:  # its entries are unpickled: never from a folder someone else could write
            log.warning("program store: not using %s: %s; programs will be traced on every start", folder, problem)
            self.trusted = writable = False
        self.cache = cache
        self.files = VerifiedFiles(folder, writable)
        self._prefix = "\n".join([source_fingerprint(), environment_fingerprint(), cache.key.digest()])

    def entry_name(self, signature: str) -> str:
        return hashlib.sha256(f"{self._prefix}\n{signature}".encode()).hexdigest()[:40] + ".program"

    def load(self, signature: str) -> jax.stages.Compiled | None:
        """The program saved under `signature`, or None: missing, or not loadable (reported, then traced)."""
        if not self.trusted:
            return None
        name = self.entry_name(signature)
        payload = self.files.read(name)
        if payload is None:
            return None
        try:
            blob, in_tree, out_tree, device_ids = pickle.loads(payload)
            by_id = {d.id: d for d in jax.devices()}
            devices = [by_id[i] for i in device_ids]
            if devices and devices[0].platform == "cpu":
                cpu_build.register_built()  # the handlers of the CPU kernels a program may call
            unloaded, args_info_flat, no_kwargs = _Unpickler(io.BytesIO(blob), self.cache.files, devices).load()
            return jax.stages.Compiled(unloaded.load(), [], in_tree.unflatten(args_info_flat), out_tree,
                                       no_kwargs=no_kwargs)
        except _MissingExecutable as e:
            log.info("program store: %s refers to a JAX cache entry that is gone (%s); tracing it", name, e)
        except Exception as e:  # noqa: BLE001 - any failure to load means: trace and compile instead
            log.warning("program store: cannot load %s for %s (%s: %s); compiling it again",
                        self.files.path(name), signature.splitlines()[0], type(e).__name__, e)
            self.files.corrupt.append(name)
        return None

    def save(self, signature: str, compiled: jax.stages.Compiled, jax_key: str | None) -> None:
        """Saves how to rebuild `compiled`, whose executable is JAX's cache entry `jax_key` (None: not saved,
        for example when JAX's in-memory cache answered and no entry was touched)."""
        if jax_key is None or not self.files.writable or jax.process_index() != 0:
            return
        try:
            unloaded = compiled._executable._unloaded_executable
            if compiled._params.const_args:
                raise ValueError("programs with constant arguments cannot be stored")
            args_info_flat, in_tree = jax.tree_util.tree_flatten(compiled.args_info)
            device_ids = [d.id for d in unloaded.device_list]
            with io.BytesIO() as f:
                _Pickler(f, jax_key).dump((unloaded, args_info_flat, compiled._no_kwargs))
                blob = f.getvalue()
        except (AttributeError, ValueError, TypeError, pickle.PicklingError) as e:
            log.info("program store: %s is not storable (%s)", signature.splitlines()[0], e)
            return
        self.files.write(self.entry_name(signature), pickle.dumps((blob, in_tree, compiled.out_tree, device_ids)))


class _MissingExecutable(Exception):
    pass


class _Pickler(serialize_executable._JaxPjrtPickler):
    """serialize_executable's pickler, with the executable replaced by its JAX cache key."""

    def __init__(self, file, jax_key: str):
        super().__init__(file)
        self.jax_key = jax_key

    def persistent_id(self, obj):
        from jax._src.lib import xla_client

        if isinstance(obj, xla_client.LoadedExecutable):
            return ("jax-cache", self.jax_key)
        return super().persistent_id(obj)


class _Unpickler(serialize_executable._JaxPjrtUnpickler):
    """Loads the executable a `_Pickler` referred to from JAX's cache entry, as JAX does on a cache hit."""

    def __init__(self, file, files: VerifiedFiles, devices: list):
        super().__init__(file, devices[0].client, devices)
        self.files = files

    def persistent_load(self, pid):
        if pid[0] != "jax-cache":
            return super().persistent_load(pid)
        from jax._src import compilation_cache as jax_cache

        entry = self.files.read(compile_cache.entry_name(pid[1]))
        if entry is None:
            raise _MissingExecutable(pid[1][:48])
        executable, _ = jax_cache.extract_executable_and_time(jax_cache.decompress_executable(entry))
        return self.backend.deserialize_executable(executable, executable_devices=self.execution_devices)
