"""The Pixtral vision tower (`PixtralVisionModel`): images at their own size, patches in raster order through RMSNorm
pre-norm layers with a gated MLP and a 2-D rotary over the patch grid (the first half of each head's frequency pairs
turned by the row, the second by the column: HF's `recomposition_frequencies`), each image attending to itself.

Parameter paths are HF's names inside `model.vision_tower` (`patch_conv`, `ln_pre`,
`transformer.layers.N.attention.q_proj`, `feed_forward.gate_proj`...). What a grid fixes (rotary positions,
segments, which patches merge into one token) is computed on the host and given as arrays, padded to a bucket of
patches (`PatchBuckets`), so one program serves every image up to its size.
HF reference: transformers/models/pixtral/modeling_pixtral.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from day0jax.core import hf_config as config_lib
from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source, same
from day0jax.layers.linear import Linear
from day0jax.layers.mlp import GatedMLP, activation
from day0jax.layers.norms import RMSNorm
from day0jax.vision import qwen_vit
from kernels_pallas.calls import OpCall

NORM_EPS = 1e-5  # every RMSNorm of the tower, as HF builds them


@dataclass(frozen=True, eq=False)
class VisionConfig:
    """HF's `PixtralVisionConfig` keys (a `vision_config` dict)."""

    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 1024  # the largest image side: unused by the forward pass
    patch_size: int = 16
    hidden_act: str = "gelu"
    attention_dropout: float = 0.0
    rope_parameters: dict | None = None
    rope_theta: float | None = None
    # Written by Mistral3Config's defaults; HF recomputes head_dim from the widths and never reads vocab_size.
    head_dim: int | None = None
    vocab_size: int | None = None
    model_type: str = "pixtral"
    unknown_keys: tuple = dataclasses.field(default=(), kw_only=True)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "VisionConfig":
        """The config for a `vision_config` dict.

        Raises:
            UnsupportedArchitecture: a key that is not implemented, naming it, or a value the tower does not run.
        """
        return config_lib.vision_from_hf(cls, dict(hf), "the Pixtral tower")

    def __post_init__(self):
        if self.model_type != "pixtral":
            refuse("vision_config.model_type", self.model_type, "is not a Pixtral tower (pixtral)")
        activation(self.hidden_act, "vision_config.hidden_act")
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "patch_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                refuse(f"vision_config.{key}", value, "must be a positive integer")
        if self.num_channels != 3:
            refuse("vision_config.num_channels", self.num_channels, "is not implemented (RGB images only)")
        if self.hidden_size % self.num_attention_heads or self.head_size % 4:
            refuse("vision_config.num_attention_heads", self.num_attention_heads,
                   f"does not split hidden_size={self.hidden_size} into heads of a multiple of 4 (the 2-D rotary)")
        rope = self.rope_parameters or {}
        if rope.get("rope_type", "axial") != "axial":
            refuse("vision_config.rope_parameters.rope_type", rope["rope_type"], "is not implemented (only 'axial')")

    @property
    def head_size(self) -> int:
        """HF's head_dim: hidden_size // num_attention_heads, whatever `head_dim` says."""
        return self.hidden_size // self.num_attention_heads

    @property
    def theta(self) -> float:
        theta = (self.rope_parameters or {}).get("rope_theta", self.rope_theta)
        return 10000.0 if theta is None else float(theta)

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size ** 2


# --- what the grids fix: computed on the host ------------------------------------------------------------------

