"""Multi-host start-up: JAX's distributed runtime, so one mesh spans the devices of several processes.

Every process runs the same program with `--coordinator HOST:PORT --num-processes N --process-id I` (or
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); process 0 hosts the coordinator. Then `jax.devices()`
lists every process's devices and a mesh over them is one program (collectives over NCCL between GPUs, gloo between
CPU processes). Each process loads only its devices' slices of the checkpoint, which all must read at the same path
(a shared file system, or a copy on each host). Without a coordinator nothing starts: one process, local devices.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from typing import Mapping

from day0jax.core.errors import MeshError

log = logging.getLogger(__name__)

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


@dataclass(frozen=True)
class Cluster:
    """Where this process stands: coordinator address, process count and this process's index."""

    coordinator: str
    num_processes: int
    process_id: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds --coordinator, --num-processes and --process-id to a CLI's parser."""
    g = parser.add_argument_group("multi-host (JAX distributed runtime)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help=f"address of process 0's coordinator (env {ENV_COORDINATOR}); enables multi-host")
    g.add_argument("--num-processes", type=int, default=None, metavar="N",
                   help=f"number of processes (env {ENV_NUM_PROCESSES})")
    g.add_argument("--process-id", type=int, default=None, metavar="I",
                   help=f"this process's index, 0..N-1 (env {ENV_PROCESS_ID})")


def resolve(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
            env: Mapping[str, str] | None = None) -> Cluster | None:
    """The cluster from arguments, falling back to the environment; None when no coordinator is set.

    Raises:
        MeshError: a malformed address, a missing or non-integer count or index, or an index out of range.
    """
    env = os.environ if env is None else env
    coordinator = coordinator or env.get(ENV_COORDINATOR) or None
    if coordinator is None:
        if num_processes not in (None, 1) or process_id not in (None, 0):
            raise MeshError("--num-processes/--process-id need --coordinator HOST:PORT (or "
                            f"{ENV_COORDINATOR}): the address of process 0")
        return None
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise MeshError(f"--coordinator {coordinator!r} is not HOST:PORT (e.g. 10.0.0.1:1234 or localhost:1234)")

    def integer(value, flag: str, var: str) -> int:
        value = value if value is not None else env.get(var)
        if value is None:
            raise MeshError(f"--coordinator is set but {flag} is not (nor {var})")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise MeshError(f"{flag} must be an integer, got {value!r}") from None

    n = integer(num_processes, "--num-processes", ENV_NUM_PROCESSES)
    i = integer(process_id, "--process-id", ENV_PROCESS_ID)
    if n < 1:
        raise MeshError(f"--num-processes must be at least 1, got {n}")
    if not 0 <= i < n:
        raise MeshError(f"--process-id must be in 0..{n - 1} for --num-processes {n}, got {i}")
    return Cluster(coordinator, n, i)


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, env: Mapping[str, str] | None = None, timeout_s: int = 300) -> Cluster | None:
    """Starts JAX's distributed runtime when a coordinator is given; must run before anything touches a JAX device.

    Args:
        coordinator: HOST:PORT of process 0 (default: $JAX_COORDINATOR_ADDRESS).
        num_processes: process count (default: $JAX_NUM_PROCESSES).
        process_id: this process's index (default: $JAX_PROCESS_ID).
        env: the environment to read (default: os.environ).
        timeout_s: how long to wait for every process to join.
    Returns:
        The `Cluster`, or None when no coordinator is set (single process; nothing started).
    Raises:
        MeshError: bad arguments, or JAX devices already in use so the runtime can no longer start.
    """
    cluster = resolve(coordinator, num_processes, process_id, env)
    if cluster is None:
        return None
    import jax
    from jax._src import distributed as jax_distributed
    from jax._src import xla_bridge

    if jax_distributed.global_state.client is not None:
        return cluster  # already started (a CLI that calls the library that calls initialize)
    if xla_bridge.backends_are_initialized():
        raise MeshError("the distributed runtime must start before any JAX device is used: call "
                        "sharding.distributed.initialize first thing in the program")
    # gloo is the CPU backend's cross-process collectives; without it a multi-process CPU mesh cannot all-reduce.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    log.info("joining %d processes as process %d via %s", cluster.num_processes, cluster.process_id,
             cluster.coordinator)
    jax.distributed.initialize(coordinator_address=cluster.coordinator, num_processes=cluster.num_processes,
                               process_id=cluster.process_id, initialization_timeout=timeout_s)
    return cluster


def initialize_from_args(args: argparse.Namespace) -> Cluster | None:
    """`initialize` with the values of `add_arguments`' flags (environment variables fill the gaps)."""
    return initialize(getattr(args, "coordinator", None), getattr(args, "num_processes", None),
                      getattr(args, "process_id", None))
