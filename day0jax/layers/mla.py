"""Multi-head latent attention (DeepSeek-V2/V3): low-rank q and kv projections, RoPE on a decoupled slice.

Absorbed form: kv_b_proj's key half W_uk is folded into the query, so attention is multi-query over
[normed latent ; roped key] (one kv head of R + P dims) and the value half W_uv is applied after it. The cache
holds the latent, not per-head keys and values (DeepSeek-V3: 576 numbers per token instead of 128 x 320); the
scores are HF's q_nope . (W_uk latent) + q_rope . k_rope, reassociated. Letters: see `MLAttention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.layers.linear import Linear, param
from day0jax.layers.norms import RMSNorm
from day0jax.layers.rope import Rope
from kernels_pallas.attention import api as attention_op
from kernels_pallas.calls import OpCall


class MLAttention(nnx.Module):
    """Args: hidden_size D; num_heads N; q_lora_rank (None: a plain q_proj); kv_lora_rank R; qk_nope_head_dim C;
    qk_rope_head_dim P; v_head_dim U; rope over P dims, or None for none at all (Kimi Linear's MLA layers are NoPE:
    the P dims of q and k enter the scores unrotated); rope_interleave: the checkpoint's rope dims are
    interleaved pairs (DeepSeek's layout); scale: the softmax scale (HF: (C + P) ** -0.5 times YaRN's mscale^2);
    eps: the latent norms' eps; use_bias: HF's `attention_bias` on q_a_proj, kv_a_proj_with_mqa and o_proj;
    query_scaling: (beta, original_max_position_embeddings), queries times 1 + beta * log(1 + floor(p / original))
    at absolute position p (Mistral 4's Llama-4-style attention temperature for long contexts); softmax_scaling:
    queries times a learned per-head `SoftmaxScaling` of the position (Mistral Large 4); reads_shared: no
    kv_a_proj_with_mqa or kv_a_layernorm, the layer attends over the latent another layer cached (Mistral Large 4's
    KV sharing; `project` then gives no key).
    """

    def __init__(self, *, hidden_size: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, rope: Rope | None,
                 rope_interleave: bool, scale: float, eps: float, use_bias: bool = False,
                 query_scaling: tuple[float, int] | None = None, softmax_scaling: bool = False,
                 reads_shared: bool = False, dtype=jnp.float32, rngs: nnx.Rngs):
        D, N, R, P, C, U = hidden_size, num_heads, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim
        if q_lora_rank is None:
            self.q_proj = Linear((D,), (N, C + P), ("embed", "heads", "head_dim"), dtype=dtype, rngs=rngs)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear((D,), (q_lora_rank,), ("embed", "q_lora"), use_bias=use_bias, dtype=dtype,
                                   rngs=rngs)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps, dtype=dtype, rngs=rngs)
            self.q_b_proj = Linear((q_lora_rank,), (N, C + P), ("q_lora", "heads", "head_dim"), dtype=dtype,
                                   rngs=rngs)
        if reads_shared:
            self.kv_a_proj_with_mqa = self.kv_a_layernorm = None
        else:
            self.kv_a_proj_with_mqa = Linear((D,), (R + P,), ("embed", "kv_lora"), use_bias=use_bias, dtype=dtype,
                                             rngs=rngs)
            self.kv_a_layernorm = RMSNorm(R, eps, dtype=dtype, rngs=rngs)
        self.kv_b_proj = Linear((R,), (N, C + U), ("kv_lora", "heads", "head_dim"), dtype=dtype, rngs=rngs)
        self.kv_b_proj.quantizable = False  # absorbed into the query and output: its kernel is read, not applied
        self.o_proj = Linear((N, U), (D,), ("heads", "head_dim", "embed"), use_bias=use_bias, dtype=dtype, rngs=rngs)
        self.rope, self.rope_interleave, self.scale = rope, rope_interleave, scale
        self.query_scaling = query_scaling
        self.softmax_scaling = SoftmaxScaling(N, dtype=dtype, rngs=rngs) if softmax_scaling else None
        self.dims = (R, P, C, U)

    @staticmethod
    def _deinterleave(x: jax.Array) -> jax.Array:
        # Pairs (x0, x1), (x2, x3)... -> evens then odds: HF's rotate_half layout. q and k are permuted alike,
        # so their dot products (all attention uses them for) are unchanged.
        return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)

    def __call__(self, x: jax.Array, positions: jax.Array, rope_tables, cache=None):
        """x [B, T, D], positions [B, T] -> ([B, T, D], updated cache). The cache holds [B, S, 1, R + P]."""
        query, key, _ = self.project(x, rope_tables)
        query = self.scale_queries(query, positions)
        # The value is the latent: the key itself, whose rope part is sliced off the output below.
        if cache is None:
            out = attention_op.attention(query, key, key, q_positions=positions, scale=self.scale)
        else:
            cache = cache.update(key, key, positions)
            out = cache.attend(query, positions, scale=self.scale)
        return self.output(out), cache

    def project(self, x: jax.Array, rope_tables) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
        """The absorbed query [B, T, N, R + P], the key [B, T, 1, R + P] (also the value; None for a layer that
        `reads_shared`), and the normed low-rank query [B, T, q_lora_rank] (None without one) that a
        sparse-attention indexer reads."""
        R, P, C, U = self.dims
        q_resid = None if self.q_proj is not None else self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(q_resid)
        q_nope, q_rope = q[..., :C], q[..., C:]  # q [B, T, N, C + P]
        w = self.kv_b_proj.kernel[...]  # [N, C + U, R]
        query = jnp.concatenate([jnp.einsum("btnc,ncr->btnr", q_nope, w[:, :C]), self._rotate(q_rope, rope_tables)],
                                axis=-1)  # [B, T, N, R + P]
        if self.kv_a_proj_with_mqa is None:  # the source layer rotated and cached the key
            return query, None, q_resid
        kv = self.kv_a_proj_with_mqa(x)  # [B, T, R + P]
        latent, k_rope = self.kv_a_layernorm(kv[..., :R]), kv[..., None, R:]  # [B, T, R], [B, T, 1, P]
        k_rope = self._rotate(k_rope, rope_tables)
        key = jnp.concatenate([latent[:, :, None, :], k_rope.astype(latent.dtype)], axis=-1)  # [B, T, 1, R + P]
        return query, key, q_resid

    def _rotate(self, x: jax.Array, rope_tables) -> jax.Array:
        if self.rope is None:
            return x
        cos, sin = rope_tables[self.rope]
        return self.rope.apply(self._deinterleave(x) if self.rope_interleave else x, cos, sin)

    def scale_queries(self, query: jax.Array, positions: jax.Array) -> jax.Array:
        """The absorbed queries [B, T, N, R + P] times the position-dependent factors, where the family has them
        (per head factors commute with the absorption and the rotation)."""
        if self.query_scaling is not None:
            beta, original = self.query_scaling
            factor = 1.0 + beta * jnp.log(1.0 + jnp.floor(positions.astype(jnp.float32) / original))  # [B, T]
            query = query * factor[:, :, None, None].astype(query.dtype)
        if self.softmax_scaling is not None:
            query = self.softmax_scaling(query, positions)
        return query

    def output(self, out: jax.Array, gate: jax.Array | None = None) -> jax.Array:
        """Attention's output over the latent [B, T, N, R + P] -> [B, T, D] (W_uv, times `gate` [B, T, N, U] where
        given, then o_proj)."""
        R, _, C, _ = self.dims
        out = jnp.einsum("btnr,nur->btnu", out[..., :R], self.kv_b_proj.kernel[...][:, C:])  # [B, T, N, U]
        return self.o_proj(out if gate is None else out * gate.astype(out.dtype))

    def op_calls(self) -> list[OpCall]:
        """Multi-query attention over the latent (key = value = [latent ; rope key]), the norms and RoPE."""
        R, P, _, _ = self.dims
        shape = dict(N=self.kv_b_proj.out_shape[0], K=1, H=R + P, Hv=R + P, scale=self.scale, window=None,
                     softcap=None, sinks=False, latent=True)
        return [OpCall.of("attention", **shape), OpCall.of("paged_attention", **shape), *self.norm_and_rope_calls()]

    def norm_and_rope_calls(self) -> list[OpCall]:
        """The latent norms' and RoPE's calls (a NoPE layer reports a RoPE of kind None)."""
        norms = [call for norm in (self.q_a_layernorm, self.kv_a_layernorm) if norm is not None
                 for call in norm.op_calls()]
        return norms + [self.rope.op_call() if self.rope is not None else OpCall.of("rope", kind=None)]


class SoftmaxScaling(nnx.Module):
    """Queries times `scale * log(p + 1) + bias` at absolute position p, `scale` and `bias` learned per head [N]
    (Mistral Large 4's attention and indexer queries: HF's `softmax_scaling`); the factor in float32. `head_axis`:
    the heads' logical axis (None for the indexer's, kept whole on every rank)."""

    def __init__(self, num_heads: int, *, head_axis: str | None = "heads", dtype=jnp.float32, rngs: nnx.Rngs):
        self.scale = param(rngs, (num_heads,), (head_axis,), dtype, 0.0)
        ones = nnx.with_partitioning(nnx.initializers.ones, (head_axis,))
        self.bias = nnx.Param(ones(rngs.params(), (num_heads,), dtype))

    def __call__(self, q: jax.Array, positions: jax.Array) -> jax.Array:
        """q [B, T, N, ...], positions [B, T] -> q scaled per (token, head)."""
        log_pos = jnp.log(positions.astype(jnp.float32) + 1.0)[:, :, None]  # [B, T, 1]
        factor = self.scale[...].astype(jnp.float32) * log_pos + self.bias[...].astype(jnp.float32)  # [B, T, N]
        return q * factor.reshape(factor.shape + (1,) * (q.ndim - 3)).astype(q.dtype)
