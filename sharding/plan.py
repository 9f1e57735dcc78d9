"""The memory planner: per-device bytes of a model served on a mesh, from shapes alone, before any weight is read.

Per device, for what the engine allocates and runs (a `Workload`, from the engine's layout): each parameter's shard
at the load dtype, the KV page pool, and an estimate of the largest program's peak activations. `plan()` gives the
figures, `suggestions()` what would fit instead, `require_fit()` raises `OutOfMemoryPlan` with them.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from day0jax.core.cache_layout import KVLayer, SharedKV, StateLayer, kv_part
from day0jax.core.errors import Day0Error, OutOfMemoryPlan
from sharding import mesh as mesh_lib
from sharding.rules import KV_POOL, shard_shape

GiB = 1 << 30
# Share of a device's free memory the plan may use: XLA needs room for compiled programs, fragmentation and
# transfers beyond what the planner counts. Not applied to an explicit budget.
HEADROOM = 0.9
FP8_SCALE_BYTES = 4  # an fp8 pool's float32 scale, one per token, kv head and pool (keys, values)


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a model, all of it from shapes (no weights)."""

    params: tuple[Any, ...]  # every parameter (`day0jax.models.ParamInfo`: path, shape, logical axes)
    cache_layout: tuple[KVLayer | StateLayer | SharedKV, ...]  # per layer, what it caches
    hidden_size: int  # D
    num_heads: int  # N, the most any layer has
    vocab_size: int  # V
    ffn_per_token: int  # F a token passes through, the most of any layer (MoE: k x expert F, plus shared experts)
    context_length: int  # the model's own
    moe_top_k: tuple[int, ...] = ()  # experts each token visits, one entry per MoE layer
    # The multi-token-prediction layers' caches (speculative decoding): pages beside the layers', same pool layout
    mtp_cache_layout: tuple[KVLayer, ...] = ()

    @classmethod
    def from_model(cls, model: Any, params: Sequence[Any], context_length: int) -> "ModelShape":
        """From a model's `cache_layout()` and `op_calls()`, and its parameters.

        Args:
            model: a `day0jax.models.base.CausalLM`, abstract (from `nnx.eval_shape`) or real.
            params: its parameters (`day0jax.models.param_infos`: path, shape, logical axes).
            context_length: the model's context.
        """
        ffn: dict[Any, int] = {}
        top_k: dict[Any, int] = {}
        heads = 0
        for layer, call in model.op_calls():
            if call.op == "mlp":
                ffn[layer] = ffn.get(layer, 0) + call["F"]
            elif call.op == "moe":
                ffn[layer] = ffn.get(layer, 0) + call["k"] * call["F"]
                top_k[layer] = call["k"]
            elif call.op in ("attention", "sparse_attention", "block_sparse_attention"):
                heads = max(heads, call["N"])
        # A vision-language model's language model holds the embeddings.
        V, D = getattr(model, "language_model", model).model.embed_tokens.weight.shape
        return cls(params=tuple(params), cache_layout=tuple(model.cache_layout()),
                   hidden_size=D, num_heads=heads, vocab_size=V, ffn_per_token=max(ffn.values(), default=0),
                   context_length=int(context_length), moe_top_k=tuple(top_k.values()),
                   mtp_cache_layout=tuple(getattr(model, "mtp_cache_layout", list)()))

    @property
    def kv_layers(self) -> list[KVLayer]:
        """What every layer that caches keys and values caches (a state layer's `kv` part included)."""
        return [kv for kv in map(kv_part, self.cache_layout) if kv is not None]

    @property
    def state_layers(self) -> list[StateLayer]:
        return [x for x in self.cache_layout if isinstance(x, StateLayer)]


