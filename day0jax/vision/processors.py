"""Image processors: transformers' preprocessing of an image into a vision tower's pixel values, in numpy and PIL.

`image_processor(folder_or_dict)` reads a checkpoint's processor config and builds the processor its
`image_processor_type` names (the "Fast" and "Pil" variants alike). Every step is transformers' PIL backend
(`*ImageProcessorPil`) bit for bit: RGB conversion, PIL resize of the uint8 image, center crop, rescale (float64,
then float32), normalize (float32), and the model's own steps (LLaVA's pad to a square, Gemma 3's pan and scan,
Qwen-VL's smart resize and patch layout).

Processors transformers has only for its torchvision backend (Kimi K2.5's) are in `torchvision_processors`, on
the same base, and `image_processor` finds them too.

Values resolve as in transformers' processors: a key the config leaves out takes the class default, a key set to
null is None (its step off); the model's processor's own image keywords (Gemma3Processor's) come over the config,
and options given to `image_processor` over everything, as call-time keywords do.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from PIL import Image

from day0jax.core.errors import ConfigError, UnsupportedArchitecture
from day0jax.vision.images import ImageError, load_image, to_rgb

CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)
BILINEAR, BICUBIC = 2, 3  # PIL's filter numbers, as configs store `resample`
_SIZE_KEYS = ({"height", "width"}, {"shortest_edge"}, {"shortest_edge", "longest_edge"}, {"longest_edge"},
              {"max_height", "max_width"}, {"min_pixels", "max_pixels"})


@dataclass(frozen=True)
class ProcessedImage:
    """One image ready for a vision tower.

    pixel_values: float32; [3, H, W] for CLIP, SigLIP, LLaVA and Gemma 3 ([1 + num_crops, 3, H, W] when Gemma 3's
        pan and scan is on); [grid_t * grid_h * grid_w, 3 * temporal_patch_size * patch_size**2] for Qwen-VL.
    grid_thw: (t, h, w) in patches for Qwen-VL, else None.
    num_crops: the pan-and-scan crops after the whole image (Gemma 3), else 0.
    """

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int] | None = None
    num_crops: int = 0


class ImageProcessor:
    """transformers' generic PIL-backend pipeline: resize, center crop, rescale, normalize, pad.

    Attributes carry the resolved values under their config names (`size`, `crop_size`, `image_mean`...).
    """

    TYPE: ClassVar[str] = ""
    CENTER_CROP: ClassVar[bool] = True  # False where transformers' class ignores do_center_crop (checks crop_size only)
    # The transformers class's attributes: the keys there are, and the values of those a config leaves out.
    DEFAULTS: ClassVar[dict[str, Any]] = dict(
        do_convert_rgb=True, do_resize=True, size={"shortest_edge": 224}, default_to_square=False, resample=BICUBIC,
        do_center_crop=True, crop_size={"height": 224, "width": 224}, do_rescale=True, rescale_factor=1 / 255,
        do_normalize=True, image_mean=CLIP_MEAN, image_std=CLIP_STD, do_pad=None, pad_size=None)
    # The image keywords the model's transformers processor passes on every call, over the config's values.
    MODEL_PROCESSOR_KWARGS: ClassVar[dict[str, Any]] = {}

    @staticmethod
    def processor_options(processor: dict[str, Any]) -> dict[str, Any]:
        """The image keywords the model's transformers processor derives from its own saved keys (`processor`:
        processor_config.json's top level), over the config's values (none by default)."""
        return {}

    def __init__(self, config: dict[str, Any], **options: Any):
        """Args:
            config: the image processor's keys (preprocessor_config.json, or "image_processor" in
                processor_config.json).
            options: keys of `DEFAULTS` over the config's, as transformers' call-time keywords
                (`do_pan_and_scan=True` for Gemma 3).
        Raises:
            ConfigError: an unknown option, or a size, filter, mean or std that transformers refuses too.
        """
        unknown = sorted(set(options) - set(self.DEFAULTS))
        if unknown:
            raise ConfigError(f"unknown {self.TYPE} options {unknown}; known: {sorted(self.DEFAULTS)}")
        self.config = dict(config)
        values = {key: config[key] if key in config else default for key, default in self.DEFAULTS.items()}
        for key, value in {**self.MODEL_PROCESSOR_KWARGS, **options}.items():
            values[key] = value
        for key, value in values.items():
            setattr(self, key, value)
        self.size = _size_dict(self.size, self.default_to_square, "size")
        self.crop_size = _size_dict(self.crop_size, True, "crop_size")
        self.pad_size = _size_dict(self.pad_size, True, "pad_size")
        self._validate()

    def _validate(self) -> None:
        """transformers' `validate_preprocess_arguments`, and what its resize and crop would refuse later."""
        if self.do_rescale and self.rescale_factor is None:
            raise ConfigError("image processor do_rescale needs rescale_factor")
        if self.do_normalize and not (_channels(self.image_mean, "image_mean") and _channels(self.image_std,
                                                                                              "image_std")):
            raise ConfigError("image processor do_normalize needs image_mean and image_std")
        if self.do_resize:
            if self.resample not in range(6) or isinstance(self.resample, bool):
                raise ConfigError(f"image processor resample={self.resample!r} is not a PIL filter number (0-5)")
            if self.size is None:
                raise ConfigError("image processor do_resize needs size")
            self._check_size()
        if self.do_center_crop and (self.crop_size is None or self.CENTER_CROP and not {"height", "width"} <= set(
                self.crop_size)):
            raise ConfigError(f"image processor do_center_crop needs crop_size with height and width, "
                              f"got {self.crop_size!r}")

    def most_patches(self) -> int | None:
        """The most patches (grid cells) one image can have after preprocessing, for processors of images of any
        size (None: unbounded, or images of one size)."""
        return None

    def preprocess(self, image: Any) -> ProcessedImage:
        """The pixel values of one image.

        Args:
            image: a PIL image of any mode (converted to RGB as transformers does), or a uint8 array.
        Returns:
            The processed image (see `ProcessedImage`).
        Raises:
            ImageError: an array of the wrong dtype or shape, a non-RGB image where the config turns RGB
                conversion off, or an image the processor cannot take (Qwen-VL: aspect ratio above 200).
        """
        return self._process(self._uint8_chw(image))

    # --- steps ---------------------------------------------------------------------------------------------------

    def _uint8_chw(self, image: Any) -> np.ndarray:
        if not isinstance(image, Image.Image):
            image = load_image(image)
        if self.do_convert_rgb:
            image = to_rgb(image)
        elif image.mode != "RGB":  # transformers would carry other bands on, then fail or mislabel them
            raise ImageError(f"this image processor's config turns do_convert_rgb off (false or null), so images "
                             f"must be RGB, got mode {image.mode}")
        return np.array(image).transpose(2, 0, 1)

    def _process(self, x: np.ndarray) -> ProcessedImage:
        if self.do_resize:
            x = _resize(x, self._target_size(*x.shape[1:]), self.resample)
        if self.do_center_crop:
            x = _center_crop(x, self.crop_size["height"], self.crop_size["width"])
        x = self._rescale_normalize(x)
        if self.do_pad and self.pad_size:  # without pad_size transformers pads a batch to its largest image
            x = _pad_bottom_right(x, self.pad_size["height"], self.pad_size["width"])
        return ProcessedImage(x)

    def _check_size(self) -> None:
        s = self.size
        if not (s.get("shortest_edge") or (s.get("max_height") and s.get("max_width"))
                or (s.get("height") and s.get("width"))):
            raise ConfigError(f"image processor size={s!r} cannot resize: give height and width, shortest_edge, "
                              "or max_height and max_width")

    def _target_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after resizing, by transformers' `PilBackend.resize` rules."""
        s = self.size
        if s.get("shortest_edge") and s.get("longest_edge"):
            return _size_with_aspect_ratio(height, width, s["shortest_edge"], s["longest_edge"])
        if s.get("shortest_edge"):
            short, long = (width, height) if width <= height else (height, width)
            new_short, new_long = s["shortest_edge"], int(s["shortest_edge"] * long / short)
            return (new_long, new_short) if width <= height else (new_short, new_long)
        if s.get("max_height") and s.get("max_width"):
            scale = min(s["max_height"] / height, s["max_width"] / width)
            return int(height * scale), int(width * scale)
        return s["height"], s["width"]

    def _rescale_normalize(self, x: np.ndarray) -> np.ndarray:
        if self.do_rescale:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)  # transformers' rescale, as is
        if self.do_normalize:
            x = x if np.issubdtype(x.dtype, np.floating) else x.astype(np.float32)
            mean = np.array(_per_channel(self.image_mean, x.shape[0]), dtype=x.dtype)
            std = np.array(_per_channel(self.image_std, x.shape[0]), dtype=x.dtype)
            x = ((x.T - mean) / std).T
        return np.ascontiguousarray(x, dtype=np.float32)


