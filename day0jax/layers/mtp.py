"""Multi-token-prediction (MTP, "NextN") layers, as flagship checkpoints ship them beside the model for speculative
decoding. Each one predicts the token after next from the model's hidden state at a position and the embedding of
the token that follows it:

    h' = layer(proj([norm_e(embed(t_{p+1})) ; norm_h(h_p)]))      logits = head(norm_out(h'))

with the model's own embedding and output head. Several layers are chained as transformers' `MtpModel` chains them:
layer i at position p takes layer i - 1's h' at p and token t_{p+1+i}, so layer i drafts the token i + 2 ahead
(`ModelRunner._mtp_fn` keeps every layer's cache over every position). Past the last layer, h' and the drafted token
take the place of h and t (as vLLM and SGLang chain a single layer). Three layouts in released checkpoints:

- `NextNStack`, DeepSeek-V3 and GLM-4.5 style: each MTP layer is stored as a decoder layer after the last one
  (`model.layers.{L + i}.`) with `enorm`, `hnorm`, `eh_proj` and `shared_head.norm` beside the decoder layer's own
  tensors (their copies of the embedding and the head are the model's, shared); h' is the decoder layer's output.
- `FusedMTP`, Qwen3-Next and Qwen3.5 style (`mtp.`): `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc`,
  decoder layers `layers.{i}` and one final `norm`, applied to h' before it is chained.

- `MtpStack`, transformers' own generic MTP layer (`modeling_layers.MtpLayer`): h' is the decoder layer's output
  after a post-norm, chained as it is (not before it, as `NextNStack` chains). ERNIE 4.5 MoE stores its parts as
  `mtp_emb_norm.{i}`, `mtp_hidden_norm.{i}`, `mtp_linear_proj.{i}`, `mtp_block.{i}` (the post-norm the model's final
  norm); Step-3.7 as DeepSeek-V3 does (`model.layers.{L + i}.`, the post-norm `shared_head.norm`).

- `StreamMTP`, DeepSeek-V4 (`mtp.{i}.`): the model's residual is n hyper-connected streams, and its MTP layer reads
  them as they stand before the hyper head collapses them: x = e_proj(enorm(e)) + h_proj(hnorm(h)) per stream, a
  decoder layer over the streams, and a hyper head and norm of its own before the shared output head. h' (the
  streams) is chained as it is.

h is the model's final hidden state, after its last norm (what the inference engines hand their MTP modules), or,
for `StreamMTP`, its last layer's streams (`CausalLM.mtp_hidden`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.layers.hyper import HyperCarry, HyperHead
from day0jax.layers.linear import Linear
from kernels_pallas.calls import OpCall


class SharedHead(nnx.Module):
    """HF's `shared_head`: the norm before the (shared) output head."""

    def __init__(self, norm: nnx.Module):
        self.norm = norm


class NextN(nnx.Module):
    """One DeepSeek-style MTP layer: a decoder layer (its modules under their own HF names, the layer itself called
    as `decoder`) with the embedding and hidden-state norms, their projection and the head's norm."""

    def __init__(self, decoder: nnx.Module, make_norm, hidden_size: int, *, dtype, rngs: nnx.Rngs):
        D = hidden_size
        self.decoder = decoder
        self.enorm, self.hnorm = make_norm(D, dtype=dtype, rngs=rngs), make_norm(D, dtype=dtype, rngs=rngs)
        self.eh_proj = Linear((2 * D,), (D,), (None, "embed"), dtype=dtype, rngs=rngs)
        self.shared_head = SharedHead(make_norm(D, dtype=dtype, rngs=rngs))