@lru_cache(maxsize=64)
def grid_inputs(rows: int, cols: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) [P, 2] of each patch of a rows x cols grid in raster order, and the patches each merged token
    gathers [P / merge**2, merge**2]: the merge x merge blocks in raster order, each block's patches row by row
    (torch's `unfold` order, which Mistral 3's patch merger flattens channel by channel)."""
    r, c = np.divmod(np.arange(rows * cols), cols)
    br, bc = np.divmod(np.arange((rows // merge) * (cols // merge)), cols // merge)
    kr, kc = np.divmod(np.arange(merge * merge), merge)
    blocks = ((br[:, None] * merge + kr) * cols + bc[:, None] * merge + kc).astype(np.int32)
    return np.stack([r, c], -1).astype(np.int32), blocks


def repatch(patches: np.ndarray, grid: tuple[int, int, int], patch: int) -> tuple[np.ndarray, int, int]:
    """An image given as patches of another (larger, multiple) size in raster order -> (patches of `patch` pixels in
    raster order, rows, columns)."""
    _, gh, gw = grid
    big = int(round((patches.shape[1] / 3) ** 0.5))
    if big % patch or patches.shape[1] != 3 * big * big:
        raise ValueError(f"patches of {patches.shape[1]} values are not [3, k * {patch}, k * {patch}] squares")
    image = patches.reshape(gh, gw, 3, big, big).transpose(2, 0, 3, 1, 4).reshape(3, gh * big, gw * big)
    rows, cols = gh * big // patch, gw * big // patch
    out = image.reshape(3, rows, patch, cols, patch).transpose(1, 3, 0, 2, 4).reshape(rows * cols, -1)
    return np.ascontiguousarray(out), rows, cols


@dataclass(frozen=True)
class PatchBuckets(qwen_vit.PatchBuckets):
    """One image per tower call, its patches padded to a bucket (`qwen_vit.PatchBuckets`' sizes and rule). The
    image processor's patches are the merged tokens' (patch_size * merge pixels: Mistral 3's processor resizes to
    those); here they become the tower's."""

    config: VisionConfig
    merge: int = 1

    def tower_patches(self, patches: int) -> int:
        return patches * self.merge ** 2

    def inputs(self, patches: np.ndarray, grid) -> tuple[tuple[int], tuple[np.ndarray, ...], int]:
        c, m = self.config, self.merge
        t, gh, gw = (int(v) for v in grid)
        if t != 1 or min(gh, gw) < 1 or len(patches) != gh * gw:
            raise ValueError(f"image grid {grid} for {len(patches)} patches: expected (1, rows, columns)")
        tower, rows, cols = repatch(np.asarray(patches, np.float32), (t, gh, gw), c.patch_size)
        if (rows, cols) != (gh * m, gw * m):
            raise ValueError(f"the image processor's patches are {rows // gh * c.patch_size} pixels a side; this "
                             f"model merges {m} x {m} patches of {c.patch_size} (check its processor config's "
                             "patch_size and spatial_merge_size)")
        size = self.bucket(len(tower))
        positions, blocks = grid_inputs(rows, cols, m)
        pad = size - len(tower)
        arrays = (np.concatenate([tower, np.zeros((pad, c.patch_dim), np.float32)]),
                  np.concatenate([positions, np.zeros((pad, 2), np.int32)]),
                  np.concatenate([np.zeros(len(tower), np.int32), np.full(pad, -1, np.int32)]),
                  np.concatenate([blocks, np.zeros((size // m ** 2 - len(blocks), m * m), np.int32)]))
        return (size,), arrays, gh * gw

    def example(self, key: tuple[int]) -> tuple[np.ndarray, ...]:
        size, m = key[0], self.merge
        return (np.zeros((size, self.config.patch_dim), np.float32), np.zeros((size, 2), np.int32),
                np.full(size, -1, np.int32), np.zeros((size // m ** 2, m * m), np.int32))


# --- modules ---------------------------------------------------------------------------------------------------

def rotary_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin [P, head_dim]: the even frequencies of a head turned by the row, the odd ones by the column,
    rows' then columns' (HF's `inv_freq_2d` and `recomposition_frequencies`), the half repeated."""
    inv = np.float32(1.0) / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    p = jnp.asarray(positions, jnp.float32)
    freqs = jnp.concatenate([p[:, :1] * jnp.asarray(inv[0::2]), p[:, 1:] * jnp.asarray(inv[1::2])], -1)
    freqs = jnp.concatenate([freqs, freqs], -1)
    return jnp.cos(freqs), jnp.sin(freqs)


class Attention(nnx.Module):
    """Bidirectional attention within each image (its segment), the 2-D rotary on q and k, no biases."""

    def __init__(self, c: VisionConfig, *, dtype, rngs: nnx.Rngs):
        D, N, H = c.hidden_size, c.num_attention_heads, c.head_size
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self, name, Linear((D,), (N, H), ("embed", "heads", "head_dim"), dtype=dtype, rngs=rngs))
        self.o_proj = Linear((N, H), (D,), ("heads", "head_dim", "embed"), dtype=dtype, rngs=rngs)
        self.scale = H ** -0.5

    @jax.named_scope("vision_attention")
    def __call__(self, x, cos, sin, segments) -> jax.Array:
        q = qwen_vit.rotate(self.q_proj(x), cos, sin)
        k = qwen_vit.rotate(self.k_proj(x), cos, sin)
        return self.o_proj(qwen_vit.segment_attention(q, k, self.v_proj(x), segments, self.scale))


class AttentionLayer(nnx.Module):
    """x + attention(attention_norm(x)), then x + feed_forward(ffn_norm(x)) (a gated MLP)."""

    def __init__(self, c: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.attention_norm = RMSNorm(c.hidden_size, NORM_EPS, dtype=dtype, rngs=rngs)
        self.attention = Attention(c, dtype=dtype, rngs=rngs)
        self.ffn_norm = RMSNorm(c.hidden_size, NORM_EPS, dtype=dtype, rngs=rngs)
        self.feed_forward = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, segments):
        x = x + self.attention(self.attention_norm(x), cos, sin, segments)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nnx.Module):
    def __init__(self, layers: list[AttentionLayer]):
        self.layers = nnx.List(layers)


class VisionModel(nnx.Module):
    """HF's `PixtralVisionModel`: patches -> the hidden states (the input of the first layer, after `ln_pre`, then
    each built layer's output), as HF's `output_hidden_states` lists them.

    Args:
        num_layers: the layers to build (those after the one read are never run; the converter drops them).
    """

    def __init__(self, config: VisionConfig, *, num_layers: int | None = None, dtype=jnp.float32, rngs: nnx.Rngs):
        c = self.config = config
        self.dtype = dtype
        p = c.patch_size
        self.patch_conv = Linear((3, p, p), (c.hidden_size,), (None, None, None, "embed"), dtype=dtype, rngs=rngs)
        self.ln_pre = RMSNorm(c.hidden_size, NORM_EPS, dtype=dtype, rngs=rngs)
        n = c.num_hidden_layers if num_layers is None else num_layers
        self.transformer = Transformer([AttentionLayer(c, dtype=dtype, rngs=rngs) for _ in range(n)])

    def __call__(self, patches: jax.Array, positions: jax.Array, segments: jax.Array) -> list[jax.Array]:
        c = self.config
        x = self.patch_conv(patches.reshape(-1, 3, c.patch_size, c.patch_size).astype(self.patch_conv.kernel.dtype))
        x = self.ln_pre(x)
        cos, sin = rotary_tables(positions, c.head_size, c.theta)
        hidden = [x]
        for layer in self.transformer.layers:
            x = layer(x, cos, sin, segments)
            hidden.append(x)
        return hidden

    def op_calls(self) -> list[OpCall]:
        c = self.config
        return [OpCall.of("mlp", D=c.hidden_size, F=c.intermediate_size, act=c.hidden_act, gated=True),
                OpCall.of("rope", kind="axial_2d", theta=c.theta, factor=None, rotary_dim=c.head_size,
                          head_dim=c.head_size)]


def hf_source(path: str, shape: tuple[int, ...]) -> Source | None:
    """The patch convolution's kernel is HF's Conv2d weight [D, 3, p, p] as it is (path inside the tower); None for
    the plain mapping."""
    if path == "patch_conv.kernel":
        return Source(("patch_conv.weight",), same, (tuple(shape),))
    return None
