"""Shared building blocks that model families compose: linear maps, norms, RoPE, attention, MLPs."""
