"""The definition of hyper-connections, in plain jax.numpy; also the fallback on every backend.

The residual stream of a hyper-connected model is n streams per token, x [B, T, n, D]. Around each block (attention,
MLP) three sets of weights are computed from the streams themselves, by one learned map of the normalized,
flattened streams: `fn` [R, n * D], `base` [R] and `scale` [3] (or [2]); rows of `fn` and `base` are pre (n), post
(n) and, in the manifold-constrained form, comb (n * n):

    flat  = x.reshape(n * D) / rms(x.reshape(n * D))            (no weight; eps `norm_eps`)
    mixes = fn @ flat
    pre   = sigmoid(scale[0] * mixes_pre + base_pre) + eps          the block's input: sum_i pre_i x_i
    post  = post_scale * sigmoid(scale[1] * mixes_post + base_post) + post_eps
    comb  = sinkhorn(softmax(scale[2] * mixes_comb + base_comb))    [n, n], doubly stochastic (mHC only)

and after the block, with its output y [B, T, D]: x'_k = post_k * y + sum_j comb[j, k] x_j (the plain form: x_k
itself in place of the mix). The Sinkhorn-Knopp projection makes comb's rows and columns sum to 1 (to within `eps`),
so mixing the streams can neither grow nor shrink them: what keeps a deep stack of such blocks stable. The hyper
head collapses the streams once more, before the final norm: sigmoid(scale * (fn @ flat) + base) + eps weights.

Forms (what `fn`'s rows hold): "mhc" (DeepSeek-V4: post_scale 2, post_eps 0, comb by `sinkhorn_iters` iterations),
"plain" (HY-V4: post_scale its `hc_magnitude`, post_eps eps, no comb), "gated" (Qwen4-Exp's gated residual, whose
weights are other maps: `gated_residual`; no comb, so the same `expand` with each stream's own residual).

Everything is float32 (as transformers computes these modules, whatever the model's dtype); the outputs take the
streams' dtype. Letters: B batch, T tokens, n streams, D model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FORMS = ("mhc", "plain", "gated")


def _normed_flat(x: jax.Array, norm_eps: float) -> jax.Array:
    flat = x.reshape(*x.shape[:-2], -1).astype(jnp.float32)
    return flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)


def sinkhorn(logits: jax.Array, *, iters: int, eps: float) -> jax.Array:
    """softmax over the last axis, + eps, then alternating column and row normalizations (as transformers: one
    column step, then `iters - 1` row-and-column rounds). logits [..., n, n] -> [..., n, n] float32."""
    comb = jax.nn.softmax(logits.astype(jnp.float32), axis=-1) + eps
    comb = comb / (comb.sum(-2, keepdims=True) + eps)

    def row_and_column(_, comb):
        comb = comb / (comb.sum(-1, keepdims=True) + eps)
        return comb / (comb.sum(-2, keepdims=True) + eps)
    # A loop, not `iters - 1` copies of the step: unrolled, the two mixes of every layer made a third of a small
    # model's program and two thirds of its compile time.
    return jax.lax.fori_loop(0, iters - 1, row_and_column, comb)


def gated_residual(x: jax.Array, norm_weight: jax.Array, down: jax.Array, up: jax.Array,
                   inject: jax.Array | None = None, *, norm_eps: float
                   ) -> tuple[jax.Array, jax.Array | None, None]:
    """Qwen4-Exp's gated residual: each stream RMS-normalized on its own, times (1 + its weight); a low-rank map of
    all of them gives per-channel input weights, and the block's input is the mean of the weighted normed streams:

        normed = rms_norm(x_i) (1 + w_i)                        per stream i, eps `norm_eps`
        mix    = sigmoid(up @ silu(down @ normed / n))          [n, D]
        input  = mean_i(mix_i * normed_i);   post = 2 sigmoid(inject @ normed / n)

    Args:
        x: [B, T, n, D]; norm_weight: [n * D]; down: [R, n * D]; up: [n * D, R]; inject: [n, n * D], or None for
            the final mixer, which has no block after it.
    Returns:
        (the block's input [B, T, D] in x's dtype, post [B, T, n] float32 or None, None).
    """
    n, D = x.shape[-2:]
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + norm_eps)
    normed = normed * (1.0 + norm_weight.astype(jnp.float32).reshape(n, D))
    flat = normed.reshape(*x.shape[:-2], n * D)
    low = jax.nn.silu(jnp.einsum("btk,rk->btr", flat, down.astype(jnp.float32)) / n)
    mix = jax.nn.sigmoid(jnp.einsum("btr,kr->btk", low, up.astype(jnp.float32))).reshape(normed.shape)
    collapsed = jnp.mean(mix * normed, axis=-2).astype(x.dtype)
    if inject is None:
        return collapsed, None, None
    post = 2.0 * jax.nn.sigmoid(jnp.einsum("btk,nk->btn", flat, inject.astype(jnp.float32)) / n)
    return collapsed, post, None


def hyper_connection(x: jax.Array, *weights: jax.Array, form: str, norm_eps: float, eps: float = 0.0,
                     post_scale: float = 2.0, sinkhorn_iters: int = 20
                     ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """The weights around one block and the block's input.

    Args:
        x: [B, T, n, D] the streams.
        weights: fn [R, n * D] (R = (2 + n) n for "mhc", 2 n for "plain"), base [R], scale [3] ("mhc") or [2];
            for "gated", `gated_residual`'s norm_weight, down, up and inject (or no inject).
        form: "mhc", "plain" or "gated" (module docstring).
        norm_eps: the flattened streams' RMS norm eps; eps: added to pre (and comb's normalizations; to post in
            the plain form).
        post_scale: post's sigmoid times this (2 for mHC, `hc_magnitude` for HY-V4).
        sinkhorn_iters: comb's Sinkhorn-Knopp iterations (mHC).
    Returns:
        (the block's input [B, T, D] in x's dtype, post [B, T, n] float32, comb [B, T, n, n] float32 or None).
    Raises:
        ValueError: an unknown form, or `fn` of the wrong size for it.
    """
    if form not in FORMS:
        raise ValueError(f"hyper-connection form {form!r} is not one of {FORMS}")
    if form == "gated":
        return gated_residual(x, *weights, norm_eps=norm_eps)
    fn, base, scale = weights
    n = x.shape[-2]
    rows = (2 + n) * n if form == "mhc" else 2 * n
    if fn.shape != (rows, x.shape[-2] * x.shape[-1]):
        raise ValueError(f"fn must be [{rows}, {n * x.shape[-1]}] for the {form} form of {n} streams, got {fn.shape}")
    mixes = jnp.einsum("btk,rk->btr", _normed_flat(x, norm_eps), fn.astype(jnp.float32))
    base, scale = base.astype(jnp.float32), scale.astype(jnp.float32)
    pre = jax.nn.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + eps
    post = post_scale * jax.nn.sigmoid(mixes[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb = None
    if form == "mhc":
        logits = (mixes[..., 2 * n:] * scale[2] + base[2 * n:]).reshape(*mixes.shape[:-1], n, n)
        comb = sinkhorn(logits, iters=sinkhorn_iters, eps=eps)
    else:
        post = post + eps
    collapsed = jnp.einsum("btn,btnd->btd", pre, x.astype(jnp.float32)).astype(x.dtype)
    return collapsed, post, comb


def expand(x: jax.Array, y: jax.Array, post: jax.Array, comb: jax.Array | None) -> jax.Array:
    """The streams after a block: x'_k = post_k y + sum_j comb[j, k] x_j (comb None: + x_k).

    Args:
        x: [B, T, n, D] the streams the block's input came from; y: [B, T, D] the block's output.
        post: [B, T, n]; comb: [B, T, n, n] or None.
    Returns:
        [B, T, n, D] in x's dtype.
    """
    out = post[..., None] * y[..., None, :].astype(jnp.float32)
    mixed = x.astype(jnp.float32) if comb is None else jnp.einsum("btjk,btjd->btkd", comb, x.astype(jnp.float32))
    return (out + mixed).astype(x.dtype)


def head(x: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *, norm_eps: float,
         eps: float) -> jax.Array:
    """The hyper head: the streams collapsed before the final norm.

    Args:
        x: [B, T, n, D]; fn: [n, n * D]; base: [n]; scale: [1].
    Returns:
        [B, T, D] in x's dtype.
    """
    mixes = jnp.einsum("btk,rk->btr", _normed_flat(x, norm_eps), fn.astype(jnp.float32))
    pre = jax.nn.sigmoid(mixes * scale.astype(jnp.float32)[0] + base.astype(jnp.float32)) + eps
    return jnp.einsum("btn,btnd->btd", pre, x.astype(jnp.float32)).astype(x.dtype)
