"""The device a kernel is traced for, and the check every Mosaic GPU kernel makes before it accepts inputs.

Mosaic GPU kernels need a Hopper GPU (compute capability 9.0: wgmma, the TMA copy engine) and raise
`NotImplementedError` elsewhere, so the api falls back. Two explicit ways around that, for tests and `selfcheck`
(never an environment variable): `interpret=True` runs a kernel in the Mosaic GPU interpreter on the CPU;
`assume(HOPPER)` traces as if for an H100, so `jax.export(..., platforms=("cuda",))` lowers kernels without one.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from dataclasses import dataclass
from typing import Iterator

import jax


@dataclass(frozen=True)
class Target:
    """What a kernel needs to know about the device it is traced for."""

    platform: str  # 'cuda', 'rocm', 'tpu', 'cpu', ...
    device_kind: str  # the device's own name, e.g. 'NVIDIA H100 80GB HBM3'
    compute_capability: str | None  # '9.0' for Hopper; None off NVIDIA GPUs
    num_cores: int  # streaming multiprocessors (or cores) per device: sizes persistent grids and split counts

    @property
    def is_hopper(self) -> bool:
        return self.platform == "cuda" and self.compute_capability == "9.0"

    @property
    def kind(self) -> str:
        """A short, stable key for tuning tables: 'h100', 'h200', 'h800', 'gh200', 'h20', else the name."""
        return short_kind(self.device_kind)


# An H100 SXM as seen by jax; what `--lower cuda` and the lowering tests trace for.
HOPPER = Target("cuda", "NVIDIA H100 80GB HBM3", "9.0", 132)

_assumed: contextvars.ContextVar[Target | None] = contextvars.ContextVar("kernels_pallas_target", default=None)


def short_kind(device_kind: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA GH200 480GB' -> 'gh200'; unknown names lower-cased."""
    m = re.search(r"\b(GH200|H200|H100|H800|H20|A100|L40S|B200|GB200)\b", device_kind, re.IGNORECASE)
    return m.group(1).lower() if m else device_kind.strip().lower()


def current() -> Target:
    """The assumed target if `assume` is active, else JAX's first device."""
    assumed = _assumed.get()
    if assumed is not None:
        return assumed
    dev = jax.devices()[0]
    platform = dev.platform
    if platform == "gpu":  # jax may name NVIDIA and AMD GPUs alike 'gpu'; the client's version string tells them apart
        client = dev.client
        named = getattr(client, "platform", "gpu")
        platform = named if named != "gpu" else (
            "rocm" if "rocm" in str(getattr(client, "platform_version", "")).lower() else "cuda")
    cc = getattr(dev, "compute_capability", None)
    cores = getattr(dev, "core_count", None) or 1
    return Target(str(platform), str(getattr(dev, "device_kind", platform)), None if cc is None else str(cc),
                  int(cores))


@contextlib.contextmanager
def assume(target: Target) -> Iterator[Target]:
    """Within the block, kernels trace for `target` (for lowering with `jax.export` on another machine)."""
    token = _assumed.set(target)
    try:
        yield target
    finally:
        _assumed.reset(token)


def require_hopper(kernel: str, interpret: bool) -> Target:
    """The target a Mosaic GPU kernel builds for; `HOPPER` when interpreting.

    Raises:
        NotImplementedError: not interpreting and the target is not a Hopper GPU.
    """
    if interpret:
        return HOPPER
    target = current()
    if not target.is_hopper:
        raise NotImplementedError(f"{kernel} needs an NVIDIA Hopper GPU (compute capability 9.0); the target is "
                                  f"{target.device_kind} ({target.platform})")
    return target


def interpret_params(interpret):
    """`plgpu.kernel`'s `interpret=`: None (compile), default parameters for True, else the InterpretGPUParams given."""
    if not interpret:
        return None
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return interpret if isinstance(interpret, plgpu.InterpretGPUParams) else plgpu.InterpretGPUParams()
