"""What the engine and the forward pass need to know of a vision-language model's images (`VisionSpec`), how one
image becomes a tower call (`WholeImages`; `qwen_vit.PatchBuckets` for towers of any image size), encoding packed
images call by call (`encode_host`), and the features of images already encoded (`FeatureCache`)."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
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
        video_token_id: the placeholder of video frames' tokens, for models that take videos (None: no videos);
            a row's images and videos are one list in order of appearance, their features in token order.
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
    video_token_id: int | None = None

    def placeholders(self, tokens) -> np.ndarray:
        """[...] bool: the image (and video) placeholder tokens of `tokens`."""
        tokens = np.asarray(tokens)
        mask = tokens == self.image_token_id
        return mask if self.video_token_id is None else mask | (tokens == self.video_token_id)

    def pack(self, processed: Sequence[Any]) -> tuple[np.ndarray, list[int], tuple | None]:
        """Processed images (`vision.processors.ProcessedImage`s) -> (pixels as the tower takes them: stacked, or
        the patches of all images one after another; tokens per image; grids or None)."""
        if self.pixel_shape is not None:
            pixels = (np.stack([np.asarray(p.pixel_values, np.float32) for p in processed]) if processed
                      else np.zeros((0, *self.pixel_shape), np.float32))
            return pixels, [self.tokens_per_image] * len(processed), None
        grids = tuple(tuple(int(v) for v in p.grid_thw) for p in processed)
        pixels = np.concatenate([np.asarray(p.pixel_values, np.float32) for p in processed])
        return pixels, [self._tokens(g) for g in grids], grids

    def _tokens(self, grid: tuple) -> int:
        """An image's tokens: its grid's patches / merge^2, or as its encoder counts them (`grid_tokens`)."""
        count = getattr(self.encoder, "grid_tokens", None)
        return count(grid) if count is not None else grid[0] * grid[1] * grid[2] // self.merge ** 2

    def encoder_calls(self, pixels: np.ndarray, grids: tuple | None) -> list[tuple[tuple, tuple, int]]:
        """One (program key, tower inputs, token count) per tower call of packed `pixels` (see `pack`): one per
        image, or each of an image's calls where its encoder splits it (`grid_calls`: LFM2-VL's tiles)."""
        if grids is None:
            return [self.encoder.inputs(p, None) for p in pixels]
        calls, start = [], 0
        split = getattr(self.encoder, "grid_calls", None)  # encoders that run an image in several calls (tiles)
        for grid in grids:
            n = self.encoder.grid_patches(grid) if split is not None else grid[0] * grid[1] * grid[2]
            part = pixels[start:start + n]
            calls.extend(split(part, grid) if split is not None else [self.encoder.inputs(part, grid)])
            start += n
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


class FeatureCache:
    """The features of images encoded before, by a digest of their tower call's inputs (an image's pixels, grid and
    program), so that an image sent again, in this request or a later one, is not encoded again. The least recently
    used entries go first once the features held pass `max_bytes` (0: nothing is kept). Thread-safe.

    Attributes:
        hits, misses: tower calls served from the cache and calls run.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes = int(max_bytes), 0
        self.hits = self.misses = 0
        self._entries: OrderedDict[bytes, tuple[np.ndarray, np.ndarray | None]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(program: tuple, arrays: Sequence[np.ndarray]) -> bytes:
        h = hashlib.blake2b(repr(program).encode(), digest_size=16, person=b"day0jax-towers")
        for a in arrays:
            a = np.ascontiguousarray(a)
            h.update(repr((a.shape, a.dtype.str)).encode())
            h.update(a.data)
        return h.digest()

    def get(self, key: bytes) -> tuple[np.ndarray, np.ndarray | None] | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return found

    def put(self, key: bytes, features: np.ndarray, deepstack: np.ndarray | None) -> None:
        size = features.nbytes + (0 if deepstack is None else deepstack.nbytes)
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = (features, deepstack)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (f, d) = self._entries.popitem(last=False)
                self.bytes -= f.nbytes + (0 if d is None else d.nbytes)

    def __len__(self) -> int:
        return len(self._entries)


def encode_host(spec: VisionSpec, pixels: np.ndarray, grids: tuple | None, run: Callable,
                cache: FeatureCache | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Encodes packed images one call each: `run(key, arrays)` -> (features, DeepStack features or None) of one
    (possibly padded) call, unless `cache` holds that call's features; returns their real tokens concatenated:
    ([n, D], [k, n, D] or None), float32."""
    features, deepstack = [], []
    for key, arrays, tokens in spec.encoder_calls(pixels, grids):
        digest = None if cache is None else cache.key(key, arrays)
        found = None if cache is None else cache.get(digest)
        if found is None:
            f, d = run(key, arrays)
            f = np.array(np.asarray(f, np.float32)[:tokens])
            d = None if d is None else np.array(np.asarray(d, np.float32)[:, :tokens])
            if cache is not None:
                cache.put(digest, f, d)
            found = f, d
        features.append(found[0])
        if found[1] is not None:
            deepstack.append(found[1])
    return np.concatenate(features), (np.concatenate(deepstack, axis=1) if deepstack else None)
