"""Reading a checkpoint's parameters straight into their shardings: each device reads only its slice.

`restore_arrays` gives every parameter of the manifest as a `jax.Array` placed as its `NamedSharding` says (Orbax
reads the slices); `manifest_problems` says why a checkpoint's parameters are not the model's.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from day0jax.core.errors import CheckpointError
from day0jax.weights import checkpoint
from sharding import plan as plan_lib
from sharding.pipeline import Stages, param_sharding

# Orbax reads at most this much (in GB) of checkpoint slices at once before they reach their devices; its default
# (96 GB) lets a whole parameter group sit in host memory on top of the already placed shards.
READ_CONCURRENT_GB = 0.064


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


def restore_arrays(path: Path, manifest: dict, infos: dict, mesh: Mesh, dtype, stages: Stages | None = None
             ) -> dict[str, jax.Array]:
    import orbax.checkpoint as ocp

    # One read may span a whole stored array (its storage chunks can cut other dimensions than the sharding does),
    # and Orbax refuses a read larger than its limit, so the limit is at least the largest array.
    largest = max(math.prod(p["shape"]) * jnp.dtype(p["dtype"]).itemsize for p in manifest["params"].values())
    limit_gb = max(READ_CONCURRENT_GB, (1.1 * largest + (1 << 20)) / 1e9)
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(restore_concurrent_gb=limit_gb))
    out = {}
    for group, names in checkpoint.groups(manifest).items():
        targets, restore_args = {}, {}
        for name in names:
            if name not in infos:  # an optional part the model is built without (`optional_prefixes`)
                continue
            info = infos[name]
            sharding = param_sharding(info, mesh, stages)
            as_dtype = plan_lib.stored_dtype(info, dtype)
            if not sharding.addressable_devices:
                # A pipeline stage on another process's devices: that process reads it; here it is a shape.
                out[name] = jax.ShapeDtypeStruct(info.shape, as_dtype, sharding=sharding)
                continue
            targets[name] = jax.ShapeDtypeStruct(info.shape, as_dtype, sharding=sharding)
            restore_args[name] = ocp.ArrayRestoreArgs(sharding=sharding, dtype=as_dtype, global_shape=info.shape)
        if not targets:
            continue
        try:
            if len(targets) == len(names):
                tree = checkpointer.restore(path / checkpoint.group_dir(group), item=checkpoint.nest(targets),
                                            restore_args=checkpoint.nest(restore_args))
            else:  # only this process's pipeline stages
                tree = checkpointer.restore(path / checkpoint.group_dir(group), args=ocp.args.PyTreeRestore(
                    item=checkpoint.nest(targets), restore_args=checkpoint.nest(restore_args), partial_restore=True))
        except (FileNotFoundError, ValueError) as e:
            raise CheckpointError(f"{path / checkpoint.group_dir(group)}: cannot restore ({e}); "
                                  "run `python -m convert --verify` on the checkpoint") from None
        out.update(checkpoint.flatten(tree))
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
