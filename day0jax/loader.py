"""`day0jax.load`: a converted checkpoint -> a `Model`, with every parameter restored straight into its sharding.

The model is first built abstractly (`nnx.eval_shape`: shapes and logical axes, no memory); the sharding rules
turn logical axes into a `NamedSharding` per parameter; Orbax then reads each parameter directly into those
shardings, so each device reads only its slice and the host never holds a replicated copy.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from day0jax import checkpoint, models
from day0jax.config import read_config_json
from day0jax.errors import CheckpointError, MeshError
from day0jax.runtime import Model
from sharding.mesh import describe, make_mesh
from sharding.rules import named_sharding

log = logging.getLogger(__name__)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def default_dtype() -> str:
    """float32 on the CPU (bf16 arithmetic is slow there), bfloat16 on accelerators."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def load(path: str | Path, *, dtype: str | None = None, mesh: Mesh | str | None = None) -> Model:
    """Loads a day0jax checkpoint.

    Args:
        path: checkpoint folder written by `python -m convert`.
        dtype: compute and parameter dtype ('float32', 'bfloat16', 'float16'); default per backend.
        mesh: a `Mesh`, a SPEC string like 'tp=2', or None for one device.
    Returns:
        A `Model`.
    Raises:
        CheckpointError: not a checkpoint, newer format, or parameters that do not match the model.
        UnsupportedArchitecture: the model type or a config value is not implemented.
        MeshError: the mesh spec is invalid or does not fit the model.
    """
    t0 = time.perf_counter()
    path = Path(path)
    manifest = checkpoint.read_manifest(path)
    hf = read_config_json(path / "config.json")
    config = models.config_from_hf(hf)
    dtype = dtype or default_dtype()
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    mesh = mesh if isinstance(mesh, Mesh) else make_mesh(mesh)
    check_mesh_fits(config, mesh)

    abstract = models.abstract_model(config, DTYPES[dtype])
    graphdef, abstract_state = nnx.split(abstract)
    infos = {i.path: i for i in models.param_infos(abstract)}
    _check_manifest(path, manifest, infos)
    arrays = _restore(path, manifest, infos, mesh, DTYPES[dtype])
    flat = [(p, var.replace(arrays[".".join(map(str, p))])) for p, var in nnx.to_flat_state(abstract_state)]
    module = nnx.merge(graphdef, nnx.from_flat_state(flat))
    log.info("loaded %s (%s, %d parameters) on %s in %.1fs", path, config.model_type,
             sum(a.size for a in arrays.values()), describe(mesh), time.perf_counter() - t0)
    return Model(module, config, path=path, mesh=mesh, dtype=dtype,
                 generation_config=_read_json(path / "generation_config.json"))


def check_mesh_fits(config, mesh: Mesh) -> None:
    """Refuses meshes whose tensor-parallel size does not divide the attention heads."""
    tp = mesh.shape.get("tp", 1)
    heads = config.num_attention_heads
    if heads % tp:
        fits = [d for d in range(1, heads + 1) if heads % d == 0 and d <= mesh.devices.size * 8]
        raise MeshError(f"tp={tp} does not divide num_attention_heads={heads}; tp could be one of {fits}")


def _check_manifest(path: Path, manifest: dict, infos: dict) -> None:
    params = manifest.get("params", {})
    for name, info in infos.items():
        if name not in params:
            raise CheckpointError(f"{path}: parameter {name} is not in the checkpoint (converted by another "
                                  "version of the model code?)")
        if tuple(params[name]["shape"]) != info.shape:
            raise CheckpointError(f"{path}: parameter {name} has shape {tuple(params[name]['shape'])} in the "
                                  f"checkpoint, the model expects {info.shape}")
    extra = sorted(set(params) - set(infos))
    if extra:
        raise CheckpointError(f"{path}: checkpoint parameter {extra[0]} is unknown to the model")


def _restore(path: Path, manifest: dict, infos: dict, mesh: Mesh, dtype) -> dict[str, jax.Array]:
    import orbax.checkpoint as ocp

    by_group: dict[int, list[str]] = {}
    for name, p in manifest["params"].items():
        by_group.setdefault(p["group"], []).append(name)
    checkpointer = ocp.PyTreeCheckpointer()
    out = {}
    for group, names in sorted(by_group.items()):
        targets, restore_args = {}, {}
        for name in names:
            info = infos[name]
            sharding = named_sharding(info.axes, info.shape, mesh)
            targets[name] = jax.ShapeDtypeStruct(info.shape, dtype, sharding=sharding)
            restore_args[name] = ocp.ArrayRestoreArgs(sharding=sharding, dtype=dtype, global_shape=info.shape)
        try:
            tree = checkpointer.restore(path / checkpoint.group_dir(group), item=checkpoint.nest(targets),
                                        restore_args=checkpoint.nest(restore_args))
        except (FileNotFoundError, ValueError) as e:
            raise CheckpointError(f"{path / checkpoint.group_dir(group)}: cannot restore ({e}); "
                                  "run `python -m convert --verify` on the checkpoint") from None
        for name in names:
            node = tree
            for part in name.split("."):
                node = node[part]
            out[name] = node
    return out


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
