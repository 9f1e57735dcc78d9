"""Block-sparse attention (MiniMax-M3): grouped-query attention whose queries each attend over the key blocks a
lightning indexer keeps (`kernels_pallas/block_sparse_attention`). The indexer has small heads of its own, one per
KV group (q_proj [I, Di]), and one key head (k_proj [Di]), each through a (1 + weight) RMSNorm and rotated like the
main heads; it has no value and no output of its own. The engine caches its keys beside the layer's keys and values
(`PagedKVCache.index_pages`). GLM-5-Next's layers are MLA over the blocks a pooled indexer keeps (`PooledIndexer`,
`PooledSparseMLAttention`), Qwen4-Exp's gated attention over the blocks its QSA indexer keeps by mean-pooled keys
(`QSAIndexer`, `QSAAttention`): the same attention over kept blocks, other choices of them. Letters: see
`Attention`; I indexer heads, Di their dims.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.layers.attention import Attention
from day0jax.layers.linear import Linear, param, project_together
from day0jax.layers.mla import MLAttention
from day0jax.layers.norms import RMSNorm
from day0jax.layers.rope import Rope
from day0jax.layers.sparse_mla import Indexer
from kernels_pallas.block_sparse_attention import api as block_op
from kernels_pallas.calls import OpCall


class BlockIndexer(nnx.Module):
    """The lightning indexer: queries [B, T, I, Di] and keys [B, T, Di] from the layer's input. Args: hidden_size D,
    n_heads I, head_dim Di, eps and norm_offset of its q/k norms."""

    def __init__(self, *, hidden_size: int, n_heads: int, head_dim: int, eps: float, norm_offset: float = 1.0,
                 dtype, rngs: nnx.Rngs):
        D, I, Di = hidden_size, n_heads, head_dim
        # Small heads, shared by every query head of a group: kept whole on every tensor-parallel rank.
        self.q_proj = Linear((D,), (I, Di), ("embed", None, None), dtype=dtype, rngs=rngs)
        self.k_proj = Linear((D,), (Di,), ("embed", None), dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(Di, eps, offset=norm_offset, dtype=dtype, rngs=rngs)
        self.k_norm = RMSNorm(Di, eps, offset=norm_offset, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, rope: Rope | None, rope_tables) -> tuple[jax.Array, jax.Array]:
        q, k = project_together(x, (self.q_proj, self.k_proj))
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is None:
            return q, k
        cos, sin = rope_tables[rope]
        # The first rotary_dim of the Di dims turn with the main heads' frequencies, as HF slices its cos/sin.
        return rope.apply(q, cos, sin), rope.apply(k[:, :, None], cos, sin)[:, :, 0]


class BlockSparseAttention(Attention):
    """`Attention` (its arguments in `attention_kwargs`) over the key blocks its `indexer` keeps: blocks of
    `block_size` positions, the `topk_blocks` best per query and indexer head, the `local_blocks` at and before the
    query's own block always among them."""

    def __init__(self, *, indexer: BlockIndexer, block_size: int, topk_blocks: int, local_blocks: int,
                 **attention_kwargs):
        super().__init__(**attention_kwargs)
        assert self.sinks is None and self.gate is None and not self.output_gate and self.sliding_window is None
        self.indexer = indexer
        self.block_size, self.topk_blocks, self.local_blocks = block_size, topk_blocks, local_blocks

    def __call__(self, x: jax.Array, positions: jax.Array, rope_tables, cache=None):
        """x [B, T, D], positions [B, T] -> ([B, T, D], updated cache)."""
        q, k, v = project_together(x, (self.q_proj, self.k_proj, self.v_proj))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            cos, sin = rope_tables[self.rope]
            q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
        iq, ik = self.indexer(x, self.rope, rope_tables)
        blocks = dict(block_size=self.block_size, topk_blocks=self.topk_blocks, local_blocks=self.local_blocks)
        if cache is None:
            out = block_op.indexed_block_sparse_attention(q, k, v, iq, ik, q_positions=positions, scale=self.scale,
                                                          **blocks)
        else:
            cache = cache.update(k, v, positions)
            cache, out = cache.attend_block_sparse(q, positions, iq, ik, scale=self.scale, **blocks)
        return self.o_proj(out), cache

    def op_calls(self) -> list[OpCall]:
        call = OpCall.of("block_sparse_attention", N=self.q_proj.out_shape[0], K=self.k_proj.out_shape[0],
                         H=self.head_dim, scale=self.scale, I=self.indexer.q_proj.out_shape[0],
                         Di=self.indexer.k_proj.out_shape[0], block=self.block_size, topk=self.topk_blocks,
                         local=self.local_blocks)
        calls = [call]
        if self.q_norm is not None:
            calls += self.q_norm.op_calls() + self.k_norm.op_calls()
        calls += self.indexer.q_norm.op_calls() + self.indexer.k_norm.op_calls()
        return calls + [self.rope.op_call() if self.rope is not None else OpCall.of("rope", kind=None)]


