"""torchvision's resize of uint8 images on the CPU, in numpy, integer for integer.

Several transformers image processors exist only for the torchvision backend (Kimi K2.5's, LFM2-VL's). On a CPU
tensor of uint8 pixels, `torchvision.transforms.v2.functional.resize(..., antialias=True)` calls torch's
`interpolate(mode="bilinear"|"bicubic", antialias=True)` on the uint8 tensor itself, whose kernel resamples one
axis at a time (width, then height; an axis whose size does not change is skipped), each output pixel a weighted
sum of its input pixels with weights rounded to int16 at a precision chosen per axis, rounded and clamped back to
uint8 between the passes. PIL resamples with the same filters (bicubic's a = -0.5) but 22-bit weights, so its
pixels differ from torchvision's by up to a level, which is enough to move a small model's logits; this module
renders torch's arithmetic instead. Reference: aten/src/ATen/native/cpu/UpSampleKernel.cpp
(`_compute_index_ranges_int16_weights`, `basic_loop_aa_horizontal`); tests/test_vision_preprocess.py compares it
with torch's own kernel.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from day0jax.vision.images import ImageError

MODES = ("bilinear", "bicubic")


def _filter(mode: str, x: np.ndarray) -> np.ndarray:
    """torch's antialiasing filters, in float64: the triangle, and Keys' cubic with a = -0.5 (PIL's)."""
    x = np.abs(x)
    if mode == "bilinear":
        return np.where(x < 1.0, 1.0 - x, 0.0)
    a = -0.5
    return np.where(x < 1.0, ((a + 2) * x - (a + 3)) * x * x + 1,
                    np.where(x < 2.0, ((a * x - 5 * a) * x + 8 * a) * x - 4 * a, 0.0))


@lru_cache(maxsize=256)
def axis_weights(size_in: int, size_out: int, mode: str) -> tuple[np.ndarray, np.ndarray, int]:
    """The taps of one axis: (first input index of each output [out], int weights [out, taps], precision bits).

    Each output i is centred at scale * (i + 0.5) (scale = size_in / size_out), its filter widened by the scale when
    shrinking; weights are normalized in float64, then scaled by 2**precision and rounded half away from zero to
    int16, the precision the largest so that twice the largest weight stays below 2**15."""
    scale = size_in / size_out
    support = (2.0 if mode == "bicubic" else 1.0) * (scale if scale >= 1.0 else 1.0)
    taps = int(math.ceil(support)) * 2 + 1
    inverse = 1.0 / scale if scale >= 1.0 else 1.0
    starts = np.zeros(size_out, np.int64)
    weights = np.zeros((size_out, taps), np.float64)
    for i in range(size_out):
        center = scale * (i + 0.5)
        start = max(int(center - support + 0.5), 0)  # C's truncation toward zero, then the clamp
        count = min(max(min(int(center + support + 0.5), size_in) - start, 0), taps)
        w = _filter(mode, (np.arange(count) + start - center + 0.5) * inverse)
        total = w.sum()
        weights[i, :count] = w / total if total != 0.0 else w
        starts[i] = start
    largest = weights.max()
    precision = next((p for p in range(22) if int(0.5 + largest * (1 << (p + 1))) >= 1 << 15), 22)
    scaled = weights * (1 << precision)
    ints = np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5)).astype(np.int64)
    return starts, ints, precision


def _resize_axis(x: np.ndarray, size: int, axis: int, mode: str) -> np.ndarray:
    starts, weights, precision = axis_weights(x.shape[axis], size, mode)
    moved = np.moveaxis(x, axis, -1).astype(np.int64)
    # Taps past a short axis carry weight 0; clipping their index keeps the gather in bounds.
    index = np.minimum(starts[:, None] + np.arange(weights.shape[1]), x.shape[axis] - 1)
    acc = np.einsum("...ot,ot->...o", moved[..., index], weights) + (1 << (precision - 1))
    return np.moveaxis(np.clip(acc >> precision, 0, 255).astype(np.uint8), -1, axis)


def resize(x: np.ndarray, height: int, width: int, mode: str = "bicubic") -> np.ndarray:
    """A uint8 [..., H, W] image (channels first) resized as torchvision resizes a CPU uint8 tensor, antialiased.

    Args:
        x: uint8 pixels, the last two axes height and width.
        height, width: the output size.
        mode: "bilinear" or "bicubic" (torchvision's InterpolationMode).
    Returns:
        uint8 [..., height, width]; `x` itself when the size does not change (as torchvision returns it).
    Raises:
        ImageError: a size below one pixel, or pixels that are not uint8.
        ValueError: another mode.
    """
    if mode not in MODES:
        raise ValueError(f"resize mode {mode!r}: torchvision's uint8 kernels here are {', '.join(MODES)}")
    if height < 1 or width < 1:
        raise ImageError(f"image of {x.shape[-2]}x{x.shape[-1]} pixels resizes to {height}x{width}: too thin")
    if x.dtype != np.uint8:
        raise ImageError(f"torchvision's resize is rendered here for uint8 pixels, got {x.dtype}")
    if x.shape[-1] != width:
        x = _resize_axis(x, width, x.ndim - 1, mode)
    if x.shape[-2] != height:
        x = _resize_axis(x, height, x.ndim - 2, mode)
    return x
