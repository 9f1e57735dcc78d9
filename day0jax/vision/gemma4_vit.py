"""Gemma 4's vision tower (`Gemma4VisionModel`) and its embedder into the language model (`embed_vision`).

Patches of an image at its own size (each [p, p, 3], channels last, in raster order), scaled to [-1, 1], through a
linear map, plus a learned embedding of the patch's column and one of its row; then layers like the language
model's (sandwich RMSNorms, q/k norms and a weightless v norm, softmax scale 1, a gated MLP) with a 2-D rotary that
turns the first half of each head by the column and the second by the row; every patch attends to the image's other
patches. The pooler averages k x k blocks of patches (`pooling_kernel_size`) into one token, times sqrt(width), and
(`standardize`) shifts and scales it; `embed_vision` norms it without a weight and projects it.

Parameter paths are HF's names inside `model.vision_tower` (`patch_embedder.input_proj`,
`encoder.layers.N.self_attn.q_proj.linear`...). The image processor pads every image to the same number of patches
(`max_soft_tokens` x k^2), so one program serves them all (`Patches`).
HF reference: transformers/models/gemma4/modeling_gemma4.py, image_processing_pil_gemma4.py.
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
from day0jax.layers.linear import Linear, param
from day0jax.layers.mlp import activation
from day0jax.layers.norms import L2Norm, RMSNorm
from day0jax.vision import qwen_vit
from kernels_pallas.calls import OpCall


@dataclass(frozen=True, eq=False)
class VisionConfig:
    """HF's `Gemma4VisionConfig` keys (a `vision_config` dict)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131_072  # unused by the tower's forward pass
    attention_bias: bool | None = False
    attention_dropout: float | None = 0.0
    rope_parameters: dict | None = None
    pooling_kernel_size: int = 3
    patch_size: int = 16
    position_embedding_size: int = 10 * 1024
    use_clipped_linears: bool = False
    standardize: bool = False
    model_type: str = "gemma4_vision"
    unknown_keys: tuple = dataclasses.field(default=(), kw_only=True)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "VisionConfig":
        """The config for a `vision_config` dict.

        Raises:
            UnsupportedArchitecture: a key that is not implemented, naming it, or a value the tower does not run.
        """
        return config_lib.vision_from_hf(cls, dict(hf), "Gemma 4's vision tower")

    def __post_init__(self):
        if self.model_type != "gemma4_vision":
            refuse("vision_config.model_type", self.model_type, "is not Gemma 4's tower (gemma4_vision)")
        activation(self.hidden_activation, "vision_config.hidden_activation")
        if self.attention_bias:
            refuse("vision_config.attention_bias", True, "is not implemented (HF's tower has no biases)")
        if self.num_attention_heads % self.num_key_value_heads:
            refuse("vision_config.num_key_value_heads", self.num_key_value_heads,
                   f"does not divide num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 4:
            refuse("vision_config.head_dim", self.head_dim, "must be a multiple of 4 (the 2-D rotary)")
        rope = self.rope_parameters or {}
        if rope.get("rope_type", "axial") != "axial":
            refuse("vision_config.rope_parameters.rope_type", rope["rope_type"], "is not implemented (only 'axial')")

    @property
    def theta(self) -> float:
        return float((self.rope_parameters or {}).get("rope_theta", 100.0))  # HF's default_theta for this tower

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size ** 2


# --- what the grid fixes: computed on the host -----------------------------------------------------------------

@lru_cache(maxsize=64)
def grid_inputs(rows: int, cols: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(column, row) [P, 2] of each patch in raster order, and the pooled token each patch averages into [P]:
    (column // k) + (cols // k) * (row // k) (HF's `_avg_pool_by_positions`, raster order over the pooled grid)."""
    r, c = np.divmod(np.arange(rows * cols), cols)
    return np.stack([c, r], -1).astype(np.int32), ((c // k) + (cols // k) * (r // k)).astype(np.int32)


@dataclass(frozen=True)
class Patches:
    """The `VisionSpec.encoder` of Gemma 4: one image per call, padded to the processor's `max_patches` (one
    program for every image)."""

    config: VisionConfig
    max_patches: int

    def keys(self) -> list[tuple[int]]:
        return [(self.max_patches,)]

    def inputs(self, patches: np.ndarray, grid) -> tuple[tuple[int], tuple[np.ndarray, ...], int]:
        c, k = self.config, self.config.pooling_kernel_size
        t, rows, cols = (int(v) for v in grid)
        n = len(patches)
        if t != 1 or rows % k or cols % k or n != rows * cols or n > self.max_patches:
            raise ValueError(f"image grid {grid} for {n} patches: expected (1, rows, columns), multiples of the "
                             f"pooling kernel {k}, at most {self.max_patches} patches")
        positions, pooled = grid_inputs(rows, cols, k)
        pad = self.max_patches - n
        return (self.max_patches,), (
            np.concatenate([np.asarray(patches, np.float32), np.zeros((pad, c.patch_dim), np.float32)]),
            np.concatenate([positions, np.full((pad, 2), -1, np.int32)]),
            np.concatenate([pooled, np.full(pad, -1, np.int32)])), n // k ** 2

    def example(self, key: tuple[int]) -> tuple[np.ndarray, ...]:
        return (np.zeros((key[0], self.config.patch_dim), np.float32), np.full((key[0], 2), -1, np.int32),
                np.full(key[0], -1, np.int32))


# --- modules ---------------------------------------------------------------------------------------------------

class ClippableLinear(nnx.Module):
    """HF's `Gemma4ClippableLinear`: `linear` (no bias), with `use_clipped_linears` its input and output clamped to
    the checkpoint's `input_min`/`input_max`/`output_min`/`output_max`."""

    def __init__(self, in_shape, out_shape, axes, clipped: bool, *, dtype, rngs: nnx.Rngs):
        self.linear = Linear(in_shape, out_shape, axes, dtype=dtype, rngs=rngs)
        self.clipped = clipped
        if clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                setattr(self, name, param(rngs, (), (), jnp.float32, 1.0))

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.clipped:
            x = jnp.clip(x, self.input_min[...].astype(x.dtype), self.input_max[...].astype(x.dtype))
        y = self.linear(x)
        if self.clipped:
            y = jnp.clip(y, self.output_min[...].astype(y.dtype), self.output_max[...].astype(y.dtype))
        return y


def rotary_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin [P, head_dim]: the first half of a head turned by the column, the second by the row, each half
    in the rotate_half layout (HF's `apply_multidimensional_rope`)."""
    half = head_dim // 2
    inv = np.float32(1.0) / (np.float32(theta) ** (np.arange(0, half, 2, dtype=np.float32) / np.float32(half)))
    freqs = jnp.asarray(positions, jnp.float32)[:, :, None] * jnp.asarray(inv)  # [P, (col, row), H/4]
    x, y = freqs[:, 0], freqs[:, 1]
    freqs = jnp.concatenate([x, x, y, y], -1)
    return jnp.cos(freqs), jnp.sin(freqs)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [P, N, H]: each half of a head turned by its half of the angles (rotate_half within the half)."""
    h = x.shape[-1] // 2
    return jnp.concatenate([qwen_vit.rotate(x[..., :h], cos[:, :h], sin[:, :h]),
                            qwen_vit.rotate(x[..., h:], cos[:, h:], sin[:, h:])], -1)


class Attention(nnx.Module):
    def __init__(self, c: VisionConfig, *, dtype, rngs: nnx.Rngs):
        D, N, K, H, clip = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, \
            c.use_clipped_linears
        self.q_proj = ClippableLinear((D,), (N, H), ("embed", "heads", "head_dim"), clip, dtype=dtype, rngs=rngs)
        self.k_proj = ClippableLinear((D,), (K, H), ("embed", "kv_heads", "head_dim"), clip, dtype=dtype, rngs=rngs)
        self.v_proj = ClippableLinear((D,), (K, H), ("embed", "kv_heads", "head_dim"), clip, dtype=dtype, rngs=rngs)
        self.o_proj = ClippableLinear((N, H), (D,), ("heads", "head_dim", "embed"), clip, dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(H, c.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.k_norm = RMSNorm(H, c.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.v_norm = L2Norm(H, c.rms_norm_eps)
        self.groups = N // K

    @jax.named_scope("vision_attention")
    def __call__(self, x, cos, sin, valid) -> jax.Array:
        q = rotate(self.q_norm(self.q_proj(x)), cos, sin)
        k = jnp.repeat(rotate(self.k_norm(self.k_proj(x)), cos, sin), self.groups, axis=1)
        v = jnp.repeat(self.v_norm(self.v_proj(x)), self.groups, axis=1)
        scores = jnp.einsum("qnh,knh->nqk", q, k, preferred_element_type=jnp.float32)  # softmax scale 1
        probs = jax.nn.softmax(jnp.where(valid[None, None, :], scores, jnp.finfo(jnp.float32).min), axis=-1)
        return self.o_proj(jnp.einsum("nqk,knh->qnh", probs.astype(v.dtype), v))


class MLP(nnx.Module):
    """down(act(gate(x)) * up(x)), each a `ClippableLinear`."""

    def __init__(self, c: VisionConfig, *, dtype, rngs: nnx.Rngs):
        D, F, clip = c.hidden_size, c.intermediate_size, c.use_clipped_linears
        self.gate_proj = ClippableLinear((D,), (F,), ("embed", "mlp"), clip, dtype=dtype, rngs=rngs)
        self.up_proj = ClippableLinear((D,), (F,), ("embed", "mlp"), clip, dtype=dtype, rngs=rngs)
        self.down_proj = ClippableLinear((F,), (D,), ("mlp", "embed"), clip, dtype=dtype, rngs=rngs)
        self.act, self.act_name = activation(c.hidden_activation), c.hidden_activation

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class EncoderLayer(nnx.Module):
    """x + post_attention_layernorm(attn(input_layernorm(x))); x + post_feedforward_layernorm(mlp(pre_...(x)))."""

    def __init__(self, c: VisionConfig, *, dtype, rngs: nnx.Rngs):
        def norm():
            return RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Attention(c, dtype=dtype, rngs=rngs)
        self.mlp = MLP(c, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, valid):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, valid))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class PatchEmbedder(nnx.Module):
    """HF's `patch_embedder`: `input_proj` of the patch scaled to [-1, 1], plus `position_embedding_table`
    [2, positions, D]'s rows of the patch's column and row (none on padding)."""

    def __init__(self, c: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.input_proj = Linear((c.patch_dim,), (c.hidden_size,), (None, "embed"), dtype=dtype, rngs=rngs)
        self.position_embedding_table = param(rngs, (2, c.position_embedding_size, c.hidden_size),
                                              (None, None, "embed"), dtype, 1.0)

    def __call__(self, patches, positions, valid) -> jax.Array:
        x = self.input_proj((2 * (patches - 0.5)).astype(self.input_proj.kernel.dtype))
        table = self.position_embedding_table[...]
        p = jnp.maximum(positions, 0)
        pos = jnp.take(table[0], p[:, 0], axis=0) + jnp.take(table[1], p[:, 1], axis=0)
        return x + jnp.where(valid[:, None], pos, 0).astype(x.dtype)


class Encoder(nnx.Module):
    def __init__(self, layers: list[EncoderLayer]):
        self.layers = nnx.List(layers)


class VisionModel(nnx.Module):
    """HF's `Gemma4VisionModel` (`model.vision_tower`): one image's padded patches -> pooled tokens [P / k^2, D]
    (the image's first, padding's after), float32 before `standardize`'s cast, as HF."""

    def __init__(self, config: VisionConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        c = self.config = config
        self.dtype = dtype
        self.patch_embedder = PatchEmbedder(c, dtype=dtype, rngs=rngs)
        self.encoder = Encoder([EncoderLayer(c, dtype=dtype, rngs=rngs) for _ in range(c.num_hidden_layers)])
        if c.standardize:
            self.std_bias = param(rngs, (c.hidden_size,), ("embed",), jnp.float32, 0.0)
            self.std_scale = param(rngs, (c.hidden_size,), ("embed",), jnp.float32, 1.0)

    def __call__(self, patches, positions, pooled) -> jax.Array:
        c, k = self.config, self.config.pooling_kernel_size
        valid = pooled >= 0
        x = self.patch_embedder(patches, positions, valid)
        cos, sin = rotary_tables(positions, c.head_dim, c.theta)
        for layer in self.encoder.layers:
            x = layer(x, cos, sin, valid)
        # Average pooling of k x k patches, in float32 (padding rows weigh nothing), then times sqrt(D).
        out = jnp.zeros((x.shape[0] // k ** 2, x.shape[1]), jnp.float32).at[jnp.where(valid, pooled, 0)].add(
            jnp.where(valid[:, None], x.astype(jnp.float32), 0.0) / (k * k))
        out = out * np.float32(c.hidden_size ** 0.5)
        if c.standardize:
            out = (out - self.std_bias[...].astype(jnp.float32)) * self.std_scale[...].astype(jnp.float32)
        return out.astype(x.dtype)

    def op_calls(self) -> list[OpCall]:
        c = self.config
        return [OpCall.of("mlp", D=c.hidden_size, F=c.intermediate_size, act=c.hidden_activation, gated=True),
                OpCall.of("rope", kind="axial_2d", theta=c.theta, factor=None, rotary_dim=c.head_dim,
                          head_dim=c.head_dim)]


class Embedder(nnx.Module):
    """HF's `embed_vision`: a weightless RMSNorm (`embedding_pre_projection_norm`), then `embedding_projection`."""

    def __init__(self, c: VisionConfig, text_hidden_size: int, *, dtype, rngs: nnx.Rngs):
        self.embedding_pre_projection_norm = L2Norm(c.hidden_size, c.rms_norm_eps)
        self.embedding_projection = Linear((c.hidden_size,), (text_hidden_size,), (None, "embed"), dtype=dtype,
                                           rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.embedding_projection(self.embedding_pre_projection_norm(x))
