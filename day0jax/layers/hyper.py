"""Hyper-connections: a residual stream of n streams per token instead of one (`kernels_pallas.hyper_connection`).

Around each block (attention, then the MLP) a `HyperConnection` computes, from the streams themselves, the weights
that collapse them into the block's input (pre), spread the block's output back over them (post) and, in DeepSeek-V4's
manifold-constrained form, mix them through a Sinkhorn-projected doubly stochastic matrix (comb); the hyper head
collapses them once more before the final norm. One layer, with the form as an option: "mhc" (DeepSeek-V4), "plain"
(HY-V4: each stream keeps its own residual); Qwen4-Exp's gated residual (form "gated", whose pre is a low-rank
per-channel mix) is `GatedResidual`, whose `__call__` returns the same (input, post, comb) triple.

The streams travel between layers as the model's x, [B, T, n, D]: the embeddings copied n times, each prefill chunk
and decode step starting from them again, so the engine keeps nothing of them between steps. What else a layer hands
the next (the token ids that hash routing reads, a shared top-k) travels in a `HyperCarry`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.layers.linear import param
from kernels_pallas.calls import OpCall
from kernels_pallas.hyper_connection import api as hc_op


class HyperConnection(nnx.Module):
    """The weights around one block. HF's names: `fn` [R, n D], `base` [R], `scale` [3] ("mhc") or [2] ("plain").

    Args:
        hidden_size: D; streams: n.
        form: "mhc" or "plain" (`kernels_pallas.hyper_connection.reference`).
        norm_eps: the flattened streams' RMS norm eps (HF: rms_norm_eps); eps: `hc_eps`.
        post_scale: post's sigmoid times this (2 for mHC; HY-V4's `hc_magnitude`).
        sinkhorn_iters: Sinkhorn-Knopp iterations of the mixing matrix ("mhc").
    """

    def __init__(self, hidden_size: int, streams: int, *, form: str, norm_eps: float, eps: float,
                 post_scale: float = 2.0, sinkhorn_iters: int = 20, dtype=jnp.float32, rngs: nnx.Rngs):
        n, D = streams, hidden_size
        rows = (2 + n) * n if form == "mhc" else 2 * n
        # Small, and read whole by every rank: never split. Kept float32 as HF keeps these modules.
        self.fn = param(rngs, (rows, n * D), (None, None), jnp.float32, (n * D) ** -0.5)
        self.base = param(rngs, (rows,), (None,), jnp.float32, 0.0)
        self.scale = nnx.Param(nnx.with_partitioning(nnx.initializers.ones, (None,))(
            rngs.params(), (3 if form == "mhc" else 2,), jnp.float32))
        self.form, self.norm_eps, self.eps = form, norm_eps, eps
        self.post_scale, self.sinkhorn_iters = post_scale, sinkhorn_iters

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """x [B, T, n, D] -> (the block's input [B, T, D], post [B, T, n], comb [B, T, n, n] or None)."""
        return hc_op.hyper_connection(x, self.fn[...], self.base[...], self.scale[...], form=self.form,
                                      norm_eps=self.norm_eps, eps=self.eps, post_scale=self.post_scale,
                                      sinkhorn_iters=self.sinkhorn_iters)

    @staticmethod
    def expand(x: jax.Array, y: jax.Array, post: jax.Array, comb: jax.Array | None) -> jax.Array:
        """The streams after the block: post spreads its output y [B, T, D] over x's mixed (or own) residuals."""
        return hc_op.expand(x, y, post, comb)

    def op_calls(self) -> list[OpCall]:
        rows, nD = self.fn.shape
        n = _streams(rows, self.form)
        return [OpCall.of("hyper_connection", n=n, D=nD // n, form=self.form,
                          sinkhorn=self.sinkhorn_iters if self.form == "mhc" else 0, post_scale=self.post_scale)]


def _streams(rows: int, form: str) -> int:
    """n from fn's rows: (2 + n) n for "mhc", 2 n for "plain"."""
    if form == "plain":
        return rows // 2
    n = 1
    while (2 + n) * n < rows:
        n += 1
    return n


class HyperHead(nnx.Module):
    """The streams collapsed before the final norm: sigmoid(hc_scale * (hc_fn @ normed flat streams) + hc_base) + eps
    weights. HF's names: `hc_fn` [n, n D], `hc_base` [n], `hc_scale` [1]."""

    def __init__(self, hidden_size: int, streams: int, *, norm_eps: float, eps: float, rngs: nnx.Rngs):
        n, D = streams, hidden_size
        self.hc_fn = param(rngs, (n, n * D), (None, None), jnp.float32, (n * D) ** -0.5)
        self.hc_base = param(rngs, (n,), (None,), jnp.float32, 0.0)
        self.hc_scale = nnx.Param(nnx.with_partitioning(nnx.initializers.ones, (None,))(
            rngs.params(), (1,), jnp.float32))
        self.norm_eps, self.eps = norm_eps, eps

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [B, T, n, D] -> [B, T, D]."""
        return hc_op.head(x, self.hc_fn[...], self.hc_base[...], self.hc_scale[...], norm_eps=self.norm_eps,
                          eps=self.eps)


class MeanHyperHead(nnx.Module):
    """The streams collapsed by their plain mean, no weights (GLM-5-Next's `Glm5NextTextHyperHead`)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [B, T, n, D] -> [B, T, D]."""
        return jnp.mean(x.astype(jnp.float32), axis=-2).astype(x.dtype)


class HyperCarry(NamedTuple):
    """What a hyper-connected layer hands the next besides the streams: the token ids [B, T] (hash routing reads
    them), and the top-k [B, T, Kt] a sparse-attention layer picked for the layers that share it (None: none yet)."""

    tokens: jax.Array
    topk: jax.Array | None = None


class HyperDecoderLayer(nnx.Module):
    """A decoder layer over n streams: attn_hc around `self_attn` (after `input_layernorm`), then ffn_hc around
    `mlp` (after `post_attention_layernorm`); HF's names. An attention with `run` (sparse attention that may share
    its top-k) takes and gives the carry's top-k; an MLP that `takes_tokens` (hash routing) reads its token ids."""

    carries = True

    def __init__(self, self_attn: nnx.Module, mlp: nnx.Module, input_layernorm: nnx.Module,
                 post_attention_layernorm: nnx.Module, attn_hc: HyperConnection, ffn_hc: HyperConnection):
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm, self.post_attention_layernorm = input_layernorm, post_attention_layernorm
        self.attn_hc, self.ffn_hc = attn_hc, ffn_hc

    def __call__(self, x: jax.Array, positions: jax.Array, rope_tables, cache: Any = None,
                 carry: HyperCarry | None = None) -> tuple[jax.Array, Any, HyperCarry]:
        """x [B, T, n, D] -> (streams [B, T, n, D], updated cache, carry)."""
        h, post, comb = self.attn_hc(x)
        h = self.input_layernorm(h)
        if hasattr(self.self_attn, "run"):
            h, cache, topk = self.self_attn.run(h, positions, rope_tables, cache, carry.topk)
            carry = carry._replace(topk=topk)
        else:
            h, cache = self.self_attn(h, positions, rope_tables, cache)
        x = self.attn_hc.expand(x, h, post, comb)
        h, post, comb = self.ffn_hc(x)
        h = self.post_attention_layernorm(h)
        h = self.mlp(h, carry.tokens) if getattr(self.mlp, "takes_tokens", False) else self.mlp(h)
        return self.ffn_hc.expand(x, h, post, comb), cache, carry

    def op_calls(self) -> list[OpCall]:
        norms = self.input_layernorm.op_calls() + self.post_attention_layernorm.op_calls()
        return self.attn_hc.op_calls() + self.self_attn.op_calls() + self.mlp.op_calls() + norms


class HyperConnected:
    """Mixin of `base.CausalLM` models whose residual stream is `hc_streams` streams: the embeddings copied into
    each, a `HyperCarry` begun with the token ids, and the streams collapsed by `model.hc_head` (a `HyperHead`)
    before the final norm (`MeanHyperHead` where the class sets `hc_head_mean`). Its config gives `hc_mult`
    streams, `hc_eps` and `rms_norm_eps`."""

    hc_streams: int
    hc_head_mean = False

    def __init__(self, config, *, dtype=jnp.float32, rngs: nnx.Rngs, **kwargs):
        self.hc_streams = config.hc_mult
        super().__init__(config, dtype=dtype, rngs=rngs, **kwargs)
        self.model.hc_head = MeanHyperHead() if self.hc_head_mean else HyperHead(
            config.hidden_size, config.hc_mult, norm_eps=config.rms_norm_eps, eps=config.hc_eps, rngs=rngs)

    def embed(self, tokens: jax.Array) -> jax.Array:
        x = super().embed(tokens)
        return jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], self.hc_streams, x.shape[-1]))

    def begin_carry(self, tokens: jax.Array, x: jax.Array) -> HyperCarry:
        return HyperCarry(tokens)

    def hyper_layer(self, index: int, attn: nnx.Module, *, dtype, rngs: nnx.Rngs, **connection) -> HyperDecoderLayer:
        """Decoder layer `index` around `attn`: the model's MLP (`make_mlp`) and norms, and a `HyperConnection`
        before each of the two blocks (`connection`: its form and that form's options)."""
        c = self.config
        D = c.hidden_size
        hc = lambda: HyperConnection(D, c.hc_mult, norm_eps=c.rms_norm_eps, eps=c.hc_eps, dtype=dtype,  # noqa: E731
                                     rngs=rngs, **connection)
        return HyperDecoderLayer(attn, self.make_mlp(index, dtype=dtype, rngs=rngs),
                                 self.make_norm(D, dtype=dtype, rngs=rngs), self.make_norm(D, dtype=dtype, rngs=rngs),
                                 hc(), hc())

    def final_norm(self, x: jax.Array) -> jax.Array:
        return self.model.norm(self.model.hc_head(x))


