"""Mamba2's mixer (NemotronH, Falcon-H1, Granite 4): in_proj to the gate z, the heads' inputs x, the state's input
and output maps B and C (one per group of heads) and the time steps dt; a depthwise causal convolution with SiLU
over x, B and C (`kernels_pallas.causal_conv1d`); the selective state-space scan (`kernels_pallas.mamba2_ssd`, with
A = -exp(A_log), the D skip and dt's bias, softplus and limits inside); a gated RMSNorm over groups of channels;
out_proj. Reference: transformers/models/nemotron_h/modeling_nemotron_h.py (`NemotronHMamba2Mixer`).

HF's fused `in_proj` [z | x | B | C | dt] and `conv1d` [x | B | C] are split at conversion
(`models.nemotron_h.mamba2_source`), so each part keeps its heads or groups as an axis of its own: tensor
parallelism splits z, x, dt, the scan and the per-sequence state by heads, and B and C by groups where the groups
divide (each device's heads use only its groups'), else keeps them whole. A speculative verify step scans its few
tokens one at a time to keep the state after each (the accepted one becomes the sequence's).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.core.cache_layout import StateLayer
from day0jax.layers.gated_delta_net import StateCache, conv_states_per_token, scan_per_token
from day0jax.layers.linear import Linear, param, project_together
from kernels_pallas.calls import OpCall
from kernels_pallas.causal_conv1d import api as conv_op
from kernels_pallas.mamba2_ssd import api as ssd_op

GROUPS = "ssm_groups"  # the logical axis of B's and C's groups
PARTS = ("z", "x", "B", "C", "dt")  # in_proj's outputs, in HF's order
NORMS = ("gate_then_norm", "norm_before_gate", None)


def ones(shape, axes, dtype, rngs: nnx.Rngs) -> nnx.Param:
    return nnx.Param(nnx.with_partitioning(nnx.initializers.ones, axes)(rngs.params(), shape, dtype))


class GatedRMSNorm(nnx.Module):
    """Mamba2's RMSNorm of the scan's output y with the gate z, over G groups of the N * H channels (each group the
    N / G consecutive heads that share B and C), in float32: `gate_then_norm` normalizes y * silu(z) (NemotronH,
    Granite 4, mamba_ssm's default), `norm_before_gate` multiplies the normalized y by silu(z) (Falcon-H1's
    `mamba_norm_before_gate`). weight [N, H] (HF's [N * H]).
    """

    def __init__(self, heads: int, head_dim: int, groups: int, eps: float, order: str, *, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        assert order in NORMS[:2] and heads % groups == 0, (order, heads, groups)
        self.weight = ones((heads, head_dim), ("heads", "head_dim"), dtype, rngs)
        self.groups, self.eps, self.order = groups, eps, order

    @jax.named_scope("norm")
    def __call__(self, y: jax.Array, z: jax.Array) -> jax.Array:
        """y, z [..., N, H] -> [..., N, H] in y's dtype."""
        h, gate = y.astype(jnp.float32), jax.nn.silu(z.astype(jnp.float32))
        if self.order == "gate_then_norm":
            h = h * gate
        grouped = h.reshape(*h.shape[:-2], self.groups, -1)
        grouped = grouped * jax.lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True) + self.eps)
        h = grouped.reshape(h.shape) * self.weight[...].astype(jnp.float32)
        if self.order == "norm_before_gate":
            h = h * gate
        return h.astype(y.dtype)


