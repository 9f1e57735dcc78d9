"""torchvision.transforms.v2: the functional namespace only."""

from torchvision.transforms.v2 import functional  # noqa: F401
