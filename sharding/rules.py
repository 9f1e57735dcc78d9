"""Logical axis names to mesh axes: the one table that decides how parameters, caches and activations are split.

Parameters declare logical names where they are made (`nnx.with_partitioning`); collectives are never written by
hand: XLA's SPMD partitioner inserts them from these annotations. A logical axis its mesh axis does not divide
stays replicated (kv heads fewer than tp: each rank keeps them all, as GQA needs; an odd vocabulary): correct, only
less memory-efficient. Heads and experts, which must divide, are checked by mesh.py.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# logical axis -> mesh axis, several (split over their product) or None (replicated). Every name a family uses must
# be here (tests/test_sharding.py checks): a new name is a decision, not a silent replication.
RULES: dict[str, str | tuple[str, ...] | None] = {
    # activations: the batch is split over ep too, so outside MoE layers (and in dense models) expert ranks work
    # as data-parallel replicas instead of repeating each other's work.
    "batch": ("dp", "ep"),
    "seq": None,
    # attention
    "embed": None,
    "heads": "tp",
    "kv_heads": "tp",
    "head_dim": None,
    "q_lora": None,   # MLA's compressed query rank: small, and each tp rank needs all of it
    "kv_lora": None,  # MLA's compressed kv rank (and its rope part): shared by every head
    # Mamba2's groups of heads sharing the state's input and output maps: split with the heads where they divide
    # tp (each device's heads then use only its groups), else whole on every device.
    "ssm_groups": "tp",
    # feed-forward
    "mlp": "tp",
    "experts": "ep",
    "expert_mlp": "tp",
    "vocab": "tp",
    "norm": None,
    "layers": None,   # stacked layers (scan form) are never split
}

# The residual stream between blocks: batch over dp, everything else whole. The only activation constraint;
# inside a block, XLA propagates the parameters' shardings.
ACTIVATION = ("batch", "seq", "embed")
# The engine's KV page pool, per layer [pages, page size, K, H]: split like the kv heads, pages shared by all rows.
KV_POOL = (None, None, "kv_heads", None)


def partition_spec(logical: Sequence[str | None], shape: Sequence[int], mesh: Any,
                   rules: dict[str, str | tuple[str, ...] | None] = RULES) -> PartitionSpec:
    """The PartitionSpec for an array whose dimensions carry these logical names: each dimension split over its mesh
    axes of size > 1 that no earlier dimension uses, or the longest leading run of them that divides it, or none.

    Args:
        logical: one logical name (or None) per dimension.
        shape: the array's shape.
        mesh: a `Mesh`, an `AbstractMesh` or a dict of axis sizes (only the sizes matter).
        rules: logical -> mesh axis table.
    Returns:
        The PartitionSpec, one entry per dimension.
    """
    sizes = mesh if isinstance(mesh, dict) else dict(mesh.shape)
    used: set[str] = set()
    spec = []
    for name, size in zip(logical, shape):
        axes = [a for a in _axes(rules.get(name) if name else None) if sizes.get(a, 1) > 1 and a not in used]
        while axes and size % math.prod(sizes[a] for a in axes):
            axes.pop()
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*spec)


def named_sharding(logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    """`partition_spec` wrapped in a NamedSharding on `mesh`."""
    return NamedSharding(mesh, partition_spec(logical, shape, mesh))


def put(x: Any, mesh: Mesh, logical: Sequence[str | None] | None = None) -> jax.Array:
    """A host array onto `mesh`, split by `logical` names (None: replicated). Built from each device's slice, so
    it works when the mesh spans several processes too, each holding the same host value."""
    x = np.asarray(x)
    sharding = NamedSharding(mesh, PartitionSpec()) if logical is None else named_sharding(logical, x.shape, mesh)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def shard_shape(logical: Sequence[str | None], shape: Sequence[int], mesh: Any) -> tuple[int, ...]:
    """The shape of one device's piece of an array sharded by these logical names."""
    sizes = mesh if isinstance(mesh, dict) else dict(mesh.shape)
    spec = partition_spec(logical, shape, sizes)
    return tuple(n // math.prod(sizes[a] for a in _axes(entry)) for n, entry in zip(shape, spec))


def _axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """A rules value or PartitionSpec entry (one mesh axis, several, or None) as a tuple of mesh axes."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def spec_table(infos: Iterable[Any], mesh: Any) -> dict[str, list[str | None]]:
    """Parameter path -> its PartitionSpec as a JSON-able list (the golden sharding files' content).

    Args:
        infos: objects with `.path`, `.shape` and `.axes` (logical names), e.g. `day0jax.models.param_infos`.
        mesh: a Mesh, AbstractMesh or sizes dict.
    """
    return {i.path: list(partition_spec(i.axes, i.shape, mesh)) for i in infos}


def constrain(x: jax.Array, logical: Sequence[str | None] = ACTIVATION) -> jax.Array:
    """Pins an activation's sharding on the mesh set by `jax.set_mesh` (a no-op without one). Used at block
    boundaries only, so XLA places each block's collectives (tp all-reduces after o_proj and down_proj) itself."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, partition_spec(logical, x.shape, mesh))
