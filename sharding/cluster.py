"""Plans for a cluster that is not here: `hosts` machines of `devices_per_host` devices with `device_memory` each.

Devices are numbered host by host and the mesh axes (pp, dp, ep, tp) laid over them tp innermost (mesh.py), so an axis
stays inside a host only while it and the axes inside it fit there (`mesh.crossing`). `traffic()` estimates the
bytes each axis moves per token; `ranked_meshes()` orders meshes as `--mesh auto` does over several hosts. The
per-device memory itself is `plan.plan()`, the same as for devices that are present."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

import jax.numpy as jnp

from day0jax.core.errors import MeshError
from sharding import mesh as mesh_lib
from sharding.plan import HEADROOM, ModelShape, fmt_bytes

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """'141GiB' -> 151397597184; also KiB/MiB/TiB, decimal kB/MB/GB/TB, a bare number of bytes.

    Raises:
        MeshError: not a positive size with one of those units.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m and m.group(2).lower()
    if not m or unit not in UNITS or float(m.group(1)) <= 0:
        raise MeshError(f"device memory {text!r}: expected a positive size such as '141GiB', '80GB' or '96GiB' "
                        f"(units: {', '.join(u for u in UNITS if u)})")
    return int(float(m.group(1)) * UNITS[unit])


@dataclass(frozen=True)
class Cluster:
    """`hosts` machines of `devices_per_host` devices, each with `device_memory` bytes."""

    hosts: int
    devices_per_host: int
    device_memory: int

    def __post_init__(self):
        for name in ("hosts", "devices_per_host", "device_memory"):
            if int(getattr(self, name)) < 1:
                raise MeshError(f"cluster: {name} must be a positive integer, got {getattr(self, name)!r}")

    @property
    def devices(self) -> int:
        return self.hosts * self.devices_per_host

    @property
    def available(self) -> int:
        """What the plan may use of one device, after the same headroom as a present device's free memory."""
        return int(self.device_memory * HEADROOM)

    def describe(self) -> str:
        return (f"{self.hosts} host(s) x {self.devices_per_host} device(s) of {fmt_bytes(self.device_memory)} "
                f"({self.devices} devices)")


@dataclass(frozen=True)
class AxisTraffic:
    """What one mesh axis moves per token, all of its devices together (bytes sent)."""

    axis: str
    size: int
    crosses_hosts: bool
    decode_bytes: int  # per generated token
    prefill_bytes: int  # per prompt token
    what: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def traffic(shape: ModelShape, sizes: dict[str, int], dtype: Any,
            devices_per_host: int | None = None) -> list[AxisTraffic]:
    """Bytes each mesh axis moves per token, from the layout's collectives (XLA's partitioner inserts them from
    the rules in rules.py): an estimate of the traffic, not of how XLA schedules it.

    tp: every layer's token mixer and feed-forward end in an all-reduce of the residual stream (heads and MLP are
    split), and so does the embedding lookup (vocabulary split); a ring all-reduce of S bytes over t devices sends
    2(t-1)S in all. The sampler needs the whole vocabulary, so each generated token's float32 logits are gathered:
    (t-1)V x 4 bytes. ep: each token's hidden state goes to its k experts and their outputs come back; with experts
    spread evenly, (e-1)/e of them live on another rank, and every tp rank moves its own copy. dp: nothing per token
    (replicas share no activations). pp: each token's residual stream goes from each stage to the next, once per
    stage boundary, each of the token's tp ranks sending its copy (the sampled token's way back to the first stage,
    4 bytes, left out).

    Args:
        shape: the model's `ModelShape`.
        sizes: mesh axis sizes.
        dtype: of activations (the model's dtype).
        devices_per_host: devices in one host, to say which axes cross hosts (None: one host).
    """
    item = jnp.dtype(dtype).itemsize
    cross = mesh_lib.crossing(sizes, devices_per_host or math.prod(sizes.values()))
    D, layers = shape.hidden_size, len(shape.cache_layout)
    t, e = sizes.get("tp", 1), sizes.get("ep", 1)
    out = []
    if sizes.get("dp", 1) > 1:
        out.append(AxisTraffic("dp", sizes["dp"], cross["dp"], 0, 0, "nothing per token: replicas"))
    if e > 1:
        moved = round(sum(2 * k * D * item * (e - 1) / e for k in shape.moe_top_k) * t)
        what = (f"{len(shape.moe_top_k)} MoE layers: each token to its experts and back" if shape.moe_top_k
                else "no experts: splits the batch like dp")
        out.append(AxisTraffic("ep", e, cross["ep"], moved, moved, what))
    pp = sizes.get("pp", 1)
    if pp > 1:
        hop = (pp - 1) * D * item * t
        out.append(AxisTraffic("pp", pp, cross["pp"], hop, hop,
                               f"{pp - 1} stage boundaries: the residual stream to the next stage"))
    if t > 1:
        # Stages split the layers, not the all-reduces: every layer's still happen, each inside its stage.
        reduced = (2 * layers + 1) * 2 * (t - 1) * D * item
        logits = (t - 1) * shape.vocab_size * 4
        out.append(AxisTraffic("tp", t, cross["tp"], reduced + logits, reduced,
                               f"{2 * layers + 1} all-reduces of the residual; decode also gathers the logits"))
    return out


def ranked_meshes(cluster: Cluster, infos: Sequence[Any]) -> list[dict[str, int]]:
    """Every mesh over all of the cluster's devices that divides the model, pipeline stages included, in
    `mesh.placement_key` order."""
    return sorted(mesh_lib.valid_sizes(cluster.devices, infos, pipeline=True),
                  key=lambda s: mesh_lib.placement_key(s, cluster.devices_per_host))
