"""SigLIP2's NaFlex vision tower (`Siglip2VisionModel`): images at their own size, as LFM2-VL runs it.

Each image's patches ([p, p, 3] each, channels last, raster order) go through a linear map, plus the learned square
table of positions resized to the image's grid (an antialiased bilinear resize written as a weight matrix over the
table, computed on the host as HF computes it); then SigLIP's pre-norm layers (LayerNorm, attention with biases over
the image's own patches, a GELU MLP) and `post_layernorm`. The pooling head is not on LFM2-VL's path (not built).

Parameter paths are HF's names inside `model.vision_tower` (`embeddings.patch_embedding`,
`encoder.layers.N.self_attn.q_proj`...). One image per call, padded to the most patches the image processor makes
(`Patches`), so one program serves every image.
HF reference: transformers/models/siglip2/modeling_siglip2.py (`Siglip2VisionEmbeddings.resize_positional_embeddings`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from day0jax.core import hf_config as config_lib
from day0jax.core.hf_config import refuse
from day0jax.layers.linear import Embedding, Linear
from day0jax.layers.mlp import activation
from day0jax.layers.norms import LayerNorm
from day0jax.vision import clip
from kernels_pallas.calls import OpCall


@dataclass(frozen=True, eq=False)
class VisionConfig:
    """HF's `Siglip2VisionConfig` keys (a `vision_config` dict)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
    attention_dropout: float | None = 0.0
    vision_use_head: bool | None = True  # the pooling head: not on the path of the patch features
    num_patches: int = 256
    model_type: str = "siglip2_vision_model"
    unknown_keys: tuple = dataclasses.field(default=(), kw_only=True)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "VisionConfig":
        """The config for a `vision_config` dict.

        Raises:
            UnsupportedArchitecture: a key that is not implemented, naming it, or a value the tower does not run.
        """
        return config_lib.vision_from_hf(cls, dict(hf), "the SigLIP2 tower")

    def __post_init__(self):
        if self.model_type != "siglip2_vision_model":
            refuse("vision_config.model_type", self.model_type, "is not SigLIP2's tower (siglip2_vision_model)")
        activation(self.hidden_act, "vision_config.hidden_act")
        if self.hidden_size % self.num_attention_heads:
            refuse("vision_config.num_attention_heads", self.num_attention_heads,
                   f"does not divide hidden_size={self.hidden_size}")
        if math.isqrt(self.num_patches) ** 2 != self.num_patches:
            refuse("vision_config.num_patches", self.num_patches, "must be a square (the position table's side)")
        if self.num_channels != 3:
            refuse("vision_config.num_channels", self.num_channels, "is not implemented (RGB images only)")

    @property
    def patch_dim(self) -> int:
        return self.num_channels * self.patch_size ** 2

    @property
    def table_side(self) -> int:
        return math.isqrt(self.num_patches)


# --- what the grid fixes: computed on the host -----------------------------------------------------------------

