"""The memory planner: per-device bytes of a model on a mesh, computed from shapes alone, before any weight is read.

Three parts, per device:
- parameters: every parameter's shard (its shape divided as `rules.partition_spec` splits it) at the load dtype;
- KV cache: per layer, batch/(dp*ep) x cached positions x kv heads (split by tp when they divide) x (key +
  value head dims), exactly what the engine allocates for that batch and cache length;
- activations, an estimate of the peak of one prefill of `context` tokens per sequence: the residual stream,
  plus the larger of attention (q/k/v and float32 scores and weights, which the reference attention
  materializes) and the feed-forward (gate, up and their product; for MoE the routed experts' share per token).
  Only the last token's logits are counted, as generation computes.

`plan()` gives the figures; `suggestions()` lists what would fit instead (a mesh, a context length, a batch);
`require_fit()` turns a plan that does not fit into an `OutOfMemoryPlan` that says so. `day0jax.load` and
`day0jax.check` use them:

    shape = ModelShape.from_model(abstract_model, context_length)
    p = plan(shape, "tp=4", batch=8, context=4096, dtype="bfloat16", available=device_memory(devices))
    p.fits, p.summary(), p.to_dict(), suggestions(p, shape, n_devices=len(devices))
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from day0jax.errors import OutOfMemoryPlan
from sharding import mesh as mesh_lib
from sharding.rules import shard_shape

GiB = 1 << 30
# Share of a device's free memory the plan may use: XLA needs room for compiled programs, fragmentation and
# transfers beyond what the planner counts. Not applied to an explicit budget.
HEADROOM = 0.9
KV_AXES = ("batch", None, "kv_heads", None)  # as the engine shards its caches


@dataclass(frozen=True)
class ParamShape:
    path: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a model, all of it from shapes (no weights).

    Attributes:
        params: every parameter's path, shape and logical axes.
        cache_layout: per layer (kv heads, key head dim, value head dim).
        hidden_size, num_heads, vocab_size: D, N, V.
        ffn_per_token: F of the feed-forward a token passes through (for MoE: experts per token x expert F,
            plus shared experts; the largest over dense and MoE layers).
        context_length: the model's own context length.
    """

    params: tuple[ParamShape, ...]
    cache_layout: tuple[tuple[int, int, int], ...]
    hidden_size: int
    num_heads: int
    vocab_size: int
    ffn_per_token: int
    context_length: int

    @classmethod
    def from_model(cls, model: Any, context_length: int | None = None) -> "ModelShape":
        """From an nnx model (abstract, from `nnx.eval_shape`, or real) with a `config` and `cache_layout()`.

        Args:
            model: a `day0jax.models.base.CausalLM` (or anything with `.config` and `.cache_layout()`).
            context_length: the model's context (default: `config.max_position_embeddings`).
        """
        from flax import nnx

        params = []
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            value = var.get_value() if hasattr(var, "get_value") else var.value
            axes = tuple(var.get_metadata().get("out_sharding") or (None,) * len(value.shape))
            params.append(ParamShape(".".join(map(str, path)), tuple(value.shape), axes))
        c = model.config
        dense = getattr(c, "intermediate_size", 0) or 0
        routed = (getattr(c, "num_experts_per_tok", 0) or 0) * (getattr(c, "moe_intermediate_size", 0) or 0)
        shared = (getattr(c, "shared_expert_intermediate_size", 0) or 0) + \
            (getattr(c, "n_shared_experts", 0) or 0) * (getattr(c, "moe_intermediate_size", 0) or 0)
        return cls(params=tuple(params), cache_layout=tuple(tuple(x) for x in model.cache_layout()),
                   hidden_size=c.hidden_size, num_heads=c.num_attention_heads, vocab_size=c.vocab_size,
                   ffn_per_token=max(dense, routed + shared),
                   context_length=int(context_length or c.max_position_embeddings))


