"""What the engine and the forward pass need to know of a vision-language model's images (`VisionSpec`), how one
image becomes a tower call (`WholeImages`; `qwen_vit.PatchBuckets` for towers of any image size), and encoding
packed images call by call (`encode_host`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np


@dataclass(frozen=True)
class VisionSpec:
    """What the engine needs to know of a model's images.

    Attributes:
        image_token_id: the placeholder token; dim: the features' width (the language model's).
        tokens_per_image, pixel_shape: for towers of one image size (LLaVA, Gemma 3): tokens per image and one
            preprocessed image's shape; None where images keep their own size (Qwen-VL).
        bidirectional: one image's tokens attend to each other both ways (Gemma 3): a prefill chunk holds them all.
        merge: images of their own size: patches per token side (an image of grid (t, h, w) takes t*h*w / merge^2
            tokens).
        encoder: how one image becomes the tower's inputs, and the program shapes that cover every image
            (`WholeImages`, `vision.qwen_vit.PatchBuckets`).
        mrope: multimodal RoPE: (prompt tokens, image grids) -> (RoPE positions [T, 3], the offset of the positions
            after the prompt), on the host.
        deepstack: how many feature arrays the tower adds to the first layers' hidden states (DeepStack).
    """

    image_token_id: int
    tokens_per_image: int | None
    pixel_shape: tuple[int, ...] | None
    dim: int
    bidirectional: bool = False
    merge: int | None = None
    mrope: Callable | None = None
    deepstack: int = 0
    encoder: Any = None

    def pack(self, processed: Sequence[Any]) -> tuple[np.ndarray, list[int], tuple | None]:
        """Processed images (`vision.processors.ProcessedImage`s) -> (pixels as the tower takes them: stacked, or
        the patches of all images one after another; tokens per image; grids or None)."""
        if self.pixel_shape is not None:
            pixels = (np.stack([np.asarray(p.pixel_values, np.float32) for p in processed]) if processed
                      else np.zeros((0, *self.pixel_shape), np.float32))
            return pixels, [self.tokens_per_image] * len(processed), None
        grids = tuple(tuple(int(v) for v in p.grid_thw) for p in processed)
        pixels = np.concatenate([np.asarray(p.pixel_values, np.float32) for p in processed])
        return pixels, [t * h * w // self.merge ** 2 for t, h, w in grids], grids

    def encoder_calls(self, pixels: np.ndarray, grids: tuple | None) -> list[tuple[tuple, tuple, int]]:
        """One (program key, tower inputs, token count) per image of packed `pixels` (see `pack`)."""
        if grids is None:
            return [self.encoder.inputs(p, None) for p in pixels]
        calls, start = [], 0
        for t, h, w in grids:
            calls.append(self.encoder.inputs(pixels[start:start + t * h * w], (t, h, w)))
            start += t * h * w
        return calls


@dataclass(frozen=True)
class WholeImages:
    """The `VisionSpec.encoder` of towers of one image size: one image per call, one program."""

    pixel_shape: tuple[int, ...]
    tokens: int

    def keys(self) -> list[tuple]:
        return [()]

    def inputs(self, pixels: np.ndarray, grid=None) -> tuple[tuple, tuple[np.ndarray], int]:
        return (), (pixels[None],), self.tokens

    def example(self, key: tuple) -> tuple[np.ndarray]:
        return (np.zeros((1, *self.pixel_shape), np.float32),)


def encode_host(spec: VisionSpec, pixels: np.ndarray, grids: tuple | None, run: Callable
                ) -> tuple[np.ndarray, np.ndarray | None]:
    """Encodes packed images one call each: `run(key, arrays)` -> (features, DeepStack features or None) of one
    (possibly padded) call; returns their real tokens concatenated: ([n, D], [k, n, D] or None), float32."""
    features, deepstack = [], []
    for key, arrays, tokens in spec.encoder_calls(pixels, grids):
        f, d = run(key, arrays)
        features.append(np.asarray(f, np.float32)[:tokens])
        if d is not None:
            deepstack.append(np.asarray(d, np.float32)[:, :tokens])
    return np.concatenate(features), (np.concatenate(deepstack, axis=1) if deepstack else None)
