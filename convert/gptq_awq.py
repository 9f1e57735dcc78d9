"""GPTQ and AWQ int4 checkpoints (`quantization_config.quant_method` 'gptq' or 'awq'), read as day0jax's int4 blocks.

Both store a linear map's weight transposed, [in, out], as 4-bit values q with one float16 scale s and one 4-bit
zero point z per group of inputs and output: w = (q - z) * s.
- GPTQ (AutoGPTQ / GPTQModel): `qweight` int32 [in / 8, out], eight inputs per word from the lowest bits; `qzeros`
  int32 [groups, out / 8], eight outputs per word; `scales` [groups, out]; `g_idx` [in], each input's group. The
  original 'gptq' checkpoint format stores z - 1 (its `checkpoint_format` 'gptq_v2' stores z). Activation order
  (`desc_act`: a g_idx that is not input // group) is refused.
- AWQ (AutoAWQ, version 'gemm'): `qweight` int32 [in, out / 8] and `qzeros` int32 [groups, out / 8], eight outputs
  per word in the order 0, 2, 4, 6, 1, 3, 5, 7; `scales` [groups, out].
Kept as int4 codes in day0jax's [out, in] layout with float32 scales and offsets -z * s: q * s + (-z * s) is
(q - z) * s exactly in float32 (each product has at most 15 significant bits). Other bit widths, AWQ's 'gemv'
layout and AWQ without zero points are refused by name.
"""

from __future__ import annotations

import numpy as np

from day0jax.core.errors import CheckpointError

PARTS = ("qweight", "qzeros", "scales", "g_idx")
AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])
SHIFTS = np.arange(8, dtype=np.uint32) * 4


def _unpack_rows(words: np.ndarray) -> np.ndarray:
    """int32 [r, c] holding eight 4-bit values each, from the lowest bits, along the rows -> [8r, c]."""
    w = words.astype(np.uint32)
    return ((w[:, None, :] >> SHIFTS[None, :, None]) & 15).reshape(-1, w.shape[1]).astype(np.uint8)


def _unpack_cols(words: np.ndarray, order: np.ndarray | None = None) -> np.ndarray:
    """int32 [r, c] holding eight 4-bit values each along the columns -> [r, 8c]; `order[j]`: the column (of
    the word's eight) that bits 4j hold."""
    w = words.astype(np.uint32)
    values = ((w[:, :, None] >> SHIFTS[None, None, :]) & 15).astype(np.uint8)  # [r, c, j]
    if order is not None:
        values = values[:, :, np.argsort(order)]  # position p holds the value of column p
    return values.reshape(w.shape[0], -1)


