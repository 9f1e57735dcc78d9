"""C++ kernels for the CPU as XLA FFI custom calls, compiled on first use for this machine's CPU.

Each source file is built with the system's C++ compiler (`-O3 -march=native`) into `$DAY0JAX_CACHE/kernels`
(default `~/.cache/day0jax/kernels`), named by a hash of the source, the compiler, the jaxlib headers and the CPU's
flags, so a different machine or version rebuilds; the build is written to a temporary name and renamed, so
processes building at once never load a half-written file. A folder or library that another user owns or could
write is never loaded from; a library that does not load is built again, once. Without a compiler (or when the build
fails) `register` returns False, with the reason in the log, and the candidate declines: the op's reference runs.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

log = logging.getLogger(__name__)

# FFI target -> (its source, below this package, and the handler's symbol): every CPU kernel, so that a program
# compiled with their calls in one process can be loaded in another (`register_built`).
KERNELS = {
    "day0jax_quantized_matmul": ("quantized_linear/cpu_kernel.cc", "QuantizedMatmul"),
    "day0jax_dense_matmul_many": ("quantized_linear/cpu_kernel.cc", "DenseMatmulMany"),
    "day0jax_paged_decode": ("paged_attention/cpu_kernel.cc", "PagedDecode"),
}


def cache_dir() -> Path:
    """`$DAY0JAX_CACHE/kernels`, else `$XDG_CACHE_HOME/day0jax/kernels`, else `~/.cache/day0jax/kernels`."""
    root = os.environ.get("DAY0JAX_CACHE")
    if root:
        return Path(root) / "kernels"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "day0jax" / "kernels"


@functools.cache
def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


@functools.cache
def _library_file(source: Path, cxx: str) -> Path:
    """Where `source` built by `cxx` for this machine lives (there or not)."""
    key = hashlib.sha256(b"\0".join([source.read_bytes(), cxx.encode(), jax.ffi.include_dir().encode(),
                                     jax.__version__.encode(), _cpu_flags().encode()])).hexdigest()[:16]
    return cache_dir() / f"{source.parent.name}-{key}.so"


@functools.cache
def library_path(source: Path) -> Path | None:
    """The compiled `source` for this machine, building it if needed; None (with a logged reason) if it cannot be."""
    what = source.parent.name.replace("_", " ")
    cxx = _compiler()
    if cxx is None:
        log.info("%s: no C++ compiler found; the CPU kernel is unavailable, the reference runs", what)
        return None
    out = _library_file(source, cxx)
    out.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    untrusted = _untrusted(out.parent) or (out.is_file() and _untrusted(out))
    if untrusted:
        # Loading a library runs its code: one that someone else could have written is never loaded.
        log.warning("%s: %s; the CPU kernel is unavailable, the reference runs", what, untrusted)
        return None
    if out.is_file():
        return out
    log.warning("%s: building the CPU kernel for this machine into %s (first use, a few seconds)", what, out.parent)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}",
           str(source), "-o", tmp]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # on disk before its name is: a crash cannot leave a named, truncated library
        os.replace(tmp, out)
    except (OSError, subprocess.SubprocessError) as e:
        errors = [line for line in (getattr(e, "stderr", "") or "").splitlines() if "error" in line]
        log.warning("%s: building the CPU kernel failed (%s); the reference runs", what, "; ".join(errors[:3]) or e)
        Path(tmp).unlink(missing_ok=True)
        return None
    log.info("%s: built the CPU kernel into %s", what, out)
    return out


def _untrusted(path: Path) -> str | None:
    """Why `path` (the kernels' folder or a built library) must not be loaded from: owned by another user, or
    writable by others; None when only this user can have written it."""
    st = path.stat()
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"{path} belongs to another user"
    if st.st_mode & 0o022:
        return f"{path} is writable by other users (mode {st.st_mode & 0o777:o})"
    return None


def _source(target: str) -> tuple[Path, str]:
    source, symbol = KERNELS[target]
    return Path(__file__).parent / source, symbol


@functools.cache
def register(target: str) -> bool:
    """Registers the CPU kernel `target` (a key of `KERNELS`), building it if needed; False if it could not be."""
    source, symbol = _source(target)
    for attempt in range(2):
        path = library_path(source)
        if path is None:
            return False
        try:
            handler = getattr(ctypes.cdll.LoadLibrary(str(path)), symbol)
            break
        except (OSError, AttributeError) as e:
            # A corrupt or truncated file (a full disk, an old crash): removed and built again, once.
            log.warning("%s: cannot load %s (%s)%s", target, path, e, "; rebuilding it" if attempt == 0 else "")
            path.unlink(missing_ok=True)
            library_path.cache_clear()
    else:
        return False
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    return True


def register_built() -> None:
    """Registers every CPU kernel already built for this machine, building none: a stored program that calls one
    finds its handler (XLA looks handlers up when it loads the program)."""
    cxx = _compiler()
    for target in KERNELS:  # the file is looked for anew each time: another process may have built it since
        if cxx is not None and _library_file(_source(target)[0], cxx).is_file():
            register(target)


def require(target: str, *, gathered: str | None = None) -> None:
    """What every CPU candidate checks before its call: the kernel `target` registered, and, for a kernel whose
    `gathered` operand a multi-device mesh would copy onto every device (a custom call has no partitioning rule), a
    mesh of one device.

    Raises:
        NotImplementedError: the kernel could not be built, or the mesh has several devices.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if gathered is not None and not mesh.empty and mesh.size > 1:
        raise NotImplementedError(f"a mesh of {mesh.size} devices (the custom call would gather {gathered})")
    if not register(target):
        raise NotImplementedError("the CPU kernel could not be built (see the log)")
