"""Per-layer embeddings (Qwen4-Exp's PLE): hashed n-gram embeddings of each token's last n token ids
(`kernels_pallas.ngram_embedding`) projected to one value and one key per residual stream; each stream's normed
activations gate the value (signed square root of a scaled dot product, through a sigmoid), and a dilated depthwise
causal convolution of the normed gated values adds local context. The result is added to every stream before the
layer's token mixer. Letters: B batch, T tokens, n streams, D model, E the concatenated n-gram embedding, C the
n - 1 context ids, W the convolution's width, d its dilation (the n-gram size).

Per sequence the engine keeps two states for it: the convolution's last (W - 1) d inputs, and the C ids the next
chunk's n-grams continue from (kept as id + 1 in float32, exact below 2^24, as the state pool holds float32: a new
sequence's zeroed state reads as eos, the context transformers starts from). `GatedResidualLayer` is Qwen4-Exp's
decoder layer, which adds them to the streams before its mixer and keeps their states after the mixer's
(`StateView`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.core.cache_layout import StateLayer
from day0jax.core.errors import GenerationError
from day0jax.layers.hyper import GatedResidual, GroupNorm, HyperCarry
from day0jax.layers.linear import Embedding, Linear, param
from kernels_pallas.calls import OpCall
from kernels_pallas.ngram_embedding import api as ngram_op


class NGramTable(nnx.Module):
    """HF's `ple_embedding`: the `ngram_embedding` table [rows, E / heads] of every hashed head, split over the
    devices like the vocabulary."""

    def __init__(self, rows: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.ngram_embedding = Embedding(rows, dim, dtype=dtype, rngs=rngs)


class Conv(nnx.Module):
    """HF's depthwise `conv1d.weight` [channels, 1, W] as stored."""

    def __init__(self, channels: int, width: int, *, dtype, rngs: nnx.Rngs):
        self.weight = param(rngs, (channels, 1, width), (None, None, None), dtype, 0.5)


