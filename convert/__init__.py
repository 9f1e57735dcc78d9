"""Checkpoint conversion: Hugging Face safetensors folders and GGUF files -> day0jax checkpoints.

`python -m convert SRC DST [--dtype bfloat16|float32] [--force]`; `python -m convert --verify DST`.
"""

from convert.convert import convert_checkpoint

__all__ = ["convert_checkpoint"]
