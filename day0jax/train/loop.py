"""The training loop: optimizer steps over batches, report lines, validation loss, periodic saves."""

from __future__ import annotations

import itertools
import logging
import math
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from day0jax.core.errors import TrainingError
from day0jax.layers.lora import LoRALinear
from day0jax.train import step as step_lib
from day0jax.train.data import Batch
from day0jax.train.resume import SavedState
from day0jax.train_plan import TRAIN_DTYPES, default_train_dtype

log = logging.getLogger(__name__)

FINE_TUNE_TYPES = ("lora", "full")


@dataclass(frozen=True)
class TrainConfig:
    """The optimizer, its schedule and the loop's cadence (the command line's flags of the same names)."""

    iters: int = 1000
    learning_rate: float = 1e-4
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    lr_schedule: str = "constant"
    warmup: int = 0
    grad_accumulation: int = 1
    steps_per_report: int = 10
    steps_per_eval: int = 200
    save_every: int = 100
    grad_checkpoint: bool = False  # recompute each decoder layer's activations in the backward pass
    seed: int = 0  # LoRA dropout's masks: step k's from the key of `seed` folded with k
    # The forward and backward's dtype, 'float32' or 'bfloat16' (None: `train_plan.default_train_dtype`, float32 on
    # the CPU backend, bfloat16 on accelerators). In bfloat16 the trained parameters stay float32 masters, and so do
    # the gradients and the optimizer's state; LoRA's base must be loaded in this dtype (`day0jax.load(dtype=)`).
    dtype: str | None = None

    def __post_init__(self):
        if self.dtype is not None and self.dtype not in TRAIN_DTYPES:
            raise TrainingError(f"--dtype {self.dtype!r} is not one of {', '.join(TRAIN_DTYPES)}")
        if self.iters < 0:
            raise TrainingError(f"--iters {self.iters}: must be 0 or more")
        if self.grad_accumulation < 1:
            raise TrainingError(f"--grad-accumulation {self.grad_accumulation}: must be at least 1")
        for name in ("steps_per_report", "steps_per_eval", "save_every"):
            if getattr(self, name) < 1:
                raise TrainingError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be at least 1")
        if self.learning_rate <= 0:
            raise TrainingError(f"--learning-rate {self.learning_rate}: must be positive")
        if self.warmup < 0 or (self.iters and self.warmup > self.iters):
            raise TrainingError(f"--warmup {self.warmup}: must be between 0 and --iters ({self.iters})")


@dataclass
class TrainResult:
    """Per-step losses and learning rates (of the steps this call ran), the validation losses ((step, loss) pairs),
    the tokens trained on and the optimizer's final state."""

    losses: list[float] = field(default_factory=list)
    learning_rates: list[float] = field(default_factory=list)
    validation: list[tuple[int, float]] = field(default_factory=list)
    tokens: int = 0
    opt_state: Any = None  # the optimizer's state after the last step (what a save for --resume keeps)


def peak_memory() -> tuple[int, str]:
    """(bytes, what): the device's peak use where the backend reports it, else the process's peak resident set."""
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "device"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "host"


def mesh_of(tree):
    """The mesh the model's parameters in `tree` live on (None: not placed on one)."""
    from jax.sharding import NamedSharding

    return next((x.sharding.mesh for x in jax.tree.leaves(tree) if isinstance(x.sharding, NamedSharding)), None)


def _placed_like(tree, mesh):
    """`tree` on `mesh`: leaves sharded on it already (a full fine-tune's tp-split weights and their optimizer
    moments) stay as they are, the others (adapters made on one device, step counts) are replicated, where the
    step's outputs land: inputs placed otherwise would compile the step a second time."""
    from jax.sharding import NamedSharding, PartitionSpec

    if mesh is None:
        return tree
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(x):
        on_mesh = isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
        return x if on_mesh else jax.device_put(x, replicated)
    return jax.tree.map(place, tree)


def fully_sharded(tree, mesh):
    """Trained weights split over the mesh's data axes (dp, ep) as well (FSDP): in each leaf, the first dim not
    split yet that they divide, added to what tp already splits. Every device then keeps its share of the weights,
    their gradients and their optimizer moments; XLA gathers a weight where a step uses it. A leaf already split over
    a data axis (experts over ep), or with no such dim, keeps its placement."""
    from jax.sharding import NamedSharding, PartitionSpec

    axes = tuple(a for a in ("dp", "ep") if mesh.shape.get(a, 1) > 1)
    n = math.prod(mesh.shape[a] for a in axes)

    def split(x):
        if not axes or not isinstance(x.sharding, NamedSharding):
            return x
        spec = list(x.sharding.spec) + [None] * (x.ndim - len(x.sharding.spec))
        used = {a for entry in spec for a in ((entry,) if isinstance(entry, str) else entry or ())}
        if used & set(axes):
            return x
        for d, entry in enumerate(spec):
            if entry is None and x.shape[d] % n == 0:
                spec[d] = axes if len(axes) > 1 else axes[0]
                return jax.device_put(x, NamedSharding(mesh, PartitionSpec(*spec)))
        return x
    return jax.tree.map(split, tree)


