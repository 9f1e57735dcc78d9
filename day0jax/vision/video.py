"""Videos for Qwen3-VL-style models: `Video` (decoded frames, their rate and the video processor's sampling
keywords), transformers' `Qwen3VLVideoProcessor` in numpy (frames sampled, resized by torchvision's uint8 kernels,
rescaled and normalized in float32, padded to whole temporal patches and cut into patches, the per-frame-pair
timestamps the prompt shows), and animated GIF / WebP / APNG decoding (Pillow reads their frames).

transformers' video processors exist only for its torchvision backend: `vision.resize` renders torchvision's uint8
resize, and tests/test_video.py runs transformers' own processor on a plain-torch rendering of torchvision
(tests/ref/plain_torchvision) and compares the pixels exactly. Reference:
transformers/models/qwen3_vl/video_processing_qwen3_vl.py and processing_qwen3_vl.py (`_calculate_timestamps`).
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from PIL import Image, ImageSequence

from day0jax.core.errors import ConfigError
from day0jax.vision import resize
from day0jax.vision.images import ImageError, _data_url_bytes, load_image, open_media_file
from day0jax.vision.processors import BICUBIC, BILINEAR, _read_json
from day0jax.vision.torchvision_processors import rescale_normalize

IMAGENET_STANDARD = (0.5, 0.5, 0.5)
DEFAULT_FPS = 24  # the frame rate transformers assumes for frames given without one
MAX_FRAMES = 1024  # frames one decoded video may hold (before sampling): hostile files declare thousands
MAX_VIDEO_PIXELS = 200_000_000  # frames x width x height of one decoded video
VIDEO_FORMATS = ("GIF", "WEBP", "PNG")  # animated GIF, WebP and APNG: what Pillow decodes frame by frame
SAMPLING_KEYS = ("fps", "num_frames", "do_sample_frames")  # the processor's call keywords a video part may carry


@dataclass(frozen=True, eq=False)
class Video:
    """One video as decoded frames.

    Attributes:
        frames: PIL images or uint8 HxWx3 arrays, all of one size, in order.
        source_fps: the frames' rate (transformers' `video_metadata["fps"]`); None: 24, as transformers assumes.
        options: the video processor's call keywords (`fps`: frames sampled per second, `num_frames`,
            `do_sample_frames`), over the checkpoint's values.
    """

    frames: Sequence[Any]
    source_fps: float | None = None
    options: dict = field(default_factory=dict)

    @classmethod
    def from_part(cls, part: dict, *, allowed_media_dir=None) -> "Video":
        """A chat content part `{"type": "video", "video": [frames]}` or `{"type": "video_url", "video_url":
        {"url": ...}}`, with optional `video_metadata` ({"fps": ...}) and sampling keywords (`SAMPLING_KEYS`).

        Raises:
            ImageError: a part without its frames, an unknown keyword, or a URL that cannot be decoded.
        """
        kind = part.get("type")
        source = part.get(kind)
        if kind == "video_url" and isinstance(source, dict):
            source = source.get("url")
        if source is None:
            raise ImageError(f"a content part of type {kind!r} has no {kind!r} field")
        metadata = part.get("video_metadata") or {}
        unknown = sorted(set(part) - {"type", kind, "video_metadata", *SAMPLING_KEYS})
        if unknown or not isinstance(metadata, dict):
            raise ImageError(f"video content part keys {unknown}: known are {['video_metadata', *SAMPLING_KEYS]}")
        options = {k: part[k] for k in SAMPLING_KEYS if k in part}
        if isinstance(source, (str, bytes, bytearray)):
            frames, fps = load_video(source, allowed_media_dir=allowed_media_dir)
            return cls(frames, metadata.get("fps", fps), options)
        if isinstance(source, np.ndarray) and source.ndim == 4:
            source = list(source)
        if not isinstance(source, (list, tuple)):
            raise ImageError(f"a {kind!r} part holds a list of frames (PIL images or uint8 HxWx3 arrays) or a URL, "
                             f"got {type(source).__name__}")
        return cls(list(source), metadata.get("fps"), options)


@dataclass(frozen=True)
class ProcessedVideo:
    """One video ready for the tower: patches [grid_t * grid_h * grid_w, C * temporal_patch_size * p * p], its grid
    (t, h, w) in temporal and spatial patches, and the seconds shown before each temporal patch's tokens."""

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    timestamps: tuple[float, ...]


