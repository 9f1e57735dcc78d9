"""Multi-head attention with grouped KV heads (GQA/MQA), through the `kernels_pallas` attention op. Projections
keep heads as their own axis (q_proj kernel [N, H, D], o_proj [D, N, H]) so tensor parallelism splits them by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.layers.linear import Linear, param, project_together
from day0jax.layers.norms import L2Norm, LayerNorm, RMSNorm
from day0jax.layers.rope import Rope
from kernels_pallas.attention import api as attention_op
from kernels_pallas.calls import OpCall


class KVCache(Protocol):
    """What attention needs of a cache: write this call's keys/values, then attend over what is cached."""

    def update(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> "KVCache": ...

    def attend(self, q: jax.Array, positions: jax.Array, **attention_kwargs: Any) -> jax.Array: ...


class ContextKV:
    """This call's keys and values as a `KVCache` with no cache behind them: a cache-less forward's way to hand one
    layer's keys and values to the layers that attend over them too (Gemma 4's KV sharing)."""

    def __init__(self, k: jax.Array | None = None, v: jax.Array | None = None, visible_until: jax.Array | None = None):
        self.k, self.v, self.visible_until = k, v, visible_until  # visible_until: as in `PagedKVCache`

    def update(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> "ContextKV":
        return ContextKV(k, v, self.visible_until)

    def attend(self, q: jax.Array, positions: jax.Array, **attention_kwargs: Any) -> jax.Array:
        if self.visible_until is not None:
            attention_kwargs["visible_until"] = self.visible_until
        return attention_op.attention(q, self.k, self.v, q_positions=positions, **attention_kwargs)


@dataclass(frozen=True)
class OutputGate:
    """The attention output times fn(proj(x)), from a projection of the layer's input of its own, named as HF names
    it: per element ([N, H]: AFMoE's sigmoid `gate_proj`) or one value per head ([N]: LFM3's sigmoid `g_proj`,
    Laguna's softplus `g_proj`, either form)."""

    name: str = "gate_proj"
    per_head: bool = False
    fn: str = "sigmoid"  # or "softplus"

    def __post_init__(self):
        assert self.fn in GATE_FNS, self.fn

    def describe(self) -> str:
        return f"{self.fn}{' per head' if self.per_head else ''}"

    def __call__(self, out: jax.Array, proj: jax.Array) -> jax.Array:
        """out [B, T, N, H], proj(x) [B, T, N] or [B, T, N, H] -> the gated output (the gate in float32, as HF)."""
        gate = GATE_FNS[self.fn](proj.astype(jnp.float32)).astype(out.dtype)
        return out * (gate[..., None] if self.per_head else gate)


GATE_FNS = {"sigmoid": jax.nn.sigmoid, "softplus": jax.nn.softplus}


def deinterleave(x: jax.Array) -> jax.Array:
    """Interleaved pairs (x0, x1), (x2, x3)... of the last axis -> evens then odds: HF's rotate_half layout."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class Attention(nnx.Module):
    """Self-attention block: q/k/v projections, optional q/k RMSNorm, RoPE, attention, output projection.

    Args:
        hidden_size, num_heads, num_kv_heads, head_dim: D, N, K (divides N), H.
        rope: the rotary embedding, or None for layers without positions (NoPE).
        qkv_bias / o_bias: biases on the input / output projections.
        qk_norm_eps: if set, RMSNorm on q and k before RoPE, over each head's H dims (`qk_norm_over="head"`: Qwen3,
            Gemma 3) or a token's N*H (K*H) dims (`"all"`: OLMo 2); `qk_norm_offset=1.0` for (1 + weight) norms;
            `qk_norm_after_rope`: per head, on the rotated q and k instead (HunYuan).
        sinks: learned per-head logits that join every softmax (gpt-oss; HF's `self_attn.sinks` [N]).
        output_gate: the output times sigmoid(gate), the gate [N, H] projected by q_proj beside each head's query
            (Qwen3-Next, Qwen3.5: q_proj [N, 2H], query then gate per head).
        gate: an `OutputGate` from a projection of its own (AFMoE, Laguna, LFM3).
        sliding_window / logit_softcap / scale: passed to the attention op.
        qk_norm_weight: False for q/k norms without a weight (Llama 4's L2 norm; per head only).
        chunk_size: chunked local attention, passed to the attention op (Llama 4's RoPE layers).
        attn_temperature: (floor_scale, attn_scale): queries times 1 + attn_scale * log1p(floor((p + 1) /
            floor_scale)) at absolute position p, after RoPE and norms (Llama 4's NoPE layers).
        v_head_dim: Hv, the values' head dim where it differs from the queries' and keys' H (MiMo-V2-Flash).
        value_scale: the values times it before they are cached (MiMo-V2-Flash's `attention_value_scale`).
        qk_layer_norm: the q/k norms are LayerNorms without bias, a weight per head and dim (Cohere), per head only.
        rope_interleave: HF rotates interleaved pairs (x0, x1), (x2, x3)... (Cohere) rather than the half-split
            layout: q and k are de-interleaved alike before the half-split rotation, which leaves their dot
            products, all attention uses them for, unchanged.
        clip_qkv: q, k and v clamped to [-clip_qkv, clip_qkv] after the q/k norms, before RoPE (OLMoE).
    """

    def __init__(self, *, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rope: Rope | None,
                 qkv_bias: bool = False, o_bias: bool = False, qk_norm_eps: float | None = None,
                 qk_norm_over: str = "head", qk_norm_offset: float = 0.0, qk_norm_after_rope: bool = False,
                 sinks: bool = False, gate: OutputGate | None = None, output_gate: bool = False,
                 sliding_window: int | None = None, logit_softcap: float | None = None,
                 scale: float | None = None, qk_norm_weight: bool = True, chunk_size: int | None = None,
                 attn_temperature: tuple[float, float] | None = None, v_head_dim: int | None = None,
                 value_scale: float = 1.0, qk_layer_norm: bool = False, rope_interleave: bool = False,
                 clip_qkv: float | None = None, dtype=jnp.float32, rngs: nnx.Rngs):
        D, N, K, H = hidden_size, num_heads, num_kv_heads, head_dim
        Hv = H if v_head_dim is None else v_head_dim
        self.q_proj = Linear((D,), (N, 2 * H if output_gate else H), ("embed", "heads", "head_dim"),
                             use_bias=qkv_bias, dtype=dtype, rngs=rngs)
        kv_axes = ("embed", "kv_heads", "head_dim")
        self.k_proj = Linear((D,), (K, H), kv_axes, use_bias=qkv_bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear((D,), (K, Hv), kv_axes, use_bias=qkv_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear((N, Hv), (D,), ("heads", "head_dim", "embed"), use_bias=o_bias, dtype=dtype, rngs=rngs)
        if gate is not None:
            shape, axes = ((N,), ("embed", "heads")) if gate.per_head else ((N, H), ("embed", "heads", "head_dim"))
            setattr(self, gate.name, Linear((D,), shape, axes, dtype=dtype, rngs=rngs))
        self.gate = gate
        if qk_norm_eps is not None:
            assert qk_norm_over in ("head", "all") and not (qk_norm_after_rope and qk_norm_over == "all")
            q_dim, k_dim = (H, H) if qk_norm_over == "head" else (N * H, K * H)
            if qk_layer_norm:
                assert qk_norm_over == "head" and not qk_norm_after_rope and not qk_norm_offset
                self.q_norm = LayerNorm((N, H), qk_norm_eps, bias=False, axes=("heads", "head_dim"), dtype=dtype,
                                        rngs=rngs)
                self.k_norm = LayerNorm((K, H), qk_norm_eps, bias=False, axes=("kv_heads", "head_dim"), dtype=dtype,
                                        rngs=rngs)
            elif qk_norm_weight:
                self.q_norm = RMSNorm(q_dim, qk_norm_eps, offset=qk_norm_offset, dtype=dtype, rngs=rngs)
                self.k_norm = RMSNorm(k_dim, qk_norm_eps, offset=qk_norm_offset, dtype=dtype, rngs=rngs)
            else:
                assert qk_norm_over == "head" and not qk_norm_offset
                self.q_norm, self.k_norm = L2Norm(H, qk_norm_eps), L2Norm(H, qk_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qk_norm_over, self.output_gate, self.head_dim = qk_norm_over, output_gate, H
        self.qk_norm_after_rope = qk_norm_after_rope
        self.sinks = param(rngs, (N,), ("heads",), dtype, 0.0) if sinks else None
        self.rope = rope
        self.sliding_window, self.logit_softcap, self.scale = sliding_window, logit_softcap, scale
        self.chunk_size, self.attn_temperature = chunk_size, attn_temperature
        self.v_head_dim, self.value_scale = Hv, value_scale
        self.rope_interleave = rope_interleave
        assert clip_qkv is None or not qk_norm_after_rope
        self.clip_qkv = clip_qkv

    def __call__(self, x: jax.Array, positions: jax.Array, rope_tables: dict[Rope, tuple[jax.Array, jax.Array]],
                 cache: KVCache | None = None) -> tuple[jax.Array, KVCache | None]:
        """x [B, T, D], positions [B, T] -> ([B, T, D], updated cache). `rope_tables`: {Rope: (cos, sin)} for
        every RoPE of the model; this layer takes its own."""
        q, k, v = project_together(x, (self.q_proj, self.k_proj, self.v_proj))  # [B, T, N|K, H]
        if self.value_scale != 1.0:
            v = v * self.value_scale
        if self.output_gate:
            q, gate = q[..., :self.head_dim], q[..., self.head_dim:]
        if self.q_norm is not None and not self.qk_norm_after_rope:
            if self.qk_norm_over == "head":
                q, k = self.q_norm(q), self.k_norm(k)
            else:  # over the whole projection, as OLMo 2 normalizes q_proj(x) before splitting heads
                q = self.q_norm(q.reshape(*q.shape[:-2], -1)).reshape(q.shape)
                k = self.k_norm(k.reshape(*k.shape[:-2], -1)).reshape(k.shape)
        if self.clip_qkv is not None:
            q, k, v = (jnp.clip(t, -self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        if self.rope is not None:
            cos, sin = rope_tables[self.rope]
            if self.rope_interleave:
                q, k = deinterleave(q), deinterleave(k)
            q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
        if self.q_norm is not None and self.qk_norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.attn_temperature is not None:
            floor_scale, attn_scale = self.attn_temperature
            pos = positions.astype(jnp.float32)
            factor = jnp.log1p(jnp.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0  # [B, T], as HF in float32
            q = (q * factor[:, :, None, None]).astype(q.dtype)
        op_kwargs = dict(sliding_window=self.sliding_window, logit_softcap=self.logit_softcap, scale=self.scale)
        if self.chunk_size is not None:
            op_kwargs["chunk_size"] = self.chunk_size
        if self.sinks is not None:
            op_kwargs["sinks"] = self.sinks[...]
        if cache is None:
            out = attention_op.attention(q, k, v, q_positions=positions, **op_kwargs)
        else:
            cache = cache.update(k, v, positions)
            out = cache.attend(q, positions, **op_kwargs)
        if self.output_gate:
            out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
        if self.gate is not None:
            out = self.gate(out, getattr(self, self.gate.name)(x))
        return self.o_proj(out), cache

    def op_calls(self) -> list[OpCall]:
        """The attention op (cache-less forward) and the paged one (engine), q/k norms and RoPE."""
        N, H = self.q_proj.out_shape[0], self.head_dim
        shape = dict(N=N, K=self.k_proj.out_shape[0], H=H, Hv=self.v_head_dim, scale=self.scale,
                     window=self.sliding_window, softcap=self.logit_softcap, sinks=self.sinks is not None,
                     latent=False)
        if self.chunk_size is not None:  # only where set: other families' calls (and flagships.json) unchanged
            shape["chunk"] = self.chunk_size
        if self.gate is not None or self.output_gate:  # applied outside the op, shown in reports
            shape["gate"] = self.gate.describe() if self.gate is not None else "sigmoid, from q_proj"
        calls = [OpCall.of("attention", **shape), OpCall.of("paged_attention", **shape)]
        if self.q_norm is not None:
            calls += self.q_norm.op_calls() + self.k_norm.op_calls()
        rope = self.rope.op_call() if self.rope is not None else OpCall.of("rope", kind=None)
        if self.rope is not None and self.rope_interleave:  # only where set: other families' calls unchanged
            rope = OpCall.of("rope", **dict(rope.params), pairs="interleaved")
        return calls + [rope]
