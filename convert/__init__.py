"""Checkpoint conversion: Hugging Face safetensors folders and GGUF files -> day0jax checkpoints."""

from convert.convert import convert_checkpoint

__all__ = ["convert_checkpoint"]