class Mamba2Mixer(nnx.Module):
    """The Mamba2 token mixer.

    Args:
        hidden_size, num_heads, head_dim, n_groups, state_size: D, N, H, G (dividing N), Z.
        conv_kernel: W, the causal convolution's width; chunk_size: the scan's chunk in prefill.
        eps: the gated norm's epsilon; norm: `gate_then_norm`, `norm_before_gate`, or None for no norm (the output
            times silu(z) only: Falcon-H1 without `mamba_rms_norm`).
        use_bias: biases on in_proj; out_bias: on out_proj; conv_bias: on the convolution.
        dt_limit: dt's clip after the softplus (HF's `time_step_limit`).
        in_multiplier: the input times it before in_proj; proj_multipliers: z, x, B, C and dt times these after
            it (Falcon-H1's muP `ssm_in_multiplier` and `ssm_multipliers`; 1.0 elsewhere).
    """

    # A speculative verify step can keep the state after each of its tokens (`StateCache.targets`).
    per_token_states = True

    def __init__(self, *, hidden_size: int, num_heads: int, head_dim: int, n_groups: int, state_size: int,
                 conv_kernel: int, chunk_size: int, eps: float, norm: str | None = "gate_then_norm",
                 use_bias: bool = False, out_bias: bool = False, conv_bias: bool = True,
                 dt_limit: tuple[float, float] = (0.0, float("inf")), in_multiplier: float = 1.0,
                 proj_multipliers: tuple[float, ...] = (1.0,) * 5, dtype=jnp.float32, rngs: nnx.Rngs):
        D, N, H, G, Z, W = hidden_size, num_heads, head_dim, n_groups, state_size, conv_kernel
        assert N % G == 0 and norm in NORMS, (N, G, norm)
        heads, groups = ("embed", "heads", "head_dim"), ("embed", GROUPS, None)
        self.in_proj_z = Linear((D,), (N, H), heads, use_bias=use_bias, dtype=dtype, rngs=rngs)
        self.in_proj_x = Linear((D,), (N, H), heads, use_bias=use_bias, dtype=dtype, rngs=rngs)
        self.in_proj_B = Linear((D,), (G, Z), groups, use_bias=use_bias, dtype=dtype, rngs=rngs)
        self.in_proj_C = Linear((D,), (G, Z), groups, use_bias=use_bias, dtype=dtype, rngs=rngs)
        self.in_proj_dt = Linear((D,), (N,), ("embed", "heads"), use_bias=use_bias, dtype=dtype, rngs=rngs)
        # Depthwise convolution weights [heads or groups, dim, W] (HF's conv1d.weight [channels, 1, W], split).
        self.conv_x = param(rngs, (N, H, W), ("heads", "head_dim", None), dtype, 0.5)
        self.conv_B = param(rngs, (G, Z, W), (GROUPS, None, None), dtype, 0.5)
        self.conv_C = param(rngs, (G, Z, W), (GROUPS, None, None), dtype, 0.5)
        if conv_bias:
            self.conv_x_bias = param(rngs, (N, H), ("heads", "head_dim"), dtype, 0.0)
            self.conv_B_bias = param(rngs, (G, Z), (GROUPS, None), dtype, 0.0)
            self.conv_C_bias = param(rngs, (G, Z), (GROUPS, None), dtype, 0.0)
        else:
            self.conv_x_bias = self.conv_B_bias = self.conv_C_bias = None
        self.dt_bias = param(rngs, (N,), ("heads",), dtype, 0.1)
        self.A_log = param(rngs, (N,), ("heads",), dtype, 0.5)
        self.D = param(rngs, (N,), ("heads",), dtype, 0.5)
        self.norm = None if norm is None else GatedRMSNorm(N, H, G, eps, norm, dtype=dtype, rngs=rngs)
        self.out_proj = Linear((N, H), (D,), ("heads", "head_dim", "embed"), use_bias=out_bias, dtype=dtype,
                               rngs=rngs)
        self.shape = (N, H, G, Z, W)
        self.chunk_size, self.dt_limit = chunk_size, tuple(float(v) for v in dt_limit)
        self.in_multiplier, self.proj_multipliers = in_multiplier, tuple(proj_multipliers)

    def state_layout(self) -> StateLayer:
        """Per sequence: the convolution's last W - 1 inputs of x, B and C, and the [N, H, Z] scan state."""
        N, H, G, Z, W = self.shape
        return StateLayer((((W - 1, N, H), (None, "heads", None)), ((W - 1, G, Z), (None, GROUPS, None)),
                           ((W - 1, G, Z), (None, GROUPS, None)), ((N, H, Z), ("heads", None, None))), kind="mamba2")

    def __call__(self, x: jax.Array, positions: jax.Array, rope_tables: dict,
                 cache: StateCache | None = None) -> tuple[jax.Array, StateCache | None]:
        """x [B, T, D] -> ([B, T, D], the cache with each row's new state). `positions` and `rope_tables` are
        unused: the convolution's and the scan's states carry order."""
        B, T = x.shape[:2]
        N, H, G, Z, W = self.shape
        per_token = cache is not None and cache.targets is not None
        if self.in_multiplier != 1.0:
            x = x * self.in_multiplier
        projs = project_together(x, [getattr(self, f"in_proj_{p}") for p in PARTS])
        z, xs, b, c, dt = (y if m == 1.0 else y * m for y, m in zip(projs, self.proj_multipliers))
        if cache is None:
            conv_states, scan_state, valid = (None, None, None), None, None
        else:
            *conv_states, scan_state = cache.read()
            valid = cache.valid
        mixed, new_conv = [], []
        for y, part, state in zip((xs, b, c), "xBC", conv_states):
            weight, bias = getattr(self, f"conv_{part}"), getattr(self, f"conv_{part}_bias")
            heads, dim = y.shape[-2:]
            flat_state = None if state is None else state.reshape(B, W - 1, heads * dim)
            out, new_state = conv_op.causal_conv1d(
                y.reshape(B, T, heads * dim), weight[...].reshape(heads * dim, W), flat_state, valid=valid,
                bias=None if bias is None else bias[...].reshape(heads * dim))
            mixed.append(out.reshape(B, T, heads, dim))
            if per_token:
                new_state = conv_states_per_token(flat_state, y.reshape(B, T, heads * dim), valid)
            new_conv.append(new_state.reshape(new_state.shape[:-1] + (heads, dim)))
        A = -jnp.exp(self.A_log[...].astype(jnp.float32))
        xs, b, c = mixed
        scan = functools.partial(ssd_op.mamba2_ssd, A=A, D=self.D[...], dt_bias=self.dt_bias[...],
                                 dt_limit=self.dt_limit, chunk_size=self.chunk_size)
        if per_token:  # a padding token leaves the state as it was
            y, scan_state = scan_per_token(lambda t, state: scan(
                xs[:, t:t + 1], dt[:, t:t + 1], b=b[:, t:t + 1], c=c[:, t:t + 1], state=state,
                valid=jnp.clip(valid - t, 0, 1)), T, scan_state)
        else:
            y, scan_state = scan(xs, dt, b=b, c=c, state=scan_state, valid=valid)
        if cache is not None:
            cache = cache.write((*new_conv, scan_state))
        if self.norm is not None:
            y = self.norm(y, z)
        else:
            y = (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(y.dtype)
        return self.out_proj(y.astype(x.dtype)), cache

    def op_calls(self) -> list[OpCall]:
        N, H, G, Z, W = self.shape
        lo, hi = self.dt_limit
        limit = dict(limit=f"{lo:g}..{hi:g}") if (lo, hi) != (0.0, float("inf")) else {}
        calls = [OpCall.of("causal_conv1d", C=N * H + 2 * G * Z, W=W),
                 OpCall.of("mamba2_ssd", N=N, H=H, G=G, Z=Z, chunk=self.chunk_size, **limit)]
        if self.norm is not None:
            calls.append(OpCall.of("gated_rms_norm", N=N, H=H, G=G, order=self.norm.order))
        return calls

