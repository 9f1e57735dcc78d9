"""Images in: a PIL image, a uint8 array, a `data:` URL or an allowed `file://` URL, decoded into an RGB PIL image
with the pixels transformers' image processors (`do_convert_rgb`) would see.

Transparency is composited onto white, as `transformers.image_transforms.convert_to_rgb` does (PIL's
`alpha_composite` for images, its rounded float blend for RGBA arrays). transformers' own `load_image` drops the
alpha channel of strings instead; compositing everywhere gives a data URL the same pixels as the PIL image it holds.
Nothing is ever fetched over the network, and image sizes are checked before their pixels are decoded.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from day0jax.core.errors import Day0Error

MAX_PIXELS = 50_000_000  # well above any photo a model takes in, far below what exhausts a host (decompression bombs)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # the decoders PIL may use; every other format is refused


class ImageError(Day0Error, ValueError):
    """An image source is malformed, refused (scheme, folder, size) or cannot be decoded."""


def load_image(source: Any, *, allowed_media_dir: str | os.PathLike | None = None,
               max_pixels: int = MAX_PIXELS) -> Image.Image:
    """The image `source` as an RGB PIL image.

    Args:
        source: a PIL image (any mode; used as is, no EXIF rotation), a uint8 numpy array (HxW, HxWx1, HxWx3 or
            HxWx4, channels last), a `data:image/...;base64,...` URL, a `file://` URL of a file inside
            `allowed_media_dir`, or the bytes of an encoded file. Decoded files are PNG, JPEG, WebP or GIF (its
            first frame), turned upright by their EXIF orientation as transformers' `load_image` does.
        allowed_media_dir: the only folder `file://` URLs may name (symbolic links resolved); None refuses them all.
        max_pixels: the largest width * height accepted, checked before decoding.
    Returns:
        An RGB image: the source itself when it already is one, else a new image.
    Raises:
        ImageError: the source is of another type, a URL of another scheme (http and https included: nothing is
            fetched), bad base64, a file outside `allowed_media_dir`, bytes that are not a supported image, an array
            of another dtype or shape, or an image above `max_pixels`.
    """
    if isinstance(source, Image.Image):
        _check_size(source.width, source.height, max_pixels)
        return to_rgb(source)
    if isinstance(source, np.ndarray):
        return _from_array(source, max_pixels)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return to_rgb(decode_image(bytes(source), max_pixels=max_pixels))
    if isinstance(source, str):
        return to_rgb(_from_url(source.strip(), allowed_media_dir, max_pixels))
    raise ImageError(f"unsupported image source of type {type(source).__name__}: pass a PIL image, a uint8 array, a "
                     "data:image/...;base64 URL or a file:// URL")


def to_rgb(image: Image.Image) -> Image.Image:
    """`image` in mode RGB, exactly as transformers' `convert_to_rgb` makes it for its image processors.

    Args:
        image: a PIL image of any mode (RGBA, LA, PA, P with or without transparency, L, 1, I;16, CMYK...).
    Returns:
        `image` itself when it is RGB without a transparency key, else a new RGB image: transparency (an alpha
        band or a `transparency` entry) composited onto opaque white, other modes converted by PIL.
    """
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if not has_alpha:
        return image if image.mode == "RGB" else image.convert("RGB")
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def decode_image(data: bytes | io.BufferedIOBase, *, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """The first frame of an encoded PNG, JPEG, WebP or GIF, upright (EXIF orientation applied), mode kept.

    Args:
        data: the encoded file, as bytes or a binary file object.
        max_pixels: the largest width * height accepted, read from the header before any pixel is decoded.
    Returns:
        The decoded image, loaded (independent of `data`).
    Raises:
        ImageError: not one of those formats, truncated or corrupt data, or too many pixels.
    """
    fp = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    try:
        image = Image.open(fp, formats=FORMATS)
        _check_size(image.width, image.height, max_pixels)
        image.load()  # the first frame only: GIF and WebP animations stay on frame 0
        return ImageOps.exif_transpose(image)
    except ImageError:
        raise
    except Image.DecompressionBombError as e:  # PIL's own ceiling, which it checks while reading the header
        raise ImageError(f"image refused as a decompression bomb: its header declares more pixels than the limit of "
                         f"{max_pixels} pixels (and than Pillow's own ceiling)") from e
    except Image.UnidentifiedImageError as e:
        raise ImageError("cannot identify the image: not a PNG, JPEG, WebP or GIF file") from e
    except Exception as e:  # PIL's decoders raise many types on corrupt data (OSError, SyntaxError, struct.error...)
        raise ImageError(f"cannot decode the image: {e} (supported formats: PNG, JPEG, WebP, GIF)") from e


def _check_size(width: int, height: int, max_pixels: int) -> None:
    if width < 1 or height < 1:
        raise ImageError(f"empty image ({width}x{height} pixels)")
    if width * height > max_pixels:
        raise ImageError(f"image of {width}x{height} = {width * height} pixels is above the limit of {max_pixels} "
                         "pixels; resize it before sending")


def _from_array(array: np.ndarray, max_pixels: int) -> Image.Image:
    """A uint8 channels-last array as RGB, by transformers' array path of `convert_to_rgb`."""
    if array.dtype != np.uint8:
        raise ImageError(f"image arrays must be uint8 (0-255), got {array.dtype}; convert with "
                         "np.clip(x, 0, 255).astype(np.uint8)")
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or array.shape[2] not in (1, 3, 4):
        raise ImageError(f"image arrays must be HxW, HxWx1, HxWx3 or HxWx4 (channels last), got shape {array.shape}")
    _check_size(array.shape[1], array.shape[0], max_pixels)
    if array.shape[2] == 1:
        array = np.repeat(array, 3, axis=2)
    elif array.shape[2] == 4:
        # transformers' blend for integer arrays: float64 alpha in [0, 1], rounded back to uint8.
        alpha = array[..., 3:4] / 255
        array = np.round(alpha * array[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return Image.fromarray(np.ascontiguousarray(array), mode="RGB")


def _from_url(url: str, allowed_media_dir: str | os.PathLike | None, max_pixels: int) -> Image.Image:
    scheme, colon, rest = url.partition(":")
    scheme = scheme.lower()
    if not colon or not scheme.isascii() or not scheme.replace("+", "").replace("-", "").isalnum():
        raise ImageError(f"not an image URL: {url[:60]!r}; pass a data:image/...;base64 URL or a file:// URL")
    if scheme == "data":
        return decode_image(_data_url_bytes(rest), max_pixels=max_pixels)
    if scheme == "file":
        with open_media_file(url, allowed_media_dir) as f:
            return decode_image(f, max_pixels=max_pixels)
    if scheme in ("http", "https"):
        raise ImageError(f"{scheme}:// image URLs are refused: day0jax never fetches from the network; send the "
                         "image inline as a data:image/...;base64 URL")
    raise ImageError(f"unsupported URL scheme {scheme!r}: pass a data:image/...;base64 URL or a file:// URL")


def _data_url_bytes(rest: str) -> bytes:
    """The payload of a data URL (after `data:`): `image/<type>;base64,<data>`."""
    header, comma, payload = rest.partition(",")
    params = [p.strip().lower() for p in header.split(";")]
    if not comma or not params[0].startswith("image/"):
        raise ImageError(f"a data URL must be data:image/<type>;base64,<data>, got data:{header[:40]}...")
    if "base64" not in params[1:]:
        raise ImageError("a data URL image must be base64-encoded (data:image/<type>;base64,<data>)")
    payload = urllib.parse.unquote("".join(payload.split()))  # line breaks and %-escapes some clients leave in
    payload += "=" * (-len(payload) % 4)  # padding some encoders omit
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"bad base64 in the data URL: {e}") from e
    if not data:
        raise ImageError("the data URL holds no data")
    return data


def open_media_file(url: str, allowed_media_dir: str | os.PathLike | None):
    """The file a file:// URL names, open for reading, once `allowed_path` allows it (`open_checked`).

    Raises:
        ImageError: as `allowed_path`, or the file cannot be opened.
    """
    path = allowed_path(url, allowed_media_dir)
    try:
        return open_checked(path)
    except OSError as e:
        raise ImageError(f"file:// URL {url[:200]!r}: cannot read the file ({e.strerror or e})") from None


def open_checked(path: str):
    """Opens for reading the file `allowed_path` returned, which has no link left in it, without following a link:
    one swapped in for the file after the check (to point outside the media folder) fails to open.

    Raises:
        OSError: the file cannot be opened, or is now a link (ELOOP).
    """
    return os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb")


def allowed_path(url: str, allowed_media_dir: str | os.PathLike | None) -> str:
    """The real path a file:// URL names, refused unless it lies inside `allowed_media_dir` (checked before
    anything about the file, even its size, is read).

    Raises:
        ImageError: no folder is allowed, another host, a control character in the path, a path outside the
            folder, or no such file.
    """
    if allowed_media_dir is None:
        raise ImageError("file:// image URLs are refused: no media folder is allowed (the server's "
                         "--allowed-media-dir); send the image as a data:image/...;base64 URL")
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ImageError(f"file:// URLs must name a local file, got host {parsed.netloc!r}")
    path = urllib.parse.unquote(parsed.path)
    if any(ord(c) < 32 or c == "\x7f" for c in path):
        # The OS takes no NUL in a path (a ValueError deep in realpath), and no media file needs control characters.
        raise ImageError(f"file:// URL {url[:200]!r} holds a NUL or another control character")
    path = os.path.realpath(path)
    root = os.path.realpath(allowed_media_dir)
    if os.path.commonpath([path, root]) != root:
        raise ImageError(f"file:// URL {url!r} is outside the allowed media folder {root}")
    if not os.path.isfile(path):
        raise ImageError(f"file:// URL {url!r}: no such file in the allowed media folder")
    return path
