"""`Model`: a loaded checkpoint as users see it (`logits`, `generate`, `tokenizer`, `config`, `mesh`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from day0jax.engine.generator import Generator
from day0jax.layers.rope import context_length
from day0jax.weights.tokenizer import Tokenizer


class Model:
    """A loaded model. Build it with `day0jax.load`.

    Attributes:
        config: the family's config dataclass (fields are the HF config.json keys).
        tokenizer: the checkpoint's `Tokenizer`, or None when the checkpoint has no tokenizer.json.
        mesh: the device mesh the parameters are sharded over.
        module: the underlying Flax NNX module.
        context_length: the longest sequence (prompt + new tokens) accepted: the model's own, or less when
            loading planned memory for a shorter `max_context`.
        memory_plan: per-device memory plan made before loading (sharding/plan.py).
        kernel_report: which implementation each operator uses, from the startup self-test.
    """

    def __init__(self, module: nnx.Module, config: Any, *, path: Path, mesh: Mesh, dtype: str,
                 generation_config: dict, max_context: int | None = None, memory_plan: Any = None,
                 kernel_report: Any = None):
        import jax.numpy as jnp

        self.module, self.config, self.path, self.mesh, self.dtype = module, config, Path(path), mesh, dtype
        self.tokenizer = Tokenizer(path) if (Path(path) / "tokenizer.json").is_file() else None
        eos = generation_config.get("eos_token_id", getattr(config, "eos_token_id", None))
        if eos is None:
            from day0jax.weights.hf_config import read_config_json
            eos = read_config_json(Path(path) / "config.json").get("eos_token_id")
        self.eos_token_ids = tuple(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.context_length = min(context_length(config.rope, config.max_position_embeddings),
                                  max_context or 1 << 62)
        self.memory_plan, self.kernel_report = memory_plan, kernel_report
        self._generator = Generator(module, mesh, getattr(jnp, dtype), self.context_length)

    def logits(self, token_ids: Sequence[Sequence[int]] | np.ndarray) -> np.ndarray:
        """A full forward pass, no cache: int32 [B, T] -> float32 numpy [B, T, V]."""
        return self._generator.logits(token_ids)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False) -> list[list[int]]:
        """Generates up to `max_new_tokens` for each prompt (a list of token ids); returns only the new tokens.

        A row stops after EOS (unless `ignore_eos`) or any of `stop_token_ids`; that token is the last returned.

        Raises:
            GenerationError: invalid prompts or parameters, or a prompt too long for the context.
        """
        stops = set(stop_token_ids or ())
        if not ignore_eos:
            stops |= set(self.eos_token_ids)
        return self._generator.generate(prompts, max_new_tokens, temperature=temperature, top_p=top_p,
                                        top_k=top_k, seed=seed, stop_token_ids=stops)
