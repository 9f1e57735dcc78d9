"""The loss, its gradients and one optimizer step, as pure functions of the split model (jitted once per shape).

The model's operators are traced through their references (`kernels_pallas` policy 'reference'): those are plain
jax.numpy and differentiable, where some kernels (the CPU linear kernel, Pallas kernels) have no gradient.
Float32 models multiply in true float32 (`exact_float32`), as the parity tests need.

Mixed precision (bfloat16 training): the trained parameters are float32 masters, which the optimizer updates and
keeps its moments for; the differentiated function casts them to the compute dtype (`compute_copy`), so the forward
and backward multiply in bfloat16 while the gradients arrive in float32, with respect to the masters. Updates below
bfloat16's resolution of a weight then still accumulate. The logits, their cross-entropy and the loss stay float32.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from day0jax.core.errors import TrainingError
from day0jax.layers.lora import dropout_key
from day0jax.layers.linear import exact_float32
from day0jax.models.base import rematerialized_layers
from day0jax.train.data import Batch
from kernels_pallas import registry


@contextlib.contextmanager
def tracing(dtype=jnp.float32):
    """The context every training program is traced in: reference operators, exact float32 products."""
    with registry.use_policy(registry.Policy("reference")), exact_float32(dtype):
        yield


def forward_hidden(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    """tokens int32 [B, T] -> the final hidden states [B, T, D]: a full forward pass at positions 0..T-1, no cache."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return model(tokens, positions)[0]


def forward_logits(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    """tokens int32 [B, T] -> float32 logits [B, T, V]."""
    return model.logits(forward_hidden(model, tokens)).astype(jnp.float32)


def token_nll(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    """tokens int32 [B, T] -> float32 [B, T - 1]: -log p(token t + 1 | tokens <= t), from float32 logits (of the
    positions that predict a token only: no [B, T, V] array is sliced)."""
    logits = model.logits(forward_hidden(model, tokens)[:, :-1]).astype(jnp.float32)
    return cross_entropy(logits, tokens[:, 1:])


@jax.custom_vjp
def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """float32 logits [..., V], int targets [...] -> -log softmax(logits)[target], [...]. Its gradient keeps only
    the logits and their log-sum-exp, where autodiff of log_softmax kept a second [..., V] array (the size of the
    logits: 400 MB at 2048 tokens of a 49k vocabulary)."""
    return _cross_entropy_forward(logits, targets)[0]


def _cross_entropy_forward(logits, targets):
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0], (logits, targets, lse)


def _cross_entropy_backward(residuals, g):
    logits, targets, lse = residuals
    is_target = jnp.arange(logits.shape[-1]) == targets[..., None]
    d_logits = (jnp.exp(logits - lse[..., None]) - is_target) * g[..., None]  # (softmax - one-hot) * g
    return d_logits, None


cross_entropy.defvjp(_cross_entropy_forward, _cross_entropy_backward)


def loss_sum(model: nnx.Module, tokens: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of the cross-entropies of the targets that count, their number), float32."""
    weights = mask[:, 1:].astype(jnp.float32)
    return jnp.sum(token_nll(model, tokens) * weights), jnp.sum(weights)


def _split(model: nnx.Module, wrt) -> tuple[Any, nnx.State, nnx.State]:
    graphdef, params, rest = nnx.split(model, wrt, ...)
    return graphdef, params, rest


def compute_copy(params, dtype):
    """`params` as the forward and backward use them: float leaves cast to `dtype` (None: as they are). Called
    inside the differentiated function, so that the cast's gradient brings the gradients back to the masters' dtype."""
    if dtype is None:
        return params
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def masters(params):
    """The trained parameters as the optimizer keeps them: float leaves in float32 (a model loaded in bfloat16 is
    widened, exactly)."""
    return compute_copy(params, jnp.float32)


def _sum_and_grads(graphdef, params, rest, tokens, mask, remat=False, key=None, compute=None):
    def f(p):
        with rematerialized_layers(remat), dropout_key(key):
            return loss_sum(nnx.merge(graphdef, compute_copy(p, compute), rest), tokens, mask)

    (total, count), grads = jax.value_and_grad(f, has_aux=True)(params)
    return total, count, grads


_jitted_loss_and_grads = jax.jit(_sum_and_grads, static_argnums=(0, 5, 7))


def loss_and_grads(model: nnx.Module, batch: Batch, wrt=None, remat: bool = False,
                   key: jax.Array | None = None, compute=None) -> tuple[float, nnx.State]:
    """The batch's loss (mean cross-entropy over its targets that count) and its gradient with respect to the
    parameters `wrt` selects (an nnx filter; default: the LoRA adapters if the model has any, else every
    parameter). `remat`: gradient checkpointing, each decoder layer's activations recomputed in the backward pass
    (the same values, less memory). `key`: the random key of LoRA dropout's masks (None: no dropout). `compute`: the
    dtype those parameters are cast to for the forward and backward (None: as they are); the gradients keep theirs.

    Returns:
        (loss, gradients as an `nnx.State` of the same paths as those parameters).
    Raises:
        TrainingError: a batch with no target that counts.
    """
    wrt = wrt if wrt is not None else default_wrt(model)
    if batch.targets == 0:
        raise TrainingError("the batch has no target that counts (every token padding or masked prompt)")
    graphdef, params, rest = _split(model, wrt)
    with tracing(compute or base_dtype(model)):
        total, count, grads = _jitted_loss_and_grads(graphdef, params, rest, jnp.asarray(batch.tokens),
                                                     jnp.asarray(batch.mask), remat, key,
                                                     None if compute is None else jnp.dtype(compute))
    return float(total / count), jax.tree.map(lambda g: g / count, grads)


def has_lora(model: nnx.Module) -> bool:
    """Whether the model has LoRA adapters (`lora.apply_lora`)."""
    from day0jax.layers.lora import LoRAParam

    return bool(jax.tree.leaves(nnx.state(model, LoRAParam)))


def default_wrt(model: nnx.Module):
    from day0jax.layers.lora import LoRAParam

    return LoRAParam if has_lora(model) else nnx.Param


def base_dtype(model: nnx.Module):
    """The dtype the model computes in: that of its float parameters, LoRA's adapters and quantized weights (whose
    scales keep dtypes of their own) aside; float32 if it has none."""
    from day0jax.layers.lora import LoRAParam
    from day0jax.layers.quantized import QuantizedExperts, QuantizedKernel

    quantized = [tuple(p) for p, m in nnx.iter_modules(model) if isinstance(m, (QuantizedKernel, QuantizedExperts))]
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.All(nnx.Param, nnx.Not(LoRAParam)))):
        x = var.get_value()
        if jnp.issubdtype(x.dtype, jnp.floating) and not any(tuple(path[:len(q)]) == q for q in quantized):
            return jnp.dtype(x.dtype)
    return jnp.dtype(jnp.float32)


# --- optimizers and schedules ------------------------------------------------------------------------------------

OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("constant", "cosine")


def learning_rate(step: int, *, lr: float, schedule: str = "constant", warmup: int = 0, iters: int = 1) -> float:
    """The learning rate of step `step` (1-based): linear warmup lr * step / warmup over the first `warmup` steps,
    then `lr` (constant) or lr * (1 + cos(pi * (step - warmup - 1) / (iters - warmup))) / 2 (cosine), which starts
    at lr and stays above 0 at the last step."""
    if step <= warmup:
        return lr * step / warmup
    if schedule == "constant":
        return lr
    return lr * 0.5 * (1.0 + math.cos(math.pi * (step - warmup - 1) / max(iters - warmup, 1)))


def schedule_fn(*, lr: float, schedule: str, warmup: int, iters: int) -> Callable[[jax.Array], jax.Array]:
    """`learning_rate` as an optax schedule of optax's step count (0-based)."""
    if schedule not in SCHEDULES:
        raise TrainingError(f"--lr-schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")

    def fn(count):
        step = count.astype(jnp.float32) + 1.0
        warm = lr * step / max(warmup, 1)
        after = (jnp.full_like(step, lr) if schedule == "constant" else
                 lr * 0.5 * (1.0 + jnp.cos(jnp.pi * (step - warmup - 1) / max(iters - warmup, 1))))
        return jnp.where(step <= warmup, warm, after)

    return fn


