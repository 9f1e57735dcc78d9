"""Grouped matmul as MoE layers see it: the Mosaic GPU kernel (Hopper), XLA's `ragged_dot`, tiles of one group's
rows (the CPU), the reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import platform, registry
from kernels_pallas.moe import pallas_mgpu, reference, tiles
from kernels_pallas.quantized_linear.reference import QuantizedWeight


# XLA:GPU runs ragged_dot as a cuDNN fusion from cuDNN 9.22 on; before that it expands it densely, every row
# times every expert ([G, M, F]: about 34 GB at DeepSeek-V3's prefill, more than an 80 GB GPU has beside the model).
# Past this size the expansion is declined and the reference (each row times its own expert) runs instead.
CUDNN_RAGGED_DOT = 92200  # cuDNN's version number for 9.22.0
DENSE_EXPANSION_LIMIT = 1 << 30


def cudnn_version() -> int | None:
    """The cuDNN that jaxlib's CUDA plugin loaded, as cuDNN numbers it (9.22.0 -> 92200); None without one."""
    try:
        from jax._src.lib import cuda_versions
        return int(cuda_versions.cudnn_get_version()) if cuda_versions is not None else None
    except Exception:  # no CUDA plugin, or it could not load cuDNN: no fusion to count on
        return None


def _check_expansion(lhs, G: int, F: int) -> None:
    if platform.current().platform not in ("cuda", "rocm") or (cudnn_version() or 0) >= CUDNN_RAGGED_DOT:
        return
    dense = G * lhs.shape[0] * F * jnp.dtype(lhs.dtype).itemsize
    if dense > DENSE_EXPANSION_LIMIT:
        raise NotImplementedError(f"ragged_dot without cuDNN >= 9.22 expands to every expert for every row "
                                  f"({dense / 2**30:.1f} GiB at G={G}, M={lhs.shape[0]}, F={F})")


def _xla_ragged_dot(lhs, rhs, group_sizes):
    G, F = (rhs.codes.shape[0], rhs.codes.shape[1]) if isinstance(rhs, QuantizedWeight) else (rhs.shape[0],
                                                                                              rhs.shape[2])
    _check_expansion(lhs, G, F)
    if isinstance(rhs, QuantizedWeight):  # every expert dequantized in the program, then XLA's grouped product
        rhs = reference.dequantize_groups(rhs).astype(lhs.dtype)
    return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype("int32"), preferred_element_type="float32").astype(lhs.dtype)


IMPLEMENTATIONS = {
    registry.REFERENCE: reference.grouped_matmul,
    "xla_ragged_dot": _xla_ragged_dot,
    "tiles": tiles.grouped_matmul,
    "mosaic_gpu": pallas_mgpu.grouped_matmul,
    "mosaic_gpu_interpret": functools.partial(pallas_mgpu.grouped_matmul, interpret=True),
}
# On the CPU, XLA expands ragged_dot densely over all groups: the reference is cheaper there. The Mosaic GPU kernel
# passed its tests' shapes but not selfcheck's serving-sized ones on an H200 (relative errors 0.2 to 0.7 at 128
# experts: its pipeline refilled a slot that an unawaited wgmma still read, since fixed); it is not chosen until a
# device self-check passes at those shapes; `implementation="mosaic_gpu"` still runs it.
# XLA:CPU expands ragged_dot densely (every row times every expert); tiles read each used expert once per tile.
CANDIDATES: dict[str, tuple[str, ...]] = {"cpu": ("tiles",), "gpu": ("xla_ragged_dot",), "tpu": ("xla_ragged_dot",)}
PALLAS = {"mosaic_gpu": "cuda"}
INTERPRET = {"mosaic_gpu": "mosaic_gpu_interpret"}


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                   implementation: str | None = None) -> jax.Array:
    """See `reference.grouped_matmul`; `implementation` forces one candidate by name.

    Raises:
        registry.KernelUnavailable: the named implementation cannot take these inputs.
    """
    return registry.dispatch("moe", IMPLEMENTATIONS, CANDIDATES, implementation, lhs, rhs, group_sizes)
