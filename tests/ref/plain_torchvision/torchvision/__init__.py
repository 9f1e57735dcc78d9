"""A plain-torch rendering of the torchvision functions transformers' torchvision-backend image processors call.

torchvision does not install beside the reference venv's CPU torch, and some processors (Kimi K2.5's, LFM2-VL's)
exist only for that backend. `tests/ref/ref_preprocess.py` puts this package first on `sys.path` in its own
subprocess, so transformers' own processor code runs on these functions: torchvision's CPU paths as torchvision
takes them (uint8 bilinear and bicubic resizing in torch's native uint8 kernel, antialiased; padding; normalizing
in float32), each a call of torch itself. day0jax's numpy renderings are checked against them.
"""

__version__ = "0.30.0"