class NextNStack(nnx.Module):
    """DeepSeek-V3 / GLM-4.5 MTP layers (`layers.{i}`, stored as `model.layers.{L + i}`)."""

    def __init__(self, layers: list[NextN]):
        self.layers = nnx.List(layers)

    def __len__(self) -> int:
        return len(self.layers)

    def step(self, index: int, embeds: jax.Array, hidden: jax.Array, positions: jax.Array, rope_tables: dict,
             cache=None):
        """embeds, hidden [B, T, D] -> (h' [B, T, D], cache)."""
        m = self.layers[index]
        x = m.eh_proj(jnp.concatenate([m.enorm(embeds), m.hnorm(hidden.astype(embeds.dtype))], axis=-1))
        return m.decoder(x, positions, rope_tables, cache)

    def head_input(self, index: int, h: jax.Array) -> jax.Array:
        return self.layers[index].shared_head.norm(h)

    def chained(self, index: int, h: jax.Array) -> jax.Array:
        """What the next MTP step takes as its hidden state: h' itself."""
        return h

    def op_calls(self, index: int) -> list[OpCall]:
        m = self.layers[index]
        return m.decoder.op_calls() + m.enorm.op_calls() + m.hnorm.op_calls() + m.shared_head.norm.op_calls()


class FusedMTP(nnx.Module):
    """Qwen3-Next / Qwen3.5 MTP layers (`mtp.`): one input projection `fc` and its two norms, decoder layers
    `layers.{i}`, one final `norm`."""

    def __init__(self, layers: list[nnx.Module], make_norm, hidden_size: int, *, dtype, rngs: nnx.Rngs):
        D = hidden_size
        self.pre_fc_norm_embedding = make_norm(D, dtype=dtype, rngs=rngs)
        self.pre_fc_norm_hidden = make_norm(D, dtype=dtype, rngs=rngs)
        self.fc = Linear((2 * D,), (D,), (None, "embed"), dtype=dtype, rngs=rngs)
        self.layers = nnx.List(layers)
        self.norm = make_norm(D, dtype=dtype, rngs=rngs)

    def __len__(self) -> int:
        return len(self.layers)

    def step(self, index: int, embeds: jax.Array, hidden: jax.Array, positions: jax.Array, rope_tables: dict,
             cache=None):
        x = jnp.concatenate([self.pre_fc_norm_embedding(embeds),
                             self.pre_fc_norm_hidden(hidden.astype(embeds.dtype))], axis=-1)
        return self.layers[index](self.fc(x), positions, rope_tables, cache)

    def head_input(self, index: int, h: jax.Array) -> jax.Array:
        return self.norm(h)

    def chained(self, index: int, h: jax.Array) -> jax.Array:
        """What the next MTP step takes as its hidden state: h' after the final norm."""
        return self.norm(h)

    def op_calls(self, index: int) -> list[OpCall]:
        calls = self.layers[index].op_calls()
        if index == 0:  # the shared input projection's norms and the final norm, counted once
            calls += self.pre_fc_norm_embedding.op_calls() + self.pre_fc_norm_hidden.op_calls() + self.norm.op_calls()
        return calls


class MtpLayer(nnx.Module):
    """transformers' generic MTP layer: `enorm`, `hnorm`, `eh_proj` (no bias), the decoder layer `mtp_block` and,
    with `post_norm`, a post-norm of its own (else the model passes its own to `MtpStack.step`)."""

    def __init__(self, mtp_block: nnx.Module, make_norm, hidden_size: int, *, post_norm: bool = False, dtype,
                 rngs: nnx.Rngs):
        D = hidden_size
        self.enorm, self.hnorm = make_norm(D, dtype=dtype, rngs=rngs), make_norm(D, dtype=dtype, rngs=rngs)
        self.eh_proj = Linear((2 * D,), (D,), (None, "embed"), dtype=dtype, rngs=rngs)
        self.mtp_block = mtp_block
        self.post_norm = make_norm(D, dtype=dtype, rngs=rngs) if post_norm else None