class GroupNorm(nnx.Module):
    """RMS norm of each of n groups of D dims on its own, times (1 + weight) [n D]: HF's `Qwen4ExpTextRMSNorm` with
    `group_size`. x [..., n, D] -> the same shape, float32."""

    def __init__(self, groups: int, dim: int, eps: float, *, rngs: nnx.Rngs):
        self.weight = param(rngs, (groups * dim,), (None,), jnp.float32, 0.0)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return normed * (1.0 + self.weight[...].reshape(x.shape[-2:]))


class Weight(nnx.Module):
    """A bare float32 matrix under HF's `<name>.weight`, kept whole on every rank (read by the op, not projected)."""

    def __init__(self, shape: tuple[int, ...], stddev: float, *, rngs: nnx.Rngs):
        self.weight = param(rngs, shape, (None,) * len(shape), jnp.float32, stddev)


class GatedResidual(nnx.Module):
    """Qwen4-Exp's gated residual around a block (form "gated" of `kernels_pallas.hyper_connection`), or with
    `combine=False` the final mixer. HF's names: `hc_norm` [n D], `input_mix_weight_down` [R, n D],
    `input_mix_weight_up` [n D, R], `block_inject_weight` [n, n D]. Same contract as `HyperConnection`."""

    def __init__(self, hidden_size: int, streams: int, rank: int, *, eps: float, combine: bool = True,
                 rngs: nnx.Rngs):
        n, D = streams, hidden_size
        self.hc_norm = GroupNorm(n, D, eps, rngs=rngs)
        self.input_mix_weight_down = Weight((rank, n * D), (n * D) ** -0.5, rngs=rngs)
        self.input_mix_weight_up = Weight((n * D, rank), rank ** -0.5, rngs=rngs)
        self.block_inject_weight = Weight((n, n * D), (n * D) ** -0.5, rngs=rngs) if combine else None
        self.eps, self.shape = eps, (n, D, rank)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None, None]:
        """x [B, T, n, D] -> (the block's input [B, T, D], post [B, T, n] or None for the mixer, None)."""
        weights = [self.hc_norm.weight[...], self.input_mix_weight_down.weight[...],
                   self.input_mix_weight_up.weight[...]]
        if self.block_inject_weight is not None:
            weights.append(self.block_inject_weight.weight[...])
        return hc_op.hyper_connection(x, *weights, form="gated", norm_eps=self.eps)

    expand = staticmethod(HyperConnection.expand)

    def op_calls(self) -> list[OpCall]:
        n, D, R = self.shape
        return [OpCall.of("hyper_connection", n=n, D=D, form="gated", R=R,
                          combine=self.block_inject_weight is not None)]
