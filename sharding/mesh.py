"""Device meshes from a SPEC such as `pp=2,dp=2,tp=4,ep=1` (pipeline, data, tensor, expert parallelism), or chosen
automatically.

Axes are (dp, ep, tp), with `pp` first when the SPEC has pp > 1 (see pipeline.py): tensor parallelism innermost,
where devices are best connected, pipeline stages outermost, where they are not (devices are numbered host by
host, so consecutive ones share a host). The product of the sizes is the number of devices used:
an explicit `devices` list's length; at most the visible devices in one process (it takes the first ones); every
process's devices when multi-host. tp must divide the attention heads and ep the experts (in a dense model ep
splits only the batch, like dp; see rules.py). Refusals say which meshes would work."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from day0jax.core.errors import MeshError

AXES = ("pp", "dp", "ep", "tp")
MODEL_AXES = AXES[1:]  # the axes of one pipeline stage's mesh
AXIS_MEANING = {"pp": "pipeline parallel: splits the layers into stages",
                "dp": "data parallel: splits the batch", "ep": "expert parallel: splits the experts",
                "tp": "tensor parallel: splits heads, MLP and vocabulary"}
AUTO = "auto"
# Logical axes that must be split evenly by a mesh axis for the model to run on it (others fall back to
# replication, see rules.py): each tensor-parallel rank owns whole attention heads, each expert rank whole experts.
MUST_DIVIDE = {"tp": ("heads", "attention heads"), "ep": ("experts", "experts")}


def parse_spec(spec: str | None) -> dict[str, int]:
    """Parses `dp=2,tp=4` into {'pp': 1, 'dp': 2, 'ep': 1, 'tp': 4}; missing axes are 1.

    Args:
        spec: comma-separated AXIS=SIZE pairs, AXIS one of pp, dp, ep, tp; None or "" is a single device.
    Returns:
        The size of every axis.
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
            raise MeshError(f"mesh spec {spec!r}: {part.strip()!r} is not AXIS=SIZE with AXIS one of "
                            + "; ".join(f"{a} ({m})" for a, m in AXIS_MEANING.items())
                            + ". Example: 'dp=2,tp=4'")
        if name in seen:
            raise MeshError(f"mesh spec {spec!r}: axis {name!r} given twice; give each axis once, e.g. "
                            f"'{name}={value.strip()}'")
        seen.add(name)
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size < 1:
            raise MeshError(f"mesh spec {spec!r}: size of {name!r} must be a positive integer, got {value.strip()!r}")
        sizes[name] = size
    return sizes


def format_spec(sizes: dict[str, int]) -> str:
    """{'pp': 1, 'dp': 2, 'ep': 1, 'tp': 4} -> 'dp=2,tp=4' (axes of size 1 left out; a single device is 'dp=1')."""
    parts = [f"{a}={sizes.get(a, 1)}" for a in AXES if sizes.get(a, 1) > 1]
    return ",".join(parts) or "dp=1"


def mesh_sizes(mesh: Any) -> dict[str, int]:
    """The axis sizes of a `Mesh`, an `AbstractMesh`, a SPEC string or a sizes dict, as {'pp', 'dp', 'ep', 'tp'}."""
    if isinstance(mesh, str) or mesh is None:
        return parse_spec(mesh)
    shape = mesh if isinstance(mesh, dict) else dict(mesh.shape)
    return {a: int(shape.get(a, 1)) for a in AXES}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _must_divide(infos: Iterable[Any]) -> dict[str, tuple[int, str]]:
    """mesh axis -> (size of the logical axis it must divide, a parameter that has it), from parameter infos."""
    found: dict[str, tuple[int, str]] = {}
    for info in infos:
        for name, size in zip(info.axes, info.shape):
            for axis, (logical, _) in MUST_DIVIDE.items():
                if name == logical:
                    # Families have one head count and one expert count; keep the first seen (layer 0).
                    found.setdefault(axis, (int(size), info.path))
    return found