@dataclass(frozen=True)
class Workload:
    """What the engine allocates and runs, as far as memory goes (`day0jax.engine.config.EngineLayout`)."""

    kv_slots: int  # token slots per layer in the KV page pool (pages x page size, the trash page included)
    forward_shapes: tuple[tuple[int, int, int], ...]  # (rows, tokens, attended positions) of every forward program
    sampler_rows: int  # the largest batch the sampler sees
    max_num_seqs: int  # the engine's limits, for messages
    max_model_len: int
    # Key positions a prefill program's attention scores at a time (the CPU's key-block loop); None: the whole span.
    score_block: int | None = None
    # Decode steps read the pages in place on a one-device mesh (the CPU's decode attention kernel): no gathered span
    # or score buffers among XLA's.
    decode_in_place: bool = False
    state_slots: int = 0  # per-sequence state slots of linear-attention layers (the trash slot included)
    # (window, token slots) of sliding-window layers whose pool holds only their window (per sequence), in place of
    # `kv_slots`
    window_slots: tuple[tuple[int, int], ...] = ()
    # Token slots per page: compressed entries are kept per page of the pool (`CompressedKV.per_page`).
    page_size: int = 16
    # "auto": keys and values in the plan's dtype; "fp8": one byte each, plus a float32 scale per token and kv head
    # (FP8_SCALE_BYTES).
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True)
class Plan:
    """Per-device memory of a model on a mesh, planned for an engine workload; every figure in bytes."""

    mesh: str  # as a SPEC, 'dp=2,tp=4'
    sizes: dict[str, int]
    devices: int
    dtype: str  # of parameters and compute (and of the KV cache unless `kv_dtype` says otherwise)
    kv_slots: int
    max_num_seqs: int
    max_model_len: int
    largest_program: tuple[int, int, int]  # (rows, tokens, attended positions) of the one with the most activations
    params_bytes: int  # this and the next two: per device (the largest share, where uneven)
    kv_cache_bytes: int
    activation_bytes: int
    model_bytes: int  # all parameters, unsharded
    available_bytes: int | None  # what one device may use (None: unknown, assumed to fit)
    notes: tuple[str, ...] = field(default=())
    state_bytes: int = 0  # per device: linear-attention state slots
    state_slots: int = 0
    # With pipeline stages (pp > 1): each stage's layers as (first, end); the per-device figures are the fullest
    # stage's.
    stages: tuple[tuple[int, int], ...] = ()
    kv_dtype: str = ""  # what the KV pages hold: the dtype's name, or float8_e4m3fn (+ float32 scales)

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.kv_cache_bytes + self.state_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.available_bytes is None or self.total_bytes <= self.available_bytes

    def summary(self) -> str:
        """One line for logs: the total per device, its parts, the largest program, the memory available."""
        avail = "available memory unknown" if self.available_bytes is None else \
            f"{fmt_bytes(self.available_bytes)} available"
        rows, tokens, span = self.largest_program
        return (f"{self.mesh}: {fmt_bytes(self.total_bytes)} per device (params {fmt_bytes(self.params_bytes)}, "
                f"KV cache {fmt_bytes(self.kv_cache_bytes)} ({self.kv_dtype or self.dtype}) for {self.kv_slots} token "
                "slots, "
                + (f"per-sequence state {fmt_bytes(self.state_bytes)} for {self.state_slots} sequence slots, "
                   if self.state_bytes else "") +
                f"activations {fmt_bytes(self.activation_bytes)} for the largest program, {rows} x {tokens} "
                f"tokens over {span} positions; up to {self.max_num_seqs} sequences of {self.max_model_len} "
                f"tokens)" + (f"; layers per stage {self.describe_stages()}" if self.stages else "") + f"; {avail}")

    def describe_stages(self) -> str:
        """`0-5 | 6-11`: each pipeline stage's layers."""
        return " | ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}" for a, b in self.stages)

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), total_bytes=self.total_bytes, fits=self.fits)


def fmt_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'; binary units, as device memory is reported."""
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def stored_dtype(p: Any, dtype: Any) -> Any:
    """The dtype parameter `p` (a `ParamInfo`) is stored and loaded as when the model's dtype is `dtype`: quantized
    weights' codes, scales and offsets keep their own, and so do integer tables (DeepSeek-V4's token -> experts
    table); every other parameter takes `dtype`."""
    return p.dtype if p.metadata.get("quantized") or jnp.issubdtype(p.dtype, jnp.integer) else dtype


def param_itemsize(p: Any, dtype: Any) -> int:
    """Bytes per element of parameter `p` loaded as `dtype`."""
    return jnp.dtype(stored_dtype(p, dtype)).itemsize


def params_bytes(shape: ModelShape, sizes: dict[str, int], dtype: Any) -> int:
    """Bytes of parameters one device holds."""
    return sum(math.prod(shard_shape(p.axes, p.shape, sizes)) * param_itemsize(p, dtype) for p in shape.params)


