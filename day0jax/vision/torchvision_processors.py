"""Image processors that transformers has only for its torchvision backend, in numpy: Kimi K2.5's (MoonViT).

transformers' torchvision backend differs from its PIL one in four places these processors follow: images are
resized by torchvision's uint8 kernels (`vision.resize`, not PIL's), padding is zeros added to the uint8 image
before normalizing, rescaling is fused into normalizing (mean and std divided by the rescale factor, in float32:
(x - mean / f) / (std / f), not (x * f - mean) / std), and an RGBA array is blended onto white in float32 and
truncated back to uint8 (PIL images are converted as the PIL backend converts them). tests/test_vision_preprocess.py
runs transformers' own processor code on a plain-torch rendering of torchvision and compares the pixels exactly.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from day0jax.core.errors import ConfigError
from day0jax.vision import resize
from day0jax.vision.images import ImageError, load_image
from day0jax.vision.processors import (BICUBIC, BILINEAR, HALF, ImageProcessor, ProcessedImage, _per_channel,
                                       fit_pixels)

MODES = {BILINEAR: "bilinear", BICUBIC: "bicubic"}  # PIL filter numbers -> torchvision's uint8 kernels


class TorchvisionProcessor(ImageProcessor):
    """transformers' `TorchvisionBackend` steps (resize, pad, fused rescale and normalize) for the subclasses."""

    CENTER_CROP = False

    def _validate(self) -> None:
        super()._validate()
        if self.do_resize and self.resample not in MODES:
            raise ConfigError(f"{self.TYPE} resample={self.resample!r}: only bilinear (2) and bicubic (3) are "
                              "implemented for the torchvision backend's processors")

    def _uint8_chw(self, image: Any) -> np.ndarray:
        if isinstance(image, np.ndarray) and image.ndim == 3 and image.shape[-1] == 4 and self.do_convert_rgb:
            load_image(image)  # the checks every image gets
            # torchvision's `to_dtype` both ways (times 1/255; times 255.999, truncated) around the blend.
            x = image.astype(np.float32) * np.float32(1 / 255)
            rgb = x[..., :3] * x[..., 3:] + (np.float32(1) - x[..., 3:])
            return (rgb * np.float32(255 + 1.0 - 1e-3)).astype(np.uint8).transpose(2, 0, 1)
        return super()._uint8_chw(image)

    def _torch_resize(self, x: np.ndarray, height: int, width: int) -> np.ndarray:
        return resize.resize(x, height, width, MODES[self.resample])

    def _rescale_normalize(self, x: np.ndarray) -> np.ndarray:
        return rescale_normalize(x, self)


def rescale_normalize(x: np.ndarray, p) -> np.ndarray:
    """`TorchvisionBackend.rescale_and_normalize` on [..., C, H, W] with processor `p`'s do_rescale, rescale_factor,
    do_normalize, image_mean and image_std: in float32, rescaling fused into the mean and std."""
    if p.do_normalize:
        channels = x.shape[-3]
        mean = np.array(_per_channel(p.image_mean, channels), np.float32)
        std = np.array(_per_channel(p.image_std, channels), np.float32)
        if p.do_rescale:
            inverse = np.float32(1.0 / p.rescale_factor)
            mean, std = mean * inverse, std * inverse
        return np.ascontiguousarray((x.astype(np.float32) - mean[:, None, None]) / std[:, None, None])
    if p.do_rescale:
        return np.ascontiguousarray(x.astype(np.float32) * np.float32(p.rescale_factor))
    return np.ascontiguousarray(x, dtype=np.float32)