def _layers(infos: Iterable[Any]) -> int | None:
    """Decoder layers of a model with `model.layers.N` parameters (None for another layout: a vision-language
    model, which pipeline stages refuse with their own message)."""
    from sharding.pipeline import layer_index

    found = [layer_index(i.path) for i in infos if layer_index(i.path) is not None]
    return 1 + max(found) if found else None


def problems(sizes: dict[str, int], infos: Sequence[Any] | None) -> list[str]:
    """Why a mesh of these sizes cannot run the model whose parameters are `infos` (empty: it can)."""
    if infos is None:
        return []
    need = _must_divide(infos)
    out = []
    pp, layers = sizes.get("pp", 1), _layers(infos)
    if pp > 1 and layers is not None and pp > layers:
        out.append(f"pp={pp} is more pipeline stages than the model's {layers} decoder layers")
    for axis, (_, words) in MUST_DIVIDE.items():
        size = sizes.get(axis, 1)
        if axis in need and need[axis][0] % size:
            n, where = need[axis]
            allowed = ", ".join(str(d) for d in divisors(n))
            out.append(f"{axis}={size} does not divide the {n} {words} ({where}); {axis} must be one of {allowed}")
    return out


def valid_sizes(n_devices: int, infos: Sequence[Any] | None = None, pipeline: bool = False
                ) -> list[dict[str, int]]:
    """Every (dp, ep, tp) over `n_devices` that fits the model, most tensor parallel first; ep=1 only without
    experts (there ep would only repeat what dp does). With `pipeline`, the meshes with pp > 1 follow (pp=2
    first)."""
    moe = infos is None or "ep" in _must_divide(infos)
    out = []
    for pp in divisors(n_devices) if pipeline else [1]:
        inner = n_devices // pp
        for tp in reversed(divisors(inner)):
            for ep in reversed(divisors(inner // tp) if moe else [1]):
                sizes = {"pp": pp, "dp": inner // tp // ep, "ep": ep, "tp": tp}
                if not problems(sizes, infos):
                    out.append(sizes)
    return out


def _would_work(n_devices: int, infos: Sequence[Any] | None, limit: int = 6) -> str:
    options = [format_spec(s) for s in valid_sizes(n_devices, infos)]
    if not options:
        return f"no mesh over {n_devices} device(s) fits this model"
    more = f" (and {len(options) - limit} more)" if len(options) > limit else ""
    return f"meshes that would work on {n_devices} device(s): " + "; ".join(options[:limit]) + more


def crossing(sizes: dict[str, int], devices_per_host: int) -> dict[str, bool]:
    """Mesh axis -> whether one of its groups (devices that differ only along it) spans more than one host, when
    devices are numbered host by host and laid out (pp, dp, ep, tp) with tp innermost, as `make_mesh` does."""
    shape = [sizes.get(a, 1) for a in AXES]
    host = np.arange(math.prod(shape)).reshape(shape) // devices_per_host
    return {a: bool((host != np.take(host, [0], axis=i)).any()) for i, a in enumerate(AXES)}


def placement_key(sizes: dict[str, int], devices_per_host: int | None = None) -> tuple:
    """Sort key for meshes: the smallest model-parallel group (pp * tp * ep) first, the rest data parallel, since
    replicas scale throughput without collectives; then, given the devices per host, meshes whose tp (the most
    traffic), then ep, stays inside a host; then fewer pipeline stages (each adds a transfer per step), then more
    tp, which also splits attention. So pp comes in when tp alone would cross hosts or the model does not fit."""
    cross = crossing(sizes, devices_per_host) if devices_per_host else {}
    pp = sizes.get("pp", 1)
    return pp * sizes["tp"] * sizes["ep"], cross.get("tp", False), cross.get("ep", False), pp, -sizes["tp"]


def auto_sizes(n_devices: int, infos: Sequence[Any] | None = None,
               fits: Callable[[dict[str, int]], bool] | None = None,
               devices_per_host: int | None = None) -> dict[str, int]:
    """The mesh `--mesh auto` picks over `n_devices`: with `fits` (a memory test, see plan.py) the first that fits in
    `placement_key` order, else the most tensor parallelism the model allows (the least memory).

    Raises:
        MeshError: no mesh over these devices fits the model.
    """
    options = valid_sizes(n_devices, infos)
    if not options:
        raise MeshError(f"no mesh over {n_devices} device(s) fits this model: "
                        + "; ".join(problems({"tp": n_devices}, infos)))
    if fits is None:
        return options[0]
    candidates = valid_sizes(n_devices, infos, pipeline=True)
    for sizes in sorted(candidates, key=lambda s: placement_key(s, devices_per_host)):
        if fits(sizes):
            return sizes
    return options[0]  # nothing fits: the caller's planner reports it with the least memory-hungry mesh


def host_ordered(devices: Sequence[Any]) -> tuple[list[Any], int | None]:
    """`devices` numbered host by host (by process, then id), and the devices per host when they span several
    processes (None for one), so that tp, innermost, stays inside a host whenever it fits there."""
    processes = {getattr(d, "process_index", 0) for d in devices}
    if len(processes) == 1:
        return list(devices), None
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return ordered, min(sum(d.process_index == p for d in devices) for p in processes)


def make_mesh(spec: str | dict | None = None, devices: Sequence[Any] | None = None, *,
              infos: Sequence[Any] | None = None,
              fits: Callable[[dict[str, int]], bool] | None = None) -> Mesh:
    """A mesh from a SPEC, over the visible (or given) devices, checked against the model.

    Args:
        spec: `pp=..,dp=..,tp=..,ep=..`, a sizes dict, 'auto' (see `auto_sizes`), or None/"" for one device.
        devices: the devices to use, all of them (default: `jax.devices()`, every process's devices).
        infos: the model's parameters (`.path`, `.shape`, `.axes`), to refuse meshes that do not divide its heads or
            experts; None skips that check.
        fits: for 'auto', a memory test on candidate sizes.
    Returns:
        A `Mesh` with axes ('dp', 'ep', 'tp'), or ('pp', 'dp', 'ep', 'tp') when pp > 1.
    Raises:
        MeshError: the spec is malformed, its product does not match the devices, or it does not fit the model;
            the message lists meshes that would work.
    """
    explicit = devices is not None
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise MeshError("no devices to build a mesh on")
    platform = devices[0].platform
    processes = len({getattr(d, "process_index", 0) for d in devices})
    multi_process = processes > 1
    devices, per_host = host_ordered(devices)
    sizes = auto_sizes(len(devices), infos, fits, per_host) if spec == AUTO else mesh_sizes(spec)
    label = spec if isinstance(spec, str) else format_spec(sizes)
    needed = math.prod(sizes.values())
    if needed > len(devices):
        raise MeshError(f"mesh spec {label!r} needs {needed} devices but only {len(devices)} {platform} device(s) "
                        f"are {'given' if explicit else 'visible'}; {_would_work(len(devices), infos)}")
    if needed < len(devices) and (explicit or multi_process):
        why = f"all {len(devices)} devices of the {processes} processes" if multi_process else "the devices given"
        raise MeshError(f"mesh spec {label!r} uses {needed} device(s); the product of the sizes must equal "
                        f"{len(devices)} ({why}); {_would_work(len(devices), infos)}")
    bad = problems(sizes, infos)
    if bad:
        raise MeshError(f"mesh spec {label!r} does not fit the model: {'; '.join(bad)}. "
                        f"{_would_work(needed, infos)}")
    axes = AXES if sizes["pp"] > 1 else MODEL_AXES
    grid = np.array(devices[:needed], dtype=object).reshape([sizes[a] for a in axes])
    return Mesh(grid, axes)


def describe(mesh: Mesh) -> str:
    """`dp=1,ep=1,tp=4 on 4 cpu device(s)`, for logs and reports."""
    spec = ",".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
    return f"{spec} on {mesh.devices.size} {mesh.devices.flat[0].platform} device(s)"
