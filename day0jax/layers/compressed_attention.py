"""DeepSeek-V4's attention: one shared key-value head over a sliding window of uncompressed keys, plus compressed
entries of the whole context (`kernels_pallas.compressed_attention`), with attention sinks and a grouped low-rank
output projection.

Per layer kind: "sliding_attention" attends over its window alone; "heavily_compressed_attention" (HCA) also over
every entry of a `Compressor` that pools each block of m' tokens (`kernels_pallas.kv_compress`); and
"compressed_sparse_attention" (CSA) over the top-k entries of a lightning `Indexer`, whose own compressor pools the
same overlapping windows (2m tokens at a stride of m) into small index keys. Queries come from a low-rank
projection (q_a_proj, q_a_norm, q_b_proj, then an RMS norm per head without weight); the key is also the value, so
its rotated tail (RoPE on the last P dims, interleaved pairs) is rotated back on the output at the query's position
before `o_a_proj` (per group of heads, to a rank each) and `o_b_proj` mix the heads.

Layout: the rotated tails are kept de-interleaved (evens, then odds) in queries, keys and entries alike, so every dot
product is HF's; the output's tail is re-interleaved before the output projection, which sees HF's layout.

The engine's cache for a compressed layer (`engine.compressed_cache.CompressedCache`) holds the window's keys in a
ring, the entries in pages (one entry per m positions, beside the page pool), and per sequence the projections of
the tokens whose window has not closed yet; a prefill chunk or decode step extends that buffer, pools the windows
that close in it, stores them, and attends. Without a cache (a whole sequence at once) the same code runs over the
call's own tokens. Letters: B, T, D, N, H as everywhere; P rotated dims, m positions per entry, C entries, I indexer
heads, Di their dims, G output groups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.layers.linear import Linear, param
from day0jax.layers.norms import RMSNorm
from day0jax.layers.rope import Rope
from kernels_pallas.calls import OpCall
from kernels_pallas.compressed_attention import api as compressed_op
from kernels_pallas.kv_compress import api as compress_op
from kernels_pallas.sparse_attention import api as sparse_op


def rms(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis, no weight (HF's `UnweightedRMSNorm`), in float32."""
    h = x.astype(jnp.float32)
    return (h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def rotate_tail(x: jax.Array, rope: Rope, cos: jax.Array, sin: jax.Array, inverse: bool = False) -> jax.Array:
    """x [B, T, heads, H] with its last P = rope.rotary_dim dims, HF's interleaved pairs, rotated at the positions of
    cos, sin [B, T, P] and left de-interleaved (evens, then odds); `inverse`: a tail already de-interleaved (the
    attention's output) rotated back, by minus the angle."""
    P = rope.rotary_dim
    tail = x[..., -P:]
    if not inverse:
        tail = jnp.concatenate([tail[..., 0::2], tail[..., 1::2]], axis=-1)
    tail = rope.apply(tail, cos, -sin if inverse else sin)
    return jnp.concatenate([x[..., :-P], tail], axis=-1) if P < x.shape[-1] else tail


def interleave_tail(x: jax.Array, P: int) -> jax.Array:
    """The inverse of `rotate_tail`'s layout change: the last P dims (evens, then odds) back to interleaved pairs."""
    tail = x[..., -P:]
    tail = jnp.stack([tail[..., :P // 2], tail[..., P // 2:]], axis=-1).reshape(tail.shape)
    return jnp.concatenate([x[..., :-P], tail], axis=-1) if P < x.shape[-1] else tail


class GroupedLinear(nnx.Module):
    """A block-diagonal map: each of G groups of the input (N H / G dims each) to `rank` outputs of its own
    (DeepSeek-V4's `o_a_proj`). kernel [G, rank, I] is HF's weight [G rank, I]; the groups split like the heads."""

    def __init__(self, groups: int, in_per_group: int, rank: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.kernel = param(rngs, (groups, rank, in_per_group), ("heads", None, None), dtype,
                            in_per_group ** -0.5, in_ndim=1)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [B, T, G, I] -> [B, T, G, rank]."""
        return jnp.einsum("btgi,gri->btgr", x, self.kernel[...])


class Compressor(nnx.Module):
    """Pools each window of `ratio` tokens into one entry (HF's compressor): kv_proj and gate_proj D -> F,
    position_bias [m, F] (float32), kv_norm over the entry's `dim`; F = 2 dim with `overlap` (CSA's windows of 2m at
    a stride of m), else dim. An entry is normed, then rotated at its first position, c m."""

    def __init__(self, hidden_size: int, dim: int, ratio: int, *, overlap: bool, eps: float, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        F = 2 * dim if overlap else dim
        self.kv_proj = Linear((hidden_size,), (F,), ("embed", None), dtype=dtype, rngs=rngs)
        self.gate_proj = Linear((hidden_size,), (F,), ("embed", None), dtype=dtype, rngs=rngs)
        self.position_bias = param(rngs, (ratio, F), (None, None), jnp.float32, 0.0)
        self.kv_norm = RMSNorm(dim, eps, dtype=dtype, rngs=rngs)
        self.ratio, self.overlap, self.dim = ratio, overlap, dim

    @property
    def buffer(self) -> int:
        """Tokens whose projections a sequence keeps between steps: the windows a step may still close need them
        (the one its first token is in; with overlap, the one before it too)."""
        return (2 if self.overlap else 1) * self.ratio

    def project(self, x: jax.Array) -> jax.Array:
        """x [B, T, D] -> each token's [kv ; gate] projections [B, T, 2F]."""
        return jnp.concatenate([self.kv_proj(x), self.gate_proj(x)], axis=-1)

    def entries(self, ext: jax.Array, ext_start: jax.Array, first: jax.Array, count: int, end: jax.Array,
                rope: Rope) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The entries of windows first .. first + count - 1.

        Args:
            ext: [B, S, 2F] projections of consecutive positions ext_start .. ext_start + S - 1 ([B]).
            first: [B] the first window's index; count: windows (static).
            end: [B] the first position not yet known: a window is complete once it lies before it.
            rope: the compressed branch's RoPE.
        Returns:
            (entries [B, count, dim], rotated; their indices [B, count]; which are complete [B, count] bool).
        """
        m, o = self.ratio, int(self.overlap)
        B, S, F2 = ext.shape
        windows = first[:, None] - o + jnp.arange(count + o)[None, :]  # [B, W]
        pos = windows[:, :, None] * m + jnp.arange(m)[None, None, :]  # [B, W, m]
        idx = pos - ext_start[:, None, None]
        valid = (pos >= 0) & (idx >= 0) & (idx < S) & (pos < end[:, None, None])
        rows = jnp.take_along_axis(ext, jnp.clip(idx, 0, S - 1).reshape(B, -1, 1), axis=1)
        rows = rows.reshape(B, count + o, m, F2)
        F = F2 // 2
        pooled = compress_op.kv_compress(rows[..., :F], rows[..., F:], self.position_bias[...], overlap=self.overlap,
                                          valid=valid)
        ids = first[:, None] + jnp.arange(count)[None, :]
        cos, sin = rope.cos_sin(ids * m)
        out = rotate_tail(self.kv_norm(pooled)[:, :, None, :], rope, cos, sin)[:, :, 0]
        return out, ids, (ids + 1) * m <= end[:, None]

    def op_calls(self) -> list[OpCall]:
        return [OpCall.of("kv_compress", Dh=self.dim, m=self.ratio, overlap=self.overlap), *self.kv_norm.op_calls()]


class IndexScorer(nnx.Module):
    """The indexer heads' weights per token: weights_proj D -> I (HF's `scorer`)."""

    def __init__(self, hidden_size: int, heads: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.weights_proj = Linear((hidden_size,), (heads,), ("embed", None), dtype=dtype, rngs=rngs)


class Indexer(Compressor):
    """CSA's lightning indexer: a `Compressor` of its own (overlapping windows, entries of Di dims: the index keys),
    queries q_b_proj(q_resid) [I, Di] rotated at the token's position, and a weight per head; the score of an entry
    is sum_i w_i relu(q_i . k) Di^-0.5, w_i = weights_proj(x)_i I^-0.5."""

    def __init__(self, hidden_size: int, q_lora_rank: int, heads: int, dim: int, ratio: int, topk: int, *,
                 eps: float, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(hidden_size, dim, ratio, overlap=True, eps=eps, dtype=dtype, rngs=rngs)
        # Small heads every query head's rank needs whole: never split.
        self.q_b_proj = Linear((q_lora_rank,), (heads, dim), ("q_lora", None, None), dtype=dtype, rngs=rngs)
        self.scorer = IndexScorer(hidden_size, heads, dtype=dtype, rngs=rngs)
        self.heads, self.topk = heads, topk

    def queries(self, x: jax.Array, q_resid: jax.Array, rope: Rope, cos_sin) -> tuple[jax.Array, jax.Array]:
        """(index queries [B, T, I, Di] rotated, head weights [B, T, I] float32)."""
        q = rotate_tail(self.q_b_proj(q_resid), rope, *cos_sin)
        return q, self.scorer.weights_proj(x).astype(jnp.float32) * self.heads ** -0.5

    @property
    def scale(self) -> float:
        return self.dim ** -0.5


class CompressedAttention(nnx.Module):
    """DeepSeek-V4's attention (module docstring). Args: hidden_size D; num_heads N; head_dim H (also the entries');
    q_lora_rank; o_groups G and o_lora_rank; window (`sliding_window`); rope (this layer's: "main" for sliding
    layers, "compress" for the others) and compress_rope (the entries' and the indexer's); eps (every norm's:
    `rms_norm_eps`); compressor: None (sliding), a `Compressor` (HCA) or one with an `indexer` (CSA)."""

    def __init__(self, *, hidden_size: int, num_heads: int, head_dim: int, q_lora_rank: int, o_groups: int,
                 o_lora_rank: int, window: int, rope: Rope, compress_rope: Rope, eps: float,
                 compressor: Compressor | None = None, dtype=jnp.float32, rngs: nnx.Rngs):
        D, N, H, G = hidden_size, num_heads, head_dim, o_groups
        self.q_a_proj = Linear((D,), (q_lora_rank,), ("embed", "q_lora"), dtype=dtype, rngs=rngs)
        self.q_a_norm = RMSNorm(q_lora_rank, eps, dtype=dtype, rngs=rngs)
        self.q_b_proj = Linear((q_lora_rank,), (N, H), ("q_lora", "heads", "head_dim"), dtype=dtype, rngs=rngs)
        self.kv_proj = Linear((D,), (H,), ("embed", "kv_lora"), dtype=dtype, rngs=rngs)
        self.kv_norm = RMSNorm(H, eps, dtype=dtype, rngs=rngs)
        self.o_a_proj = GroupedLinear(G, N * H // G, o_lora_rank, dtype=dtype, rngs=rngs)
        self.o_b_proj = Linear((G, o_lora_rank), (D,), ("heads", None, "embed"), dtype=dtype, rngs=rngs)
        self.sinks = param(rngs, (N,), ("heads",), jnp.float32, 0.0)
        self.compressor = compressor
        self.rope, self.compress_rope, self.eps = rope, compress_rope, eps
        self.sliding_window, self.num_heads, self.head_dim = window, N, H
        self.scale = H ** -0.5

    @property
    def indexer(self) -> Indexer | None:
        return getattr(self.compressor, "indexer", None) if self.compressor is not None else None

    @property
    def ratio(self) -> int:
        return self.compressor.ratio if self.compressor is not None else 0

    def __call__(self, x: jax.Array, positions: jax.Array, rope_tables, cache=None):
        """x [B, T, D], positions [B, T] -> ([B, T, D], updated cache)."""
        B, T, _ = x.shape
        cos_sin = rope_tables[self.rope]
        q_resid = self.q_a_norm(self.q_a_proj(x))
        q = rotate_tail(rms(self.q_b_proj(q_resid), self.eps), self.rope, *cos_sin)  # [B, T, N, H]
        key = rotate_tail(self.kv_norm(self.kv_proj(x))[:, :, None, :], self.rope, *cos_sin)  # [B, T, 1, H]
        kwargs = dict(window=self.sliding_window, ratio=max(self.ratio, 1), sinks=self.sinks[...], scale=self.scale)
        if cache is not None:
            cache = cache.update(key, key[..., :0], positions)  # one head that is key and value: no value pool
        entries = indices = None
        if self.compressor is not None:
            cache, entries, indices = self._compress(x, q_resid, positions, rope_tables, cache)
        if cache is None:
            out = compressed_op.compressed_attention(q, key[:, :, 0], entries, indices, q_positions=positions,
                                                     **kwargs)
        else:
            out = cache.attend_compressed(q, positions, indices, **kwargs)
        out = interleave_tail(rotate_tail(out, self.rope, *cos_sin, inverse=True), self.rope.rotary_dim)
        G = self.o_a_proj.kernel.shape[0]
        return self.o_b_proj(self.o_a_proj(out.reshape(B, T, G, -1))), cache

    def _compress(self, x, q_resid, positions, rope_tables, cache):
        """This call's entries (cache-less: [B, C, H] or None for fewer than m tokens) or the cache with them stored,
        and the indexer's choice [B, T, Kt] (None: every entry)."""
        T, m, rope = x.shape[1], self.ratio, self.compress_rope
        start = positions[:, 0]
        parts = [self.compressor] + ([self.indexer] if self.indexer is not None else [])
        stored = []
        for i, part in enumerate(parts):
            proj = part.project(x)
            if cache is None:
                if T < m:
                    return None, None, None
                zeros = jnp.zeros_like(start)
                stored.append(part.entries(proj, zeros, zeros, T // m, zeros + T, rope)[0])
            else:
                cache, ext = cache.extend(i, proj)
                entries, ids, complete = part.entries(ext, start - part.buffer, start // m, T // m + 1,
                                                      cache.kv_lengths, rope)
                cache = cache.store(i, entries, ids, complete)
        indices = None
        if self.indexer is not None:
            q, weights = self.indexer.queries(x, q_resid, rope, rope_tables[rope])
            last = compressed_op.entry_positions(positions, m)
            if cache is None:
                keys = stored[1]
                indices = sparse_op.index_topk(q, keys, weights, topk=min(self.indexer.topk, keys.shape[1]),
                                               scale=self.indexer.scale, q_positions=last)
            else:
                indices = cache.index_topk(q, weights, last, topk=self.indexer.topk, scale=self.indexer.scale)
        return cache, (stored[0] if cache is None else None), indices

    def op_calls(self) -> list[OpCall]:
        idx = self.indexer
        call = OpCall.of("compressed_attention", N=self.num_heads, H=self.head_dim, window=self.sliding_window,
                         ratio=self.ratio, topk=idx.topk if idx is not None else None,
                         I=idx.heads if idx is not None else None, Di=idx.dim if idx is not None else None,
                         sinks=True, scale=self.scale)
        norms = self.q_a_norm.op_calls() + self.kv_norm.op_calls()
        parts = [] if self.compressor is None else self.compressor.op_calls() + (idx.op_calls() if idx else [])
        ropes = [self.rope.op_call()] + ([self.compress_rope.op_call()] if self.compressor is not None
                                         and self.compress_rope is not self.rope else [])
        return [call, *parts, *norms, *ropes]