def _axis_weights(size: int, side: int) -> np.ndarray:
    """[size, side]: the antialiased bilinear (triangle) weights of each output index over the table's `side`
    entries, in float32 and in HF's order of operations."""
    scale = np.float32(side) / np.float32(size)
    support = max(scale, np.float32(1.0))
    center = (np.arange(size, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5)
    source = np.arange(side, dtype=np.float32)
    w = np.maximum(np.float32(1.0) - np.abs(source[None, :] - center[:, None]) / support, np.float32(0.0))
    return (w / w.sum(-1, keepdims=True)).astype(np.float32)


@lru_cache(maxsize=64)
def position_weights(rows: int, cols: int, side: int) -> np.ndarray:
    """[rows * cols, side * side]: each patch's weights over the position table (rows of the table's rows, columns
    of its columns), so that weights @ table is HF's resized position embedding of the patch."""
    wr, wc = _axis_weights(rows, side), _axis_weights(cols, side)
    return (wr[:, None, :, None] * wc[None, :, None, :]).reshape(rows * cols, side * side)


@dataclass(frozen=True)
class Patches:
    """The `VisionSpec.encoder` of SigLIP2 NaFlex: one image (or tile) per call, its patches padded to
    `max_patches` (one program for every image), and the merge blocks of the projector's pixel unshuffle. A grid is
    (1, rows, columns), or (1, rows, columns, tile rows, tile columns, patches per tile side) for an image split into
    tiles (each a call, row by row) followed by its thumbnail of rows x columns patches (none where 0)."""

    config: VisionConfig
    max_patches: int
    merge: int

    def keys(self) -> list[tuple[int]]:
        return [(self.max_patches,)]

    @staticmethod
    def _parts(grid) -> list[tuple[int, int, int]]:
        """The (1, rows, columns) of each call of an image's grid: its tiles, then the image or thumbnail."""
        grid = tuple(int(v) for v in grid)
        tiles = [(1, grid[5], grid[5])] * (grid[3] * grid[4]) if len(grid) == 6 else []
        return tiles + ([(1, grid[1], grid[2])] if grid[1] * grid[2] else [])

    def grid_patches(self, grid) -> int:
        return sum(h * w for _, h, w in self._parts(grid))

    def grid_tokens(self, grid) -> int:
        return self.grid_patches(grid) // self.merge ** 2

    def grid_calls(self, patches: np.ndarray, grid) -> list[tuple[tuple[int], tuple[np.ndarray, ...], int]]:
        """One image's calls (`inputs` of each tile and of the image or thumbnail), in the order of its tokens."""
        out, start = [], 0
        for part in self._parts(grid):
            out.append(self.inputs(patches[start:start + part[1] * part[2]], part))
            start += part[1] * part[2]
        return out

    def inputs(self, patches: np.ndarray, grid) -> tuple[tuple[int], tuple[np.ndarray, ...], int]:
        c, m = self.config, self.merge
        t, rows, cols = (int(v) for v in grid)
        n = len(patches)
        if t != 1 or rows % m or cols % m or n != rows * cols or n > self.max_patches:
            raise ValueError(f"image grid {grid} for {n} patches: expected (1, rows, columns), multiples of the "
                             f"downsample factor {m}, at most {self.max_patches} patches")
        pad, tokens = self.max_patches - n, n // m ** 2
        weights = np.zeros((self.max_patches, c.table_side ** 2), np.float32)
        weights[:n] = position_weights(rows, cols, c.table_side)
        valid = np.arange(self.max_patches) < n
        return (self.max_patches,), (
            np.concatenate([np.asarray(patches, np.float32), np.zeros((pad, c.patch_dim), np.float32)]),
            weights, valid, merge_blocks(rows, cols, m, self.max_patches // m ** 2)), tokens

    def example(self, key: tuple[int]) -> tuple[np.ndarray, ...]:
        P, c, m = key[0], self.config, self.merge
        return (np.zeros((P, c.patch_dim), np.float32), np.zeros((P, c.table_side ** 2), np.float32),
                np.zeros(P, bool), np.zeros((P // m ** 2, m * m), np.int32))


@lru_cache(maxsize=64)
def merge_blocks(rows: int, cols: int, m: int, size: int) -> np.ndarray:
    """[size, m*m]: the patches of each m x m block (blocks in raster order, patches row by row inside one), as
    LFM2-VL's pixel unshuffle gathers them; rows past the image's blocks point at patch 0."""
    out = np.zeros((size, m * m), np.int32)
    br, bc = np.divmod(np.arange((rows // m) * (cols // m)), cols // m)
    dr, dc = np.divmod(np.arange(m * m), m)
    out[:len(br)] = (br[:, None] * m + dr) * cols + bc[:, None] * m + dc
    return out


# --- modules ---------------------------------------------------------------------------------------------------

class Embeddings(nnx.Module):
    """`patch_embedding` (a Linear over the [p, p, 3] patch) plus `position_embedding`'s table through each patch's
    resize weights."""

    def __init__(self, c: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.patch_embedding = Linear((c.patch_dim,), (c.hidden_size,), (None, "embed"), use_bias=True, dtype=dtype,
                                      rngs=rngs)
        self.position_embedding = Embedding(c.num_patches, c.hidden_size, dtype=dtype, rngs=rngs)

    def __call__(self, patches: jax.Array, weights: jax.Array) -> jax.Array:
        x = self.patch_embedding(patches.astype(self.patch_embedding.kernel.dtype))
        table = self.position_embedding.weight[...].astype(jnp.float32)
        return x + jnp.matmul(weights, table, precision=jax.lax.Precision.HIGHEST).astype(x.dtype)


class Attention(clip.SelfAttention):
    """SigLIP's attention (biases, scale 1/sqrt(H)) over the image's real patches: padding is no key."""

    @jax.named_scope("vision_attention")
    def __call__(self, x: jax.Array, valid: jax.Array) -> jax.Array:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [P, N, H]
        scores = jnp.einsum("tnh,snh->nts", q, k, preferred_element_type=jnp.float32) * self.scale
        probs = jax.nn.softmax(jnp.where(valid[None, None, :], scores, jnp.finfo(jnp.float32).min), axis=-1)
        return self.out_proj(jnp.einsum("nts,snh->tnh", probs.astype(v.dtype), v))


class EncoderLayer(nnx.Module):
    def __init__(self, c: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.layer_norm1 = LayerNorm(c.hidden_size, c.layer_norm_eps, dtype=dtype, rngs=rngs)
        self.self_attn = Attention(c, dtype=dtype, rngs=rngs)
        self.layer_norm2 = LayerNorm(c.hidden_size, c.layer_norm_eps, dtype=dtype, rngs=rngs)
        self.mlp = clip.MLP(c, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, valid: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.layer_norm1(x), valid)
        return x + self.mlp(self.layer_norm2(x))


class VisionModel(nnx.Module):
    """HF's `Siglip2VisionModel` without its head: one image's padded patches -> `last_hidden_state` [P, D]."""

    def __init__(self, config: VisionConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        c = self.config = config
        self.embeddings = Embeddings(c, dtype=dtype, rngs=rngs)
        self.encoder = clip.Encoder([EncoderLayer(c, dtype=dtype, rngs=rngs) for _ in range(c.num_hidden_layers)])
        self.post_layernorm = LayerNorm(c.hidden_size, c.layer_norm_eps, dtype=dtype, rngs=rngs)

    def __call__(self, patches: jax.Array, weights: jax.Array, valid: jax.Array) -> jax.Array:
        x = self.embeddings(patches, weights)
        for layer in self.encoder.layers:
            x = layer(x, valid)
        return self.post_layernorm(x)

    def op_calls(self) -> list[OpCall]:
        c = self.config
        return [OpCall.of("vision_attention", N=c.num_attention_heads, H=c.hidden_size // c.num_attention_heads,
                          T=c.num_patches),
                OpCall.of("mlp", D=c.hidden_size, F=c.intermediate_size, act=c.hidden_act, gated=False)]
