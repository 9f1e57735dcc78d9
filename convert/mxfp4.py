"""MXFP4 checkpoints (`quantization_config.quant_method` 'mxfp4', gpt-oss as OpenAI ships it): MoE experts' weights
as `X_blocks` [E, O, I/32, 16] uint8 (two FP4 e2m1 codes per byte, element 2i in the low nibble) and `X_scales`
[E, O, I/32] uint8 (E8M0 exponents, one per block of 32 inputs), each expert's [out, in] map. Each pair is seen as
the float tensor transformers' dequantizer makes of it, `X` [E, I, O] (gpt-oss's experts are x @ W), and is kept
as day0jax's mxfp4 kind byte for byte (`read_quantized`), or dequantized exactly for --dequantize. The
interface is `compressed_tensors.CompressedTensors`'s.
"""

from __future__ import annotations

import numpy as np

from day0jax.core.errors import CheckpointError
from kernels_pallas.quantized_linear.reference import MX_GROUP

PARTS = ("_blocks", "_scales")


class Mxfp4:
    """The MXFP4 weights of one checkpoint: `weights` maps each float tensor name to its shape [E, I, O]."""

    def __init__(self, path, names: list[str], read_part, dtype_of, shape_of):
        self.path, self._read = path, read_part
        self.weights: dict[str, tuple[int, ...]] = {}
        present = set(names)
        for name in names:
            if not name.endswith("_blocks"):
                continue
            base = name[: -len("_blocks")]
            scales = base + "_scales"
            if scales not in present:
                raise CheckpointError(f"{path}: MXFP4 tensor {name!r} has no {scales!r}")
            blocks_shape, scale_shape = tuple(shape_of(name)), tuple(shape_of(scales))
            if len(blocks_shape) != 4 or blocks_shape[-1] != MX_GROUP // 2 or blocks_shape[:-1] != scale_shape \
                    or np.dtype(dtype_of(name)) != np.uint8 or np.dtype(dtype_of(scales)) != np.uint8:
                raise CheckpointError(f"{path}: MXFP4 tensors {name!r} {blocks_shape} and {scales!r} {scale_shape} "
                                      f"are not uint8 blocks [E, out, in/{MX_GROUP}, {MX_GROUP // 2}] with uint8 "
                                      f"scales [E, out, in/{MX_GROUP}]")
            E, O, G, _ = blocks_shape
            self.weights[base] = (E, G * MX_GROUP, O)
        stray = sorted(n for n in names if n.endswith("_scales") and n[: -len("_scales")] not in self.weights
                       and n[: -len("_scales")] + "_blocks" not in present)
        if stray:
            raise CheckpointError(f"{path}: MXFP4 scales {stray[0]!r} have no blocks")

    def parts(self, name: str) -> list[str]:
        return [name + p for p in PARTS]

    def hides(self, name: str) -> bool:
        return name.endswith(PARTS) and name.rsplit("_", 1)[0] in self.weights

    def spec(self, name: str):
        from day0jax.layers.quantized import QuantSpec

        return QuantSpec("mxfp4", MX_GROUP, False, "uint8")

    def read_quantized(self, name: str):
        """Weight `name` as a `QuantizedWeight` of numpy arrays: codes [E, O, I/2], scales [E, O, I/32], the
        source's bytes."""
        from kernels_pallas.quantized_linear.reference import QuantizedWeight

        blocks, scales = (self._read(p) for p in self.parts(name))
        E, O, G, B = blocks.shape
        return QuantizedWeight(np.ascontiguousarray(blocks).reshape(E, O, G * B), np.ascontiguousarray(scales), None,
                               "mxfp4", MX_GROUP)

    def dequantize(self, name: str) -> np.ndarray:
        """The float32 weight [E, I, O], exactly (every MXFP4 value is a float32)."""
        from kernels_pallas.quantized_linear.reference import dequantize

        w = self.read_quantized(name)
        E, O, _ = w.codes.shape
        flat = type(w)(w.codes.reshape(E * O, -1), w.scale.reshape(E * O, -1), None, w.kind, w.group)
        return np.swapaxes(np.asarray(dequantize(flat)).reshape(E, O, -1), 1, 2)