class PLELayer(nnx.Module):
    """One layer's per-layer embeddings (HF's `Qwen4ExpTextPLELayer`, its names kept).

    Args:
        hidden_size: D; streams: n; embed_dim: E; eos: the id n-grams restart after; vocab_size: the tokens'.
        hash: `ngram_embedding`'s multipliers, primes and offsets for this layer; rows: the table's rows.
        conv_kernel: W; eps: the norms' epsilon.
    """

    def __init__(self, *, hidden_size: int, streams: int, embed_dim: int, eos: int, vocab_size: int, hash: dict,
                 rows: int,
                 conv_kernel: int, eps: float, dtype, rngs: nnx.Rngs):
        n, D, E = streams, hidden_size, embed_dim
        heads = sum(len(p) for p in hash["primes"])
        self.ple_embedding = NGramTable(rows, E // heads, dtype=dtype, rngs=rngs)
        self.key_proj = Linear((E,), (n * D,), (None, None), dtype=dtype, rngs=rngs)
        self.value_proj = Linear((E,), (D,), (None, None), dtype=dtype, rngs=rngs)
        self.norm_key = GroupNorm(n, D, eps, rngs=rngs)
        self.norm_query = GroupNorm(n, D, eps, rngs=rngs)
        self.norm_conv = GroupNorm(n, D, eps, rngs=rngs)
        self.conv1d = Conv(n * D, conv_kernel, dtype=dtype, rngs=rngs)
        self.eos, self.hash, self.vocab_size = eos, hash, vocab_size
        self.context = len(hash["multipliers"]) - 1
        self.span = (conv_kernel - 1) * len(hash["multipliers"])  # the convolution's reach: (W - 1) d

    def state_arrays(self) -> tuple:
        """The per-sequence states `StateLayer` lists: the convolution's inputs and the n-gram context."""
        n_D = self.conv1d.weight.shape[0]
        return (((self.span, n_D), (None, None)), ((self.context,), (None,)))

    def state_layout(self) -> StateLayer:
        """Its own states alone (the layer's cache holds them after its mixer's). It keeps no state per token, so
        speculative decoding refuses it (`engine.speculative.refuse_unverifiable_state`)."""
        return StateLayer(self.state_arrays(), kind="per-layer embeddings")

    def __call__(self, x: jax.Array, tokens: jax.Array, state: tuple | None = None,
                 valid: jax.Array | None = None) -> tuple[jax.Array, tuple | None]:
        """x [B, T, n, D] streams, tokens [B, T] -> (what is added to the streams [B, T, n, D], the new state or
        None). `state`: (conv inputs [B, (W - 1) d, n D], context [B, C] as float32), None at a sequence start
        without a cache; `valid` [B]: real tokens per row (padding after them leaves the state as it was)."""
        B, T, n, D = x.shape
        if state is None:
            conv_state = jnp.zeros((B, self.span, n * D), jnp.float32)
            context = jnp.full((B, self.context), self.eos, jnp.int32)
        else:
            stored = state[1].astype(jnp.int32)
            conv_state, context = state[0], jnp.where(stored == 0, self.eos, stored - 1)
        table = self.ple_embedding.ngram_embedding.weight[...]
        embedded, new_context = ngram_op.ngram_embedding(tokens, context, table, eos=self.eos, lengths=valid,
                                                         **self.hash)
        key = self.norm_key(self.key_proj(embedded).reshape(B, T, n, D))
        value = self.value_proj(embedded).astype(jnp.float32)
        gate = (key * self.norm_query(x)).sum(-1, keepdims=True) / math.sqrt(D)
        gate = jnp.sqrt(jnp.maximum(jnp.abs(gate), 1e-6)) * jnp.sign(gate)
        gated = jax.nn.sigmoid(gate) * value[:, :, None]
        normed = self.norm_conv(gated).reshape(B, T, n * D)
        history = jnp.concatenate([conv_state.astype(jnp.float32), normed], axis=1)  # [B, span + T, n D]
        w = self.conv1d.weight[...].astype(jnp.float32)[:, 0]  # [n D, W]
        W, d = w.shape[1], len(self.hash["multipliers"])
        conv = sum(w[:, k] * history[:, self.span - (W - 1 - k) * d:self.span - (W - 1 - k) * d + T]
                   for k in range(W))
        out = (gated.reshape(B, T, n * D) + jax.nn.silu(conv)).reshape(x.shape).astype(x.dtype)
        if state is None:
            return out, None
        ends = jnp.full((B,), T, jnp.int32) if valid is None else valid.astype(jnp.int32)
        idx = ends[:, None] + jnp.arange(self.span, dtype=jnp.int32)[None, :]
        new_conv = jnp.take_along_axis(history, idx[:, :, None], axis=1)
        return out, (new_conv, (new_context + 1).astype(jnp.float32))

    def op_calls(self) -> list[OpCall]:
        primes = self.hash["primes"]
        return [OpCall.of("ngram_embedding", n=len(self.hash["multipliers"]), heads=len(primes[0]),
                          Dh=self.ple_embedding.ngram_embedding.weight.shape[1], V=self.vocab_size,
                          base=min(map(min, primes)))]


class GatedResidualLayer(nnx.Module):
    """Qwen4-Exp's decoder layer over n streams: per-layer embeddings added (where the layer has them), then
    `attn_hyper_connection` around the token mixer (`linear_attn` or `self_attn`) and `mlp_hyper_connection` around
    `mlp`. Its cache: the mixer's (a linear-attention layer's state arrays first, the PLE's two after them)."""

    carries = True

    def __init__(self, mixer: nnx.Module, mixer_name: str, mlp: nnx.Module, attn_hc: GatedResidual,
                 mlp_hc: GatedResidual, ple: PLELayer | None):
        setattr(self, mixer_name, mixer)
        self.mixer_name, self.mlp, self.ple = mixer_name, mlp, ple
        self.attn_hyper_connection, self.mlp_hyper_connection = attn_hc, mlp_hc

    @property
    def mixer(self) -> nnx.Module:
        return getattr(self, self.mixer_name)

    def __call__(self, x: jax.Array, positions: jax.Array, rope_tables, cache: Any = None,
                 carry: HyperCarry | None = None) -> tuple[jax.Array, Any, HyperCarry]:
        if self.ple is not None:
            view = None if cache is None else StateView(cache, len(self.mixer.state_layout().arrays))
            add, state = self.ple(x, carry.tokens, None if view is None else view.ple_state(),
                                  None if view is None else cache.valid)
            x = x + add
            if view is not None:
                view = view.with_ple(state)
                cache = view
        h, post, _ = self.attn_hyper_connection(x)
        h, cache = self.mixer(h, positions, rope_tables, cache)
        if isinstance(cache, StateView):
            cache = cache.merged()
        x = GatedResidual.expand(x, h, post, None)
        h, post, _ = self.mlp_hyper_connection(x)
        return GatedResidual.expand(x, self.mlp(h), post, None), cache, carry

    def op_calls(self) -> list[OpCall]:
        ple = self.ple.op_calls() if self.ple is not None else []
        return (ple + self.attn_hyper_connection.op_calls() + self.mixer.op_calls()
                + self.mlp_hyper_connection.op_calls() + self.mlp.op_calls())


class StateView:
    """A linear-attention layer's state cache as its mixer sees it: only the mixer's arrays (the first `count`), the
    per-layer embeddings' two after them kept apart and written back with the mixer's."""

    def __init__(self, cache, count: int, ple: tuple | None = None):
        self.cache, self.count, self.ple = cache, count, ple
        self.valid, self.targets = cache.valid, cache.targets
        if cache.targets is not None:
            raise GenerationError("speculative decoding is not implemented for Qwen4-Exp's per-layer embeddings "
                                  "(their state after each verified token is not kept)")

    def ple_state(self) -> tuple:
        return tuple(self.cache.read()[self.count:])

    def with_ple(self, state: tuple) -> "StateView":
        return StateView(self.cache, self.count, state)

    def read(self) -> tuple:
        return tuple(self.cache.read()[:self.count])

    def token_mask(self, tokens: int) -> jax.Array:
        return self.cache.token_mask(tokens)

    def write(self, states: tuple) -> "StateView":
        return StateView(self.cache.write((*states, *self.ple)), self.count, self.ple)

    def merged(self):
        return self.cache
