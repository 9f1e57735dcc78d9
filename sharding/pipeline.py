"""Pipeline parallelism: which layers each stage of the `pp` mesh axis holds, where each parameter lives, and each
stage's own (dp, ep, tp) mesh.

A stage holds a contiguous range of decoder layers. The ranges minimize the largest stage's step bytes, what one
decode step reads there and so what sets its time: its layers' parameters and KV page pool, plus the final norm and
vocabulary projection on the last stage. The embedding table is held by the first stage but not counted there: a
step reads one row of it per token (counting it, as memory would, leaves the first stage with fewer layers and the
pipeline waiting on the others; the memory plan counts it, per stage). Parameters outside the layers are held where
they are used: the embeddings by the first stage (and the last, when the vocabulary projection reuses them), the
final norm and projection by the last, anything else (RoPE parameters and the like) by every stage. A parameter
lives on its stage's mesh, or on the mesh of the stages that use it (each stage's program then takes its own
devices' shards).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.rules import named_sharding, shard_shape

LAYER = re.compile(r"model\.layers\.(\d+)\.")
FIRST_ONLY = ("model.embed_tokens.",)
LAST_ONLY = ("model.norm.", "lm_head.")


def layer_index(path: str) -> int | None:
    """The decoder layer a parameter path belongs to (`model.layers.3.mlp...` -> 3), or None."""
    m = LAYER.match(path)
    return int(m[1]) if m else None


def stage_meshes(mesh: Mesh) -> list[Mesh]:
    """One (dp, ep, tp) mesh per pipeline stage of a mesh whose first axis is `pp` (a mesh without it: itself)."""
    if "pp" not in mesh.axis_names:
        return [mesh]
    inner = tuple(a for a in mesh.axis_names if a != "pp")
    return [Mesh(mesh.devices[s], inner) for s in range(mesh.shape["pp"])]


def balanced_ranges(costs: Sequence[int], pp: int, first: int = 0, last: int = 0) -> tuple[range, ...]:
    """`pp` contiguous, non-empty ranges of layers whose largest total cost is the smallest possible.

    Args:
        costs: bytes per layer.
        pp: stages; at most `len(costs)`.
        first, last: extra bytes of the first and the last stage.
    Returns:
        One range of layer indices per stage, in order.
    """
    n = len(costs)
    if not 1 <= pp <= n:
        raise ValueError(f"{pp} pipeline stages need at least as many layers; the model has {n}")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(s: int, a: int, b: int) -> int:
        return prefix[b] - prefix[a] + (first if s == 0 else 0) + (last if s == pp - 1 else 0)

    # best[s][b]: the smallest largest cost of splitting layers [0, b) into stages 0..s; small (layers x stages^2).
    INF = float("inf")
    best = [[INF] * (n + 1) for _ in range(pp)]
    cut = [[0] * (n + 1) for _ in range(pp)]
    for b in range(1, n + 1):
        best[0][b] = stage_cost(0, 0, b)
    for s in range(1, pp):
        for b in range(s + 1, n + 1):
            for a in range(s, b):
                value = max(best[s - 1][a], stage_cost(s, a, b))
                if value < best[s][b]:
                    best[s][b], cut[s][b] = value, a
    bounds, b = [n], n
    for s in range(pp - 1, 0, -1):
        b = cut[s][b]
        bounds.append(b)
    bounds.append(0)
    bounds.reverse()
    return tuple(range(bounds[s], bounds[s + 1]) for s in range(pp))


@dataclass(frozen=True)
class Stages:
    """The pipeline's split of a model: one range of layers per stage."""

    ranges: tuple[range, ...]
    tied: bool  # the vocabulary projection reuses the embeddings: the last stage holds them too

    @property
    def count(self) -> int:
        return len(self.ranges)

    @property
    def last(self) -> int:
        return len(self.ranges) - 1

    def of_layer(self, index: int) -> int:
        return next(s for s, r in enumerate(self.ranges) if index in r)

    def holders(self, path: str) -> tuple[int, ...]:
        """The stages that use parameter `path`; the first of them holds the loaded array."""
        layer = layer_index(path)
        if layer is not None:
            return (self.of_layer(layer),)
        if path.startswith(FIRST_ONLY):
            return (0, self.last) if self.tied and self.last else (0,)
        if path.startswith(LAST_ONLY):
            return (self.last,)
        return tuple(range(self.count))

    def describe(self) -> str:
        """`layers 0-5 | 6-11`, for logs and reports."""
        return " | ".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else f"{r.start}" for r in self.ranges)