class CLIPImageProcessor(ImageProcessor):
    """CLIP (and LLaVA-1.5 checkpoints): shortest edge to `size`, center crop to `crop_size`."""

    TYPE = "CLIPImageProcessor"

    def __init__(self, config: dict[str, Any], **options: Any):
        if config.get("use_square_size"):  # KOSMOS-2's key: a square of the *class* default's shortest edge
            config = dict(config, size={"height": 224, "width": 224})
        super().__init__(config, **options)


class SiglipImageProcessor(ImageProcessor):
    """SigLIP: resize to a fixed height and width, no crop."""

    TYPE = "SiglipImageProcessor"
    DEFAULTS = dict(ImageProcessor.DEFAULTS, size={"height": 224, "width": 224}, do_center_crop=None,
                    crop_size=None, image_mean=HALF, image_std=HALF)


class LlavaImageProcessor(ImageProcessor):
    """LLaVA: CLIP's steps, after padding the image to a square with the mean colour when `do_pad`."""

    TYPE = "LlavaImageProcessor"
    DEFAULTS = dict(ImageProcessor.DEFAULTS, do_pad=False)

    def _process(self, x: np.ndarray) -> ProcessedImage:
        if self.do_pad:
            x = self._pad_to_square(x)
        if self.do_resize:
            x = _resize(x, self._target_size(*x.shape[1:]), self.resample)
        if self.do_center_crop:
            x = _center_crop(x, self.crop_size["height"], self.crop_size["width"])
        return ProcessedImage(self._rescale_normalize(x))

    def _pad_to_square(self, x: np.ndarray) -> np.ndarray:
        c, h, w = x.shape
        if h == w:
            return x
        colour = [int(m * 255) for m in _per_channel(self.image_mean, c)] if self.image_mean else [0]
        side = max(h, w)
        out = np.zeros((c, side, side), dtype=x.dtype)
        out[:] = np.array(colour, dtype=x.dtype)[:, None, None]
        if w > h:
            out[:, (side - h) // 2:(side - h) // 2 + h, :] = x
        else:
            out[:, :, (side - w) // 2:(side - w) // 2 + w] = x
        return out


class Gemma3ImageProcessor(ImageProcessor):
    """Gemma 3: resize to a fixed square; with `do_pan_and_scan`, crops of a long image follow the whole one."""

    TYPE = "Gemma3ImageProcessor"
    CENTER_CROP = False
    DEFAULTS = dict(SiglipImageProcessor.DEFAULTS, default_to_square=True, resample=BILINEAR, do_pan_and_scan=None,
                    pan_and_scan_min_crop_size=None, pan_and_scan_max_num_crops=None,
                    pan_and_scan_min_ratio_to_activate=None)
    # Gemma3Processor's `images_kwargs`: RGB conversion and pan and scan are its choices, not the config's (null).
    MODEL_PROCESSOR_KWARGS = dict(do_convert_rgb=True, do_pan_and_scan=False, pan_and_scan_min_crop_size=256,
                                  pan_and_scan_max_num_crops=4, pan_and_scan_min_ratio_to_activate=1.2)

    def _process(self, x: np.ndarray) -> ProcessedImage:
        crops = self._pan_and_scan(x) if self.do_pan_and_scan else []
        images = []
        for image in [x] + crops:  # Gemma 3 neither center-crops nor pads
            if self.do_resize:
                image = _resize(image, self._target_size(*image.shape[1:]), self.resample)
            images.append(self._rescale_normalize(image))
        if not self.do_pan_and_scan:
            return ProcessedImage(images[0])
        return ProcessedImage(np.stack(images), num_crops=len(crops))

    def _pan_and_scan(self, x: np.ndarray) -> list[np.ndarray]:
        """transformers' `pan_and_scan`: 2 to max_num_crops equal crops along the long side of a long image."""
        _, height, width = x.shape
        min_crop, max_crops = self.pan_and_scan_min_crop_size, self.pan_and_scan_max_num_crops
        long, short = max(width, height), min(width, height)
        if long / short < self.pan_and_scan_min_ratio_to_activate:
            return []
        n = min(int(math.floor(long / min_crop)), int(math.floor(long / short + 0.5)))
        n = min(max_crops, max(2, n))
        n_w, n_h = (n, 1) if width >= height else (1, n)
        crop_w, crop_h = int(math.ceil(width / n_w)), int(math.ceil(height / n_h))
        if min(crop_w, crop_h) < min_crop:
            return []
        return [x[:, top:top + crop_h, left:left + crop_w]
                for top, left in itertools.product(range(0, crop_h * n_h, crop_h), range(0, crop_w * n_w, crop_w))]


class Qwen2VLImageProcessor(ImageProcessor):
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL: smart resize to multiples of patch_size * merge_size within a pixel
    budget, then the image as a sequence of flattened patches, merge groups adjacent, repeated over time."""

    TYPE = "Qwen2VLImageProcessor"
    CENTER_CROP = False
    DEFAULTS = dict(ImageProcessor.DEFAULTS, size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
                    do_center_crop=None, crop_size=None, patch_size=14, temporal_patch_size=2, merge_size=2)

    def __init__(self, config: dict[str, Any], **options: Any):
        """As `ImageProcessor`; `min_pixels` and `max_pixels` (config keys or options) set size's shortest_edge and
        longest_edge, as in transformers (which refuses a size holding only those two keys; we read it the same)."""
        merged = {**config, **options}
        size = merged.get("size")
        size = dict(self.DEFAULTS["size"]) if size is None else size  # transformers' __init__: null is the default
        if isinstance(size, dict):
            size = dict(size)
            for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
                value = merged.get(key) if merged.get(key) is not None else size.pop(key, None)
                if value is not None:
                    size[edge] = value
                    size.pop(key, None)
        options = {k: v for k, v in options.items() if k not in ("size", "min_pixels", "max_pixels")}
        super().__init__(dict(config, size=size), **options)

    def _validate(self) -> None:
        super()._validate()
        for key in ("patch_size", "temporal_patch_size", "merge_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"Qwen-VL image processor {key}={value!r} must be a positive integer")

    def _check_size(self) -> None:
        if not (self.size.get("shortest_edge") and self.size.get("longest_edge")):
            raise ConfigError(f"Qwen-VL image processor size={self.size!r} needs shortest_edge (min pixels) and "
                              "longest_edge (max pixels)")

    def most_patches(self) -> int | None:
        return self.size["longest_edge"] // self.patch_size ** 2 if self.do_resize else None

    def grid_thw(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) in patches of an image of `height` x `width` pixels (before preprocessing).

        Raises:
            ImageError: an aspect ratio above 200, which transformers refuses.
        """
        h, w = self._target_size(height, width) if self.do_resize else (height, width)
        return 1, h // self.patch_size, w // self.patch_size

    def _target_size(self, height: int, width: int) -> tuple[int, int]:
        return smart_resize(height, width, self.patch_size * self.merge_size, self.size["shortest_edge"],
                            self.size["longest_edge"])

    def _process(self, x: np.ndarray) -> ProcessedImage:
        if self.do_resize:
            x = _resize(x, self._target_size(*x.shape[1:]), self.resample)
        x = self._rescale_normalize(x)
        c, height, width = x.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        if height % (p * m) or width % (p * m):
            raise ImageError(f"image of {height}x{width} pixels is not a multiple of patch_size * merge_size = "
                             f"{p * m} (the config turns resizing off)")
        gh, gw = height // p, width // p
        # transformers' patchify: (merge rows, merge cols, m, m, C, p, p), the one frame repeated over time.
        patches = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
        return ProcessedImage(patches.reshape(gh * gw, c * t * p * p), grid_thw=(1, gh, gw))


class PixtralImageProcessor(ImageProcessor):
    """Pixtral (Mistral 3): the longest edge shrunk to `size` (never grown), both sides then rounded up to whole
    patches; the image as patches of `patch_size` in raster order, grid (1, rows, columns). PixtralProcessor hands
    its own patch_size * spatial_merge_size (processor_config.json) over the image processor's, so that a patch is
    one merged token (`processor_options`)."""

    TYPE = "PixtralImageProcessor"
    CENTER_CROP = False
    DEFAULTS = dict(ImageProcessor.DEFAULTS, size={"longest_edge": 1024}, default_to_square=True,
                    do_center_crop=None, crop_size=None, do_pad=True, patch_size={"height": 16, "width": 16})

    @staticmethod
    def processor_options(processor: dict[str, Any]) -> dict[str, Any]:
        if "patch_size" not in processor and "spatial_merge_size" not in processor:
            return {}
        side = processor.get("patch_size", 16) * processor.get("spatial_merge_size", 1)
        return {"patch_size": {"height": side, "width": side}}

    def __init__(self, config: dict[str, Any], **options: Any):
        super().__init__(config, **options)
        self.patch_size = _size_dict(self.patch_size, True, "patch_size")
        if self.patch_size is None or self.patch_size["height"] != self.patch_size["width"]:
            raise ConfigError(f"Pixtral image processor patch_size={self.patch_size!r}: square patches only")

    def _check_size(self) -> None:
        s = self.size
        if not (s.get("longest_edge") or (s.get("height") and s.get("width"))):
            raise ConfigError(f"Pixtral image processor size={s!r} needs longest_edge, or height and width")

    def _target_size(self, height: int, width: int) -> tuple[int, int]:
        """transformers' Pixtral `get_resize_output_image_size`."""
        s, p = self.size, self.patch_size["height"]
        max_h, max_w = (s["longest_edge"],) * 2 if s.get("longest_edge") else (s["height"], s["width"])
        ratio = max(height / max_h, width / max_w)
        if ratio > 1:
            height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
        return ((height - 1) // p + 1) * p, ((width - 1) // p + 1) * p

    def grid_thw(self, height: int, width: int) -> tuple[int, int, int]:
        h, w = self._target_size(height, width) if self.do_resize else (height, width)
        return 1, h // self.patch_size["height"], w // self.patch_size["height"]

    def most_patches(self) -> int | None:
        if not self.do_resize:
            return None
        s, p = self.size, self.patch_size["height"]
        h, w = (s["longest_edge"],) * 2 if s.get("longest_edge") else (s["height"], s["width"])
        return -(-h // p) * -(-w // p)

    def _process(self, x: np.ndarray) -> ProcessedImage:
        if self.do_resize:
            x = _resize(x, self._target_size(*x.shape[1:]), self.resample)
        x = self._rescale_normalize(x)
        c, height, width = x.shape
        p = self.patch_size["height"]
        if height % p or width % p:
            raise ImageError(f"image of {height}x{width} pixels is not a multiple of the patch size {p} (the config "
                             "turns resizing off)")
        patches = x.reshape(c, height // p, p, width // p, p).transpose(1, 3, 0, 2, 4).reshape(-1, c * p * p)
        return ProcessedImage(np.ascontiguousarray(patches), grid_thw=(1, height // p, width // p))


class Gemma4ImageProcessor(ImageProcessor):
    """Gemma 4: the image resized, keeping its aspect ratio, to the largest multiples of pooling_kernel_size *
    patch_size within max_soft_tokens * pooling_kernel_size^2 patches, rescaled (not normalized, by default), as
    patches of [p, p, 3] (channels last) in raster order; grid (1, rows, columns)."""

    TYPE = "Gemma4ImageProcessor"
    CENTER_CROP = False
    SOFT_TOKENS = (70, 140, 280, 560, 1120)
    DEFAULTS = dict(ImageProcessor.DEFAULTS, size=None, do_center_crop=None, crop_size=None, do_normalize=False,
                    image_mean=[0.0, 0.0, 0.0], image_std=[1.0, 1.0, 1.0], patch_size=16, max_soft_tokens=280,
                    pooling_kernel_size=3)

    def _validate(self) -> None:
        if self.max_soft_tokens not in self.SOFT_TOKENS:
            raise ConfigError(f"Gemma 4 image processor max_soft_tokens={self.max_soft_tokens!r} must be one of "
                              f"{self.SOFT_TOKENS} (transformers refuses others)")
        for key in ("patch_size", "pooling_kernel_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"Gemma 4 image processor {key}={value!r} must be a positive integer")
        do_resize, self.do_resize = self.do_resize, False  # its own sizes: no `size` to check
        super()._validate()
        self.do_resize = do_resize

    def most_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size ** 2

    def _target_size(self, height: int, width: int) -> tuple[int, int]:
        """transformers' Gemma 4 `get_aspect_ratio_preserving_size`.

        Raises:
            ImageError: an image that would shrink to nothing, or past the patch budget (transformers refuses it).
        """
        p, k = self.patch_size, self.pooling_kernel_size
        max_patches = self.most_patches()
        target_px = max_patches * p * p
        factor = math.sqrt(target_px / (height * width))
        side = k * p
        th, tw = int(math.floor(factor * height / side)) * side, int(math.floor(factor * width / side)) * side
        if th == 0 and tw == 0:
            raise ImageError(f"image of {height}x{width} pixels resizes to 0x0 (sides are multiples of {side})")
        longest = (max_patches // k ** 2) * side
        if th == 0:
            th, tw = side, min(int(math.floor(width / height)) * side, longest)
        elif tw == 0:
            th, tw = min(int(math.floor(height / width)) * side, longest), side
        if th * tw > target_px:
            raise ImageError(f"image of {height}x{width} pixels would resize to {th}x{tw}, past the "
                             f"{max_patches} patches of {p} pixels")
        return th, tw

    def grid_thw(self, height: int, width: int) -> tuple[int, int, int]:
        h, w = self._target_size(height, width) if self.do_resize else (height, width)
        return 1, h // self.patch_size, w // self.patch_size

    def _process(self, x: np.ndarray) -> ProcessedImage:
        if self.do_resize:
            target = self._target_size(*x.shape[1:])
            if target != x.shape[1:]:
                x = _resize(x, target, self.resample)
        x = self._rescale_normalize(x)
        c, height, width = x.shape
        p = self.patch_size
        rows, cols = height // p, width // p
        patches = x[:, :rows * p, :cols * p].reshape(c, rows, p, cols, p).transpose(1, 3, 2, 4, 0)
        return ProcessedImage(np.ascontiguousarray(patches.reshape(rows * cols, -1)), grid_thw=(1, rows, cols))


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen-VL `smart_resize`: (height, width) in multiples of `factor`, about the same aspect ratio,
    with min_pixels <= height * width <= max_pixels.

    Raises:
        ImageError: an aspect ratio above 200.
    """
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"image of {height}x{width} pixels: Qwen-VL takes aspect ratios up to 200, got "
                         f"{max(height, width) / min(height, width):.1f}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    return fit_pixels(height, width, h_bar, w_bar, factor, min_pixels, max_pixels)


def fit_pixels(height: int, width: int, h_bar: int, w_bar: int, factor: int, min_pixels: int, max_pixels: int
               ) -> tuple[int, int]:
    """`smart_resize`'s last step: (h_bar, w_bar), the image's size rounded to multiples of `factor`, scaled at the
    image's aspect ratio down below max_pixels or up above min_pixels where it falls outside."""
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


PROCESSORS = {cls.TYPE: cls for cls in (CLIPImageProcessor, SiglipImageProcessor, LlavaImageProcessor,
                                        Gemma3ImageProcessor, Qwen2VLImageProcessor, PixtralImageProcessor,
                                        Gemma4ImageProcessor)}
# config.json model types -> processor, for the rare processor config that names no type (transformers' auto map).
BY_MODEL_TYPE = {"clip": "CLIPImageProcessor", "siglip": "SiglipImageProcessor", "paligemma": "SiglipImageProcessor",
                 "llava": "LlavaImageProcessor", "gemma3": "Gemma3ImageProcessor",
                 "kimi_k25": "Kimi_K25ImageProcessor", "mistral3": "PixtralImageProcessor",
                 "gemma4": "Gemma4ImageProcessor",
                 "lfm2_vl": "Lfm2VlImageProcessor",
                 **dict.fromkeys(("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"),
                                 "Qwen2VLImageProcessor")}


def image_processor(source: str | os.PathLike | dict[str, Any], **options: Any) -> ImageProcessor:
    """The image processor of a checkpoint.

    Args:
        source: a checkpoint folder (its processor_config.json with an "image_processor" entry first, as
            transformers 5 saves it, else its preprocessor_config.json), the path of one of those files, or
            their parsed dict.
        options: values over the config's, as transformers' processor call keywords (`do_pan_and_scan=True`).
    Returns:
        The processor for its `image_processor_type` (a "Fast" or "Pil" suffix is ignored).
    Raises:
        ConfigError: no processor config, unreadable JSON, no type, an unknown option, or values transformers
            refuses too.
        UnsupportedArchitecture: an image processor type that is not implemented.
    """
    folder, outer = None, {}
    if isinstance(source, dict):
        config = source
    else:
        folder = os.fspath(source) if os.path.isdir(source) else os.path.dirname(os.fspath(source))
        config = read_processor_config(source)
        if os.path.isfile(os.path.join(folder, "processor_config.json")):
            outer = _read_json(os.path.join(folder, "processor_config.json"))
    if isinstance(config.get("image_processor"), dict):
        config = config["image_processor"]
    from day0jax.vision import torchvision_processors  # imports this module: loaded on first use

    known = {**PROCESSORS, **torchvision_processors.PROCESSORS}
    name = _type_name(config, folder)
    base = name.removesuffix("Fast").removesuffix("Pil")
    if base not in known:
        raise UnsupportedArchitecture(f"image_processor_type {name!r} is not implemented; implemented: "
                                      f"{', '.join(sorted(known))}")
    cls = known[base]
    return cls(config, **{**cls.processor_options(outer), **options})


def patch_limit(folder: str | os.PathLike) -> int | None:
    """The most patches the image processor of the checkpoint `folder` makes of one image (None: no processor
    config, one that cannot be read, or no bound; the processor's own errors come when images are preprocessed)."""
    try:
        return image_processor(folder).most_patches()
    except Exception:  # noqa: BLE001 - any refusal is reported again, with its reason, when images are sent
        return None


def read_processor_config(source: str | os.PathLike) -> dict[str, Any]:
    """The image processor's dict of a checkpoint folder or processor config file (see `image_processor`).

    Raises:
        ConfigError: neither file, or a file that is not a JSON object.
    """
    if not os.path.isdir(source):
        return _read_json(os.fspath(source))
    processor = os.path.join(source, "processor_config.json")
    if os.path.isfile(processor):
        nested = _read_json(processor).get("image_processor")
        if isinstance(nested, dict):
            return nested
    preprocessor = os.path.join(source, "preprocessor_config.json")
    if os.path.isfile(preprocessor):
        return _read_json(preprocessor)
    raise ConfigError(f"{source} has no image processor config: neither preprocessor_config.json nor an "
                      "\"image_processor\" entry in processor_config.json")


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the processor config {path}: {e}") from e
    if not isinstance(value, dict):
        raise ConfigError(f"the processor config {path} is not a JSON object")
    return value


def _type_name(config: dict[str, Any], folder: str | None) -> str:
    if config.get("image_processor_type"):
        return config["image_processor_type"]
    if str(config.get("feature_extractor_type", "")).endswith("FeatureExtractor"):  # pre-2023 configs
        return config["feature_extractor_type"].removesuffix("FeatureExtractor") + "ImageProcessor"
    if folder and os.path.isfile(os.path.join(folder, "config.json")):
        model_type = _read_json(os.path.join(folder, "config.json")).get("model_type")
        if model_type in BY_MODEL_TYPE:
            return BY_MODEL_TYPE[model_type]
    raise ConfigError("the processor config names no image_processor_type")


# --- transformers' numpy/PIL transforms, on uint8 or float [C, H, W] ---------------------------------------------

def _size_dict(value: Any, default_to_square: bool, name: str) -> dict[str, int] | None:
    """transformers' `get_size_dict`: an int (a square, or a shortest edge), a (height, width) pair, or a dict."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return {"height": value, "width": value} if default_to_square else {"shortest_edge": value}
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return {"height": value[0], "width": value[1]}
    if isinstance(value, dict) and set(value) in _SIZE_KEYS:
        return dict(value)
    raise ConfigError(f"image processor {name}={value!r} is not a size: give an int, [height, width] or a dict with "
                      f"one of the key sets {[sorted(k) for k in _SIZE_KEYS]}")


def _channels(value: Any, name: str) -> bool:
    if value is None:
        return False
    if isinstance(value, (list, tuple)) and len(value) != 3:
        raise ConfigError(f"image processor {name}={value!r}: give one value or three (RGB)")
    return True


def _per_channel(value: Any, channels: int) -> list[float]:
    return list(value) if isinstance(value, (list, tuple)) else [value] * channels


def _size_with_aspect_ratio(height: int, width: int, size: int, max_size: int) -> tuple[int, int]:
    """transformers' `get_size_with_aspect_ratio`: shortest edge `size` unless the longest passes `max_size`."""
    raw_size = None
    short, long = float(min(height, width)), float(max(height, width))
    if long / short * size > max_size:
        raw_size = max_size * short / long
        size = int(round(raw_size))
    if (height <= width and height == size) or (width <= height and width == size):
        return height, width
    if width < height:
        return int((raw_size if raw_size is not None else size) * height / width), size
    return size, int((raw_size if raw_size is not None else size) * width / height)


def _resize(x: np.ndarray, size: tuple[int, int], resample: int) -> np.ndarray:
    """PIL's resize of a uint8 [C, H, W] image to (height, width), as transformers' `resize` calls it."""
    height, width = size
    if height < 1 or width < 1:
        raise ImageError(f"image of {x.shape[1]}x{x.shape[2]} pixels resizes to {height}x{width}: too thin")
    image = Image.fromarray(np.ascontiguousarray(x.transpose(1, 2, 0)))
    return np.array(image.resize((width, height), resample=resample)).transpose(2, 0, 1)


def _center_crop(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' `center_crop`: a crop larger than the image pads it with zeros, centred."""
    _, h, w = x.shape
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return x[:, top:top + height, left:left + width]
    new_h, new_w = max(height, h), max(width, w)
    padded = np.zeros((x.shape[0], new_h, new_w), dtype=x.dtype)
    top_pad, left_pad = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
    padded[:, top_pad:top_pad + h, left_pad:left_pad + w] = x
    top, left = top + top_pad, left + left_pad
    return padded[:, max(0, top):min(new_h, top + height), max(0, left):min(new_w, left + width)]


def _pad_bottom_right(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' `PilBackend.pad` to `pad_size`: zeros after the last row and column."""
    if height < x.shape[1] or width < x.shape[2]:
        raise ImageError(f"image of {x.shape[1]}x{x.shape[2]} pixels after resizing is larger than pad_size "
                         f"{height}x{width}")
    return np.pad(x, ((0, 0), (0, height - x.shape[1]), (0, width - x.shape[2])))
