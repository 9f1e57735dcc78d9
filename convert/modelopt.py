"""NVIDIA ModelOpt NVFP4 checkpoints (`quantization_config.quant_method` 'modelopt', `quant_algo` 'NVFP4'): each
quantized linear weight as `X.weight` uint8 [O, I/2] (two FP4 e2m1 codes per byte, element 2i in the low nibble),
`X.weight_scale` float8_e4m3fn [O, I/16] and the per-tensor float32 `X.weight_scale_2`, w = e2m1 * (scale *
weight_scale_2). Kept as day0jax's nvfp4_modelopt kind (`read_quantized`), or dequantized exactly in float32.
Their activation scales (`X.input_scale`, FP4 activations) are not applied: activations stay in float (weight-only,
as on hardware without FP4 arithmetic). The interface is `compressed_tensors.CompressedTensors`'s.
"""

from __future__ import annotations

import logging

import ml_dtypes
import numpy as np

from day0jax.core.errors import CheckpointError
from kernels_pallas.quantized_linear.reference import NV_GROUP

PARTS = ("_scale", "_scale_2")
log = logging.getLogger(__name__)


class ModelOpt:
    """The NVFP4 weights of one checkpoint: `weights` maps each `X.weight` to its float shape [O, I]."""

    def __init__(self, path, q: dict, names: list[str], read_part, dtype_of, shape_of):
        self.path, self._read = path, read_part
        if q.get("quant_algo") != "NVFP4" or q.get("group_size", NV_GROUP) != NV_GROUP:
            raise CheckpointError(f"{path}: ModelOpt quantization {q.get('quant_algo')!r} (group size "
                                  f"{q.get('group_size')}) is not supported (day0jax reads NVFP4 with groups of 16)")
        present = set(names)
        self.weights: dict[str, tuple[int, int]] = {}
        for name in names:
            if not name.endswith(".weight") or name + "_scale_2" not in present:
                continue
            shape, scale = tuple(shape_of(name)), tuple(shape_of(name + "_scale"))
            if np.dtype(dtype_of(name)) != np.uint8 or len(shape) != 2 or name + "_scale" not in present \
                    or np.dtype(dtype_of(name + "_scale")) != np.dtype(ml_dtypes.float8_e4m3fn) \
                    or scale != (shape[0], shape[1] * 2 // NV_GROUP):
                raise CheckpointError(f"{path}: ModelOpt NVFP4 weight {name!r} {shape} with scales {scale} is not "
                                      f"uint8 [O, I/2] with float8_e4m3fn scales [O, I/{NV_GROUP}]")
            self.weights[name] = (shape[0], shape[1] * 2)
        self._hidden = {name + p for name in self.weights for p in PARTS}
        inputs = [n for n in names if n.endswith(".input_scale")]
        self._hidden |= set(inputs)
        if inputs:
            log.warning("%s: %d activation scales of the NVFP4 checkpoint are not applied: activations stay in "
                        "float, multiplied by the NVFP4 weights (weight-only, as on hardware without FP4 "
                        "arithmetic)", path, len(inputs))

    def parts(self, name: str) -> list[str]:
        return [name] + [name + p for p in PARTS]

    def hides(self, name: str) -> bool:
        return name in self._hidden

    def spec(self, name: str):
        from day0jax.layers.quantized import QuantSpec

        return QuantSpec("nvfp4_modelopt", NV_GROUP, False, "float8_e4m3fn") if name in self.weights else None

    def read_quantized(self, name: str):
        """Weight `name` as a `QuantizedWeight` of numpy arrays: the source's codes and scales, weight_scale_2 on
        every row."""
        from kernels_pallas.quantized_linear.reference import QuantizedWeight

        O, _ = self.weights[name]
        scale_2 = np.asarray(self._read(name + "_scale_2"), np.float32)
        if scale_2.size != 1:
            raise CheckpointError(f"{self.path}: {name + '_scale_2'!r} has {scale_2.size} elements; ModelOpt's "
                                  "NVFP4 has one per tensor")
        codes, scale = (np.ascontiguousarray(self._read(n)) for n in (name, name + "_scale"))
        return QuantizedWeight(codes, scale, None, "nvfp4_modelopt", NV_GROUP,
                               np.full((O, 1), scale_2.reshape(()), np.float32))

    def dequantize(self, name: str) -> np.ndarray:
        """The float32 weight [O, I]."""
        from kernels_pallas.quantized_linear.reference import dequantize

        return np.asarray(dequantize(self.read_quantized(name)))