def param_bytes(info: Any, sizes: dict[str, int], itemsize: int) -> int:
    """One device's bytes of a parameter (`.axes`, `.shape`) split over a stage's (dp, ep, tp) sizes."""
    return math.prod(shard_shape(info.axes, info.shape, sizes)) * itemsize


def plan_stages(params: Sequence[Any], layer_kv_bytes: Sequence[int], pp: int, sizes: dict[str, int],
                itemsize: Any) -> Stages:
    """The split of a model over `pp` stages whose meshes have `sizes`, balanced by one device's step bytes (see
    the module docstring).

    Args:
        params: the model's parameters (`.path`, `.shape`, `.axes`).
        layer_kv_bytes: one device's KV pool (and state) bytes per layer.
        pp: pipeline stages.
        sizes: each stage's (dp, ep, tp) sizes.
        itemsize: callable(param) -> bytes per element as loaded.
    Raises:
        ValueError: more stages than layers.
    """
    costs = list(layer_kv_bytes)
    last = 0
    tied = not any(p.path.startswith("lm_head.") for p in params)
    for p in params:
        n = param_bytes(p, sizes, itemsize(p))
        layer = layer_index(p.path)
        if layer is not None:
            costs[layer] += n
        elif p.path.startswith(FIRST_ONLY):
            last += n if tied else 0  # read whole as the vocabulary projection; a row per token as embeddings
        elif p.path.startswith(LAST_ONLY):
            last += n
    return Stages(balanced_ranges(costs, pp, 0, last), tied)


def param_sharding(info: Any, mesh: Mesh, stages: Stages | None) -> NamedSharding:
    """Where parameter `info` is loaded: split by its logical axes over the mesh, or with a `pp` axis over the mesh
    of the stage that uses it, or of the stages that do (`holders_mesh`)."""
    if stages is None or "pp" not in mesh.axis_names:
        return named_sharding(info.axes, info.shape, mesh)
    holders = stages.holders(info.path)
    inner = stage_meshes(mesh)[holders[0]]
    spec = named_sharding(info.axes, info.shape, inner).spec
    return NamedSharding(inner if len(holders) == 1 else holders_mesh(mesh, holders), spec)


def holders_mesh(mesh: Mesh, holders: Sequence[int]) -> Mesh:
    """The mesh a parameter used by several stages is loaded on: those stages' devices, with the `pp` axis (not in
    any parameter's spec, so every holder gets the whole of its (dp, ep, tp) split)."""
    return Mesh(mesh.devices[np.array(holders)], mesh.axis_names)


