"""MoonViT, Kimi K2.5's vision tower (`Kimi_K25VisionModel`) and its projector (`Kimi_K25MultimodalProjection`):
patches of an image at its own size -> one feature per merge block of patches, in the language model's width.

What is its own: the learned 64 x 64 position table resampled bicubically (align_corners=False, the Keys kernel,
16 taps) to each image's grid, plus a sinusoid per frame for clips; a 2-D rotary whose frequency pairs alternate
column and row (HF's `recomposition_frequencies`); attention over the whole clip; a final LayerNorm; the patch
merger, which gathers each merge_kernel_size block of patches (averaged over a clip's frames) and the projector,
which norms each patch before flattening the block into one vector for its two-layer GELU MLP.

Parameter paths are HF's names inside `model.vision_tower` and `model.mm_projector`. Everything a grid fixes
(taps, rotary positions, segments, the merge's destinations) is computed on the host and given to the tower as
arrays, padded to a bucket of patches (`PatchBuckets`), so one program serves every image up to its size.
HF reference: transformers/models/kimi_k25/modeling_kimi_k25.py, transformers/vision_utils.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from day0jax.core import hf_config as config_lib
from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source, same
from day0jax.layers.linear import Linear, exact_float32, param
from day0jax.layers.mlp import activation
from day0jax.layers.norms import LayerNorm
from day0jax.vision import qwen_vit
from kernels_pallas.calls import OpCall

NORM_EPS = 1e-5  # the tower's LayerNorms, as HF builds them
# The published checkpoint's remote code writes these keys; the values listed are the only ones it (and so HF's
# reimplementation) runs.
FIXED = {"merge_type": "sd2_tpool", "pos_emb_type": "divided_fixed", "video_attn_type": "spatial_temporal",
         "mm_projector_type": "patchmerger", "projector_hidden_act": "gelu"}


@dataclass(frozen=True, eq=False)
class VisionConfig:
    """HF's `Kimi_K25VisionConfig` keys, and the published checkpoint's own names for them (`ALIASES`: `vt_*`,
    `init_pos_emb_*`), with its other keys checked against what is implemented."""

    ALIASES = {"vt_hidden_size": "hidden_size", "vt_intermediate_size": "intermediate_size",
               "vt_num_attention_heads": "num_attention_heads", "vt_num_hidden_layers": "num_hidden_layers",
               "init_pos_emb_height": "pos_emb_height", "init_pos_emb_width": "pos_emb_width",
               "init_pos_emb_time": "pos_emb_time"}

    patch_size: int = 14
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    pos_emb_time: int = 4
    num_attention_heads: int = 16
    num_hidden_layers: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    hidden_act: str = "gelu_pytorch_tanh"
    merge_kernel_size: Sequence[int] = (2, 2)
    rope_parameters: dict | None = None
    # The published checkpoint's keys (see FIXED); mm_hidden_size, text_hidden_size and projector_ln_eps are
    # checked by the outer config against the widths and eps it uses.
    merge_type: str = "sd2_tpool"
    pos_emb_type: str = "divided_fixed"
    video_attn_type: str = "spatial_temporal"
    mm_projector_type: str = "patchmerger"
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float | None = None
    mm_hidden_size: int | None = None
    text_hidden_size: int | None = None
    model_type: str = "kimi_k25_vision"
    unknown_keys: tuple = dataclasses.field(default=(), kw_only=True)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "VisionConfig":
        """The config for a `vision_config` dict.

        Raises:
            UnsupportedArchitecture: a key that is not implemented, naming it, or a value the tower does not run.
        """
        hf = dict(hf)
        for alias, field in cls.ALIASES.items():
            if alias in hf:
                hf.setdefault(field, hf.pop(alias))
        return config_lib.vision_from_hf(cls, hf, "the MoonViT tower")

    def __post_init__(self):
        if self.model_type not in ("kimi_k25_vision", "kimi_k25", ""):  # the published config writes ""
            refuse("vision_config.model_type", self.model_type, "is not Kimi K2.5's MoonViT (kimi_k25_vision)")
        activation(self.hidden_act, "vision_config.hidden_act")
        for key, value in FIXED.items():
            if getattr(self, key) != value:
                refuse(f"vision_config.{key}", getattr(self, key), f"is not implemented (only {value!r})")
        for key in ("patch_size", "pos_emb_height", "pos_emb_width", "pos_emb_time", "num_attention_heads",
                    "num_hidden_layers", "hidden_size", "intermediate_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                refuse(f"vision_config.{key}", value, "must be a positive integer")
        if self.pos_emb_width != self.pos_emb_height:
            # HF resamples the flattened table as a square of pos_emb_height a side.
            refuse("vision_config.pos_emb_width", self.pos_emb_width,
                   f"differs from pos_emb_height={self.pos_emb_height}; only square position tables are implemented")
        kernel = tuple(self.merge_kernel_size)
        if len(kernel) != 2 or kernel[0] != kernel[1] or kernel[0] < 1:
            refuse("vision_config.merge_kernel_size", list(kernel),
                   "is not implemented (a square kernel, as the image processor's merge_size makes)")
        if self.hidden_size % self.num_attention_heads or (self.hidden_size // self.num_attention_heads) % 4:
            refuse("vision_config.num_attention_heads", self.num_attention_heads,
                   f"does not split hidden_size={self.hidden_size} into heads of a multiple of 4 (the 2-D rotary)")
        rope = self.rope_parameters or {}
        if rope.get("rope_type", "axial") != "axial":
            refuse("vision_config.rope_parameters.rope_type", rope["rope_type"], "is not implemented (only 'axial')")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def name(self) -> str:
        """The tower's name in reports (the published config's model_type is empty)."""
        return self.model_type or "kimi_k25_vision"

    @property
    def theta(self) -> float:
        return float((self.rope_parameters or {}).get("rope_theta", 10000.0))

    @property
    def merge(self) -> int:
        """Patches per side of a merge block (the kernel is square)."""
        return int(self.merge_kernel_size[0])

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size ** 2


# --- what the grids fix: computed on the host ------------------------------------------------------------------

Grid = tuple[int, int, int]


def _bicubic_axis(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """4 taps into a `side`-long axis for positions `index` of `size` (align_corners=False, edges clamped) and
    their Keys weights (a = -0.75), in float32 with HF's order of operations."""
    f32 = np.float32
    src = (index.astype(f32) + f32(0.5)) * f32(side) / f32(size) - f32(0.5)
    floor = np.floor(src)
    offsets = np.arange(-1, 3)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    d = np.abs(src[:, None] - floor[:, None] - offsets.astype(f32))
    a = f32(-0.75)
    near = ((a + f32(2)) * d - (a + f32(3))) * d * d + f32(1)
    far = ((a * d - f32(5) * a) * d + f32(8) * a) * d - f32(4) * a
    return taps, np.where(d <= 1, near, far).astype(f32)


