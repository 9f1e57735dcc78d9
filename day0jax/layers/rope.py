"""Rotary position embeddings with HF's half-split layout and the scalings of transformers'
`modeling_rope_utils.py` (`ROPE_TYPES`). `dynamic` and `longrope` depend on the longest position in the call, as
in HF, so they are computed in-graph."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from day0jax.core.errors import UnsupportedArchitecture
from kernels_pallas.calls import OpCall

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope", "proportional")

# Keys each rope_type reads; any other key in rope_parameters changes math we do not implement.
_KNOWN_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "yarn": {"factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "original_max_position_embeddings", "truncate"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "longrope": {"factor", "attention_factor", "long_factor", "short_factor", "original_max_position_embeddings"},
    "proportional": {"factor"},
}
_COMMON_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


def rope_parameters(rope_parameters: dict | None, rope_scaling: dict | None, rope_theta: float | None,
                    partial_rotary_factor: float | None = None, default_theta: float = 10000.0,
                    original_max_position_embeddings: int | None = None,
                    max_position_embeddings: int | None = None) -> dict[str, Any]:
    """One normalized dict from the transformers 4.x (`rope_theta`, `rope_scaling`) or 5.x (`rope_parameters`) keys.

    Raises:
        UnsupportedArchitecture: an unknown `rope_type`, or a key of it that we do not implement.
    """
    params = dict(rope_parameters or rope_scaling or {})
    params["rope_type"] = params.pop("type", None) or params.get("rope_type") or "default"
    params.setdefault("rope_theta", rope_theta if rope_theta is not None else default_theta)
    if partial_rotary_factor is not None:
        params.setdefault("partial_rotary_factor", partial_rotary_factor)
    kind = params["rope_type"]
    if kind not in ROPE_TYPES:
        raise UnsupportedArchitecture(f"rope_parameters.rope_type={kind!r} is not implemented "
                                      f"(supported: {', '.join(ROPE_TYPES)})")
    unknown = set(params) - _KNOWN_KEYS[kind] - _COMMON_KEYS
    if unknown:
        raise UnsupportedArchitecture(f"rope_parameters key(s) {sorted(unknown)} are not implemented for "
                                      f"rope_type={kind!r}")
    if kind in ("yarn", "llama3", "longrope"):
        params.setdefault("original_max_position_embeddings",
                          original_max_position_embeddings or max_position_embeddings)
    return params


def context_length(params: dict, max_position_embeddings: int) -> int:
    """Longest sequence the model supports: dynamic NTK scaling stretches the trained context by its factor."""
    if params.get("rope_type") == "dynamic":
        return int(max_position_embeddings * params["factor"])
    return max_position_embeddings


@dataclass(frozen=True)
class Rope:
    """Computes cos/sin tables for positions and applies the rotation to q and k.

    Args:
        params: the normalized dict from `rope_parameters`.
        head_dim: H; the rotated part is the first `int(H * partial_rotary_factor)` dims.
        max_position_embeddings: the config's value (used by `dynamic` and `longrope`).
    """

    params: dict
    head_dim: int
    max_position_embeddings: int

    def __hash__(self):  # params holds lists; identity is enough for a module attribute
        return id(self)

    def op_call(self) -> OpCall:
        p = self.params
        return OpCall.of("rope", kind=p["rope_type"], theta=float(p["rope_theta"]), factor=p.get("factor"),
                         rotary_dim=self.rotary_dim, head_dim=self.head_dim)

    @property
    def rotary_dim(self) -> int:
        if self.params["rope_type"] == "proportional":  # rotates all H dims; its unrotated pairs have frequency 0
            return self.head_dim
        return int(self.head_dim * self.params.get("partial_rotary_factor", 1.0))

    def _base_inv_freq(self, base) -> jax.Array:
        dim = self.rotary_dim
        return 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))

    def inv_freq_and_scale(self, seq_len: jax.Array) -> tuple[jax.Array, float | jax.Array]:
        """Inverse frequencies [rotary_dim/2] and the cos/sin scale, for calls whose longest position is seq_len-1."""
        p, dim = self.params, self.rotary_dim
        base, kind = float(p["rope_theta"]), p["rope_type"]
        if kind == "default":
            return self._base_inv_freq(base), 1.0
        if kind == "linear":
            return self._base_inv_freq(base) / p["factor"], 1.0
        if kind == "dynamic":
            factor, max_pos = p["factor"], self.max_position_embeddings
            seq = jnp.maximum(seq_len, max_pos).astype(jnp.float32)
            dyn_base = base * ((factor * seq / max_pos) - (factor - 1)) ** (dim / (dim - 2))
            return self._base_inv_freq(dyn_base), 1.0
        if kind == "llama3":
            return jnp.asarray(_llama3_inv_freq(p, dim)), 1.0
        if kind == "yarn":
            inv_freq, scale = _yarn_inv_freq(p, dim, self.max_position_embeddings)
            return jnp.asarray(inv_freq), scale
        if kind == "proportional":
            # Gemma 4's global layers: the first `partial_rotary_factor` of each half's frequencies, spaced as for
            # the whole head (exponents over H, not over the rotated part), the rest 0: the pairs (i, i + H/2) for
            # i < that share rotate, the others pass through. Not the same dims as a partial rotary.
            H = self.head_dim
            angles = int(p.get("partial_rotary_factor", 1.0) * H // 2)
            inv_freq = 1.0 / (base ** (np.arange(0, 2 * angles, 2, dtype=np.float32) / H))
            inv_freq = np.concatenate([inv_freq, np.zeros(H // 2 - angles, np.float32)]) / p.get("factor", 1.0)
            return jnp.asarray(inv_freq), 1.0
        if kind == "longrope":
            orig = p["original_max_position_embeddings"]
            factor = p.get("factor") or self.max_position_embeddings / orig
            scale = p.get("attention_factor")
            if scale is None:
                scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
            shape = np.arange(0, dim, 2, dtype=np.float32) / dim
            long = 1.0 / (np.asarray(p["long_factor"], np.float32) * base ** shape)
            short = 1.0 / (np.asarray(p["short_factor"], np.float32) * base ** shape)
            return jnp.where(seq_len > orig, jnp.asarray(long), jnp.asarray(short)), scale
        raise UnsupportedArchitecture(f"rope_type={kind!r}")

    def cos_sin(self, positions: jax.Array, seq_len: jax.Array | None = None,
                inv_freq_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """cos, sin [B, T, rotary_dim] float32 for integer positions [B, T]. `seq_len`: the length HF would see
        (default: the largest position + 1); callers that pad pass the real one, for `dynamic` and `longrope`.
        `inv_freq_scale`: [rotary_dim/2] factors on the inverse frequencies, learned ones (`LearnedRopeScale`)."""
        inv_freq, scale = self.inv_freq_and_scale(jnp.max(positions) + 1 if seq_len is None else seq_len)
        if inv_freq_scale is not None:
            inv_freq = inv_freq * inv_freq_scale.astype(jnp.float32)
        freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, rotary_dim/2]
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        return jnp.cos(emb) * scale, jnp.sin(emb) * scale

    @jax.named_scope("rope")
    def apply(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """Rotates the first rotary_dim dims of x [B, T, heads, H] (HF's rotate_half layout)."""
        rot = self.rotary_dim
        cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        half = rot // 2
        rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
        out = x_rot * cos + rotated * sin
        return out if rot == x.shape[-1] else jnp.concatenate([out, x_pass], axis=-1)


@dataclass(frozen=True)
class MRope(Rope):
    """Multimodal RoPE (Qwen-VL): positions [B, T, 3] (temporal, height, width) turn separate parts of the
    frequencies. `sections` counts the frequencies of each axis; `interleaved` (Qwen3-VL, Qwen3.5) takes them in turn
    (t, h, w, t, h, w, ..., the tail temporal), else in blocks (Qwen2-VL, Qwen2.5-VL). Positions [B, T] (all three
    equal: text) give 1-D RoPE."""

    sections: tuple[int, ...] = (24, 20, 20)
    interleaved: bool = True

    def __hash__(self):
        return id(self)

    def cos_sin(self, positions: jax.Array, seq_len: jax.Array | None = None,
                inv_freq_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        if positions.ndim == 2:
            return super().cos_sin(positions, seq_len, inv_freq_scale)
        inv_freq, scale = self.inv_freq_and_scale(jnp.max(positions) + 1 if seq_len is None else seq_len)
        freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, 3, rotary_dim/2]
        freqs = jnp.take_along_axis(freqs, jnp.asarray(self.axis_of_frequency())[None, None, None, :], axis=2)[:, :, 0]
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        return jnp.cos(emb) * scale, jnp.sin(emb) * scale

    def axis_of_frequency(self) -> np.ndarray:
        """[rotary_dim/2] the position axis (0 t, 1 h, 2 w) each frequency turns by (HF's recomposition)."""
        n = self.rotary_dim // 2
        axis = np.zeros(n, np.int32)
        if self.interleaved:
            for a in (1, 2):
                axis[a:self.sections[a] * 3:3] = a
        else:
            start = 0
            for a, size in enumerate(self.sections):
                axis[start:start + size] = a
                start += size
        return axis

    def op_call(self) -> OpCall:
        p = self.params
        return OpCall.of("rope", kind=f"mrope{'-interleaved' if self.interleaved else ''} {list(self.sections)}",
                         theta=float(p["rope_theta"]), factor=p.get("factor"), rotary_dim=self.rotary_dim,
                         head_dim=self.head_dim)


class LearnedRopeScale(nnx.Module):
    """LeRoPE (Mistral Large 4): a learned `alpha` per frequency, HF's `rotary_emb.alpha` [rotary_dim/2]; the
    inverse frequencies are the RoPE type's own times exp(alpha), every other step of `rope` unchanged."""

    def __init__(self, rope: Rope, *, dtype, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.zeros, (None,))
        self.alpha = nnx.Param(init(rngs.params(), (rope.rotary_dim // 2,), dtype))

    def cos_sin(self, rope: Rope, positions: jax.Array, seq_len: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
        """`rope.cos_sin` with the learned scaling (exp in float32, as HF keeps alpha)."""
        return rope.cos_sin(positions, seq_len, inv_freq_scale=jnp.exp(self.alpha[...].astype(jnp.float32)))


def _llama3_inv_freq(p: dict, dim: int) -> np.ndarray:
    inv_freq = 1.0 / (float(p["rope_theta"]) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(p: dict, dim: int, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    base = float(p["rope_theta"])
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_position_embeddings / orig

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)