def layer_kv_bytes(layer: KVLayer | SharedKV | StateLayer, sizes: dict[str, int], kv_slots: int, dtype: Any,
                   window_slots: dict[int, int] | None = None, page_size: int = 16,
                   kv_cache_dtype: str = "auto") -> int:
    """Bytes of one layer's KV page pool on one device: `kv_slots` token slots, or for a sliding-window layer its
    window's (`window_slots`: window -> token slots, where the engine keeps only the window); 0 for a state layer
    (its `kv` part's for one that also attends, and its compressed entries', one page of them per page of
    `page_size` slots, never split) or one that keeps nothing (None). With `kv_cache_dtype` "fp8", keys and values
    take a byte each and a float32 scale per token and kv head (indexer keys and compressed entries, which fp8
    does not cover, stay in `dtype`)."""
    item = jnp.dtype(dtype).itemsize
    if isinstance(layer, KVLayer) and layer.window and window_slots and layer.window in window_slots:
        kv_slots = window_slots[layer.window]
    if isinstance(layer, SharedKV):
        return kv_slots * layer.index_dim * item
    if isinstance(layer, StateLayer) and layer.kv is not None:
        c = layer.compressed
        entries = 0 if c is None else c.entries(kv_slots, page_size) * (c.dim + c.index_dim) * item
        return entries + layer_kv_bytes(layer.kv, sizes, kv_slots, dtype, window_slots, page_size, kv_cache_dtype)
    if layer is None or isinstance(layer, StateLayer):
        return 0
    _, _, k, _ = shard_shape(KV_POOL, (1, kv_slots, layer.kv_heads, 1), sizes)
    if kv_cache_dtype == "fp8":
        return kv_slots * (k * (layer.k_dim + layer.v_dim + 2 * FP8_SCALE_BYTES) + layer.index_dim * item)
    return kv_slots * (k * (layer.k_dim + layer.v_dim) + layer.index_dim) * item


def layer_state_bytes(layer: KVLayer | SharedKV | StateLayer, sizes: dict[str, int], state_slots: int) -> int:
    """Bytes of one layer's state slots on one device (float32, split like its heads; 0 for a KV layer)."""
    if not isinstance(layer, StateLayer):
        return 0
    return sum(math.prod(shard_shape((None,) + axes, (state_slots,) + per_seq, sizes)) * 4
               for per_seq, axes in layer.arrays)


def kv_cache_bytes(shape: ModelShape, sizes: dict[str, int], kv_slots: int, dtype: Any,
                   window_slots: dict[int, int] | None = None, page_size: int = 16,
                   kv_cache_dtype: str = "auto") -> int:
    """Bytes of the KV page pool one device holds: `kv_slots` token slots per layer (sliding-window layers,
    compressed entries and fp8: see `layer_kv_bytes`)."""
    return sum(layer_kv_bytes(x, sizes, kv_slots, dtype, window_slots, page_size, kv_cache_dtype)
               for x in shape.cache_layout + shape.mtp_cache_layout)


def state_bytes(shape: ModelShape, sizes: dict[str, int], state_slots: int) -> int:
    """Bytes of the linear-attention state slots one device holds (float32, split like their heads)."""
    return sum(layer_state_bytes(x, sizes, state_slots) for x in shape.cache_layout)


def stage_split(shape: ModelShape, sizes: dict[str, int], workload: Workload, dtype: Any):
    """With `pp` in `sizes`: the pipeline's `Stages` and the fullest stage's (params, KV, state) bytes per device.

    Raises:
        MeshError: more stages than the model has layers.
    """
    from sharding.pipeline import param_bytes, plan_stages

    inner = {a: n for a, n in sizes.items() if a != "pp"}
    kv = [layer_kv_bytes(x, inner, workload.kv_slots, dtype, dict(workload.window_slots), workload.page_size,
                         workload.kv_cache_dtype) for x in shape.cache_layout]
    state = [layer_state_bytes(x, inner, workload.state_slots) for x in shape.cache_layout]
    layers = len(shape.cache_layout)
    if sizes["pp"] > layers:
        raise mesh_lib.MeshError(f"pp={sizes['pp']} needs at least as many layers; the model has {layers}")
    stages = plan_stages(shape.params, [a + b for a, b in zip(kv, state)], sizes["pp"], inner,
                         lambda p: param_itemsize(p, dtype))
    per_stage = []
    for s, layer_range in enumerate(stages.ranges):
        params = sum(param_bytes(p, inner, param_itemsize(p, dtype)) for p in shape.params
                     if s in stages.holders(p.path))
        per_stage.append((params, sum(kv[i] for i in layer_range), sum(state[i] for i in layer_range)))
    return stages, max(per_stage, key=sum)