def smart_resize(num_frames: int, height: int, width: int, temporal_factor: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen3-VL video `smart_resize`: the frames' (height, width) in multiples of `factor`, with the
    pixels of all (temporally padded) frames between min_pixels and max_pixels.

    Raises:
        ImageError: fewer frames than one temporal patch, or an aspect ratio above 200.
    """
    if num_frames < temporal_factor:
        raise ImageError(f"a video of {num_frames} frame(s) after sampling: Qwen3-VL takes at least "
                         f"{temporal_factor} (temporal_patch_size)")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"video frames of {height}x{width} pixels: aspect ratios up to 200 are taken")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class Qwen3VLVideoProcessor:
    """transformers' `Qwen3VLVideoProcessor` (its torchvision backend), in numpy. Attributes carry the resolved
    values under their config names; a key the config leaves out takes the class default."""

    TYPE = "Qwen3VLVideoProcessor"
    DEFAULTS = dict(size={"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}, resample=BICUBIC,
                    do_resize=True, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
                    image_mean=IMAGENET_STANDARD, image_std=IMAGENET_STANDARD, do_convert_rgb=True, patch_size=16,
                    temporal_patch_size=2, merge_size=2, min_frames=4, max_frames=768, do_sample_frames=True,
                    fps=2, num_frames=None, cap_pixels_per_frame=None, max_video_tokens=768)

    def __init__(self, config: dict[str, Any]):
        """Raises:
            ConfigError: a size without shortest_edge and longest_edge, a filter other than bilinear or bicubic,
                or patch sizes that are not positive integers.
        """
        self.config = dict(config)
        for key, default in self.DEFAULTS.items():
            setattr(self, key, config[key] if key in config else default)
        if not (isinstance(self.size, dict) and self.size.get("shortest_edge") and self.size.get("longest_edge")):
            raise ConfigError(f"{self.TYPE} size={self.size!r} needs shortest_edge and longest_edge (pixels)")
        if self.resample not in (BILINEAR, BICUBIC):
            raise ConfigError(f"{self.TYPE} resample={self.resample!r}: bilinear (2) and bicubic (3) are implemented")
        for key in ("patch_size", "temporal_patch_size", "merge_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{self.TYPE} {key}={value!r} must be a positive integer")

    def sample_indices(self, total: int, source_fps: float | None, fps, num_frames, do_sample_frames
                       ) -> tuple[np.ndarray, float]:
        """(indices of the frames kept, the frame rate the timestamps use): `Qwen3VLVideoProcessor.sample_frames`."""
        if not do_sample_frames:
            return np.arange(total), DEFAULT_FPS if source_fps is None else source_fps
        if fps is not None and num_frames is not None:
            raise ImageError("`num_frames` and `fps` are mutually exclusive: give fps=None with num_frames")
        rate = DEFAULT_FPS if source_fps is None else source_fps
        if num_frames is None and fps is not None:
            num_frames = min(max(int(total / rate * fps), self.min_frames), self.max_frames, total)
        if num_frames is None:
            num_frames = min(max(total, self.min_frames), self.max_frames)
        return np.linspace(0, total - 1, num_frames).round().astype(int), rate

    def preprocess(self, video: Video) -> ProcessedVideo:
        """One video's patches, grid and timestamps.

        Raises:
            ImageError: no frames, frames of differing sizes or of the wrong type, too few frames, or an unknown
                sampling keyword.
        """
        unknown = sorted(set(video.options) - set(SAMPLING_KEYS))
        if unknown:
            raise ImageError(f"unknown video keywords {unknown}; known: {list(SAMPLING_KEYS)}")
        frames = frames_array(video.frames)  # [T, H, W, 3] uint8
        opts = {k: video.options.get(k, getattr(self, k)) for k in SAMPLING_KEYS}
        indices, rate = self.sample_indices(len(frames), video.source_fps, opts["fps"], opts["num_frames"],
                                            opts["do_sample_frames"])
        x = np.ascontiguousarray(frames[indices].transpose(0, 3, 1, 2))  # [T, C, H, W]
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        if self.do_resize:
            T, _, height, width = x.shape
            max_pixels = self.size["longest_edge"]
            if self.cap_pixels_per_frame:  # qwen-vl-utils' per-frame budget
                per_frame = max(min(self.max_video_tokens * (p * m) ** 2, max_pixels // T),
                                int(self.size["shortest_edge"] * 1.05))
                max_pixels = per_frame * T
            h, w = smart_resize(T, height, width, tp, p * m, self.size["shortest_edge"], max_pixels)
            x = resize.resize(x, h, w, "bicubic" if self.resample == BICUBIC else "bilinear")
        x = rescale_normalize(x, self)  # [T, C, H, W]
        T, C, H, W = x.shape
        if H % (p * m) or W % (p * m):
            raise ImageError(f"video frames of {H}x{W} pixels are not multiples of patch_size * merge_size = "
                             f"{p * m} (the config turns resizing off)")
        if T % tp:  # the last frame repeated to whole temporal patches
            x = np.concatenate([x, np.repeat(x[-1:], tp - T % tp, axis=0)])
        gt, gh, gw = len(x) // tp, H // p, W // p
        patches = x.reshape(gt, tp, C, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return ProcessedVideo(np.ascontiguousarray(patches.reshape(gt * gh * gw, C * tp * p * p)), (gt, gh, gw),
                              timestamps(indices, rate, tp))

def timestamps(indices: Sequence[int], fps: float, temporal_patch_size: int) -> tuple[float, ...]:
    """Qwen3VLProcessor's `_calculate_timestamps`: the indices padded with the last to whole temporal patches, each
    patch's time the mean of its first and last frame's, in seconds."""
    indices = [int(i) for i in indices]
    indices += [indices[-1]] * (-len(indices) % temporal_patch_size)
    seconds = [i / fps for i in indices]
    return tuple((seconds[i] + seconds[i + temporal_patch_size - 1]) / 2
                 for i in range(0, len(seconds), temporal_patch_size))


def frames_array(frames: Sequence[Any]) -> np.ndarray:
    """Frames (PIL images of any mode, converted as images are, or uint8 HxWx3 arrays) -> uint8 [T, H, W, 3].

    Raises:
        ImageError: no frames, a frame of another type or dtype, or frames of differing sizes.
    """
    if len(frames) == 0:
        raise ImageError("a video needs at least one frame")
    if len(frames) > MAX_FRAMES:
        raise ImageError(f"a video of {len(frames)} frames is above the limit of {MAX_FRAMES} frames")
    out = [f if isinstance(f, np.ndarray) and f.ndim == 3 and f.shape[2] == 3 and f.dtype == np.uint8
           else np.asarray(load_image(f)) for f in frames]
    if len({f.shape for f in out}) != 1:
        raise ImageError(f"a video's frames must share one size, got {sorted({f.shape[:2] for f in out})}")
    return np.stack(out)


def video_processor(folder: str | os.PathLike) -> Qwen3VLVideoProcessor:
    """The video processor of a checkpoint folder: processor_config.json's "video_processor" entry (as transformers
    5 saves it), else video_preprocessor_config.json.

    Raises:
        ConfigError: neither, unreadable JSON, or a video processor type that is not implemented.
    """
    folder = os.fspath(folder)
    config = None
    outer = os.path.join(folder, "processor_config.json")
    if os.path.isfile(outer):
        config = _read_json(outer).get("video_processor")
    if not isinstance(config, dict) and os.path.isfile(os.path.join(folder, "video_preprocessor_config.json")):
        config = _read_json(os.path.join(folder, "video_preprocessor_config.json"))
    if not isinstance(config, dict):
        raise ConfigError(f"{folder} has no video processor config (video_preprocessor_config.json, or a "
                          "\"video_processor\" entry in processor_config.json): videos cannot be preprocessed")
    name = str(config.get("video_processor_type") or Qwen3VLVideoProcessor.TYPE)
    if name.removesuffix("Fast") != Qwen3VLVideoProcessor.TYPE:
        raise ConfigError(f"video_processor_type {name!r} is not implemented; implemented: "
                          f"{Qwen3VLVideoProcessor.TYPE}")
    return Qwen3VLVideoProcessor(config)


def load_video(source: str | bytes, *, allowed_media_dir=None, max_frames: int = MAX_FRAMES,
               max_pixels: int = MAX_VIDEO_PIXELS) -> tuple[list[np.ndarray], float | None]:
    """An animated GIF, WebP or PNG (APNG) as frames: a `data:` URL (any media type), a `file://` URL of a file
    inside `allowed_media_dir`, or the encoded bytes.

    Returns:
        (uint8 HxWx3 frames, the frame rate from the frames' durations, None where the file gives none).
    Raises:
        ImageError: another container (mp4, webm...), a URL of another scheme, a file outside the folder, corrupt
            data, more than `max_frames` frames, or more than `max_pixels` pixels over all frames (checked from the
            header and frame count before the frames are decoded).
    """
    if isinstance(source, str):
        url = source.strip()
        scheme, _, rest = url.partition(":")
        scheme = scheme.lower()
        if scheme == "data":
            header = rest.partition(",")[0]
            data = _data_url_bytes("image/" + rest.partition("/")[2] if header.lower().startswith("video/") else rest)
            return _decode(io.BytesIO(data), max_frames, max_pixels)
        if scheme == "file":
            with open_media_file(url, allowed_media_dir) as f:
                return _decode(io.BytesIO(f.read()), max_frames, max_pixels)
        raise ImageError(f"unsupported video URL scheme {scheme!r}: pass a data:video/...;base64 URL or a file:// "
                         "URL (nothing is fetched from the network)")
    return _decode(io.BytesIO(bytes(source)), max_frames, max_pixels)


def _decode(fp: io.BytesIO, max_frames: int, max_pixels: int) -> tuple[list[np.ndarray], float | None]:
    head = fp.getvalue()[:12]
    if head[4:8] == b"ftyp" or head[:4] == b"\x1a\x45\xdf\xa3" or head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        raise ImageError("video container not supported (mp4/mov/webm/mkv/avi): videos are read as animated GIF, "
                         "WebP or PNG (APNG); convert the clip to one of those")
    try:
        image = Image.open(fp, formats=VIDEO_FORMATS)
    except Exception as e:  # noqa: BLE001 - PIL raises many types on foreign or corrupt data
        raise ImageError(f"cannot read the video: not an animated GIF, WebP or PNG (APNG) ({e})") from e
    count = getattr(image, "n_frames", 1)
    if count > max_frames:
        raise ImageError(f"a video of {count} frames is above the limit of {max_frames} frames")
    if count * image.width * image.height > max_pixels:
        raise ImageError(f"a video of {count} frames of {image.width}x{image.height} pixels is above the limit of "
                         f"{max_pixels} pixels over all frames")
    frames, durations = [], []
    try:
        for frame in ImageSequence.Iterator(image):
            frames.append(np.asarray(load_image(frame.copy())))
            durations.append(frame.info.get("duration"))
    except ImageError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ImageError(f"cannot decode the video's frames: {e}") from e
    total = sum(d for d in durations if d) if all(durations) else 0
    return frames, (len(frames) * 1000.0 / total if total else None)
