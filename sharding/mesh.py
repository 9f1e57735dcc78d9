"""Device meshes from a SPEC string such as `dp=2,tp=4,ep=1` (data, tensor, expert parallelism).

The mesh always has the three axes, in the order (dp, ep, tp): tensor parallelism innermost, where devices are
best connected. The product of the sizes is the number of devices used.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh

from day0jax.errors import MeshError

AXES = ("dp", "ep", "tp")


def parse_spec(spec: str | None) -> dict[str, int]:
    """Parses `dp=2,tp=4` into {'dp': 2, 'ep': 1, 'tp': 4}; missing axes are 1.

    Raises:
        MeshError: an unknown axis, a repeated axis, or a size that is not a positive integer.
    """
    sizes = dict.fromkeys(AXES, 1)
    if not spec:
        return sizes
    seen = set()
    for part in spec.split(","):
        name, sep, value = part.strip().partition("=")
        name = name.strip()
        if not sep or name not in AXES:
            raise MeshError(f"mesh spec {spec!r}: {part.strip()!r} is not AXIS=SIZE with AXIS one of {', '.join(AXES)}")
        if name in seen:
            raise MeshError(f"mesh spec {spec!r}: axis {name!r} given twice")
        seen.add(name)
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size < 1:
            raise MeshError(f"mesh spec {spec!r}: size of {name!r} must be a positive integer, got {value!r}")
        sizes[name] = size
    return sizes


def make_mesh(spec: str | None = None, devices: list | None = None) -> Mesh:
    """A mesh over the first dp*ep*tp devices (default: one device).

    Args:
        spec: `dp=..,tp=..,ep=..`; None or "" means a single device.
        devices: the devices to use (default: `jax.devices()`).
    Returns:
        A `Mesh` with axes ('dp', 'ep', 'tp').
    Raises:
        MeshError: the spec is malformed or asks for more devices than exist.
    """
    sizes = parse_spec(spec)
    devices = list(jax.devices() if devices is None else devices)
    needed = math.prod(sizes.values())
    if needed > len(devices):
        raise MeshError(f"mesh spec {spec!r} needs {needed} devices but only {len(devices)} "
                        f"{devices[0].platform if devices else ''} device(s) are visible")
    grid = np.array(devices[:needed], dtype=object).reshape([sizes[a] for a in AXES])
    return Mesh(grid, AXES)


def describe(mesh: Mesh) -> str:
    """`dp=1,ep=1,tp=4 on 4 cpu devices`, for logs and reports."""
    spec = ",".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
    return f"{spec} on {mesh.devices.size} {mesh.devices.flat[0].platform} device(s)"
