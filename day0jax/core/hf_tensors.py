"""How a runtime parameter is made from Hugging Face tensors: the mapping every family, the vision towers and the
converter share (the model files say which tensors; the converter reads and checks them)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class Source:
    """Where a runtime parameter comes from: HF tensors `names`, their required `shapes` (checked first), and
    `combine(numpy arrays in names order, target shape)`, which makes them one array of the runtime's shape."""

    names: tuple[str, ...]
    combine: Callable[[list[np.ndarray], tuple[int, ...]], np.ndarray]
    shapes: tuple[tuple[int, ...], ...]
    # The same parameter from tensors in another layout, taken where the checkpoint's tensors have its shapes
    # instead (released checkpoints and transformers' saves of one family that store a tensor transposed).
    alternative: "Source | None" = None
    # For a parameter made from one quantized tensor by more than renaming (gpt-oss's gate_up_proj split into gate
    # and up rows): makes its quantized weight (codes, scales: each [..., out, in']) from the source tensor's, so
    # that it stays quantized; without it such a parameter is read dequantized.
    quantized: Callable | None = None

    def renamed(self, rename: Callable[[str], str]) -> "Source":
        """The same tensors under other names (a multimodal checkpoint's prefix for its language model)."""
        return Source(tuple(rename(n) for n in self.names), self.combine, self.shapes,
                      None if self.alternative is None else self.alternative.renamed(rename), self.quantized)

    def matching(self, shapes: dict[str, tuple[int, ...]]) -> "Source":
        """This source, or the first alternative whose tensors all have its shapes in `shapes` (name -> shape);
        this one when none does (its mismatch is the one reported)."""
        src = self
        while src is not None:
            if all(tuple(shapes.get(n, ())) == tuple(w) for n, w in zip(src.names, src.shapes)):
                return src
            src = src.alternative
        return self


def same(arrays: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    return arrays[0].reshape(shape)


def default_source(path: str, shape: tuple[int, ...], metadata: dict) -> Source:
    """The plain HF mapping: `a.b.kernel` <- `a.b.weight` [out, in] reshaped; everything else by the same name."""
    if path.endswith(".kernel"):
        n_out = len(shape) - metadata["in_ndim"]
        hf_shape = (math.prod(shape[:n_out]), math.prod(shape[n_out:]))
        return Source((path[: -len("kernel")] + "weight",), same, (hf_shape,))
    if path.endswith(".bias"):
        return Source((path,), same, ((math.prod(shape),),))
    return Source((path,), same, (shape,))
