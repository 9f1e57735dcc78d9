"""torchvision.transforms.v2.functional's tensor paths, in plain torch: resize, pad, normalize, grayscale_to_rgb,
to_dtype, as torchvision runs them on CPU tensors."""

import torch
import torch.nn.functional as F

from torchvision.transforms import InterpolationMode
from torchvision.transforms.functional import pil_to_tensor  # noqa: F401


def resize(image, size, interpolation=InterpolationMode.BILINEAR, max_size=None, antialias=True):
    """torchvision's `resize_image` on a [..., C, H, W] tensor: unchanged when the size is; uint8 pixels go through
    torch's own uint8 kernels for bilinear (the AVX2 path, which x86 CPUs of the last decade take) and bicubic,
    other dtypes and modes through float32 and back, rounded and clamped."""
    if isinstance(interpolation, int):
        interpolation = {0: InterpolationMode.NEAREST_EXACT, 2: InterpolationMode.BILINEAR,
                         3: InterpolationMode.BICUBIC}[interpolation]
    height, width = (size, size) if isinstance(size, int) else size
    if image.shape[-2:] == (height, width):
        return image
    shape = image.shape
    image = image.reshape(-1, *shape[-3:])
    native = image.dtype == torch.float32 or (
        image.dtype == torch.uint8 and interpolation in (InterpolationMode.BILINEAR, InterpolationMode.BICUBIC,
                                                         InterpolationMode.NEAREST,
                                                         InterpolationMode.NEAREST_EXACT))
    dtype = image.dtype
    if not native:
        image = image.float()
    align = False if interpolation in (InterpolationMode.BILINEAR, InterpolationMode.BICUBIC) else None
    out = F.interpolate(image, size=[height, width], mode=interpolation.value, align_corners=align,
                        antialias=antialias and interpolation in (InterpolationMode.BILINEAR,
                                                                  InterpolationMode.BICUBIC))
    if not native:
        if interpolation == InterpolationMode.BICUBIC and dtype == torch.uint8:
            out = out.clamp_(0, 255)
        out = out.round_().to(dtype)
    return out.reshape(*shape[:-2], height, width)


def pad(image, padding, fill=0, padding_mode="constant"):
    """`padding` as torchvision takes it: an int, [left/right, top/bottom] or [left, top, right, bottom]."""
    if isinstance(padding, int):
        padding = [padding] * 4
    if len(padding) == 2:
        padding = [padding[0], padding[1], padding[0], padding[1]]
    left, top, right, bottom = padding
    if padding_mode != "constant":
        return F.pad(image, [left, right, top, bottom], mode=padding_mode)
    return F.pad(image, [left, right, top, bottom], value=float(fill or 0))


def normalize(tensor, mean, std, inplace=False):
    """(tensor - mean) / std per channel, in the tensor's float dtype."""
    mean = torch.as_tensor(mean, dtype=tensor.dtype, device=tensor.device)
    std = torch.as_tensor(std, dtype=tensor.dtype, device=tensor.device)
    if mean.ndim == 1:
        mean = mean.view(-1, 1, 1)
    if std.ndim == 1:
        std = std.view(-1, 1, 1)
    if not inplace:
        tensor = tensor.clone()
    return tensor.sub_(mean).div_(std)


def grayscale_to_rgb(image):
    return image if image.shape[-3] != 1 else image.repeat_interleave(3, dim=-3)


def to_dtype(image, dtype=torch.float32, scale=False):
    """torchvision's conversion: uint8 -> float divides by 255; float -> uint8 multiplies by 255.999 and truncates."""
    if not scale or image.dtype == dtype:
        return image.to(dtype)
    if image.is_floating_point() and not dtype.is_floating_point:
        return image.mul(255 + 1.0 - 1e-3).to(dtype)
    if not image.is_floating_point() and dtype.is_floating_point:
        return image.to(dtype).mul_(1.0 / 255)
    return image.to(dtype)
