"""The Qwen3-VL vision tower (`Qwen3VLVisionModel`, reused without DeepStack by Qwen3.5): pixel patches -> merged
image embeddings for the language model, plus DeepStack features from chosen blocks.

Parameter paths are HF's names inside `model.visual` (`patch_embed.proj`, `pos_embed`, `blocks.N.attn.qkv`,
`merger.linear_fc1`, `deepstack_merger_list.N.norm`...), so conversion is renaming (see `hf_source`). Everything
that depends on the images' grids (position-table interpolation, rotary angles, which patches attend to which) is
computed on the host from the static grids, so a program is traced per distinct grid tuple.
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
from kernels_pallas.calls import OpCall

Grid = tuple[int, int, int]  # (t, h, w): frames and patch rows and columns of one image or video

# `model_type` of the vision config: Qwen3-VL's towers have DeepStack mergers, Qwen3.5's do not (its HF tower has
# no `deepstack_merger_list` and ignores `deepstack_visual_indexes`).
DEEPSTACK_TYPES = ("qwen3_vl", "qwen3_vl_vision", "qwen3_vl_moe", "qwen3_vl_moe_vision")
PLAIN_TYPES = ("qwen3_5", "qwen3_5_vision", "qwen3_5_moe", "qwen3_5_moe_vision")
# Every LayerNorm of the tower, as HF builds them.
NORM_EPS = 1e-6


@dataclass(frozen=True, eq=False)
class VisionConfig:
    """HF's `Qwen3VLVisionConfig` (a `vision_config` dict): its keys as fields, its defaults as defaults.

    `rope_theta` is the legacy top-level spelling that HF moves into `rope_parameters`.
    """

    ALIASES = {"num_attention_heads": "num_heads", "num_hidden_layers": "depth"}  # HF's attribute_map

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: Sequence[int] = (8, 16, 24)
    initializer_range: float = 0.02
    rope_parameters: dict | None = None
    rope_theta: float | None = None
    model_type: str = "qwen3_vl_vision"
    unknown_keys: tuple = dataclasses.field(default=(), kw_only=True)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "VisionConfig":
        """The config for a `vision_config` dict.

        Args:
            hf: the dict, as config.json nests it.
        Returns:
            The config.
        Raises:
            UnsupportedArchitecture: a key that is not implemented (it may change the math), naming it, or a value
                the tower does not implement.
        """
        hf = dict(hf)
        for alias, field in cls.ALIASES.items():
            if alias in hf:
                hf.setdefault(field, hf.pop(alias))
        return config_lib.vision_from_hf(cls, hf, "the Qwen3-VL vision tower")

    def __post_init__(self):
        """Refuses what the tower does not implement, naming the key."""
        if self.model_type not in DEEPSTACK_TYPES + PLAIN_TYPES:
            refuse("vision_config.model_type", self.model_type,
                   f"is not a Qwen3-VL vision tower (known: {', '.join(DEEPSTACK_TYPES + PLAIN_TYPES)})")
        activation(self.hidden_act, "vision_config.hidden_act")
        for key in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                    "spatial_merge_size", "temporal_patch_size", "out_hidden_size", "num_position_embeddings"):
            value = getattr(self, key)
            # HF types patch sizes as int or pair, but its Conv3d kernel takes only an int here.
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                refuse(f"vision_config.{key}", value, "must be a positive integer")
        if self.hidden_size % self.num_heads:
            refuse("vision_config.num_heads", self.num_heads, f"does not divide hidden_size={self.hidden_size}")
        if self.head_dim % 4:
            # The 2-D rotary splits each head into h and w halves of cos/sin pairs.
            refuse("vision_config.hidden_size", self.hidden_size,
                   f"gives a head dim of {self.head_dim}, not a multiple of 4 as the 2-D rotary needs")
        rope = self.rope_parameters or {}
        if rope.get("rope_type", "axial") != "axial":
            refuse("vision_config.rope_parameters.rope_type", rope["rope_type"], "is not implemented (only 'axial')")
        layers = self.deepstack_layers
        if len(set(layers)) != len(layers) or any(not 0 <= i < self.depth for i in layers):
            refuse("vision_config.deepstack_visual_indexes", self.deepstack_visual_indexes,
                   f"must name distinct blocks in [0, depth={self.depth})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def theta(self) -> float:
        """The rotary base: `rope_parameters.rope_theta`, else the legacy `rope_theta`, else HF's 10000."""
        theta = (self.rope_parameters or {}).get("rope_theta", self.rope_theta)
        return 10000.0 if theta is None else float(theta)

    @property
    def deepstack_layers(self) -> tuple[int, ...]:
        """The blocks whose outputs feed a DeepStack merger, in `deepstack_visual_indexes` order (none in Qwen3.5)."""
        return () if self.model_type in PLAIN_TYPES else tuple(int(i) for i in self.deepstack_visual_indexes)

    @property
    def grid_side(self) -> int:
        """The learned position table is a grid_side x grid_side grid (HF: int(sqrt(num_position_embeddings)))."""
        return int(self.num_position_embeddings ** 0.5)

    @property
    def patch_dim(self) -> int:
        """The length of one flattened pixel patch: in_channels * temporal_patch_size * patch_size**2."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


# --- what the grids fix: computed on the host, once per grid tuple ---------------------------------------------

def check_grids(grids: Sequence[Sequence[int]], merge: int) -> tuple[Grid, ...]:
    """`grids` as a hashable tuple of (t, h, w) Python ints.

    Raises:
        ValueError: a grid that is not three positive ints, or whose h or w the merge size does not divide.
    """
    out = []
    for g in grids:
        g = tuple(int(v) for v in g)
        if len(g) != 3 or min(g) < 1 or g[1] % merge or g[2] % merge:
            raise ValueError(f"image grid {g}: expected (t, h, w), positive, h and w multiples of the spatial "
                             f"merge size {merge}")
        out.append(g)
    return tuple(out)


def patch_rows_cols(grid: Grid, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Each patch's (row, col) in its frame, in the order the image processor emits patches: frame by frame, then
    merge x merge blocks in raster order, then raster order inside a block (the order the merger groups)."""
    t, h, w = grid
    within = np.arange(t * h * w) % (h * w)
    in_col, in_row = within % merge, (within // merge) % merge
    block = within // (merge * merge)
    return (block // (w // merge)) * merge + in_row, (block % (w // merge)) * merge + in_col


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear, align_corners=True taps into a `side`-long axis for target positions `index` of `size`, in
    float32 with HF's operation order (its weights are then equal to the last bit)."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    distance = np.abs((src - floor)[:, None] - offsets.astype(np.float32))
    return taps, np.maximum(np.float32(1) - distance, np.float32(0))


@lru_cache(maxsize=64)
def interpolation_taps(grids: tuple[Grid, ...], side: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of the side x side position table and their weights that resample it bilinearly to each image's grid
    (transformers' `get_vision_interpolation_indices_and_weights`, align_corners=True).

    Returns:
        indices int32 [P, 4] and weights float32 [P, 4], one row per patch in processor order.
    """
    indices, weights = [], []
    for grid in grids:
        rows, cols = patch_rows_cols(grid, merge)
        h_taps, h_weights = _axis_taps(rows, grid[1], side)
        w_taps, w_weights = _axis_taps(cols, grid[2], side)
        indices.append((h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4))
        weights.append((h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4))
    return np.concatenate(indices).astype(np.int32), np.concatenate(weights)


@lru_cache(maxsize=64)
def rotary_positions(grids: tuple[Grid, ...], merge: int) -> np.ndarray:
    """Each patch's (row, col), the two coordinates the 2-D rotary turns by (transformers' `get_vision_position_ids`).

    Returns:
        int32 [P, 2].
    """
    return np.concatenate([np.stack(patch_rows_cols(g, merge), -1) for g in grids]).astype(np.int32)


def frame_segments(grids: tuple[Grid, ...]) -> np.ndarray:
    """[P] int32 each patch's attention segment: a patch attends to the patches of its own frame only
    (transformers' `cu_seqlens`: one segment per frame of each image)."""
    return np.concatenate([np.repeat(np.arange(t), h * w) + sum(g[0] for g in grids[:i])
                           for i, (t, h, w) in enumerate(grids)]).astype(np.int32)


def tower_inputs(grids: tuple[Grid, ...], side: int, merge: int,
                 padded_to: int | None = None) -> tuple[np.ndarray, ...]:
    """What the grids fix, as the tower's array inputs: (position-table rows [P, 4], their weights [P, 4], rotary
    (row, col) [P, 2], attention segments [P]); with `padded_to`, grown to that many patches by padding rows (weight
    0, segment -1: attended by nothing else)."""
    taps, weights = interpolation_taps(grids, side, merge)
    arrays = [taps, weights, rotary_positions(grids, merge), frame_segments(grids)]
    if padded_to is not None:
        pad = padded_to - len(taps)
        arrays = [np.concatenate([a, np.full((pad, *a.shape[1:]), -1 if a.ndim == 1 else 0, a.dtype)])
                  for a in arrays]
    return tuple(arrays)


def rotary_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin [P, head_dim]: the first quarter of the frequencies turns by the row, the second by the column,
    and the two halves repeat (HF's rotate_half layout)."""
    spatial = head_dim // 2
    inv_freq = np.float32(1.0) / (np.float32(theta) ** (np.arange(0, spatial, 2, dtype=np.float32) / spatial))
    freqs = jnp.asarray(positions, jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [P, 2, H/4]
    freqs = freqs.reshape(freqs.shape[0], -1)  # row frequencies, then column ones
    freqs = jnp.concatenate([freqs, freqs], -1)
    return jnp.cos(freqs), jnp.sin(freqs)


def segment_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array, scale: float) -> jax.Array:
    """Whole-image attention of a tower's patches: q, k, v [P, N, H], segments [P]; a patch attends to the patches of
    its own segment (its image or frame); returns [P, N, H]."""
    scores = jnp.einsum("qnh,knh->nqk", q, k, preferred_element_type=jnp.float32) * scale
    same = segments[:, None] == segments[None, :]
    # A finite floor keeps padding rows (a segment of their own kind, outputs dropped) free of NaNs.
    probs = jax.nn.softmax(jnp.where(same[None], scores, jnp.finfo(jnp.float32).min), axis=-1).astype(v.dtype)
    return jnp.einsum("nqk,knh->qnh", probs, v)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [P, N, H] turned by the per-patch angles, in float32 as HF does, back in x's dtype."""
    h = x.astype(jnp.float32)
    x1, x2 = jnp.split(h, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], -1)
    return (h * cos[:, None] + rotated * sin[:, None]).astype(x.dtype)


@dataclass(frozen=True)
class PatchBuckets:
    """One image per tower call, its patches padded to the smallest of `sizes` that holds them: a program per size
    serves every image up to it, so the server compiles them at warm-up (the `VisionSpec.encoder` of Qwen-VL)."""

    config: VisionConfig
    # Patches; 4096 16-pixel patches is a 1024 x 1024 image. Sizes double, and go on doubling past the largest: an
    # image pays at most twice its patches in the products (4x in attention). Steps of 4 ran a 480 x 640 image's
    # 1656 14-pixel patches (Kimi K2.5, Pixtral) as 4096, 2.1x the tower time of a 2048 bucket, for two more
    # programs to compile at warm-up per four-fold of sizes.
    sizes: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
    # The most patches one image can have (the checkpoint's image processor bounds them): the programs stop at its
    # bucket, past the largest size too, so that warm-up covers every image it can take. None: `sizes`.
    limit: int | None = None
    # A video runs as several calls of whole temporal patches where it would need a program past the largest one:
    # the Qwen-VL tower attends, places and merges inside each temporal patch only, so the split changes no
    # feature, and a long video takes the programs warm-up compiled. False for towers that mix frames.
    splits_frames: ClassVar[bool] = True

    def keys(self) -> list[tuple[int]]:
        if self.limit is None:
            return [(s,) for s in self.sizes]
        top, sizes = self.bucket(self.tower_patches(self.limit)), list(self.sizes)
        while sizes[-1] < top:  # the sizes `bucket` grows past the largest one to
            sizes.append(sizes[-1] * 2)
        return [(s,) for s in sizes if s <= top]

    def tower_patches(self, patches: int) -> int:
        """The tower's patches for an image of `patches` of the image processor's."""
        return patches

    def bucket(self, patches: int) -> int:
        """The padded size for an image of `patches` patches (past the largest size, doubled until it holds them)."""
        size = next((s for s in self.sizes if s >= patches), self.sizes[-1])
        while size < patches:
            size *= 2
        return size

    def grid_patches(self, grid: Grid) -> int:
        """The image processor's patches of one image or video of `grid`."""
        t, h, w = (int(v) for v in grid)
        return t * h * w

    def grid_calls(self, patches: np.ndarray, grid: Grid) -> list[tuple[tuple[int], tuple[np.ndarray, ...], int]]:
        """One image's or video's calls (`inputs` of each), in the order of its tokens: one call, or for a video
        past the largest program, runs of as many temporal patches as that program holds."""
        t, h, w = (int(v) for v in grid)
        per_call = max(1, self.keys()[-1][0] // max(1, self.tower_patches(h * w)))
        if t <= per_call or not self.splits_frames:
            return [self.inputs(patches, grid)]
        return [self.inputs(patches[start * h * w:min(t, start + per_call) * h * w],
                            (min(per_call, t - start), h, w)) for start in range(0, t, per_call)]

    def inputs(self, patches: np.ndarray, grid: Grid) -> tuple[tuple[int], tuple[np.ndarray, ...], int]:
        """(program key, the tower's padded array inputs, the image's token count) for one image's patches."""
        c = self.config
        size = self.bucket(len(patches))
        padded = np.zeros((size, c.patch_dim), np.float32)
        padded[:len(patches)] = patches
        grid = check_grids([grid], c.spatial_merge_size)
        return (size,), (padded, *tower_inputs(grid, c.grid_side, c.spatial_merge_size, size)), \
            len(patches) // c.spatial_merge_size ** 2

    def example(self, key: tuple[int]) -> tuple[np.ndarray, ...]:
        """Inputs of the program `key` (shapes and dtypes for compiling it)."""
        size = key[0]
        return (np.zeros((size, self.config.patch_dim), np.float32), np.zeros((size, 4), np.int32),
                np.zeros((size, 4), np.float32), np.zeros((size, 2), np.int32), np.full(size, -1, np.int32))


# --- modules ---------------------------------------------------------------------------------------------------

class PatchEmbed(nnx.Module):
    """HF's Conv3d with stride equal to its kernel, which is one matmul per patch: `proj.kernel` is the Conv3d
    weight as it is, [D, C, T, p, p], contracting a patch's (C, T, p, p)."""

    def __init__(self, config: VisionConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        self.shape = (c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        self.proj = Linear(self.shape, (c.hidden_size,), (None, None, None, None, "embed"), use_bias=True,
                           dtype=dtype, rngs=rngs)

    def __call__(self, patches: jax.Array) -> jax.Array:
        return self.proj(patches.reshape(-1, *self.shape).astype(self.proj.kernel.dtype))


class PositionTable(nnx.Module):
    """HF's `pos_embed` (an nn.Embedding): the learned side x side position grid, `weight` [side**2, D]."""

    def __init__(self, num: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.weight = param(rngs, (num, dim), (None, "embed"), dtype, 1.0)

    def __call__(self, indices: jax.Array, weights: jax.Array) -> jax.Array:
        """sum_k weights[:, k] * weight[indices[:, k]], in float32 (HF's weights are float32) -> [P, D]."""
        rows = jnp.take(self.weight[...].astype(jnp.float32), indices, axis=0)  # [P, 4, D]
        return (rows * weights[:, :, None]).sum(1)


class VisionAttention(nnx.Module):
    """Bidirectional multi-head attention inside each frame, with the 2-D rotary on q and k. `qkv` [3, N, H, D]
    is HF's fused [3D, D] weight, q, k, v stacked in that order."""

    def __init__(self, config: VisionConfig, *, dtype, rngs: nnx.Rngs):
        D, N, H = config.hidden_size, config.num_heads, config.head_dim
        self.qkv = Linear((D,), (3, N, H), ("embed", None, "heads", "head_dim"), use_bias=True, dtype=dtype,
                          rngs=rngs)
        self.proj = Linear((N, H), (D,), ("heads", "head_dim", "embed"), use_bias=True, dtype=dtype, rngs=rngs)
        self.scale = H ** -0.5

    @jax.named_scope("vision_attention")
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segments: jax.Array) -> jax.Array:
        """x [P, D], segments [P]: a patch attends to the patches of its own segment (its frame); padding (-1) to
        none but others of its kind, whose outputs are dropped."""
        qkv = self.qkv(x)  # [P, 3, N, H]
        q, k = rotate(qkv[:, 0], cos, sin), rotate(qkv[:, 1], cos, sin)
        return self.proj(segment_attention(q, k, qkv[:, 2], segments, self.scale))


class VisionMLP(nnx.Module):
    """linear_fc2(act(linear_fc1(x))), with biases."""

    def __init__(self, config: VisionConfig, *, dtype, rngs: nnx.Rngs):
        D, F = config.hidden_size, config.intermediate_size
        self.linear_fc1 = Linear((D,), (F,), ("embed", "mlp"), use_bias=True, dtype=dtype, rngs=rngs)
        self.linear_fc2 = Linear((F,), (D,), ("mlp", "embed"), use_bias=True, dtype=dtype, rngs=rngs)
        self.act = activation(config.hidden_act, "vision_config.hidden_act")

    @jax.named_scope("vision_mlp")
    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nnx.Module):
    """Pre-norm residual block: x + attn(norm1(x)), then x + mlp(norm2(x)), LayerNorms."""

    def __init__(self, config: VisionConfig, *, dtype, rngs: nnx.Rngs):
        D = config.hidden_size
        self.norm1 = LayerNorm(D, NORM_EPS, dtype=dtype, rngs=rngs)
        self.norm2 = LayerNorm(D, NORM_EPS, dtype=dtype, rngs=rngs)
        self.attn = VisionAttention(config, dtype=dtype, rngs=rngs)
        self.mlp = VisionMLP(config, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    """merge x merge neighbouring patches (consecutive in processor order) -> one token of out_hidden_size:
    LayerNorm per patch before the concatenation (the final merger) or over the concatenation (`postshuffle`,
    the DeepStack mergers), then linear_fc1, exact GELU (HF's nn.GELU, whatever hidden_act says), linear_fc2."""

    def __init__(self, config: VisionConfig, postshuffle: bool, *, dtype, rngs: nnx.Rngs):
        D, M = config.hidden_size, config.hidden_size * config.spatial_merge_size ** 2
        self.merged, self.postshuffle = M, postshuffle
        self.norm = LayerNorm(M if postshuffle else D, NORM_EPS, dtype=dtype, rngs=rngs)
        self.linear_fc1 = Linear((M,), (M,), (None, "mlp"), use_bias=True, dtype=dtype, rngs=rngs)
        self.linear_fc2 = Linear((M,), (config.out_hidden_size,), ("mlp", "embed"), use_bias=True, dtype=dtype,
                                 rngs=rngs)

    @jax.named_scope("patch_merger")
    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.norm(x.reshape(-1, self.merged)) if self.postshuffle else self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(jax.nn.gelu(self.linear_fc1(x), approximate=False))


class VisionModel(nnx.Module):
    """HF's `Qwen3VLVisionModel` (`model.visual`): patches -> (merged embeddings, DeepStack features)."""

    def __init__(self, config: VisionConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config, self.dtype = config, dtype
        self.patch_embed = PatchEmbed(config, dtype=dtype, rngs=rngs)
        self.pos_embed = PositionTable(config.num_position_embeddings, config.hidden_size, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([VisionBlock(config, dtype=dtype, rngs=rngs) for _ in range(config.depth)])
        self.merger = PatchMerger(config, postshuffle=False, dtype=dtype, rngs=rngs)
        self.deepstack_merger_list = nnx.List([PatchMerger(config, postshuffle=True, dtype=dtype, rngs=rngs)
                                               for _ in config.deepstack_layers])

    def __call__(self, patches: jax.Array, grids: Sequence[Sequence[int]]) -> tuple[jax.Array, list[jax.Array]]:
        """The tower on a batch of images packed along the patch axis.

        Args:
            patches: float [P, in_channels * temporal_patch_size * patch_size**2], transformers' `pixel_values`
                (each patch flattened as (C, T, p, p); images one after another, in merge-block order).
            grids: one (t, h, w) per image, Python ints (`image_grid_thw`); static: one program per grid tuple.
        Returns:
            (embeds [P // merge**2, out_hidden_size], deepstack: one [P // merge**2, out_hidden_size] per DeepStack
            block, in block order), in the model's dtype.
        Raises:
            ValueError: a malformed grid, or grids that do not add up to P patches.
        """
        c = self.config
        grids = check_grids(grids, c.spatial_merge_size)
        total = sum(t * h * w for t, h, w in grids)
        if patches.ndim != 2 or patches.shape != (total, c.patch_dim):
            raise ValueError(f"patches of shape {tuple(patches.shape)} for grids {grids}: expected "
                             f"({total}, {c.patch_dim})")
        return self.forward(patches, *(jnp.asarray(a) for a in tower_inputs(grids, c.grid_side, c.spatial_merge_size)))

    def forward(self, patches: jax.Array, taps: jax.Array, weights: jax.Array, rotary: jax.Array,
                segments: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
        """The tower on patches and what their grids fix (`tower_inputs`, possibly padded: a program per padded
        size then serves every image up to it). Returns as `__call__`, padding rows included."""
        c = self.config
        with exact_float32(self.dtype):
            x = self.patch_embed(patches)
            x = x + self.pos_embed(taps, weights).astype(x.dtype)
            cos, sin = rotary_tables(rotary, c.head_dim, c.theta)
            layers, deepstack = c.deepstack_layers, []
            for i, block in enumerate(self.blocks):
                x = block(x, cos, sin, segments)
                # HF's order: by block, each block's merger the one at its place in deepstack_visual_indexes.
                if i in layers:
                    deepstack.append(self.deepstack_merger_list[layers.index(i)](x))
            return self.merger(x), deepstack

    def op_calls(self) -> list[OpCall]:
        """The operators the tower runs, all plain jax.numpy: the blocks' MLP, the mergers' MLP and the 2-D rotary
        (attention is an in-frame einsum here, not the kernel op)."""
        c = self.config
        M = c.hidden_size * c.spatial_merge_size ** 2
        return [OpCall.of("mlp", D=c.hidden_size, F=c.intermediate_size, act=c.hidden_act, gated=False),
                OpCall.of("mlp", D=M, F=M, act="gelu", gated=False),
                OpCall.of("rope", kind="axial_2d", theta=c.theta, factor=None, rotary_dim=c.head_dim,
                          head_dim=c.head_dim)]


def hf_source(path: str, shape: tuple[int, ...], metadata: dict) -> Source | None:
    """The HF tensor of a tower parameter where `core.hf_tensors.default_source` does not find it: the patch
    embedding's kernel is the Conv3d weight [D, C, T, p, p] unchanged (the default expects a 2-D [out, in]).

    Args:
        path: the parameter's path inside the tower, as nnx reports it ("patch_embed.proj.kernel").
        shape: its shape.
        metadata: its metadata (unused).
    Returns:
        The Source, names relative to the tower's prefix, or None for the default mapping.
    """
    if path == "patch_embed.proj.kernel":
        return Source(("patch_embed.proj.weight",), same, (tuple(shape),))
    return None