class PooledIndexer(Indexer):
    """GLM-5-Next's indexer: DeepSeek's lightning indexer (queries from MLA's low-rank query, one LayerNorm'd key per
    token, per-head weights; no RoPE) scoring blocks of `block_size` tokens through one pooled key each. A block's
    key is the average of its tokens' keys weighted, per channel, by a softmax over the block of
    `index_kpool_compress_gate` @ x + `index_kpool_compress_ape` (HF's names; gate [Di, D], ape [block, Di]). The
    engine caches [key ; pooling logits] per token (index_dim 2 Di)."""

    def __init__(self, *, block_size: int, **indexer_kwargs):
        super().__init__(rope_dim=0, rope_interleave=False, **indexer_kwargs)
        D, Di = indexer_kwargs["hidden_size"], indexer_kwargs["head_dim"]
        dtype, rngs = indexer_kwargs.get("dtype", jnp.float32), indexer_kwargs["rngs"]
        self.index_kpool_compress_ape = param(rngs, (block_size, Di), (None, None), dtype, 0.5)
        self.index_kpool_compress_gate = param(rngs, (Di, D), (None, "embed"), dtype, D ** -0.5)

    def packed(self, x: jax.Array, q_resid: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(queries [B, T, I, Di], head weights [B, T, I], [key ; pooling logits] [B, T, 2 Di])."""
        q, k, weights = self.queries_keys(x, q_resid, None, None)
        gate = jnp.einsum("btd,kd->btk", x, self.index_kpool_compress_gate[...].astype(x.dtype))
        return q, weights, jnp.concatenate([k, gate.astype(k.dtype)], axis=-1)


class PooledSparseMLAttention(MLAttention):
    """MLA (`layers/mla.py`) over the key blocks a `PooledIndexer` keeps (`kernels_pallas.block_sparse_attention`'s
    `pooled_block_select`): the `topk_blocks` best complete blocks of `block_size` keys a query sees whole, plus its
    own incomplete block. Without an indexer the layer reuses the blocks of the layer before it (GLM-5-Next's
    "shared" layers). Other arguments as `MLAttention`."""

    def __init__(self, *, indexer: PooledIndexer | None, block_size: int, topk_blocks: int, **mla_kwargs):
        super().__init__(**mla_kwargs)
        self.indexer, self.block_size, self.topk_blocks = indexer, block_size, topk_blocks

    def __call__(self, x: jax.Array, positions: jax.Array, rope_tables, cache=None):
        out, cache, _ = self.run(x, positions, rope_tables, cache)
        return out, cache

    def run(self, x: jax.Array, positions: jax.Array, rope_tables, cache=None, shared_kept=None):
        """x [B, T, D], positions [B, T], the previous layer's kept blocks (for a layer without an indexer) ->
        ([B, T, D], updated cache, this layer's kept blocks [B, 1, T, Nb])."""
        query, key, q_resid = self.project(x, rope_tables)
        if cache is not None:
            cache = cache.update(key, key, positions)
        kept = shared_kept
        if self.indexer is not None:
            iq, weights, packed = self.indexer.packed(x, q_resid)
            select = dict(block_size=self.block_size, topk_blocks=self.topk_blocks, scale=self.indexer.scale)
            ape = self.indexer.index_kpool_compress_ape[...]
            if cache is None:
                Di = packed.shape[-1] // 2
                kept = block_op.pooled_block_select(iq, weights, packed[..., :Di], packed[..., Di:], ape,
                                                    q_positions=positions, **select)
            else:
                cache, kept = cache.pooled_blocks(packed, positions, iq, weights, ape, **select)
        if cache is None:
            out = block_op.block_sparse_attention(query, key, key, kept, block_size=self.block_size,
                                                  q_positions=positions, scale=self.scale)
        else:
            # Kept: the top-k complete blocks and the query's own incomplete one.
            out = cache.attend_blocks(query, positions, kept, block_size=self.block_size,
                                      most_blocks=self.topk_blocks + 1, scale=self.scale)
        return self.output(out), cache, kept

    def op_calls(self) -> list[OpCall]:
        R, P, _, _ = self.dims
        indexer = self.indexer
        # The engine's op over the kept blocks (the selection runs beside it, in the same program).
        call = OpCall.of("block_sparse_attention", N=self.kv_b_proj.out_shape[0], K=1, H=R + P, scale=self.scale,
                         I=None if indexer is None else indexer.wq_b.out_shape[0],
                         Di=None if indexer is None else indexer.wk.out_shape[0], block=self.block_size,
                         topk=self.topk_blocks, local=1, pool="learned", indexer=indexer is not None)
        return [call, *self.norm_and_rope_calls()]


class QSAIndexer(nnx.Module):
    """Qwen4-Exp's QSA indexer: queries [B, T, I, Di] and raw keys [B, T, Di] from one projection
    (`index_qk_proj` [(I + 1) Di, D]), the queries through a (1 + weight) RMSNorm and rotated; the keys are
    normalized and rotated only once mean-pooled into blocks (`block_keys`)."""

    def __init__(self, *, hidden_size: int, n_heads: int, head_dim: int, eps: float, dtype, rngs: nnx.Rngs):
        D, I, Di = hidden_size, n_heads, head_dim
        self.index_qk_proj = Linear((D,), ((I + 1) * Di,), ("embed", None), dtype=dtype, rngs=rngs)
        self.q_layernorm = RMSNorm(Di, eps, offset=1.0, dtype=dtype, rngs=rngs)
        self.k_layernorm = RMSNorm(Di, eps, offset=1.0, dtype=dtype, rngs=rngs)
        self.n_heads, self.head_dim = I, Di

    def __call__(self, x: jax.Array, rope: Rope, rope_tables) -> tuple[jax.Array, jax.Array]:
        qk = self.index_qk_proj(x)
        I, Di = self.n_heads, self.head_dim
        q = self.q_layernorm(qk[..., :I * Di].reshape(*x.shape[:2], I, Di))
        cos, sin = rope_tables[rope]
        return rope.apply(q, cos, sin), qk[..., I * Di:]

    def block_keys(self, keys: jax.Array, block_size: int, rope: Rope) -> jax.Array:
        """Raw keys [B, S, Di] -> the keys of the S // block_size complete blocks: mean, norm, rotated at each
        block's first position (as transformers does)."""
        pooled = self.k_layernorm(block_op.mean_pool(keys, block_size))
        starts = jnp.broadcast_to(jnp.arange(pooled.shape[1], dtype=jnp.int32) * block_size, pooled.shape[:2])
        cos, sin = rope.cos_sin(starts, None)
        return rope.apply(pooled[:, :, None], cos, sin)[:, :, 0]


class QSAAttention(Attention):
    """`Attention` (gated, q/k normed: its arguments in `attention_kwargs`) over the tokens Qwen4-Exp's QSA indexer
    keeps: per query, the `budget // block_size` complete blocks of mean-pooled keys that score best, plus the
    tokens of its own partly seen block (`block_sparse_attention`'s "mean" pooling). Among blocks of equal score
    (relu makes exact zeros common: a block every indexer head scores negative) the first are kept, where
    transformers keeps whichever torch.topk's tie order gives."""

    def __init__(self, *, indexer: QSAIndexer, block_size: int, budget: int, **attention_kwargs):
        super().__init__(**attention_kwargs)
        assert self.sinks is None and self.gate is None and self.sliding_window is None
        self.indexer = indexer
        self.block_size, self.topk_blocks = block_size, budget // block_size

    def __call__(self, x: jax.Array, positions: jax.Array, rope_tables, cache=None):
        """x [B, T, D], positions [B, T] -> ([B, T, D], updated cache)."""
        q, k, v = project_together(x, (self.q_proj, self.k_proj, self.v_proj))
        q, gate = q[..., :self.head_dim], q[..., self.head_dim:]
        q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_tables[self.rope]
        q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
        iq, ik = self.indexer(x, self.rope, rope_tables)
        blocks = dict(block_size=self.block_size, topk_blocks=self.topk_blocks, local_blocks=0)
        pool = lambda keys: self.indexer.block_keys(keys, self.block_size, self.rope)  # noqa: E731
        if cache is None:
            out = block_op.indexed_block_sparse_attention(q, k, v, iq, pool(ik), q_positions=positions,
                                                          scale=self.scale, pool="mean", **blocks)
        else:
            cache = cache.update(k, v, positions)
            cache, out = cache.attend_block_sparse(q, positions, iq, ik, scale=self.scale, block_keys=pool,
                                                   **blocks)
        out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
        return self.o_proj(out), cache

    def op_calls(self) -> list[OpCall]:
        call = OpCall.of("block_sparse_attention", N=self.q_proj.out_shape[0], K=self.k_proj.out_shape[0],
                         H=self.head_dim, scale=self.scale, I=self.indexer.n_heads, Di=self.indexer.head_dim,
                         block=self.block_size, topk=self.topk_blocks, local=0, pool="mean")
        return ([call] + self.q_norm.op_calls() + self.k_norm.op_calls() + self.indexer.q_layernorm.op_calls()
                + self.indexer.k_layernorm.op_calls() + [self.rope.op_call()])