@dataclass(frozen=True)
class Plan:
    """Per-device memory of a model on a mesh; every figure in bytes.

    Attributes:
        mesh: the mesh as a SPEC ('dp=2,tp=4'); sizes: its axis sizes; devices: their product.
        batch, context: the batch and cache length planned for; dtype: parameter and cache dtype.
        params_bytes, kv_cache_bytes, activation_bytes: per device (the largest share, where uneven).
        model_bytes: all parameters, unsharded.
        available_bytes: what one device may use (None: unknown, assumed to fit).
    """

    mesh: str
    sizes: dict[str, int]
    devices: int
    batch: int
    context: int
    dtype: str
    params_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    model_bytes: int
    available_bytes: int | None
    notes: tuple[str, ...] = field(default=())

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.kv_cache_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.available_bytes is None or self.total_bytes <= self.available_bytes

    def summary(self) -> str:
        """One line: 'tp=4: 1.23 GiB per device (params 1.00 GiB, KV cache ..., activations ...); 8.00 GiB
        available'."""
        avail = "available memory unknown" if self.available_bytes is None else \
            f"{fmt_bytes(self.available_bytes)} available"
        return (f"{self.mesh}: {fmt_bytes(self.total_bytes)} per device (params {fmt_bytes(self.params_bytes)}, "
                f"KV cache {fmt_bytes(self.kv_cache_bytes)} for batch {self.batch} x {self.context} positions, "
                f"activations {fmt_bytes(self.activation_bytes)}); {avail}")

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), total_bytes=self.total_bytes, fits=self.fits)


def fmt_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'; binary units, as device memory is reported."""
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _itemsize(dtype: Any) -> int:
    import jax.numpy as jnp

    return np.dtype(jnp.dtype(dtype)).itemsize


def params_bytes(shape: ModelShape, sizes: dict[str, int], dtype: Any) -> int:
    """Bytes of parameters one device holds."""
    item = _itemsize(dtype)
    return sum(math.prod(shard_shape(p.axes, p.shape, sizes)) * item for p in shape.params)


def kv_cache_bytes(shape: ModelShape, sizes: dict[str, int], batch: int, context: int, dtype: Any) -> int:
    """Bytes of KV cache one device holds for `batch` sequences of `context` cached positions."""
    item = _itemsize(dtype)
    total = 0
    for kv_heads, k_dim, v_dim in shape.cache_layout:
        b, s, k, _ = shard_shape(KV_AXES, (batch, context, kv_heads, 1), sizes)
        total += b * s * k * (k_dim + v_dim) * item
    return total


def activation_bytes(shape: ModelShape, sizes: dict[str, int], batch: int, context: int, dtype: Any) -> int:
    """Estimated peak activation bytes on one device for a prefill of `context` tokens per sequence."""
    item = _itemsize(dtype)
    tp = sizes.get("tp", 1)
    b = shard_shape(("batch",), (batch,), sizes)[0]
    t = context
    split = lambda n: n // tp if n % tp == 0 else n  # noqa: E731  (as the rules split, else replicated)
    n = split(shape.num_heads)
    kv = max((k for k, _, _ in shape.cache_layout), default=0)
    k_dim = max((kd for _, kd, _ in shape.cache_layout), default=0)
    v_dim = max((vd for _, _, vd in shape.cache_layout), default=0)
    residual = 2 * b * t * shape.hidden_size * item
    qkv = b * t * (n * k_dim + split(kv) * (k_dim + v_dim) + n * v_dim) * item
    # float32 scores, masked scores and softmax weights: XLA:CPU keeps all three live at some lengths
    # (measured: 128 tokens needed 1.3x the two-buffer figure).
    scores = 3 * b * n * t * t * 4
    ffn = 3 * b * t * split(shape.ffn_per_token) * item
    logits = b * split(shape.vocab_size) * 4
    return residual + max(qkv + scores, ffn) + logits


def device_memory(devices: Sequence[Any]) -> int | None:
    """Free bytes one of `devices` may use (this process's devices only), or None when it cannot be known.

    Accelerators report `memory_stats()` (limit minus in use; the smallest over the devices). CPU devices share
    the host's memory, so each gets the host's available memory divided by the local devices in `devices`.
    """
    import jax

    local = [d for d in devices if getattr(d, "process_index", 0) == jax.process_index()] or list(devices)
    free = []
    for d in local:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if stats and "bytes_limit" in stats:
            free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
    if free:
        return int(min(free) * HEADROOM)
    host = _host_available()
    return None if host is None else int(host * HEADROOM) // len(local)


