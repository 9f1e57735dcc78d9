"""What every decoder-only family shares: the embed -> layers -> norm -> head skeleton, and the default
mapping from Hugging Face tensor names to runtime parameters.

A family subclasses `CausalLM`, says how to build one layer (`make_layer`) and, only where it differs from HF's
plain naming, how its parameters map to HF tensors (`hf_sources`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from day0jax.layers.linear import Embedding, Linear
from day0jax.layers.norms import RMSNorm
from day0jax.layers.rope import Rope


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)). HF names kept."""

    def __init__(self, self_attn: nnx.Module, mlp: nnx.Module, input_layernorm: RMSNorm,
                 post_attention_layernorm: RMSNorm):
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm, self.post_attention_layernorm = input_layernorm, post_attention_layernorm

    def __call__(self, x, positions, rope_tables, cache=None):
        h, cache = self.self_attn(self.input_layernorm(x), positions, rope_tables, cache)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class Backbone(nnx.Module):
    """HF's `model.` prefix: embed_tokens, layers, norm."""

    def __init__(self, embed_tokens: Embedding, layers: list[nnx.Module], norm: RMSNorm):
        self.embed_tokens, self.layers, self.norm = embed_tokens, nnx.List(layers), norm


class CausalLM(nnx.Module):
    """Token ids -> hidden states (with an optional per-layer KV cache) -> float32 logits.

    Subclasses set `config` fields and implement `make_layer`; the constructor does the rest.
    """

    def __init__(self, config: Any, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        D = config.hidden_size
        self.rope = self.make_rope()
        layers = [self.make_layer(i, dtype=dtype, rngs=rngs) for i in range(config.num_hidden_layers)]
        self.model = Backbone(Embedding(config.vocab_size, D, dtype=dtype, rngs=rngs), layers,
                              RMSNorm(D, config.rms_norm_eps, dtype=dtype, rngs=rngs))
        self.lm_head = None if config.tie_word_embeddings else Linear(
            (D,), (config.vocab_size,), ("embed", "vocab"), dtype=dtype, rngs=rngs)

    # --- hooks ---------------------------------------------------------------------------------------------
    def make_rope(self) -> Rope | None:
        c = self.config
        return Rope(c.rope, c.head_dim, c.max_position_embeddings)

    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        raise NotImplementedError

    def cache_layout(self) -> list[tuple[int, int, int]]:
        """Per layer: (kv heads, key head dim, value head dim) of its KV cache; what caches are allocated from."""
        c = self.config
        return [(c.num_key_value_heads, c.head_dim, c.head_dim)] * c.num_hidden_layers

    def embed(self, tokens: jax.Array) -> jax.Array:
        return self.model.embed_tokens(tokens)

    # --- forward -------------------------------------------------------------------------------------------
    def __call__(self, tokens: jax.Array, positions: jax.Array, caches: Sequence[Any] | None = None,
                 seq_len: jax.Array | None = None) -> tuple[jax.Array, list[Any] | None]:
        """tokens, positions [B, T] int32 -> (final hidden states [B, T, D], updated caches or None).

        `seq_len`: the unpadded length of the longest sequence, for RoPE variants that depend on it.
        """
        x = self.embed(tokens)
        rope_tables = self.rope.cos_sin(positions, seq_len) if self.rope is not None else None
        new_caches = [] if caches is not None else None
        for i, layer in enumerate(self.model.layers):
            x, cache = layer(x, positions, rope_tables, None if caches is None else caches[i])
            if caches is not None:
                new_caches.append(cache)
        return self.model.norm(x), new_caches

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[..., D] -> float32 [..., V]."""
        if self.lm_head is None:
            out = self.model.embed_tokens.attend(hidden)
        else:
            out = self.lm_head(hidden)
        return out.astype(jnp.float32)


# --- Hugging Face tensor mapping -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """Where a runtime parameter comes from: HF tensors and how to make them one array of the runtime's shape.

    `combine` receives the tensors (as numpy arrays, in `names` order) and the target shape.
    """

    names: tuple[str, ...]
    combine: Callable[[list[np.ndarray], tuple[int, ...]], np.ndarray]
    # What the source tensors' shapes must be, per name (checked before `combine`).
    shapes: tuple[tuple[int, ...], ...]


def linear_kernel(arrays: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """HF Linear weight [out, in] -> runtime kernel in_shape + out_shape."""
    return arrays[0].T.reshape(shape)


def same(arrays: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    return arrays[0].reshape(shape)


def default_source(path: str, shape: tuple[int, ...], metadata: dict) -> Source:
    """The plain HF mapping: `a.b.kernel` <- `a.b.weight` transposed; everything else by the same name."""
    if path.endswith(".kernel"):
        k = metadata["in_ndim"]
        hf_shape = (math.prod(shape[k:]), math.prod(shape[:k]))
        return Source((path[: -len("kernel")] + "weight",), linear_kernel, (hf_shape,))
    if path.endswith(".bias"):
        return Source((path,), same, ((math.prod(shape),),))
    return Source((path,), same, (shape,))