class Links:
    """Moves arrays between the stages of a pipeline mesh.

    In one process, a device-to-device copy. Across processes, a process cannot address another's devices, so
    every move is a program over the whole mesh that all processes run: the array is laid out as [pp, ...] (the
    sender's slot real, the others zeros) and rolled along the stage axis, a collective permute; the receiver takes
    its slot's shards. The sampler then runs on the whole mesh, its inputs broadcast there from the last stage, so
    that every process reads the same tokens. These programs share no data, so nothing would stop two of them from
    running at once, and collectives of programs in flight together may be matched across processes in different
    orders: each takes and returns an ordering token, which runs them one after the other, in the order every
    process dispatched them. XLA:CPU also runs a stage's program beside them on the same devices, and its gloo
    collectives then deadlock now and then: across CPU processes every program is waited for (`settle`) before the
    next is dispatched, which gives up the overlap of stages there (a test setting; accelerators order a device's
    programs).
    """

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.meshes = stage_meshes(mesh)
        me = jax.process_index()
        self.local = [any(d.process_index == me for d in m.devices.flat) for m in self.meshes]
        self.multi_process = len({d.process_index for d in mesh.devices.flat}) > 1
        # Where the sampler runs and the tokens every process reads live.
        self.sample_mesh = mesh if self.multi_process else self.meshes[-1]
        # One stage moves nothing between stages and samples where its logits already are: nothing to order.
        self.blocking = self.multi_process and len(self.meshes) > 1 and mesh.devices.flat[0].platform == "cpu"
        self._programs: dict = {}
        self._order = None  # the ordering token (multi-process only), on the whole mesh

    def restrict(self, x, s: int):
        """A sample-mesh array (replicated) as one on stage `s`'s mesh; None where that stage is not local."""
        target = NamedSharding(self.meshes[s], x.sharding.spec)
        if not self.multi_process:
            return jax.device_put(x, target)
        if not self.local[s]:
            return None
        return self._take(x, target)

    def send(self, x, src: int, dst: int, shape, dtype, spec):
        """Stage `src`'s array `x` (None on processes that do not run that stage) onto stage `dst`'s mesh with
        PartitionSpec `spec`; None on processes without `dst`'s devices."""
        target = NamedSharding(self.meshes[dst], spec)
        if not self.multi_process:
            return jax.device_put(x, target)
        moved = self._run("roll", shape, dtype, spec, dst - src, self._stacked(x, src, shape, dtype, spec))
        return self._take(moved, target, slot=True) if self.local[dst] else None

    def to_sampler(self, x, shape, dtype, spec):
        """The last stage's array onto the sample mesh, replicated (one stage: already there)."""
        if not self.multi_process or len(self.meshes) == 1:
            return x
        last = len(self.meshes) - 1
        return self._run("broadcast", shape, dtype, spec, 0, self._stacked(x, last, shape, dtype, spec))

    def _run(self, kind: str, shape, dtype, spec, shift: int, stacked):
        if self._order is None:
            self._order = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(self.mesh, PartitionSpec()))
        out, self._order = self._program(kind, shape, dtype, spec, shift)(stacked, self._order)
        return self.settle(out)

    def settle(self, x):
        """`x`, waited for where programs must not overlap (see the class docstring)."""
        if self.blocking:
            jax.block_until_ready(x)
        return x

    def _stacked(self, x, src: int, shape, dtype, spec):
        """The global [pp, *shape] array whose slot `src` is `x` (this process's shards of it) and the rest zeros."""
        sharding = NamedSharding(self.mesh, PartitionSpec("pp", *spec))
        full = (len(self.meshes),) + tuple(shape)
        piece = sharding.shard_shape(full)
        mine = {} if x is None else {s.device: s.data for s in x.addressable_shards}
        arrays = [mine[d][None] if d in mine else jnp.zeros(piece, dtype, device=d)
                  for d in sharding.addressable_devices]
        return jax.make_array_from_single_device_arrays(full, sharding, arrays)

    def _program(self, kind: str, shape, dtype, spec, shift: int):
        key = (kind, tuple(shape), str(dtype), tuple(spec), shift)
        if key not in self._programs:
            token = NamedSharding(self.mesh, PartitionSpec())
            if kind == "roll":
                out = NamedSharding(self.mesh, PartitionSpec("pp", *spec))
                fn = lambda a, order: (jnp.roll(a, shift, axis=0), order + 1)  # noqa: E731
            else:
                out = NamedSharding(self.mesh, PartitionSpec())
                fn = lambda a, order: (a[-1], order + 1)  # noqa: E731
            self._programs[key] = jax.jit(fn, out_shardings=(out, token))
        return self._programs[key]

    @staticmethod
    def _take(x, target: NamedSharding, slot: bool = False):
        """The shards of `x` on `target`'s local devices as one array with `target`'s sharding (no copy); `slot`:
        `x` is [pp, ...] and each shard drops its stage axis."""
        shards = {s.device: (s.data[0] if slot else s.data) for s in x.addressable_shards}
        shape = x.shape[1:] if slot else x.shape
        return jax.make_array_from_single_device_arrays(shape, target, [shards[d] for d in target.addressable_devices])