class GptqAwq:
    """The int4 weights of an opened GPTQ or AWQ folder, each seen as its float `X.weight` (shape, float read) or
    its blocks (`spec`, `read_quantized`); the interface of `compressed_tensors.CompressedTensors`."""

    PARTS = PARTS  # the stored tensors of one weight, by suffix

    def __init__(self, path, q: dict, names: list[str], read_part, shape_of):
        self.path, self._read = path, read_part
        self.method = q.get("quant_method")
        bits = q.get("bits", q.get("w_bit"))
        group = q.get("group_size", q.get("q_group_size"))
        if bits != 4 or not isinstance(group, int) or group == 0 or group < -1:
            raise CheckpointError(f"{path}: {self.method} with bits={bits}, group_size={group} is not read (4-bit "
                                  "weights with groups, or -1 for one group per row)")
        if self.method == "awq" and (str(q.get("version", "gemm")).lower() != "gemm"
                                     or not q.get("zero_point", True)):
            raise CheckpointError(f"{path}: AWQ version {q.get('version')!r} with zero_point={q.get('zero_point')} "
                                  "is not read (version 'gemm' with zero points is)")
        fmt = q.get("checkpoint_format", "gptq")
        if self.method == "gptq" and fmt not in ("gptq", "gptq_v2"):
            raise CheckpointError(f"{path}: GPTQ checkpoint_format {fmt!r} is not read ('gptq' or 'gptq_v2')")
        self.zero_bias = 1 if self.method == "gptq" and fmt == "gptq" else 0  # the original format stores z - 1
        self.group = group
        self.weights: dict[str, tuple[int, int]] = {}  # X.weight -> float shape [O, I]
        for n in names:
            if n.endswith(".qweight"):
                base = n[: -len("qweight")] + "weight"
                rows, cols = shape_of(n)
                self.weights[base] = (cols, rows * 8) if self.method == "gptq" else (cols * 8, rows)
        self._parts = {f"{w[: -len('weight')]}{p}" for w in self.weights for p in PARTS}

    def hides(self, name: str) -> bool:
        """A stored part (packed words, scales, zero points, group indices) that the `X.weight` view stands for."""
        return name in self._parts

    def _group(self, name: str) -> int:
        _, I = self.weights[name]
        return I if self.group == -1 else self.group

    def spec(self, name: str):
        from day0jax.layers.quantized import QuantSpec

        if name not in self.weights:
            return None
        _, I = self.weights[name]
        group = self._group(name)
        if I % group or group % 2:
            raise CheckpointError(f"{self.path}: {name!r} has groups of {group} over {I} inputs, which day0jax "
                                  "does not keep; convert with --dequantize")
        return QuantSpec("int4", group, offset=True, scale_dtype="float32")

    def _unpacked(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(q [I, O] values, zero points and scales [G, O] as float32, each input's group [I])."""
        O, I = self.weights[name]
        base, group = name[: -len("weight")], self._group(name)
        G = -(-I // group)
        order = AWQ_ORDER if self.method == "awq" else None
        if self.method == "gptq":
            q = _unpack_rows(np.asarray(self._read(base + "qweight")))[:I]
        else:
            q = _unpack_cols(np.asarray(self._read(base + "qweight")), order)
        zero = _unpack_cols(np.asarray(self._read(base + "qzeros")), order)[:, :O].astype(np.float32) + self.zero_bias
        scale = np.asarray(self._read(base + "scales")).astype(np.float32)
        if q.shape != (I, O) or zero.shape != (G, O) or scale.shape != (G, O):
            raise CheckpointError(f"{self.path}: {base}qweight/qzeros/scales give {q.shape}/{zero.shape}/"
                                  f"{scale.shape}, expected {(I, O)}/{(G, O)}/{(G, O)}")
        g_idx = np.arange(I) // group
        if self.method == "gptq":
            try:
                g_idx = np.asarray(self._read(base + "g_idx")).reshape(-1).astype(np.int64)
            except CheckpointError:
                pass  # no g_idx: groups in input order
        return q, zero, scale, g_idx

    def read_quantized(self, name: str):
        """Tensor `name`'s blocks as a `QuantizedWeight` of numpy arrays, in day0jax's [out, in] layout.

        Raises:
            CheckpointError: GPTQ activation order (a g_idx that is not input // group): not kept.
        """
        from kernels_pallas.quantized_linear.reference import QuantizedWeight, pack_int4

        spec = self.spec(name)
        q, zero, scale, g_idx = self._unpacked(name)
        if not np.array_equal(g_idx, np.arange(len(g_idx)) // spec.group):
            raise CheckpointError(f"{self.path}: {name[: -len('weight')]}g_idx puts inputs out of order (GPTQ "
                                  "activation order, desc_act), which day0jax does not keep; convert with "
                                  "--dequantize")
        codes = pack_int4(np.ascontiguousarray(q.T), spec.group)
        return QuantizedWeight(codes, np.ascontiguousarray(scale.T), np.ascontiguousarray((-zero * scale).T),
                               spec.kind, spec.group)

    def dequantize(self, name: str) -> np.ndarray:
        """The float32 weight [O, I], (q - z) * s per input's group (any g_idx): for --dequantize, or where the
        runtime keeps the parameter float."""
        q, zero, scale, g_idx = self._unpacked(name)
        return np.ascontiguousarray(((q.astype(np.float32) - zero[g_idx]) * scale[g_idx]).T)
