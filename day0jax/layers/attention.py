"""Multi-head attention with grouped KV heads (GQA/MQA), through the `kernels_pallas` attention op. Projections
keep heads as their own axis (q_proj kernel [N, H, D], o_proj [D, N, H]) so tensor parallelism splits them by name."""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.layers.linear import Linear, param
from day0jax.layers.norms import RMSNorm
from day0jax.layers.rope import Rope
from kernels_pallas.attention import api as attention_op
from kernels_pallas.calls import OpCall


class KVCache(Protocol):
    """What attention needs of a cache: write this call's keys/values, then attend over what is cached."""

    def update(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> "KVCache": ...

    def attend(self, q: jax.Array, positions: jax.Array, **attention_kwargs: Any) -> jax.Array: ...


class Attention(nnx.Module):
    """Self-attention block: q/k/v projections, optional q/k RMSNorm, RoPE, attention, output projection.

    Args:
        hidden_size, num_heads, num_kv_heads, head_dim: D, N, K (divides N), H.
        rope: the rotary embedding, or None for layers without positions (NoPE).
        qkv_bias / o_bias: biases on the input / output projections.
        qk_norm_eps: if set, RMSNorm on q and k before RoPE, over each head's H dims (`qk_norm_over="head"`: Qwen3,
            Gemma 3) or a token's N*H (K*H) dims (`"all"`: OLMo 2); `qk_norm_offset=1.0` for (1 + weight) norms.
        sinks: learned per-head logits that join every softmax (gpt-oss; HF's `self_attn.sinks` [N]).
        sliding_window / logit_softcap / scale: passed to the attention op.
    """

    def __init__(self, *, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rope: Rope | None,
                 qkv_bias: bool = False, o_bias: bool = False, qk_norm_eps: float | None = None,
                 qk_norm_over: str = "head", qk_norm_offset: float = 0.0, sinks: bool = False,
                 sliding_window: int | None = None, logit_softcap: float | None = None,
                 scale: float | None = None, dtype=jnp.float32, rngs: nnx.Rngs):
        D, N, K, H = hidden_size, num_heads, num_kv_heads, head_dim
        self.q_proj = Linear((D,), (N, H), ("embed", "heads", "head_dim"), use_bias=qkv_bias, dtype=dtype, rngs=rngs)
        kv_axes = ("embed", "kv_heads", "head_dim")
        self.k_proj = Linear((D,), (K, H), kv_axes, use_bias=qkv_bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear((D,), (K, H), kv_axes, use_bias=qkv_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear((N, H), (D,), ("heads", "head_dim", "embed"), use_bias=o_bias, dtype=dtype, rngs=rngs)
        if qk_norm_eps is not None:
            assert qk_norm_over in ("head", "all"), qk_norm_over
            q_dim, k_dim = (H, H) if qk_norm_over == "head" else (N * H, K * H)
            self.q_norm = RMSNorm(q_dim, qk_norm_eps, offset=qk_norm_offset, dtype=dtype, rngs=rngs)
            self.k_norm = RMSNorm(k_dim, qk_norm_eps, offset=qk_norm_offset, dtype=dtype, rngs=rngs)
        else:
            self.q_norm = self.k_norm = None
        self.qk_norm_over = qk_norm_over
        self.sinks = param(rngs, (N,), ("heads",), dtype, 0.0) if sinks else None
        self.rope = rope
        self.sliding_window, self.logit_softcap, self.scale = sliding_window, logit_softcap, scale

    def __call__(self, x: jax.Array, positions: jax.Array, rope_tables: dict[Rope, tuple[jax.Array, jax.Array]],
                 cache: KVCache | None = None) -> tuple[jax.Array, KVCache | None]:
        """x [B, T, D], positions [B, T] -> ([B, T, D], updated cache). `rope_tables`: {Rope: (cos, sin)} for
        every RoPE of the model; this layer takes its own."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [B, T, N|K, H]
        if self.q_norm is not None:
            if self.qk_norm_over == "head":
                q, k = self.q_norm(q), self.k_norm(k)
            else:  # over the whole projection, as OLMo 2 normalizes q_proj(x) before splitting heads
                q = self.q_norm(q.reshape(*q.shape[:-2], -1)).reshape(q.shape)
                k = self.k_norm(k.reshape(*k.shape[:-2], -1)).reshape(k.shape)
        if self.rope is not None:
            cos, sin = rope_tables[self.rope]
            q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
        op_kwargs = dict(sliding_window=self.sliding_window, logit_softcap=self.logit_softcap, scale=self.scale)
        if self.sinks is not None:
            op_kwargs["sinks"] = self.sinks[...]
        if cache is None:
            out = attention_op.attention(q, k, v, q_positions=positions, **op_kwargs)
        else:
            cache = cache.update(k, v, positions)
            out = cache.attend(q, positions, **op_kwargs)
        return self.o_proj(out), cache

    def op_calls(self) -> list[OpCall]:
        """The attention op (cache-less forward) and the paged one (engine), q/k norms and RoPE."""
        N, H = self.q_proj.out_shape
        shape = dict(N=N, K=self.k_proj.out_shape[0], H=H, Hv=H, scale=self.scale, window=self.sliding_window,
                     softcap=self.logit_softcap, sinks=self.sinks is not None, latent=False)
        calls = [OpCall.of("attention", **shape), OpCall.of("paged_attention", **shape)]
        if self.q_norm is not None:
            calls += self.q_norm.op_calls() + self.k_norm.op_calls()
        return calls + [self.rope.op_call() if self.rope is not None else OpCall.of("rope", kind=None)]