def _host_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def plan(shape: ModelShape | Any, mesh: Any, *, batch: int = 1, context: int | None = None,
         dtype: Any = "float32", available: int | None = None) -> Plan:
    """Per-device memory of a model on a mesh.

    Args:
        shape: a `ModelShape`, or a model (abstract or real) to build one from.
        mesh: a Mesh, AbstractMesh, SPEC string or sizes dict.
        batch: sequences decoded together (the engine's batch bucket: a multiple of dp * ep).
        context: cached positions per sequence (default: the model's context length).
        dtype: parameter, cache and compute dtype.
        available: bytes one device may use (None: unknown; see `device_memory`).
    Returns:
        A `Plan`.
    """
    if not isinstance(shape, ModelShape):
        shape = ModelShape.from_model(shape)
    sizes = mesh_lib.mesh_sizes(mesh)
    context = int(context or shape.context_length)
    import jax.numpy as jnp

    item = _itemsize(dtype)
    notes = []
    kv_split = [k % sizes["tp"] == 0 for k, _, _ in shape.cache_layout]
    if sizes["tp"] > 1 and not all(kv_split):
        notes.append(f"kv heads are fewer than tp={sizes['tp']} (or not divisible): the KV cache is replicated "
                     "across tensor-parallel ranks")
    return Plan(mesh=mesh_lib.format_spec(sizes), sizes=sizes, devices=math.prod(sizes.values()), batch=batch,
                context=context, dtype=str(jnp.dtype(dtype)),
                params_bytes=params_bytes(shape, sizes, dtype),
                kv_cache_bytes=kv_cache_bytes(shape, sizes, batch, context, dtype),
                activation_bytes=activation_bytes(shape, sizes, batch, context, dtype),
                model_bytes=sum(math.prod(p.shape) for p in shape.params) * item,
                available_bytes=available, notes=tuple(notes))


def largest_context(shape: ModelShape, mesh: Any, *, batch: int, dtype: Any, available: int,
                    minimum: int = 64) -> int | None:
    """The largest power-of-two context (at most the model's) that fits on `mesh`, or None if not even `minimum`."""
    best = None
    context = minimum
    while context <= max(shape.context_length, minimum):
        if plan(shape, mesh, batch=batch, context=context, dtype=dtype, available=available).fits:
            best = context
        else:
            break
        context *= 2
    return best


def suggestions(p: Plan, shape: ModelShape, *, n_devices: int | None = None) -> list[str]:
    """What would fit when `p` does not: a mesh over the devices there are (or over more of them), a shorter
    context, a smaller batch. Empty when `p` fits.

    Args:
        p: the plan.
        shape: the model it was made for.
        n_devices: devices available for a mesh (default: the plan's own count); meshes over these, then over 2,
            4 and 8 times as many devices of the same size, are tried.
    """
    if p.fits:
        return []
    n_devices = n_devices or p.devices
    hints = []

    def fitting(n: int) -> list[Plan]:
        plans = [plan(shape, s, batch=p.batch, context=p.context, dtype=p.dtype, available=p.available_bytes)
                 for s in mesh_lib.valid_sizes(n, shape.params)]
        # Fewest model-parallel devices first: the rest serve as data-parallel replicas.
        return sorted((q for q in plans if q.fits), key=lambda q: (q.sizes["tp"] * q.sizes["ep"], -q.sizes["tp"]))

    here = fitting(n_devices)
    if here:
        hints.append(f"--mesh {here[0].mesh} fits ({fmt_bytes(here[0].total_bytes)} per device)")
    else:
        for n in (2 * n_devices, 4 * n_devices, 8 * n_devices):
            more = fitting(n)
            if more:
                hints.append(f"{n} devices of this size would fit it (--mesh {more[0].mesh})")
                break
    context = largest_context(shape, p.sizes, batch=p.batch, dtype=p.dtype, available=p.available_bytes)
    if context is not None and context < p.context:
        hints.append(f"a context of {context} tokens fits on {p.mesh} (max_context={context})")
    if p.batch > p.sizes["dp"] * p.sizes["ep"]:
        hints.append(f"a smaller batch (now {p.batch}) needs less KV cache")
    if not hints:
        hints.append(f"the parameters alone need {fmt_bytes(p.params_bytes)} per device on {p.mesh}; use more "
                     "devices or a smaller dtype")
    return hints


def require_fit(p: Plan, shape: ModelShape, *, n_devices: int | None = None) -> None:
    """Raises `OutOfMemoryPlan` unless `p` fits, naming meshes and context lengths that would (`suggestions`).

    Raises:
        OutOfMemoryPlan: the plan does not fit.
    """
    if not p.fits:
        raise OutOfMemoryPlan(f"the model will not fit: {p.summary()}. Would fit: "
                              + "; or ".join(suggestions(p, shape, n_devices=n_devices)))
