"""The CPU candidate: `cpu_kernel.cc` as an XLA FFI custom call, compiled on first use for this machine's CPU.

The shared library is built with the system's C++ compiler (`-O3 -march=native`) into
`$DAY0JAX_CACHE/kernels` (default `~/.cache/day0jax/kernels`), named by a hash of the source, the compiler, the
jaxlib headers and the CPU's flags, so a different machine or version rebuilds; the build is written to a temporary
name and renamed, so processes building at once never load a half-written file. Without a compiler the candidate
declines and the reference runs.
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
import jax.numpy as jnp
import numpy as np

from kernels_pallas.quantized_linear.reference import QuantizedWeight

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernel.cc")
TARGET = "day0jax_quantized_matmul"
KIND_IDS = {"int8": 0, "int4": 1, "fp8": 2}
# Rows (tokens) up to which one pass over the codes serves every row; prefill-sized inputs go to the reference,
# whose one float copy of the weight is small next to the product's arithmetic.
MAX_ROWS = 16


def cache_dir() -> Path:
    """`$DAY0JAX_CACHE/kernels`, else `$XDG_CACHE_HOME/day0jax/kernels`, else `~/.cache/day0jax/kernels`."""
    root = os.environ.get("DAY0JAX_CACHE")
    if root:
        return Path(root) / "kernels"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "day0jax" / "kernels"


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
def library_path() -> Path | None:
    """The compiled kernel for this machine, building it if needed; None (with a logged reason) if it cannot be."""
    cxx = _compiler()
    if cxx is None:
        log.info("quantized linear: no C++ compiler found; the CPU kernel is unavailable, the reference runs")
        return None
    include = jax.ffi.include_dir()
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), cxx.encode(), include.encode(),
                                     jax.__version__.encode(), _cpu_flags().encode()])).hexdigest()[:16]
    out = cache_dir() / f"quantized_matmul-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    log.warning("quantized linear: building the CPU kernel for this machine into %s (first use, about 10 s)",
                out.parent)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{include}", str(SOURCE), "-o", tmp]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, out)
    except (OSError, subprocess.SubprocessError) as e:
        errors = [line for line in (getattr(e, "stderr", "") or "").splitlines() if "error" in line]
        log.warning("quantized linear: building the CPU kernel failed (%s); the reference runs",
                    "; ".join(errors[:3]) or e)
        Path(tmp).unlink(missing_ok=True)
        return None
    log.info("quantized linear: built the CPU kernel into %s", out)
    return out


@functools.cache
def _registered() -> bool:
    path = library_path()
    if path is None:
        return False
    library = ctypes.cdll.LoadLibrary(str(path))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.QuantizedMatmul), platform="cpu")
    return True


def quantized_matmul(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """See `reference.quantized_matmul`: x [R, I] with R <= MAX_ROWS, on the CPU, multiplied in float32 (16-bit
    activations widened exactly, as the reference does).

    Raises:
        NotImplementedError: another backend, too many rows, non-float input, a group that is not a multiple of 16,
            or no compiled kernel.
    """
    if jax.default_backend() != "cpu":
        raise NotImplementedError("the FFI kernel is built for the CPU")
    R, I = x.shape
    if R > MAX_ROWS:
        raise NotImplementedError(f"{R} rows (the kernel serves up to {MAX_ROWS} per pass over the codes)")
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise NotImplementedError(f"x is {x.dtype}; the kernel multiplies float activations")
    if w.group % 16:
        raise NotImplementedError(f"group size {w.group} is not a multiple of 16")
    if w.codes.dtype != np.dtype(jnp.int8) and w.kind == "int8":
        raise NotImplementedError(f"int8 codes stored as {w.codes.dtype}")
    if not _registered():
        raise NotImplementedError("the CPU kernel could not be built (see the log)")
    O, _ = w.shape
    offset = w.offset if w.offset is not None else jnp.zeros((0,), w.scale.dtype)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((R, O), jnp.float32))
    return call(x.astype(jnp.float32), w.codes, w.scale, offset, kind=np.int64(KIND_IDS[w.kind]),
                group=np.int64(w.group), has_offset=w.offset is not None)
