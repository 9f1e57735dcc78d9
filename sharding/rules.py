"""Logical axis names to mesh axes: the one table that decides how parameters and caches are split.

Parameters declare logical names where they are made (`nnx.with_partitioning`); this table maps them to mesh
axes. XLA inserts the collectives. A logical axis whose size the mesh axis does not divide stays replicated
(kv heads fewer than tp, for instance), which is correct, only less memory-efficient.
"""

from __future__ import annotations

from typing import Sequence

from jax.sharding import Mesh, NamedSharding, PartitionSpec

# logical axis -> mesh axis (None: replicated).
RULES: dict[str, str | None] = {
    "batch": "dp",
    "seq": None,
    "embed": None,
    "heads": "tp",
    "kv_heads": "tp",
    "head_dim": None,
    "mlp": "tp",
    "vocab": "tp",
    "experts": "ep",
    "expert_mlp": "tp",
    "norm": None,
}


def partition_spec(logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                   rules: dict[str, str | None] = RULES) -> PartitionSpec:
    """The PartitionSpec for an array whose dimensions carry these logical names.

    A dimension is split over its mesh axis only when the axis size divides it and no earlier dimension of the
    same array already uses that mesh axis.
    """
    used: set[str] = set()
    spec = []
    for name, size in zip(logical, shape):
        axis = rules.get(name) if name else None
        if axis is None or axis in used or mesh.shape.get(axis, 1) == 1 or size % mesh.shape[axis]:
            spec.append(None)
            continue
        used.add(axis)
        spec.append(axis)
    return PartitionSpec(*spec)


def named_sharding(logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    """`partition_spec` wrapped in a NamedSharding on `mesh`."""
    return NamedSharding(mesh, partition_spec(logical, shape, mesh))