def forward_activation_bytes(shape: ModelShape, sizes: dict[str, int], rows: int, tokens: int, span: int,
                             dtype: Any, score_block: int | None = None, decode_in_place: bool = False) -> int:
    """Estimated peak temporary bytes on one device of a forward program: `rows` x `tokens` new tokens attending
    over `span` positions. The residual stream plus the larger of attention (q/k/v, the gathered pages and the
    float32 scores, over the whole span or, for several tokens per row with `score_block`, one block of it at a time;
    neither for decode steps with `decode_in_place` on one device, whose kernel keeps its own few scores) and the
    feed-forward, plus the last position's logits. Measured against XLA:CPU's own buffer assignment
    (tests/test_sharding.py): never below it, at most about 1.5 times it. In-place decode steps keep two of the
    feed-forward's three buffers and no logits beside their result (XLA:CPU: 9.4 KiB a row for a 256-wide model
    with a 1024-wide MLP)."""
    item = jnp.dtype(dtype).itemsize
    tp = sizes.get("tp", 1)
    b = shard_shape(("batch",), (rows,), sizes)[0]
    t = tokens
    split = lambda n: n // tp if n % tp == 0 else n  # noqa: E731  (as the rules split, else replicated)
    n = split(shape.num_heads)
    kv = split(max((x.kv_heads for x in shape.kv_layers), default=0))
    k_dim = max((x.k_dim for x in shape.kv_layers), default=0)
    v_dim = max((x.v_dim for x in shape.kv_layers), default=0)
    residual = 2 * b * t * shape.hidden_size * item
    qkv = b * t * (n * k_dim + kv * (k_dim + v_dim) + n * v_dim) * item
    blocked = score_block is not None and t > 1 and span > score_block
    keys = score_block if blocked else span
    in_place = decode_in_place and t == 1 and math.prod(sizes.values()) <= 1
    gathered = 0 if in_place else b * keys * kv * (k_dim + v_dim) * item
    # float32 scores, masked scores and softmax weights: XLA:CPU keeps all three live at some lengths (two inside
    # the key-block loop's body).
    scores = 0 if in_place else (2 if blocked else 3) * b * n * t * keys * 4
    carried = b * t * n * v_dim * 4 if blocked else 0  # the loop's float32 numerators
    ffn = (2 if in_place else 3) * b * t * split(shape.ffn_per_token) * item
    # The logits are the program's result; counted where attention's buffers leave room for XLA to keep a copy.
    logits = 0 if in_place else b * split(shape.vocab_size) * 4
    return residual + max(qkv + gathered + scores + carried, ffn) + logits


def activation_bytes(shape: ModelShape, sizes: dict[str, int], workload: Workload, dtype: Any
                     ) -> tuple[int, tuple[int, int, int]]:
    """The largest program's estimated activation bytes on one device, and that program's forward shape."""
    best, largest = 0, (0, 0, 0)
    for rows, tokens, span in workload.forward_shapes:
        n = forward_activation_bytes(shape, sizes, rows, tokens, span, dtype, workload.score_block,
                                     workload.decode_in_place)
        if n > best:
            best, largest = n, (rows, tokens, span)
    # The sampler, replicated: float32 [rows, V] buffers (scaled and filtered logits, probabilities, noise, penalties).
    sampler = 6 * workload.sampler_rows * shape.vocab_size * 4
    return max(best, sampler), largest


def device_memory(devices: Sequence[Any]) -> int | None:
    """Free bytes one of this process's `devices` may use (after HEADROOM), or None when it cannot be known: the
    smallest `memory_stats()` limit minus use, else (CPU devices) the host's available memory shared equally."""
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


def plan(shape: ModelShape, mesh: Any, workload: Workload, *, dtype: Any = "float32",
         available: int | None = None) -> Plan:
    """Per-device memory of a model serving `workload` on a mesh.

    Args:
        shape: the model's `ModelShape`.
        mesh: a Mesh, AbstractMesh, SPEC string or sizes dict.
        workload: what the engine allocates and runs.
        dtype: parameter, cache and compute dtype.
        available: bytes one device may use (None: unknown; see `device_memory`).
    Returns:
        A `Plan`.
    """
    sizes = mesh_lib.mesh_sizes(mesh)
    dtype = jnp.dtype(dtype)
    notes = []
    if sizes["tp"] > 1 and not all(x.kv_heads % sizes["tp"] == 0 for x in shape.kv_layers):
        notes.append(f"kv heads are fewer than tp={sizes['tp']} (or not divisible): the KV cache is replicated "
                     "across tensor-parallel ranks")
    activations, largest = activation_bytes(shape, sizes, workload, dtype)
    if sizes["pp"] > 1:
        stages, (params, kv, state) = stage_split(shape, sizes, workload, dtype)
        ranges = tuple((r.start, r.stop) for r in stages.ranges)
    else:
        params = params_bytes(shape, sizes, dtype)
        kv = kv_cache_bytes(shape, sizes, workload.kv_slots, dtype, dict(workload.window_slots), workload.page_size,
                            workload.kv_cache_dtype)
        state, ranges = state_bytes(shape, sizes, workload.state_slots), ()
    return Plan(mesh=mesh_lib.format_spec(sizes), sizes=sizes, devices=math.prod(sizes.values()),
                dtype=str(dtype), kv_slots=workload.kv_slots, max_num_seqs=workload.max_num_seqs,
                max_model_len=workload.max_model_len, largest_program=largest, params_bytes=params,
                kv_cache_bytes=kv, activation_bytes=activations,
                model_bytes=sum(math.prod(p.shape) * param_itemsize(p, dtype) for p in shape.params),
                available_bytes=available, notes=tuple(notes), state_bytes=state, state_slots=workload.state_slots,
                stages=ranges, kv_dtype="float8_e4m3fn" if workload.kv_cache_dtype == "fp8" else str(dtype))


