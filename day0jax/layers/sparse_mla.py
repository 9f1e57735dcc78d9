"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): multi-head latent attention (`layers/mla.py`) restricted, per
query, to the top-k keys a lightning indexer picks.

The indexer has its own small heads: queries from MLA's low-rank query (wq_b), one key per token from the hidden
state (wk, then a LayerNorm), both with RoPE on their first P dims, and per-head weights (weights_proj); its score
of a key is sum_i w_i * relu(q_i . k / sqrt(Di)). The engine caches its keys beside the latent
(`PagedKVCache.index_topk`). A layer may instead reuse the top-k of the layer before it (GLM-5's shared layers,
which have no indexer). Letters: see `MLAttention`; I indexer heads, Di their dims.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.layers.linear import Linear
from day0jax.layers.mla import MLAttention
from day0jax.layers.norms import LayerNorm
from kernels_pallas.calls import OpCall
from kernels_pallas.sparse_attention import api as sparse_op


class Indexer(nnx.Module):
    """The lightning indexer. Args: hidden_size D; q_lora_rank; n_heads I; head_dim Di; rope_dim P (the rotated
    leading dims); rope_interleave: HF rotates interleaved pairs (GLM-5) rather than the half-split layout
    (DeepSeek-V3.2)."""

    def __init__(self, *, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, rope_dim: int,
                 rope_interleave: bool, dtype=jnp.float32, rngs: nnx.Rngs):
        D, I, Di = hidden_size, n_heads, head_dim
        # Small heads shared by every query head: kept whole on every tensor-parallel rank.
        self.wq_b = Linear((q_lora_rank,), (I, Di), ("q_lora", None, None), dtype=dtype, rngs=rngs)
        self.wk = Linear((D,), (Di,), ("embed", None), dtype=dtype, rngs=rngs)
        self.k_norm = LayerNorm(Di, 1e-6, dtype=dtype, rngs=rngs)
        self.weights_proj = Linear((D,), (I,), ("embed", None), dtype=dtype, rngs=rngs)
        self.rope_dim, self.rope_interleave = rope_dim, rope_interleave

    def queries_keys(self, x: jax.Array, q_resid: jax.Array, rope, rope_tables) -> tuple[jax.Array, ...]:
        """Index queries [B, T, I, Di], keys [B, T, Di] and head weights [B, T, I] (float32)."""
        q, k = self.wq_b(q_resid), self.k_norm(self.wk(x))
        P = self.rope_dim
        q_rot, k_rot = q[..., :P], k[..., None, :P]
        if self.rope_interleave:  # q and k permuted alike: the scores, all they are used for, are unchanged
            q_rot, k_rot = MLAttention._deinterleave(q_rot), MLAttention._deinterleave(k_rot)
        cos, sin = rope_tables[rope]
        q = jnp.concatenate([rope.apply(q_rot, cos, sin), q[..., P:]], axis=-1)
        k = jnp.concatenate([rope.apply(k_rot, cos, sin)[:, :, 0], k[..., P:]], axis=-1)
        I = q.shape[-2]
        weights = self.weights_proj(x).astype(jnp.float32) * I ** -0.5
        return q, k, weights

    @property
    def scale(self) -> float:
        return self.wk.out_shape[0] ** -0.5


class SparseMLAttention(MLAttention):
    """MLA over the top-k keys of its `indexer`, or, without one, of the layer before it (GLM-5's shared layers);
    `topk` keys per query; other arguments as `MLAttention` (with a low-rank query)."""

    def __init__(self, *, indexer: Indexer | None, topk: int, **mla_kwargs):
        super().__init__(**mla_kwargs)
        self.indexer, self.topk = indexer, topk

    def __call__(self, x: jax.Array, positions: jax.Array, rope_tables, cache=None):
        """x [B, T, D], positions [B, T] -> ([B, T, D], updated cache)."""
        out, cache, _ = self.run(x, positions, rope_tables, cache)
        return out, cache

    def run(self, x: jax.Array, positions: jax.Array, rope_tables, cache=None, shared_topk=None):
        """As `__call__`, also taking the previous layer's top-k (for a layer without an indexer) and returning
        this layer's ([B, T, Kt] positions)."""
        query, key, q_resid = self.project(x, rope_tables)
        if cache is not None:
            cache = cache.update(key, key, positions)
        if self.indexer is None:
            indices = shared_topk
        else:
            q, k, weights = self.indexer.queries_keys(x, q_resid, self.rope, rope_tables)
            if cache is None:
                indices = sparse_op.index_topk(q, k, weights, topk=self.topk, scale=self.indexer.scale,
                                               q_positions=positions)
            else:
                cache, indices = cache.index_topk(k, q, weights, positions, topk=self.topk, scale=self.indexer.scale)
        if cache is None:
            out = sparse_op.sparse_attention(query, key, key, indices, q_positions=positions, scale=self.scale)
        else:
            out = cache.attend_sparse(query, positions, indices, scale=self.scale)
        return self.output(out), cache, indices

    def op_calls(self) -> list[OpCall]:
        R, P, _, _ = self.dims
        indexer = self.indexer
        call = OpCall.of("sparse_attention", N=self.kv_b_proj.out_shape[0], K=1, H=R + P, Hv=R + P,
                         scale=self.scale, latent=True, topk=self.topk,
                         I=None if indexer is None else indexer.wq_b.out_shape[0],
                         Di=None if indexer is None else indexer.wk.out_shape[0], indexer=indexer is not None)
        norms = self.q_a_layernorm.op_calls() + self.kv_a_layernorm.op_calls()
        return [call, *norms, self.rope.op_call()]