def _batch_on(mesh, *arrays, uneven_ok: bool = False):
    """Host arrays [..., B, T] onto `mesh`, rows split over its data axes (dp, ep): each device computes its rows'
    loss and gradients, which the step's sums gather (None: as they are, for one device). `uneven_ok`: rows that do
    not split evenly (an evaluation's last batch) go to every device whole instead.

    Raises:
        TrainingError: rows that do not split evenly over the data axes (unless `uneven_ok`).
    """
    data = 1 if mesh is None else mesh.shape.get("dp", 1) * mesh.shape.get("ep", 1)
    rows = arrays[0].shape[-2]
    if mesh is None or mesh.size == 1 or (uneven_ok and rows % data):
        return tuple(jnp.asarray(a) for a in arrays)
    from sharding.rules import put

    if rows % data:
        raise TrainingError(f"--batch-size {rows}: the mesh splits each batch's rows over dp x ep = {data} devices; "
                            f"use a multiple of {data}")
    return tuple(put(a, mesh, (None,) * (a.ndim - 2) + ("batch", None)) for a in arrays)


def _mesh_context(mesh):
    """The mesh as the context the model's sharding constraints read (`sharding.rules.constrain`), while tracing."""
    import contextlib

    return contextlib.nullcontext() if mesh is None or mesh.size == 1 else jax.set_mesh(mesh)


def _loss_sum(graphdef, params, rest, tokens, mask, compute=None):
    return step_lib.loss_sum(nnx.merge(graphdef, step_lib.compute_copy(params, compute), rest), tokens, mask)


# One jitted function for every evaluation: compiled once per model structure and batch shape, not per call.
_jitted_loss_sum = jax.jit(_loss_sum, static_argnums=(0, 5))


def compute_dtype(model: nnx.Module, dtype) -> jnp.dtype | None:
    """What the trained parameters are cast to for the forward and backward in training precision `dtype`: a full
    fine-tune's float32 masters to bfloat16; None (as they are) in float32, and for LoRA's adapters, which compute
    in float32 on the base's output whatever its dtype (as PEFT's adapters do)."""
    dtype = jnp.dtype(dtype)
    return None if dtype == jnp.float32 or step_lib.has_lora(model) else dtype


