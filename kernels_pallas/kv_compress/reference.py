"""The definition of the gated window compressor, in plain jax.numpy; also the fallback on every backend.

Compressed attention keeps one entry per window of m consecutive tokens (window c covers positions [c m, c m + m)).
Each token brings a projection kv and a gate z of its own (the layer's `kv_proj`, `gate_proj`); a learned bias per
offset in the window (`position_bias` [m, F]) is added to the gates, and the entry is, channel by channel, the
softmax-over-tokens of the gates applied to the kvs:

    entry[c, d] = sum_i softmax_i(z[i, d] + bias[i % m, d]) kv[i, d]    over the tokens i of window c

With `overlap` (CSA), every token brings two series (F = 2 Dh): the first Dh channels (Ca) feed the *next* window's
entry, the last Dh (Cb) its own window's, so entry c pools 2m slots, window c - 1's Ca beside window c's Cb: windows of
2m tokens at a stride of m. Window -1 does not exist: its slots weigh nothing. The layer then normalizes each entry and
rotates it at position c m (not here: this op is the pooling, the part that reads every token's projections).

Letters: B batch, C entries, m tokens per window, F projection width, Dh entry width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FLOOR = jnp.finfo(jnp.float32).min  # masked gates: finite, so a window with no token left pools to zeros, not NaN


def kv_compress(kv: jax.Array, gate: jax.Array, position_bias: jax.Array, *, overlap: bool,
                valid: jax.Array | None = None) -> jax.Array:
    """One entry per window.

    Args:
        kv, gate: [B, C + overlap, m, F] the tokens' projections, window by window; with `overlap`, window 0 is the
            one before the first entry's (only its Ca half is read) and F = 2 Dh.
        position_bias: [m, F] added to the gates by offset in the window.
        overlap: the CSA layout (module docstring); without it F = Dh and entry c pools window c alone.
        valid: [B, C + overlap, m] bool, tokens that exist (None: all): the others weigh nothing (a sequence's
            window -1, tokens not yet arrived).
    Returns:
        [B, C, Dh] in kv's dtype; the softmax and the sum in float32.
    """
    g = gate.astype(jnp.float32) + position_bias.astype(jnp.float32)
    if valid is not None:
        g = jnp.where(valid[..., None], g, FLOOR)
    x = kv.astype(jnp.float32)
    if overlap:
        dh = x.shape[-1] // 2
        x = jnp.concatenate([x[:, :-1, :, :dh], x[:, 1:, :, dh:]], axis=2)  # [B, C, 2m, Dh]
        g = jnp.concatenate([g[:, :-1, :, :dh], g[:, 1:, :, dh:]], axis=2)
    return (jax.nn.softmax(g, axis=2) * x).sum(axis=2).astype(kv.dtype)