def optimizer(name: str, schedule: Callable, weight_decay: float = 0.0) -> optax.GradientTransformation:
    """'adamw' (torch.optim.AdamW's defaults: betas 0.9, 0.999, eps 1e-8, decoupled decay lr * weight_decay) or
    'sgd' (plain, torch.optim.SGD's weight decay: weight_decay * p added to the gradient)."""
    if name == "adamw":
        return optax.adamw(schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)
    if name == "sgd":
        return optax.chain(optax.add_decayed_weights(weight_decay), optax.sgd(schedule))
    raise TrainingError(f"--optimizer {name!r} is not one of {', '.join(OPTIMIZERS)}")


def make_step(tx: optax.GradientTransformation, graphdef, remat: bool = False, compute=None) -> Callable:
    """One optimizer step over `A` micro-batches (tokens, mask [A, B, T]), their gradients accumulated as the
    gradient of the mean over all their targets: (params, rest, opt_state, tokens, mask, key) -> (params,
    opt_state, loss, targets); `key`: LoRA dropout's for this step (micro-batch i takes it folded with i), or None;
    `remat`: gradient checkpointing per decoder layer; `compute`: the dtype the parameters (float32 masters) are cast
    to for the forward and backward (None: as they are). Jitted: compiled once per shape."""

    def step(params, rest, opt_state, tokens, mask, key=None):
        def micro(carry, xs):
            total, count, grads = carry
            t_, m_, i = xs
            t, n, g = _sum_and_grads(graphdef, params, rest, t_, m_, remat,
                                     None if key is None else jax.random.fold_in(key, i), compute)
            return (total + t, count + n, jax.tree.map(jnp.add, grads, g)), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        (total, count, grads), _ = jax.lax.scan(micro, (jnp.float32(0), jnp.float32(0), zeros),
                                                (tokens, mask, jnp.arange(tokens.shape[0])))
        grads = jax.tree.map(lambda g: g / count, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, total / count, count

    return jax.jit(step, donate_argnums=(0, 2))


def stack(batches: list[Batch], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Micro-batches -> tokens, mask [A, B, T], each padded to the longest (padding never counts)."""
    T = max(b.tokens.shape[1] for b in batches)
    tokens = np.stack([np.pad(b.tokens, ((0, 0), (0, T - b.tokens.shape[1])), constant_values=pad_id)
                       for b in batches])
    mask = np.stack([np.pad(b.mask, ((0, 0), (0, T - b.mask.shape[1]))) for b in batches])
    return tokens, mask