def evaluate(model: nnx.Module, batches: Iterable[Batch], compute=None) -> float:
    """Mean cross-entropy over every target that counts in `batches` (all rows pooled). `compute`: the dtype the
    model's parameters are cast to for it (`compute_dtype`: a bfloat16 full fine-tune's; None: as they are)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    mesh = mesh_of(params) or mesh_of(rest)
    compute = None if compute is None else jnp.dtype(compute)
    total = count = 0.0
    with step_lib.tracing(compute or step_lib.base_dtype(model)), _mesh_context(mesh):
        for b in batches:
            t, n = _jitted_loss_sum(graphdef, params, rest, *_batch_on(mesh, b.tokens, b.mask, uneven_ok=True),
                                    compute)
            total, count = total + float(t), count + float(n)
    if not count:
        raise TrainingError("no target that counts in the evaluation data")
    return total / count


def train(model: nnx.Module, data: Iterable[Batch], config: TrainConfig, *, wrt=None,
          valid: Callable[[], Iterable[Batch]] | None = None, on_save: Callable[[int, Any, Any], None] | None = None,
          report: Callable[[str], None] = print, pad_id: int = 0, progress: bool = False,
          resume: SavedState | None = None) -> TrainResult:
    """Trains `model` in place up to step `config.iters`, each step on `config.grad_accumulation` batches from `data`.

    Args:
        model: the nnx model, with LoRA adapters applied (`lora.apply_lora`) or not (then every parameter trains).
        data: batches (an iterator is consumed as needed).
        wrt: the nnx filter of what trains; default: the adapters if any, else every parameter.
        valid: makes the validation batches, evaluated every `steps_per_eval` steps and after the last.
        on_save: called every `save_every` steps with the step number, the trainable parameters (an `nnx.State`)
            and the optimizer state (the model holds those parameters too).
        report: where report lines go.
        pad_id: the token id micro-batches of different lengths are padded with (it never counts).
        progress: a progress bar over the steps on stderr.
        resume: a save to continue from (`resume.read_state`): its parameters and optimizer state replace the
            fresh ones and the steps after its step run; `data` must start where that run's stream stood.
    The trained parameters are float32 (masters) from the first step on: a full fine-tune of a model loaded in
    bfloat16 leaves it holding float32 parameters.
    Returns:
        The `TrainResult`.
    Raises:
        TrainingError: the data runs out, a step with no target, a loss that is not finite, a `resume` whose
            tensors do not fit this run's, or LoRA on a base loaded in another dtype than `config.dtype`.
    """
    wrt = wrt if wrt is not None else step_lib.default_wrt(model)
    dtype = jnp.dtype(config.dtype or default_train_dtype())
    if step_lib.has_lora(model) and step_lib.base_dtype(model) != dtype:
        raise TrainingError(f"--dtype {dtype}: the LoRA base is loaded in {step_lib.base_dtype(model)}; load it in "
                            f"{dtype} (day0jax.load(..., dtype='{dtype}')), the frozen weights' only copy")
    compute = compute_dtype(model, dtype)
    log.info("training precision: %s", "float32" if dtype == jnp.float32 else
             f"{dtype} forward and backward on float32 master weights")
    graphdef, params, rest = nnx.split(model, wrt, ...)
    params = step_lib.masters(params)
    nnx.update(model, params)  # a bfloat16-loaded full fine-tune's weights: the masters replace them
    schedule = step_lib.schedule_fn(lr=config.learning_rate, schedule=config.lr_schedule, warmup=config.warmup,
                                    iters=config.iters)
    tx = step_lib.optimizer(config.optimizer, schedule, config.weight_decay)
    opt_state = tx.init(params)
    first = 1
    if resume is not None:
        params, opt_state = jax.tree.map(jnp.asarray, resume.restore(params, opt_state))
        nnx.update(model, params)
        first = resume.step + 1
    mesh = mesh_of(rest) or mesh_of(params)
    params = _placed_like(params, mesh)
    if mesh is not None and not step_lib.has_lora(model):  # full fine-tuning: FSDP over the data axes
        params = fully_sharded(params, mesh)
    if mesh is not None:  # each optimizer moment where its parameter is (a tp-split weight's split the same way)
        opt_state = optax.tree_map_params(tx, lambda s, p: jax.device_put(s, p.sharding), opt_state, params,
                                          transform_non_params=lambda s: s)
    opt_state = _placed_like(opt_state, mesh)
    step_fn = step_lib.make_step(tx, graphdef, config.grad_checkpoint, compute)
    # A key per step only where some adapter drops out: a step without dropout stays one program without a key.
    dropout = any(isinstance(m, LoRALinear) and m.dropout for _, m in nnx.iter_modules(model))
    result = TrainResult()
    batches: Iterator[Batch] = iter(data)
    window_loss, window_tokens, window_start = [], 0, time.perf_counter()
    bar = tqdm(total=config.iters, initial=first - 1, desc="training", unit="step", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    for it in range(first, config.iters + 1):
        micro = list(itertools.islice(batches, config.grad_accumulation))
        if len(micro) < config.grad_accumulation:
            raise TrainingError(f"the data ran out at step {it}")
        tokens, mask = step_lib.stack(micro, pad_id)
        if not mask[:, :, 1:].any():
            raise TrainingError(f"step {it}: its batches have no target that counts")
        with step_lib.tracing(dtype), _mesh_context(mesh):
            key = jax.random.fold_in(jax.random.key(config.seed), it) if dropout else None
            params, opt_state, loss, _ = step_fn(params, rest, opt_state, *_batch_on(mesh, tokens, mask), key)
        loss = float(loss)
        if not math.isfinite(loss):
            raise TrainingError(f"step {it}: the loss is {loss}; lower --learning-rate")
        lr = step_lib.learning_rate(it, lr=config.learning_rate, schedule=config.lr_schedule, warmup=config.warmup,
                                    iters=config.iters)
        n_tokens = sum(b.lengths for b in micro)
        result.losses.append(loss)
        result.learning_rates.append(lr)
        result.tokens += n_tokens
        window_loss.append(loss)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}")
        window_tokens += n_tokens
        if it % config.steps_per_report == 0 or it == config.iters:
            seconds = time.perf_counter() - window_start
            peak, where = peak_memory()
            report(f"step {it}: train loss {np.mean(window_loss):.4f}, lr {lr:.3e}, "
                   f"{window_tokens / max(seconds, 1e-9):.1f} tokens/s, trained tokens {result.tokens}, "
                   f"peak {where} memory {peak / 2 ** 30:.3f} GiB")
            window_loss, window_tokens, window_start = [], 0, time.perf_counter()
        if valid is not None and (it % config.steps_per_eval == 0 or it == config.iters):
            nnx.update(model, params)
            val = evaluate(model, valid(), compute)
            result.validation.append((it, val))
            report(f"step {it}: validation loss {val:.4f}")
        if on_save is not None and it % config.save_every == 0:
            nnx.update(model, params)
            on_save(it, params, opt_state)
    bar.close()
    nnx.update(model, params)
    result.opt_state = opt_state
    return result

