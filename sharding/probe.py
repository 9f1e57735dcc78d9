"""Measures the collectives of each mesh axis on the devices present, and what they cost a decode step.

`probe()` times an all-reduce and an all-gather over each axis of size > 1 at a small and a large size: the small
one gives the latency, the large one the bandwidth (bytes each device sends per second, the ring algorithms'
traffic, as `cluster.traffic` counts it). `decode_step_time()` turns a model's traffic per token into seconds per
decode step with those figures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sharding.cluster import traffic
from sharding.plan import ModelShape
from sharding.rules import shard_shape

SMALL, LARGE = 4 << 10, 16 << 20  # bytes per device: latency, then bandwidth
REPEATS = 5


@dataclass(frozen=True)
class AxisLink:
    """One mesh axis's measured collectives: bandwidth in bytes each device sends per second, latency in seconds
    (the time of a small one)."""

    axis: str
    size: int
    all_reduce_bandwidth: float
    all_reduce_latency: float
    all_gather_bandwidth: float
    all_gather_latency: float

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _timed(fn, x) -> float:
    """Best of REPEATS wall times of `fn(x)`, after one call that compiles it."""
    jax.block_until_ready(fn(x))
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        best = min(best, time.perf_counter() - start)
    return best


def _collective(mesh: Mesh, axis: str, kind: str, nbytes: int) -> float:
    """Seconds one all-reduce or all-gather of `nbytes` per device over `axis` takes."""
    every = tuple(mesh.axis_names)
    n = max(nbytes // 4, 1)
    x = jax.device_put(jnp.ones((mesh.devices.size * n,), jnp.float32), NamedSharding(mesh, P(every)))
    if kind == "all-reduce":
        body = partial(jax.lax.psum, axis_name=axis)
    else:
        body = partial(jax.lax.all_gather, axis_name=axis, tiled=True)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(every), out_specs=P(every)))
    return _timed(fn, x)


def probe(mesh: Mesh) -> list[AxisLink]:
    """All-reduce and all-gather latency and bandwidth over each axis of `mesh` of size > 1."""
    out = []
    for axis in mesh.axis_names:
        k = mesh.shape[axis]
        if k == 1:
            continue
        figures = []
        for kind, sent in (("all-reduce", 2 * (k - 1) / k), ("all-gather", k - 1)):
            latency = _collective(mesh, axis, kind, SMALL)
            seconds = _collective(mesh, axis, kind, LARGE)
            # Bytes a device sends: a ring all-reduce 2(k-1)/k of its buffer, an all-gather its buffer to k-1 others.
            figures += [sent * LARGE / max(seconds - latency, 1e-9), latency]
        out.append(AxisLink(axis, k, *figures))
    return out


def decode_step_time(shape: ModelShape, sizes: dict[str, int], dtype: Any, rows: int,
                     links: list[AxisLink]) -> dict[str, float]:
    """Estimated seconds of communication per decode step of `rows` sequences, by axis: for each collective its
    latency plus the bytes one device sends over the axis's measured bandwidth (all-reduce figures for tp, all-gather
    figures for ep's exchange of tokens with their experts and for pp's hand-over between stages).

    Args:
        shape: the model's `ModelShape`; sizes: the mesh; dtype: of activations.
        rows: sequences decoded together (the engine's max_num_seqs).
        links: `probe()` on that mesh.
    """
    by_axis = {link.axis: link for link in links}
    per_device_rows = shard_shape(("batch",), (rows,), sizes)[0]  # the batch is split over dp and ep
    out = {}
    for t in traffic(shape, sizes, dtype):
        link = by_axis.get(t.axis)
        if link is None or not t.decode_bytes:
            continue
        # `traffic` sums a token's bytes over the tp ranks that each move a copy: one device sends 1/tp of them for
        # every row it holds.
        sent = t.decode_bytes / sizes["tp"] * per_device_rows
        if t.axis == "tp":  # an all-reduce after every mixer, feed-forward and the embedding; the logits gathered
            count, bandwidth, latency = 2 * len(shape.cache_layout) + 2, link.all_reduce_bandwidth, \
                link.all_reduce_latency
        elif t.axis == "pp":  # the residual stream to the next stage, once per boundary (priced as a gather)
            count, bandwidth, latency = sizes["pp"] - 1, link.all_gather_bandwidth, link.all_gather_latency
        else:  # each MoE layer sends tokens to their experts and brings the outputs back
            count, bandwidth, latency = 2 * len(shape.moe_top_k), link.all_gather_bandwidth, link.all_gather_latency
        out[t.axis] = count * latency + sent / bandwidth
    return out
