"""LFM's gated short convolution (LFM2, LFM3): in_proj to three gates B, C, x; a depthwise causal convolution of
B * x over the last W tokens, without activation; C times its output; out_proj. HF names kept (`in_proj`,
`conv.weight`, `out_proj`); reference: transformers/models/lfm2/modeling_lfm2.py, `Lfm2ShortConv`.

The convolution is the `kernels_pallas` op `causal_conv1d` (activation None), and its
per-sequence state (the last W - 1 inputs) lives in the engine's state cache like linear attention's. Its channels
are split by tensor parallelism like an MLP's hidden units: every step between in_proj and out_proj is per channel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.core.cache_layout import StateLayer
from day0jax.layers.gated_delta_net import StateCache
from day0jax.layers.linear import Linear, param
from kernels_pallas.calls import OpCall
from kernels_pallas.causal_conv1d import api as conv_op

# The logical axis of the convolution's channels.
CHANNELS = "mlp"


class DepthwiseConv(nnx.Module):
    """The weights of HF's `nn.Conv1d(C, C, W, groups=C)`: weight [C, W] (HF's [C, 1, W] squeezed), bias [C]."""

    def __init__(self, channels: int, width: int, *, use_bias: bool, dtype=jnp.float32, rngs: nnx.Rngs):
        self.weight = param(rngs, (channels, width), (CHANNELS, None), dtype, 0.5)
        self.bias = param(rngs, (channels,), (CHANNELS,), dtype, 0.0) if use_bias else None


class ShortConv(nnx.Module):
    """The gated short convolution over D channels.

    Args:
        hidden_size: D (the channels too).
        kernel_size: W, the convolution's width (HF's `conv_L_cache`).
        use_bias: biases on in_proj, the convolution and out_proj (HF's `conv_bias`, all three).
    """

    def __init__(self, *, hidden_size: int, kernel_size: int, use_bias: bool, dtype=jnp.float32, rngs: nnx.Rngs):
        D, W = hidden_size, kernel_size
        # [3, D] outputs: HF's in_proj [3D, D] rows are B, C, x in that order, so conversion is a reshape.
        self.in_proj = Linear((D,), (3, D), ("embed", None, CHANNELS), use_bias=use_bias, dtype=dtype, rngs=rngs)
        self.conv = DepthwiseConv(D, W, use_bias=use_bias, dtype=dtype, rngs=rngs)
        self.out_proj = Linear((D,), (D,), (CHANNELS, "embed"), use_bias=use_bias, dtype=dtype, rngs=rngs)
        self.shape = (D, W)

    def state_layout(self) -> StateLayer:
        """Per sequence: the convolution's last W - 1 inputs, [W - 1, D]."""
        D, W = self.shape
        return StateLayer((((W - 1, D), (None, CHANNELS)),), kind="short convolution")

    def __call__(self, x: jax.Array, positions: jax.Array, rope_tables: dict,
                 cache: StateCache | None = None) -> tuple[jax.Array, StateCache | None]:
        """x [B, T, D] -> ([B, T, D], the cache with each row's new state). `positions` and `rope_tables` are
        unused: the convolution's state carries order."""
        proj = self.in_proj(x)  # [B, T, 3, D]
        b, c, h = proj[..., 0, :], proj[..., 1, :], proj[..., 2, :]
        state, valid = (None, None) if cache is None else (cache.read()[0], cache.valid)
        bias = None if self.conv.bias is None else self.conv.bias[...]
        out, new_state = conv_op.causal_conv1d(b * h, self.conv.weight[...], state, valid=valid, bias=bias,
                                               activation=None)
        if cache is not None:
            cache = cache.write((new_state,))
        return self.out_proj(c * out), cache

    def op_calls(self) -> list[OpCall]:
        D, W = self.shape
        return [OpCall.of("causal_conv1d", C=D, W=W, act=None)]