@lru_cache(maxsize=64)
def grid_inputs(grid: Grid, side: int, merge: int) -> dict[str, np.ndarray]:
    """What one image's or clip's grid fixes, per patch in raster order (frames one after another):
    `taps` int32 [P, 16] rows of the side x side position table and `weights` float32 [P, 16] resampling it to the
    grid; `rotary` int32 [P, 2] (row, column); `frames` int32 [P] the row of the time sinusoid (0, the zero row,
    for a single image; frame + 1 in a clip); `merged` int32 [P] the patch's slot, merged token * merge**2 +
    its place in the block; `frame_weight` float32 [P] 1 / frames (the merge averages a clip's frames)."""
    t, h, w = grid
    within = np.arange(t * h * w) % (h * w)
    rows, cols = within // w, within % w
    h_taps, h_weights = _bicubic_axis(rows, h, side)
    w_taps, w_weights = _bicubic_axis(cols, w, side)
    k = merge * merge
    return {"taps": (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 16).astype(np.int32),
            "weights": (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 16),
            "rotary": np.stack([rows, cols], -1).astype(np.int32),
            "frames": (np.arange(t * h * w) // (h * w) + (t > 1)).astype(np.int32),
            "merged": (((rows // merge) * (w // merge) + cols // merge) * k
                       + (rows % merge) * merge + cols % merge).astype(np.int32),
            "frame_weight": np.full(t * h * w, 1.0 / t, np.float32)}


INPUTS = ("taps", "weights", "rotary", "frames", "merged", "frame_weight")


def tower_inputs(grid: Grid, side: int, merge: int, padded_to: int) -> tuple[np.ndarray, ...]:
    """`grid_inputs` in `INPUTS` order, then the attention segments [P] (0; -1 for padding), grown to `padded_to`
    patches: padding rows take table row 0 with weight 0, are merged nowhere (weight 0) and attend to padding only."""
    t, h, w = grid
    n = t * h * w
    out = []
    for name in INPUTS:
        a = grid_inputs(grid, side, merge)[name]
        out.append(np.concatenate([a, np.zeros((padded_to - n, *a.shape[1:]), a.dtype)]))
    out.append(np.concatenate([np.zeros(n, np.int32), np.full(padded_to - n, -1, np.int32)]))
    return tuple(out)


def time_table(frames: int, dim: int) -> np.ndarray:
    """[frames + 1, dim] float32: a zero row, then each frame's sinusoid (sines then cosines, HF's
    `compute_pos_embed`)."""
    inv_freq = np.float32(1.0) / (np.float32(10000) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)))
    freqs = np.outer(np.arange(frames, dtype=np.float32), inv_freq)
    return np.concatenate([np.zeros((1, dim), np.float32),
                           np.concatenate([np.sin(freqs), np.cos(freqs)], 1)]).astype(np.float32)


@dataclass(frozen=True)
class PatchBuckets(qwen_vit.PatchBuckets):
    """One image per tower call, padded to a bucket of patches (`qwen_vit.PatchBuckets`' sizes and rule): the
    `VisionSpec.encoder` of MoonViT."""

    config: VisionConfig
    splits_frames: ClassVar[bool] = False  # a frame's time embedding counts from the video's first frame

    def inputs(self, patches: np.ndarray, grid: Grid) -> tuple[tuple[int], tuple[np.ndarray, ...], int]:
        c = self.config
        t, h, w = (int(v) for v in grid)
        if min(t, h, w) < 1 or h % c.merge or w % c.merge or len(patches) != t * h * w:
            raise ValueError(f"image grid {grid} for {len(patches)} patches: expected (t, h, w), positive, h and w "
                             f"multiples of the merge size {c.merge}, t * h * w patches")
        size = self.bucket(len(patches))
        padded = np.zeros((size, c.patch_dim), np.float32)
        padded[:len(patches)] = patches
        return (size,), (padded, *tower_inputs((t, h, w), c.pos_emb_height, c.merge, size)), h * w // c.merge ** 2

    def example(self, key: tuple[int]) -> tuple[np.ndarray, ...]:
        c = self.config
        return (np.zeros((key[0], c.patch_dim), np.float32),
                *tower_inputs((1, c.merge, c.merge), c.pos_emb_height, c.merge, key[0]))


# --- modules ---------------------------------------------------------------------------------------------------

def rotary_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin [P, head_dim]: frequency pair i turns by the column (even i) or the row (odd i), the half
    repeated (HF's `recomposition_frequencies` over the rotate_half layout)."""
    inv_freq = np.float32(1.0) / (np.float32(theta) ** (np.arange(0, head_dim // 2, 2, dtype=np.float32)
                                                        / np.float32(head_dim // 2)))
    freqs = jnp.asarray(positions, jnp.float32)[:, ::-1, None] * jnp.asarray(inv_freq)  # [P, (col, row), H/4]
    freqs = jnp.swapaxes(freqs, 1, 2).reshape(freqs.shape[0], -1)  # col0, row0, col1, row1...
    freqs = jnp.concatenate([freqs, freqs], -1)
    return jnp.cos(freqs), jnp.sin(freqs)


class PositionEmbedding(nnx.Module):
    """HF's `pos_emb`: the learned table `position_embeddings` [side, side, D], resampled per patch by 16 taps,
    plus the (fixed) sinusoid of the patch's frame."""

    def __init__(self, c: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.position_embeddings = param(rngs, (c.pos_emb_height, c.pos_emb_width, c.hidden_size),
                                         (None, None, "embed"), dtype, 1.0)
        self.frames, self.dim = c.pos_emb_time, c.hidden_size

    def __call__(self, taps: jax.Array, weights: jax.Array, frames: jax.Array) -> jax.Array:
        table = self.position_embeddings[...].astype(jnp.float32)
        table = table.reshape(-1, table.shape[-1])
        pos = (jnp.take(table, taps, axis=0) * weights[:, :, None]).sum(1)
        return pos + jnp.take(jnp.asarray(time_table(self.frames, self.dim)), frames, axis=0)


class PatchEmbed(nnx.Module):
    """HF's Conv2d with stride equal to its kernel, one matmul per [3, p, p] patch (`proj.kernel` is the Conv2d
    weight as it is, [D, 3, p, p]), then the positions."""

    def __init__(self, c: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.shape = (3, c.patch_size, c.patch_size)
        self.proj = Linear(self.shape, (c.hidden_size,), (None, None, None, "embed"), use_bias=True, dtype=dtype,
                           rngs=rngs)
        self.pos_emb = PositionEmbedding(c, dtype=dtype, rngs=rngs)

    def __call__(self, patches, taps, weights, frames) -> jax.Array:
        x = self.proj(patches.reshape(-1, *self.shape).astype(self.proj.kernel.dtype))
        return x + self.pos_emb(taps, weights, frames).astype(x.dtype)


class Attention(nnx.Module):
    """Bidirectional attention within a segment (one image or clip), the 2-D rotary on q and k; q, k, v and the
    output projection with biases."""

    def __init__(self, c: VisionConfig, *, dtype, rngs: nnx.Rngs):
        D, N, H = c.hidden_size, c.num_attention_heads, c.head_dim
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self, name, Linear((D,), (N, H), ("embed", "heads", "head_dim"), use_bias=True, dtype=dtype,
                                       rngs=rngs))
        self.proj = Linear((N, H), (D,), ("heads", "head_dim", "embed"), use_bias=True, dtype=dtype, rngs=rngs)
        self.scale = H ** -0.5

    @jax.named_scope("vision_attention")
    def __call__(self, x, cos, sin, segments) -> jax.Array:
        q = qwen_vit.rotate(self.q_proj(x), cos, sin)
        k = qwen_vit.rotate(self.k_proj(x), cos, sin)
        return self.proj(qwen_vit.segment_attention(q, k, self.v_proj(x), segments, self.scale))


class MLP(nnx.Module):
    def __init__(self, c: VisionConfig, *, dtype, rngs: nnx.Rngs):
        D, F = c.hidden_size, c.intermediate_size
        self.fc1 = Linear((D,), (F,), ("embed", "mlp"), use_bias=True, dtype=dtype, rngs=rngs)
        self.fc2 = Linear((F,), (D,), ("mlp", "embed"), use_bias=True, dtype=dtype, rngs=rngs)
        self.act = activation(c.hidden_act, "vision_config.hidden_act")

    @jax.named_scope("vision_mlp")
    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nnx.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, c: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.norm1 = LayerNorm(c.hidden_size, NORM_EPS, dtype=dtype, rngs=rngs)
        self.norm2 = LayerNorm(c.hidden_size, NORM_EPS, dtype=dtype, rngs=rngs)
        self.attn = Attention(c, dtype=dtype, rngs=rngs)
        self.mlp = MLP(c, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class VisionModel(nnx.Module):
    """HF's `Kimi_K25VisionModel` (`model.vision_tower`): patches -> merge blocks [M, merge**2, D]."""

    def __init__(self, config: VisionConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config, self.dtype = config, dtype
        self.patch_embed = PatchEmbed(config, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([EncoderLayer(config, dtype=dtype, rngs=rngs)
                                for _ in range(config.num_hidden_layers)])
        self.final_layernorm = LayerNorm(config.hidden_size, NORM_EPS, dtype=dtype, rngs=rngs)

    def __call__(self, patches, taps, weights, rotary, frames, merged, frame_weight, segments) -> jax.Array:
        """One call's patches [P, 3 * p * p] and `tower_inputs` -> [P / merge**2, merge**2, D] (padding's blocks
        after the image's, zero)."""
        c = self.config
        x = self.patch_embed(patches, taps, weights, frames)
        cos, sin = rotary_tables(rotary, c.head_dim, c.theta)
        for layer in self.layers:
            x = layer(x, cos, sin, segments)
        x = self.final_layernorm(x)
        k = c.merge ** 2
        # HF's temporal merge: each patch into its block slot, weighted by 1 / frames, summed in float32.
        pooled = jnp.zeros((x.shape[0], x.shape[1]), jnp.float32).at[merged].add(
            x.astype(jnp.float32) * frame_weight[:, None])
        return pooled.reshape(-1, k, x.shape[1]).astype(x.dtype)

    def op_calls(self) -> list[OpCall]:
        c = self.config
        return [OpCall.of("mlp", D=c.hidden_size, F=c.intermediate_size, act=c.hidden_act, gated=False),
                OpCall.of("rope", kind="axial_2d", theta=c.theta, factor=None, rotary_dim=c.head_dim,
                          head_dim=c.head_dim)]


class Projector(nnx.Module):
    """HF's `mm_projector`: `pre_norm` (LayerNorm of each patch), the block flattened, `in_proj`, exact GELU,
    `out_proj` into the language model's width."""

    def __init__(self, c: VisionConfig, text_hidden_size: int, eps: float, *, dtype, rngs: nnx.Rngs):
        D, M = c.hidden_size, c.hidden_size * c.merge ** 2
        self.pre_norm = LayerNorm(D, eps, dtype=dtype, rngs=rngs)
        self.in_proj = Linear((M,), (M,), (None, "mlp"), use_bias=True, dtype=dtype, rngs=rngs)
        self.out_proj = Linear((M,), (text_hidden_size,), ("mlp", "embed"), use_bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, blocks: jax.Array) -> jax.Array:
        x = self.pre_norm(blocks).reshape(blocks.shape[0], -1)
        return self.out_proj(jax.nn.gelu(self.in_proj(x), approximate=False))


def encode(tower: VisionModel, projector: Projector, *inputs: jax.Array) -> jax.Array:
    """One call's tower inputs (`PatchBuckets.inputs`) -> features [P / merge**2, D_text]."""
    patches, taps, weights, rotary, frames, merged, frame_weight, segments = inputs
    with exact_float32(tower.dtype):
        return projector(tower(patches, taps, weights, rotary, frames, merged, frame_weight, segments))


def hf_source(path: str, shape: tuple[int, ...]) -> Source | None:
    """The patch embedding's kernel is the Conv2d weight [D, 3, p, p] unchanged (path inside the tower); None for
    the plain mapping."""
    if path == "patch_embed.proj.kernel":
        return Source(("patch_embed.proj.weight",), same, (tuple(shape),))
    return None
