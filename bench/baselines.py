"""jax's own Hopper kernels, shipped in the jax wheel, as baselines beside ours in bench/kernels.py.

`jax.experimental.pallas.ops.gpu.attention_mgpu` (causal flash attention, no window, soft-cap or sinks) for the
attention op, and `ragged_dot_mgpu` for the MoE grouped matmul. Each baseline takes a bench case's arguments and
returns (jitted function, its array arguments), or raises NotImplementedError for a case it cannot take; the
caller checks its output against the reference and times it like one of our implementations.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def _jax_attention(args: tuple, kwargs: dict) -> tuple[Callable, list]:
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    q, k, v = args
    if kwargs.get("sliding_window") or kwargs.get("logit_softcap") or kwargs.get("sinks") is not None:
        raise NotImplementedError("no window, soft-cap or sinks in jax's attention_mgpu")
    if q.shape[1] != k.shape[1] or not kwargs.get("causal", True):
        raise NotImplementedError("jax's attention_mgpu is bench-compared on causal self-attention only")
    scale = kwargs.get("scale") or q.shape[-1] ** -0.5
    q = (q.astype(jnp.float32) * scale).astype(q.dtype)  # its logits are unscaled: scale q once, outside the timing
    config = attention_mgpu.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, causal=True)
    return jax.jit(lambda q, k, v: attention_mgpu.attention(q, k, v, config)), [q, k, v]


def _jax_ragged_dot(args: tuple, kwargs: dict) -> tuple[Callable, list]:
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    lhs, rhs, group_sizes = args
    if not isinstance(rhs, jax.Array) or rhs.ndim != 3:
        raise NotImplementedError("jax's ragged_dot_mgpu takes float experts [G, D, F]")
    block_n = 128 if rhs.shape[2] % 128 == 0 else 64
    grid_block_n = next(g for g in (8, 4, 2, 1) if rhs.shape[2] % (g * block_n) == 0)
    fn = jax.jit(lambda lhs, rhs, sizes: ragged_dot_mgpu.ragged_dot(
        lhs, rhs, group_sizes=sizes, block_m=128, block_n=block_n, block_k=64, max_concurrent_steps=4,
        grid_block_n=grid_block_n))
    return fn, [lhs, rhs, group_sizes.astype(jnp.int32)]


# op -> (row name, baseline); only where a GPU runs them (they are compiled Mosaic GPU kernels).
BASELINES: dict[str, tuple[str, Callable]] = {
    "attention": ("jax attention_mgpu", _jax_attention),
    "moe": ("jax ragged_dot_mgpu", _jax_ragged_dot),
}
