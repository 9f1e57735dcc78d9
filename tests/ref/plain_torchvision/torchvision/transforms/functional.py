"""torchvision.transforms.functional: what transformers imports of it."""

import numpy as np
import torch

from torchvision.transforms import InterpolationMode  # noqa: F401


def pil_to_tensor(pic):
    """A PIL image as a uint8 [C, H, W] tensor."""
    array = np.array(pic, copy=True)
    if array.ndim == 2:
        array = array[:, :, None]
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()