def largest_context(shape: ModelShape, mesh: Any, workload_for: Callable[[int], Workload], *, dtype: Any,
                    available: int, minimum: int = 64) -> int | None:
    """The largest power-of-two max_model_len (at most the model's context) whose workload fits on `mesh`, or
    None if not even `minimum`."""
    best, context = None, minimum
    while context <= max(shape.context_length, minimum):
        try:
            workload = workload_for(context)
        except Day0Error:  # no layout at this length (a pool too small for it)
            break
        if not plan(shape, mesh, workload, dtype=dtype, available=available).fits:
            break
        best, context = context, context * 2
    return best


def suggestions(p: Plan, shape: ModelShape, workload: Workload,
                workload_for: Callable[[int], Workload] | None = None, *, n_devices: int | None = None) -> list[str]:
    """What would fit when `p` does not (empty when it fits): a mesh over `n_devices` (else over 2, 4 or 8 times
    as many devices of the same size), a shorter max_model_len, fewer sequences.

    Args:
        p: the plan.
        shape, workload: what it was made for.
        workload_for: the engine's workload at another max_model_len (None: no context suggestion).
        n_devices: devices available for a mesh (default: the plan's own count).
    """
    if p.fits:
        return []
    n_devices = n_devices or p.devices
    hints = []

    def fitting(n: int) -> Plan | None:
        """The plan over `n` devices that `--mesh auto` would pick, if one fits."""
        for sizes in sorted(mesh_lib.valid_sizes(n, shape.params), key=mesh_lib.placement_key):
            q = plan(shape, sizes, workload, dtype=p.dtype, available=p.available_bytes)
            if q.fits:
                return q
        return None

    here = fitting(n_devices)
    if here:
        hints.append(f"--mesh {here.mesh} fits ({fmt_bytes(here.total_bytes)} per device)")
    else:
        for n in (2 * n_devices, 4 * n_devices, 8 * n_devices):
            more = fitting(n)
            if more:
                hints.append(f"{n} devices of this size would fit it (--mesh {more.mesh})")
                break
    if p.params_bytes > p.available_bytes:  # no engine setting helps: only more devices or fewer bytes
        if not hints:
            hints.append(f"the parameters alone need {fmt_bytes(p.params_bytes)} per device on {p.mesh}, more than "
                         f"the {fmt_bytes(p.available_bytes)} available; use more devices, a smaller dtype or "
                         "quantized weights")
        return hints
    if workload_for is not None:
        context = largest_context(shape, p.sizes, workload_for, dtype=p.dtype, available=p.available_bytes)
        if context is not None and context < p.max_model_len:
            hints.append(f"a context of {context} tokens fits on {p.mesh} (max_model_len={context})")
    if p.max_num_seqs > 1:
        hints.append(f"fewer sequences at once (max_num_seqs, now {p.max_num_seqs}) need less activation memory")
    if not hints:
        hints.append(f"the parameters alone need {fmt_bytes(p.params_bytes)} per device on {p.mesh}; use more "
                     "devices or a smaller dtype")
    return hints


def require_fit(p: Plan, shape: ModelShape, workload: Workload,
                workload_for: Callable[[int], Workload] | None = None, *, n_devices: int | None = None) -> None:
    """Raises `OutOfMemoryPlan` unless `p` fits, naming meshes and context lengths that would (`suggestions`).

    Raises:
        OutOfMemoryPlan: the plan does not fit.
    """
    if not p.fits:
        raise OutOfMemoryPlan(f"the model will not fit: {p.summary()}. Would fit: "
                              + "; or ".join(suggestions(p, shape, workload, workload_for, n_devices=n_devices)))
