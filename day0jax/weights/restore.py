"""Reading a checkpoint's parameters straight into their shardings: each device reads only its slice.

`restore_arrays` gives every parameter of the manifest as a `jax.Array` placed as its `NamedSharding` says
(`stream` reads the slices); `manifest_problems` says why a checkpoint's parameters are not the model's.
"""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

from day0jax.core.errors import CheckpointError
from day0jax.weights import checkpoint, stream
from sharding import plan as plan_lib
from sharding.pipeline import Stages, param_sharding


def manifest_problems(manifest: dict, infos) -> list[str]:
    """Why a checkpoint's parameters (its manifest) are not the model's: `load` refuses the first, `check` lists them.

    Args:
        manifest: the checkpoint's manifest (`checkpoint.read_manifest`).
        infos: the model's parameters (`models.param_infos`).
    Returns:
        One line per missing parameter, shape mismatch and parameter the model does not know; empty when they match.
    """
    params = manifest.get("params", {})
    optional = optional_prefixes(manifest)
    problems = []
    for info in infos:
        if info.path not in params and info.path.startswith("mtp."):
            problems.append(f"parameter {info.path} is not in the checkpoint: it was converted without the "
                            "multi-token-prediction layers (--no-mtp, or a source without them), which speculative "
                            "method 'mtp' runs")
        elif info.path not in params:
            problems.append(f"parameter {info.path} is not in the checkpoint (converted by another version of the "
                            "model code?)")
        elif tuple(params[info.path]["shape"]) != info.shape:
            problems.append(f"parameter {info.path} has shape {tuple(params[info.path]['shape'])} in the checkpoint, "
                            f"the model expects {info.shape}")
    known = {info.path for info in infos}
    return problems + [f"checkpoint parameter {name} is unknown to the model" for name in sorted(set(params) - known)
                       if not name.startswith(optional)]


def optional_prefixes(manifest: dict) -> tuple[str, ...]:
    """The parameter-name prefixes of the checkpoint's optional parts (its multi-token-prediction layers), which a
    model built without them leaves unread."""
    return tuple(part["prefix"] for part in manifest.get("parts", {}).values())


def restore_arrays(path: Path, manifest: dict, infos: dict, mesh: Mesh, dtype, stages: Stages | None = None, *,
                   concurrency: int | None = None, timings: stream.Timings | None = None) -> dict[str, jax.Array]:
    """Every parameter of `infos` the checkpoint at `path` holds, read into its sharding (`stream.read_sharded`);
    a parameter of another process's pipeline stage is a `jax.ShapeDtypeStruct` here.

    Args:
        concurrency: bytes of host buffers in flight (default `stream.default_concurrency()`).
        timings: filled with where the readers' time went.
    Raises:
        CheckpointError: a stored array missing, truncated, malformed, or not the shape and dtype the manifest says.
    """
    out, targets = {}, []
    for name, p in manifest["params"].items():
        if name not in infos:  # an optional part the model is built without (`optional_prefixes`)
            continue
        info = infos[name]
        sharding = param_sharding(info, mesh, stages)
        as_dtype = np.dtype(plan_lib.stored_dtype(info, dtype))
        if not sharding.addressable_devices:
            # A pipeline stage on another process's devices: that process reads it; here it is a shape.
            out[name] = jax.ShapeDtypeStruct(info.shape, as_dtype, sharding=sharding)
            continue
        stored = stream.StoredArray.open(path / checkpoint.group_dir(p["group"]) / name)
        if stored.shape != tuple(p["shape"]) or str(stored.dtype) != p["dtype"]:
            raise CheckpointError(f"{stored.folder}: stores {stored.shape} {stored.dtype}, the manifest says "
                                  f"{tuple(p['shape'])} {p['dtype']}; run `python -m convert --verify` on the checkpoint")
        targets.append(stream.Target(name, stored, as_dtype, sharding))
    out.update(stream.read_sharded(targets, concurrency=concurrency, timings=timings))
    return out


@contextlib.contextmanager
def large_buffers_back_to_the_os():
    """Maps blocks of 1 MiB or more on their own while restoring, so a freed read buffer goes back to the OS at once
    (glibc raises its mmap threshold to the largest block freed, up to 32 MiB, and host peak memory grows with the
    reads). Afterwards 32 MiB, where glibc's own rule ends up anyway. A no-op without glibc's `mallopt`."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        yield
        return
    M_MMAP_THRESHOLD = -3
    mallopt(M_MMAP_THRESHOLD, 1 << 20)
    try:
        yield
    finally:
        mallopt(M_MMAP_THRESHOLD, 32 << 20)