def navit_size(height: int, width: int, patch: int, merge: int, max_patches: int,
               max_per_side: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """transformers' Kimi K2.5 `navit_resize`: ((height, width) resized, (height, width) padded). The image shrinks
    (never grows) to at most `max_patches` patches and `max_per_side` patches a side, then is padded up to
    multiples of patch * merge."""
    patches_h, patches_w = max(1.0, height // patch), max(1.0, width // patch)
    scale = min(1.0, math.sqrt(max_patches / (patches_h * patches_w)), max_per_side * patch / height,
                max_per_side * patch / width)
    new_h = min(max(1, int(height * scale)), max_per_side * patch)
    new_w = min(max(1, int(width * scale)), max_per_side * patch)
    factor = merge * patch
    return (new_h, new_w), (new_h + (factor - new_h % factor) % factor, new_w + (factor - new_w % factor) % factor)


class KimiK25ImageProcessor(TorchvisionProcessor):
    """Kimi K2.5 (MoonViT): an image at its own size, shrunk to a patch budget, padded to whole merge blocks, as
    patches of [3, p, p] in raster order (flattened to 3 * p * p values each); grid (1, rows, columns)."""

    TYPE = "Kimi_K25ImageProcessor"
    DEFAULTS = dict(ImageProcessor.DEFAULTS, size={"max_height": 512, "max_width": 512}, do_center_crop=None,
                    crop_size=None, image_mean=HALF, image_std=HALF, max_patches=16384, patch_size=14, merge_size=2)

    def _validate(self) -> None:
        super()._validate()
        for key in ("max_patches", "patch_size", "merge_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"Kimi K2.5 image processor {key}={value!r} must be a positive integer")
        s = self.size or {}
        if self.do_resize and (s.get("max_height") is None or s.get("max_height") != s.get("max_width")):
            raise ConfigError(f"Kimi K2.5 image processor size={self.size!r} must give max_height and max_width, "
                              "equal (transformers refuses other sizes too)")

    def most_patches(self) -> int | None:
        """A bound: `max_patches` (10% over, for sides that are not whole patches), plus the padding to whole merge
        blocks along both sides of at most `max_height` patches."""
        if not self.do_resize:
            return None
        m, side = self.merge_size, self.size["max_height"]
        return int(self.max_patches * 1.1) + 2 * m * side + m * m

    def grid_thw(self, height: int, width: int) -> tuple[int, int, int]:
        """(1, rows, columns) of patches for an image of `height` x `width` pixels."""
        if not self.do_resize:
            return 1, height // self.patch_size, width // self.patch_size
        _, (h, w) = navit_size(height, width, self.patch_size, self.merge_size, self.max_patches,
                               self.size["max_height"])
        return 1, h // self.patch_size, w // self.patch_size

    def _process(self, x: np.ndarray) -> ProcessedImage:
        p = self.patch_size
        if self.do_resize:
            (h, w), (ph, pw) = navit_size(*x.shape[1:], p, self.merge_size, self.max_patches,
                                          self.size["max_height"])
            x = self._torch_resize(x, h, w)
            x = np.pad(x, ((0, 0), (0, ph - h), (0, pw - w)))
        c, height, width = x.shape
        if height % (p * self.merge_size) or width % (p * self.merge_size):
            raise ImageError(f"image of {height}x{width} pixels is not a multiple of patch_size * merge_size = "
                             f"{p * self.merge_size} (the config turns resizing off)")
        x = self._rescale_normalize(x)
        gh, gw = height // p, width // p
        patches = x.reshape(c, gh, p, gw, p).transpose(1, 3, 0, 2, 4).reshape(gh * gw, c * p * p)
        return ProcessedImage(np.ascontiguousarray(patches), grid_thw=(1, gh, gw))


def round_by_factor(number: float, factor: int) -> int:
    return round(number / factor) * factor


class Lfm2VlImageProcessor(TorchvisionProcessor):
    """LFM2-VL (SigLIP2 NaFlex): an image resized, keeping about its aspect ratio, to multiples of encoder_patch_size
    * downsample_factor between min_image_tokens and max_image_tokens tokens, as patches of [p, p, 3] (channels last)
    in raster order; grid (1, rows, columns). An image too large for that (with `do_image_splitting`) is resized to
    a grid of tile_size tiles of the aspect ratio closest to its own and split, row by row, then followed by that
    resized image as a thumbnail (`use_thumbnail`): its patches are each tile's, then the thumbnail's, and its grid
    (1, rows, columns, tile rows, tile columns, patches per tile side), rows and columns the thumbnail's."""

    TYPE = "Lfm2VlImageProcessor"
    # transformers converts no image to RGB unless the config says so (other modes then fail there).
    DEFAULTS = dict(ImageProcessor.DEFAULTS, do_convert_rgb=None, size={"height": 512, "width": 512}, resample=BILINEAR,
                    do_center_crop=None, crop_size=None, image_mean=HALF, image_std=HALF, do_pad=True,
                    downsample_factor=2, do_image_splitting=True, min_tiles=2, max_tiles=10, use_thumbnail=True,
                    min_image_tokens=64, max_image_tokens=256, encoder_patch_size=16, tile_size=512,
                    max_pixels_tolerance=2.0, return_row_col_info=False)

    def _validate(self) -> None:
        super()._validate()
        for key in ("downsample_factor", "min_image_tokens", "max_image_tokens", "encoder_patch_size", "tile_size",
                    "min_tiles", "max_tiles"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"LFM2-VL image processor {key}={value!r} must be a positive integer")
        if not self.do_resize:
            raise ConfigError("LFM2-VL image processor do_resize=false: transformers resizes every image anyway, "
                              "which day0jax does not follow silently")

    @property
    def splits(self) -> bool:
        return bool(self.do_image_splitting) and not self.min_tiles == self.max_tiles == 1

    def most_patches(self) -> int:
        """transformers' `max_num_patches`: what it pads every image to."""
        tile = (self.tile_size // self.encoder_patch_size) ** 2 if self.do_image_splitting else 0
        return max(self.max_image_tokens * self.downsample_factor ** 2, tile)

    def _tiles(self, height: int, width: int) -> tuple[int, int] | None:
        """(tile rows, tile columns) where transformers splits the image (`_get_split_layout`), else None."""
        p, m = self.encoder_patch_size, self.downsample_factor
        h, w = max(p, round_by_factor(height, p * m)), max(p, round_by_factor(width, p * m))
        if not self.splits or h * w <= self.max_image_tokens * p ** 2 * m ** 2 * self.max_pixels_tolerance:
            return None
        ratios = sorted({(a, b) for n in range(self.min_tiles, self.max_tiles + 1) for a in range(1, n + 1)
                         for b in range(1, n + 1) if self.min_tiles <= a * b <= self.max_tiles},
                        key=lambda r: r[0] * r[1])  # transformers' `_target_ratios`, set order and all
        best, best_diff, aspect = (1, 1), float("inf"), width / height
        for ratio in ratios:  # `find_closest_aspect_ratio`: ties go to the larger grid if the image fills half
            diff = abs(aspect - ratio[0] / ratio[1])
            if diff < best_diff:
                best_diff, best = diff, ratio
            elif diff == best_diff and height * width > 0.5 * self.tile_size ** 2 * ratio[0] * ratio[1]:
                best = ratio
        if best == (1, 1):  # transformers then counts the thumbnail's tokens for the one tile's features
            raise ImageError(f"an image of {height}x{width} pixels splits into a single tile with min_tiles=1, "
                             "which transformers' LFM2-VL processor lays out inconsistently; day0jax refuses it")
        return best[1], best[0]

    def _target_size(self, height: int, width: int) -> tuple[int, int]:
        """transformers' `smart_resize` (height, width): the whole image's, or the thumbnail's of a split one."""
        p, m = self.encoder_patch_size, self.downsample_factor
        factor = p * m
        min_pixels = self.min_image_tokens * p ** 2 * m ** 2
        max_pixels = self.max_image_tokens * p ** 2 * m ** 2
        h_bar, w_bar = max(factor, round_by_factor(height, factor)), max(factor, round_by_factor(width, factor))
        return fit_pixels(height, width, h_bar, w_bar, factor, min_pixels, max_pixels)

    def grid_thw(self, height: int, width: int) -> tuple[int, ...]:
        p, tiles = self.encoder_patch_size, self._tiles(height, width)
        h, w = self._target_size(height, width)
        if tiles is None:
            return 1, h // p, w // p
        thumbnail = (h // p, w // p) if self.use_thumbnail else (0, 0)
        return (1, *thumbnail, *tiles, self.tile_size // p)

    def _patches(self, x: np.ndarray) -> np.ndarray:
        """A uint8 [3, H, W] image rescaled, normalized, as patches [H/p * W/p, p * p * 3] in raster order."""
        x, p = self._rescale_normalize(x), self.encoder_patch_size
        rows, cols = x.shape[1] // p, x.shape[2] // p
        return x.reshape(3, rows, p, cols, p).transpose(1, 3, 2, 4, 0).reshape(rows * cols, -1)

    def _process(self, x: np.ndarray) -> ProcessedImage:
        grid = self.grid_thw(*x.shape[1:])
        p, parts = self.encoder_patch_size, []
        if len(grid) > 3:  # `crop_image_to_patches`: the tiles, row by row, from the image resized to their grid
            _, _, _, tr, tc, side = grid
            t = side * p
            tiled = self._torch_resize(x, tr * t, tc * t)
            parts += [self._patches(tiled[:, i * t:(i + 1) * t, j * t:(j + 1) * t]) for i in range(tr)
                      for j in range(tc)]
        if grid[1]:  # the whole image, or the thumbnail of a split one
            parts.append(self._patches(self._torch_resize(x, grid[1] * p, grid[2] * p)))
        return ProcessedImage(np.ascontiguousarray(np.concatenate(parts)), grid_thw=grid)


PROCESSORS = {cls.TYPE: cls for cls in (KimiK25ImageProcessor, Lfm2VlImageProcessor)}
