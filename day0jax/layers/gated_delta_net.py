"""Delta-rule linear attention: Gated DeltaNet (Qwen3-Next, Qwen3.5) and Kimi Delta Attention (Kimi Linear, the
same with one decay per key channel). Projections, a short causal convolution over q/k/v, the gated delta rule
through the `kernels_pallas` op (and the convolution through its own, `causal_conv1d`), a gated RMSNorm and the
output projection.

Projections keep heads as their own axis (q/k [Nk, Hk], v/z [Nv, Hv]) and the convolution is one weight per
projection, so tensor parallelism splits all of them, and the per-sequence state, by heads. Checkpoints that fuse
the projections (`in_proj_qkvz`) are split at conversion by the family.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.core.cache_layout import StateLayer
from day0jax.layers.linear import Linear, param
from day0jax.layers.norms import RMSNorm
from kernels_pallas.calls import OpCall
from kernels_pallas.causal_conv1d import api as conv_op
from kernels_pallas.gated_delta_rule import api as gdr_op


class StateCache(Protocol):
    """What the layer needs of the engine's per-sequence state (engine/state_cache.py). With `targets` set (a
    speculative verify step), `write` takes the state after each of the T tokens, [B, T, *shape] per array."""

    valid: jax.Array
    targets: jax.Array | None

    def read(self) -> tuple[jax.Array, ...]: ...

    def write(self, states: tuple[jax.Array, ...]) -> "StateCache": ...

    def token_mask(self, tokens: int) -> jax.Array: ...


def conv_states_per_token(state: jax.Array, x: jax.Array, valid: jax.Array) -> jax.Array:
    """A causal convolution's state after each token of x: [B, T, W - 1, C], the last W - 1 inputs of
    state ++ x[:min(t + 1, valid)] for token t (a speculative verify step keeps them all; see `StateCache`).

    Args:
        state: [B, W - 1, C], the inputs before x.
        x: [B, T, C].
        valid: [B] int32, each row's real tokens (padding after them leaves the state as it was).
    """
    B, T, _ = x.shape
    width = state.shape[1]
    full = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [B, W - 1 + T, C]
    ends = jnp.minimum(jnp.arange(1, T + 1, dtype=jnp.int32)[None, :], valid[:, None])  # [B, T]
    index = ends[:, :, None] + jnp.arange(width, dtype=jnp.int32)[None, None, :]  # [B, T, W - 1]
    return jax.vmap(lambda row, ix: row[ix])(full, index)


def scan_per_token(step, tokens: int, state):
    """A recurrence run one token at a time, keeping the state after each (a speculative verify step's; see
    `StateCache`): step(t, state) -> (output [B, 1, ...], state). Returns (outputs [B, T, ...], states [B, T, ...])."""
    outs, states = [], []
    for t in range(tokens):
        out, state = step(t, state)
        outs.append(out)
        states.append(state)
    return jnp.concatenate(outs, axis=1), jnp.stack(states, axis=1)


class DeltaRuleMixer(nnx.Module):
    """What both delta-rule layers share: the per-sequence state and its layout, the convolutions over q/k/v and the
    recurrence. Subclasses set `self.shape` = (Nk, Nv, Hk, Hv, W)."""

    # A speculative verify step can keep the state after each of its tokens (`StateCache.targets`).
    per_token_states = True

    def state_layout(self) -> StateLayer:
        """Per sequence: the last W-1 inputs of each convolution, and the [Nv, Hk, Hv] recurrent state."""
        Nk, Nv, Hk, Hv, W = self.shape
        conv = (None, "heads", None)  # [W - 1, heads, head dim]
        return StateLayer((((W - 1, Nk, Hk), conv), ((W - 1, Nk, Hk), conv), ((W - 1, Nv, Hv), conv),
                           ((Nv, Hk, Hv), ("heads", None, None))))

    def convolve_and_recur(self, qkv: tuple[jax.Array, jax.Array, jax.Array], convs: tuple[jax.Array, ...],
                           g: jax.Array, beta: jax.Array, cache: StateCache | None
                           ) -> tuple[jax.Array, StateCache | None]:
        """The convolutions, then the gated delta rule, from and into the cache's state.

        Args:
            qkv: q, k [B, T, Nk, Hk] and v [B, T, Nv, Hv], before their convolutions.
            convs: their depthwise weights, each [heads, head dim, W].
            g: log-space decay, [B, T, Nv] (per head) or [B, T, Nv, Hk] (per key channel), float32.
            beta: [B, T, Nv] the delta rule's write strength, float32.
            cache: the engine's state for these rows, or None (a cache-less forward from zeros).
        Returns:
            (out [B, T, Nv, Hv] in q's dtype, the cache with each row's new state, or None).
        """
        B, T = qkv[0].shape[:2]
        W = self.shape[-1]
        per_token = cache is not None and cache.targets is not None
        if cache is None:
            conv_states, recurrent, valid = (None, None, None), None, None
        else:
            *conv_states, recurrent = cache.read()
            valid = cache.valid
            # Padding tokens neither decay nor write the state.
            mask = cache.token_mask(T)
            g = jnp.where(mask.reshape(mask.shape + (1,) * (g.ndim - 2)), g, 0.0)
            beta = jnp.where(mask[..., None], beta, 0.0)
        mixed, new_conv = [], []
        for y, weight, state in zip(qkv, convs, conv_states):
            heads, dim = y.shape[-2:]
            flat_state = None if state is None else state.reshape(B, W - 1, heads * dim)
            out, new_state = conv_op.causal_conv1d(y.reshape(B, T, heads * dim), weight[...].reshape(heads * dim, W),
                                                   flat_state, valid=valid)
            mixed.append(out.reshape(B, T, heads, dim))
            if per_token:
                new_state = conv_states_per_token(flat_state, y.reshape(B, T, heads * dim), valid)
            new_conv.append(new_state.reshape(new_state.shape[:-1] + (heads, dim)))
        if per_token:  # padding tokens neither decay nor write the state
            out, recurrent = scan_per_token(lambda t, state: gdr_op.gated_delta_rule(
                *(m[:, t:t + 1] for m in mixed), g[:, t:t + 1], beta[:, t:t + 1], state), T, recurrent)
        else:
            out, recurrent = gdr_op.gated_delta_rule(*mixed, g, beta, recurrent)
        if cache is not None:
            cache = cache.write((*new_conv, recurrent))
        return out, cache

    def delta_rule_calls(self, decay: str) -> list[OpCall]:
        """The recurrence's and the convolution's op calls; `decay` is 'head' or 'channel' (`kernels_pallas.calls`)."""
        Nk, Nv, Hk, Hv, W = self.shape
        return [OpCall.of("gated_delta_rule", Nk=Nk, Nv=Nv, Hk=Hk, Hv=Hv, decay=decay),
                OpCall.of("causal_conv1d", C=2 * Nk * Hk + Nv * Hv, W=W)]


class GatedDeltaNet(DeltaRuleMixer):
    """Linear attention with the gated delta rule.

    Args:
        hidden_size, num_k_heads, num_v_heads, k_head_dim, v_head_dim: D, Nk, Nv (a multiple of Nk), Hk, Hv.
        conv_kernel: W, the causal convolution's width.
        eps: the gated RMSNorm's epsilon.
    """

    def __init__(self, *, hidden_size: int, num_k_heads: int, num_v_heads: int, k_head_dim: int, v_head_dim: int,
                 conv_kernel: int, eps: float, dtype=jnp.float32, rngs: nnx.Rngs):
        D, Nk, Nv, Hk, Hv, W = hidden_size, num_k_heads, num_v_heads, k_head_dim, v_head_dim, conv_kernel
        self.in_proj_q = Linear((D,), (Nk, Hk), ("embed", "heads", "head_dim"), dtype=dtype, rngs=rngs)
        self.in_proj_k = Linear((D,), (Nk, Hk), ("embed", "heads", "head_dim"), dtype=dtype, rngs=rngs)
        self.in_proj_v = Linear((D,), (Nv, Hv), ("embed", "heads", "head_dim"), dtype=dtype, rngs=rngs)
        self.in_proj_z = Linear((D,), (Nv, Hv), ("embed", "heads", "head_dim"), dtype=dtype, rngs=rngs)
        self.in_proj_b = Linear((D,), (Nv,), ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.in_proj_a = Linear((D,), (Nv,), ("embed", "heads"), dtype=dtype, rngs=rngs)
        # Depthwise convolution weights [heads, head dim, W] (HF's conv1d.weight [channels, 1, W], split).
        self.conv_q = param(rngs, (Nk, Hk, W), ("heads", "head_dim", None), dtype, 0.5)
        self.conv_k = param(rngs, (Nk, Hk, W), ("heads", "head_dim", None), dtype, 0.5)
        self.conv_v = param(rngs, (Nv, Hv, W), ("heads", "head_dim", None), dtype, 0.5)
        self.dt_bias = param(rngs, (Nv,), ("heads",), dtype, 0.1)
        self.A_log = param(rngs, (Nv,), ("heads",), dtype, 0.5)
        self.norm = RMSNorm(Hv, eps, dtype=dtype, rngs=rngs)
        self.out_proj = Linear((Nv, Hv), (D,), ("heads", "head_dim", "embed"), dtype=dtype, rngs=rngs)
        self.shape = (Nk, Nv, Hk, Hv, W)

    def __call__(self, x: jax.Array, positions: jax.Array, rope_tables: dict,
                 cache: StateCache | None = None) -> tuple[jax.Array, StateCache | None]:
        """x [B, T, D] -> ([B, T, D], the cache with each row's new state). `positions` and `rope_tables` are
        unused: the recurrence itself carries order."""
        q, k, v = self.in_proj_q(x), self.in_proj_k(x), self.in_proj_v(x)
        # Decay in log space and the write strength, per value head and token.
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            self.in_proj_a(x).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        beta = jax.nn.sigmoid(self.in_proj_b(x).astype(jnp.float32))
        out, cache = self.convolve_and_recur((q, k, v), (self.conv_q, self.conv_k, self.conv_v), g, beta, cache)
        z = self.in_proj_z(x)
        out = self.norm(out.astype(x.dtype)) * jax.nn.silu(z.astype(jnp.float32)).astype(x.dtype)
        return self.out_proj(out), cache

    def op_calls(self) -> list[OpCall]:
        return self.delta_rule_calls("head") + self.norm.op_calls()


class KimiDeltaAttention(DeltaRuleMixer):
    """Kimi Delta Attention (Kimi Linear): the gated delta rule with one decay per key channel, from low-rank
    projections, and an output gate through a sigmoid; q, k and v have the same N heads of H dims. HF names kept.

    Args:
        hidden_size, num_heads, head_dim: D, N, H.
        conv_kernel: W, the causal convolution's width.
        eps: the gated RMSNorm's epsilon.
        lower_bound: None for Kimi's decay, -exp(A_log) * softplus(f + dt_bias); else GLM-5-Next's bounded one,
            lower_bound * sigmoid(exp(A_log) * (f + dt_bias)), never below lower_bound (its `linear_lower_bound`).
    """

    def __init__(self, *, hidden_size: int, num_heads: int, head_dim: int, conv_kernel: int, eps: float,
                 lower_bound: float | None = None, dtype=jnp.float32, rngs: nnx.Rngs):
        D, N, H, W = hidden_size, num_heads, head_dim, conv_kernel
        self.q_proj = Linear((D,), (N, H), ("embed", "heads", "head_dim"), dtype=dtype, rngs=rngs)
        self.k_proj = Linear((D,), (N, H), ("embed", "heads", "head_dim"), dtype=dtype, rngs=rngs)
        self.v_proj = Linear((D,), (N, H), ("embed", "heads", "head_dim"), dtype=dtype, rngs=rngs)
        # Depthwise convolution weights [heads, head dim, W] (HF's q/k/v_conv1d.weight [N * H, 1, W]).
        self.q_conv1d = param(rngs, (N, H, W), ("heads", "head_dim", None), dtype, 0.5)
        self.k_conv1d = param(rngs, (N, H, W), ("heads", "head_dim", None), dtype, 0.5)
        self.v_conv1d = param(rngs, (N, H, W), ("heads", "head_dim", None), dtype, 0.5)
        # The decay's and the output gate's low-rank projections go through H dims shared by every head.
        self.f_a_proj = Linear((D,), (H,), ("embed", None), dtype=dtype, rngs=rngs)
        self.f_b_proj = Linear((H,), (N, H), (None, "heads", "head_dim"), dtype=dtype, rngs=rngs)
        self.dt_bias = param(rngs, (N, H), ("heads", "head_dim"), dtype, 0.1)
        self.A_log = param(rngs, (N,), ("heads",), dtype, 0.5)
        self.b_proj = Linear((D,), (N,), ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.g_a_proj = Linear((D,), (H,), ("embed", None), dtype=dtype, rngs=rngs)
        self.g_b_proj = Linear((H,), (N, H), (None, "heads", "head_dim"), dtype=dtype, rngs=rngs)
        self.o_norm = RMSNorm(H, eps, dtype=dtype, rngs=rngs)
        self.o_proj = Linear((N, H), (D,), ("heads", "head_dim", "embed"), dtype=dtype, rngs=rngs)
        self.shape = (N, N, H, H, W)
        self.lower_bound = lower_bound

    def __call__(self, x: jax.Array, positions: jax.Array, rope_tables: dict,
                 cache: StateCache | None = None) -> tuple[jax.Array, StateCache | None]:
        """x [B, T, D] -> ([B, T, D], the cache with each row's new state); `positions`, `rope_tables` unused."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # Log-space decay per head and key channel [B, T, N, H] (see `lower_bound`).
        f = self.f_b_proj(self.f_a_proj(x)).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        rate = jnp.exp(self.A_log[...].astype(jnp.float32))[:, None]
        if self.lower_bound is None:
            g = -rate * jax.nn.softplus(f)
        else:
            g = self.lower_bound * jax.nn.sigmoid(rate * f)
        beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
        out, cache = self.convolve_and_recur((q, k, v), (self.q_conv1d, self.k_conv1d, self.v_conv1d), g, beta,
                                             cache)
        gate = self.g_b_proj(self.g_a_proj(x))
        out = self.o_norm(out).astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))
        return self.o_proj(out.astype(x.dtype)), cache

    def op_calls(self) -> list[OpCall]:
        calls = self.delta_rule_calls("channel")
        if self.lower_bound is not None:
            calls[0] = OpCall.of("gated_delta_rule", **dict(calls[0].params, lower_bound=self.lower_bound))
        return calls + self.o_norm.op_calls()
