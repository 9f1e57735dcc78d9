"""The definition of the depthwise causal convolution over time, in plain jax.numpy; also the fallback on every
backend.

The contract: x [B, T, C] (C channels), a depthwise weight [C, W] (W taps; PyTorch's `Conv1d(C, C, W, groups=C)`
weight [C, 1, W] squeezed), a per-sequence state [B, W - 1, C] holding the W - 1 inputs before x, oldest first.
Every call returns its output and the new state, so a prompt run in chunks, then decode steps (T = 1), each from the
state the previous call left, gives exactly what the whole sequence gives in one call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def causal_conv1d(x: jax.Array, weight: jax.Array, state: jax.Array | None = None, *,
                  valid: jax.Array | None = None, bias: jax.Array | None = None,
                  activation: str | None = "silu") -> tuple[jax.Array, jax.Array]:
    """Depthwise causal convolution over time, then SiLU: the short convolution in front of the gated delta rule
    (and, without the SiLU, LFM's short convolution, which its projections gate instead). See the module docstring.

    out[t] = silu(sum_j weight[:, j] * concat(state, x)[t + j] + bias), in float32; the state holds the W - 1
    inputs before x, so a prompt split in pieces, or a decode step (T = 1), gives what the whole sequence gives.

    Args:
        x: [B, T, C].
        weight: [C, W] (a depthwise conv1d weight [C, 1, W] squeezed).
        state: [B, W - 1, C], the previous W - 1 inputs, oldest first; None for zeros (a sequence start).
        valid: [B] int32, the number of real tokens in each row (None: all T); the inputs past it (padding at the
            end of a row) do not enter the new state.
        bias: [C], added before the activation (the conv1d's own bias); None for none.
        activation: "silu", or None for the plain convolution.
    Returns:
        (out [B, T, C] in x's dtype, new state [B, W - 1, C] in x's dtype: the last W - 1 inputs of
        state ++ x[:valid], per row).
    Raises:
        ValueError: inconsistent shapes.
    """
    B, T, C = x.shape
    if weight.ndim != 2 or weight.shape[0] != C:
        raise ValueError(f"weight {weight.shape} must be [{C}, W]")
    if bias is not None and bias.shape != (C,):
        raise ValueError(f"bias {bias.shape} must be [{C}]")
    if activation not in ("silu", None):
        raise ValueError(f"activation {activation!r} must be 'silu' or None")
    W = weight.shape[1]
    if state is None:
        state = jnp.zeros((B, W - 1, C), x.dtype)
    elif state.shape != (B, W - 1, C):
        raise ValueError(f"state {state.shape} must be [{B}, {W - 1}, {C}]")
    full = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [B, W - 1 + T, C]
    w = weight.astype(jnp.float32)
    acc = sum(full[:, j:j + T].astype(jnp.float32) * w[:, j] for j in range(W))
    if bias is not None:
        acc = acc + bias.astype(jnp.float32)
    out = (acc if activation is None else jax.nn.silu(acc)).astype(x.dtype)
    # The last W - 1 inputs among state ++ x[:valid] sit at full[valid : valid + W - 1].
    ends = jnp.full((B,), T, jnp.int32) if valid is None else jnp.asarray(valid, jnp.int32)
    new_state = jax.vmap(lambda row, end: lax.dynamic_slice_in_dim(row, end, W - 1, axis=0))(full, ends)
    return out, new_state