class MtpStack(nnx.Module):
    """transformers' `MtpModel` layers (`layers.{i}`): h' = post_norm(mtp_block(eh_proj([enorm(e) ; hnorm(h)]))),
    the head reading h' and the next layer taking it. A layer without a post-norm of its own takes the model's, passed
    to `step` (ERNIE 4.5's is the model's final norm, shared)."""

    def __init__(self, layers: list[MtpLayer]):
        self.layers = nnx.List(layers)

    def __len__(self) -> int:
        return len(self.layers)

    def step(self, index: int, embeds: jax.Array, hidden: jax.Array, positions: jax.Array, rope_tables: dict,
             cache=None, *, post_norm=None):
        """embeds, hidden [B, T, D] -> (post-normed h' [B, T, D], cache)."""
        m = self.layers[index]
        x = m.eh_proj(jnp.concatenate([m.enorm(embeds), m.hnorm(hidden.astype(embeds.dtype))], axis=-1))
        h, cache = m.mtp_block(x, positions, rope_tables, cache)
        return (m.post_norm if m.post_norm is not None else post_norm)(h), cache

    def head_input(self, index: int, h: jax.Array) -> jax.Array:
        return h  # normed in `step`

    def chained(self, index: int, h: jax.Array) -> jax.Array:
        return h

    def op_calls(self, index: int) -> list[OpCall]:
        m = self.layers[index]
        own = m.post_norm.op_calls() if m.post_norm is not None else []
        return m.mtp_block.op_calls() + m.enorm.op_calls() + m.hnorm.op_calls() + own


class StreamLayer(nnx.Module):
    """One DeepSeek-V4 MTP layer: `enorm`, `hnorm`, `e_proj`, `h_proj` (no bias), the hyper-connected decoder layer
    `decoder`, and the head's `hc_head` (its own `HyperHead`) and `norm`."""

    def __init__(self, decoder: nnx.Module, make_norm, hidden_size: int, streams: int, *, norm_eps: float,
                 hc_eps: float, dtype, rngs: nnx.Rngs):
        D = hidden_size
        self.decoder = decoder
        self.enorm, self.hnorm = make_norm(D, dtype=dtype, rngs=rngs), make_norm(D, dtype=dtype, rngs=rngs)
        self.e_proj = Linear((D,), (D,), (None, "embed"), dtype=dtype, rngs=rngs)
        self.h_proj = Linear((D,), (D,), (None, "embed"), dtype=dtype, rngs=rngs)
        self.hc_head = HyperHead(D, streams, norm_eps=norm_eps, eps=hc_eps, rngs=rngs)
        self.norm = make_norm(D, dtype=dtype, rngs=rngs)


class StreamMTP(nnx.Module):
    """DeepSeek-V4's MTP layers (`layers.{i}`, stored as `mtp.{i}.`) over n streams: the hidden state they take and
    give is the streams flattened, [B, T, n D]."""

    def __init__(self, layers: list[StreamLayer], streams: int):
        self.layers = nnx.List(layers)
        self.streams = streams

    def __len__(self) -> int:
        return len(self.layers)

    def _split(self, h: jax.Array) -> jax.Array:
        return h.reshape(*h.shape[:-1], self.streams, h.shape[-1] // self.streams)

    def step(self, index: int, embeds: jax.Array, hidden: jax.Array, positions: jax.Array, rope_tables: dict,
             cache=None, *, tokens: jax.Array):
        """embeds [B, T, D] (the plain embeddings of `tokens`), hidden [B, T, n D] -> (h' [B, T, n D], cache)."""
        m = self.layers[index]
        x = m.e_proj(m.enorm(embeds))[:, :, None, :] + m.h_proj(m.hnorm(self._split(hidden).astype(embeds.dtype)))
        y, cache, _ = m.decoder(x, positions, rope_tables, cache, HyperCarry(tokens))
        return y.reshape(hidden.shape), cache

    def head_input(self, index: int, h: jax.Array) -> jax.Array:
        """h' [..., n D] -> the head's input [..., D]."""
        m = self.layers[index]
        x = self._split(h)
        flat = m.hc_head(x.reshape(-1, 1, *x.shape[-2:]))  # the hyper head takes [B, T, n, D]
        return m.norm(flat.reshape(*x.shape[:-2], x.shape[-1]))

    def chained(self, index: int, h: jax.Array) -> jax.Array:
        """What the next MTP step takes: the streams themselves."""
        return h

    def op_calls(self, index: int) -> list[OpCall]:
        m = self.layers[index]
        return m.decoder.op_calls() + m.enorm.op_calls() + m.hnorm.op_calls() + m.norm.op_calls()
