"""Low-rank adapters (LoRA) on a `Linear`: y = base(x) + scale * (dropout(x) A^T) B^T, as PEFT's `lora.Linear`
computes it, with A [r, in] and B [out, r] in PEFT's layouts (the map's input and output dims flattened).

`LoRALinear` holds one trainable adapter (fine-tuning); `MultiLoRALinear` holds the served adapters of a module, one
slot each, and each batch row takes its own (serving several adapters at once, `day0jax.adapters`)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.core.errors import TrainingError
from day0jax.layers.linear import Linear

DENSE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


_DROPOUT: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("lora_dropout_key", default=None)


@contextlib.contextmanager
def _tracing_with(var: contextvars.ContextVar, value):
    """`var` set to `value` for the block: what the layers of a model call read while it is traced."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def dropout_key(key: jax.Array | None):
    """While tracing a training step: the random key of its LoRA dropout masks (each adapter draws from it folded
    with its own index). None, and outside any training step: no dropout (evaluation, inference)."""
    return _tracing_with(_DROPOUT, key)


class LoRAParam(nnx.Param):
    """A trainable adapter matrix: its own variable type, so that training splits adapters from the frozen base."""


class LoRALinear(Linear):
    """A `Linear` with its base kernel and bias (shared, frozen by the trainer) plus `lora_a` [r, I] and `lora_b`
    [O, r] (I, O: the products of the input and output dims), scaled by `alpha / r`.

    Initialised as PEFT initialises LoRA: A Kaiming-uniform (torch's `kaiming_uniform_(a=sqrt(5))`: U(-1/sqrt(I),
    1/sqrt(I))), B zero, so that the adapted map starts equal to the base. `dropout` p: within a training step
    (`dropout_key`), the adapter's input keeps each element with probability 1 - p, scaled by 1 / (1 - p), as
    torch's `nn.Dropout` before PEFT's lora_A; `index` tells this adapter's masks from the others'.
    """

    def __init__(self, base: Linear, rank: int, alpha: float, *, rngs: nnx.Rngs, dropout: float = 0.0,
                 index: int = 0):
        self.in_shape, self.out_shape = base.in_shape, base.out_shape
        self.kernel, self.bias, self.quantizable = base.kernel, base.bias, base.quantizable
        I, O = math.prod(self.in_shape), math.prod(self.out_shape)
        bound = 1.0 / math.sqrt(I)
        a = jax.random.uniform(rngs.params(), (rank, I), jnp.float32, -bound, bound)
        self.lora_a = LoRAParam(a)
        self.lora_b = LoRAParam(jnp.zeros((O, rank), jnp.float32))
        self.rank, self.alpha = rank, float(alpha)
        self.dropout, self.index = float(dropout), index

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def __call__(self, x: jax.Array) -> jax.Array:
        y = super().__call__(x)
        lead = x.shape[: x.ndim - len(self.in_shape)]
        flat = x.reshape(*lead, -1).astype(self.lora_a.dtype)
        key = _DROPOUT.get()
        if self.dropout and key is not None:
            keep = jax.random.bernoulli(jax.random.fold_in(key, self.index), 1.0 - self.dropout, flat.shape)
            flat = jnp.where(keep, flat / (1.0 - self.dropout), 0.0)
        delta = low_rank_product(flat.reshape(-1, flat.shape[-1]), self.lora_a[...], self.lora_b[...], self.scale)
        return y + delta.reshape(*lead, *self.out_shape).astype(y.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def low_rank_product(x: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """x [N, I] -> scale * (x A^T) B^T [N, O], A [r, I], B [O, r]: the adapter's term, with a gradient whose products
    all contract the N rows of two row-major operands with the small one transposed. Autodiff's own dB = g^T (x A^T)
    had XLA:CPU copy g [N, O] into [O, N] first, a quarter of a LoRA training step. Products in true float32 even
    where the base's are bfloat16 (no TF32 on GPUs), as PEFT's float32 adapters compute."""
    return _low_rank_forward(x, a, b, scale)[0]


def _mm(x, y):
    return jnp.matmul(x, y, precision=jax.lax.Precision.HIGHEST)


def _low_rank_forward(x, a, b, scale):
    u = _mm(x, a.T)  # [N, r]
    return _mm(u, b.T) * scale, (x, a, b, u)


def _low_rank_backward(scale, residuals, g):
    x, a, b, u = residuals
    gu = _mm(g, b) * scale  # [N, r]
    db = _mm(u.T * scale, g)  # [r, O]: the small u transposed, not g
    da = _mm(gu.T, x)  # [r, I]
    return _mm(gu, a), da, db.T


low_rank_product.defvjp(_low_rank_forward, _low_rank_backward)


def module_at(model: nnx.Module, path: tuple):
    """The sub-module (or variable) at `path`: attribute names and layer indices."""
    node = model
    for part in path:
        node = node[part] if isinstance(part, int) else getattr(node, part)
    return node


def replace_module_at(model: nnx.Module, path: tuple, module: nnx.Module) -> None:
    """Puts `module` at `path` (as `module_at` reads it) in place of what is there."""
    parent = module_at(model, path[:-1])
    if isinstance(path[-1], int):
        parent[path[-1]] = module
    else:
        setattr(parent, path[-1], module)


def lora_targets(model: nnx.Module, targets) -> list[tuple]:
    """The paths of the `Linear`s named in `targets` (HF module names such as q_proj) that would take adapters, in
    parameter order; the model may be abstract (`nnx.eval_shape`): the fine-tuning memory plan walks it before any
    weight is read.

    Raises:
        TrainingError: a target that is not a `Linear` (MoE experts' stacked weights, a map whose kernel a layer
            reads itself), or no module of those names. A quantized base is a target: it stays frozen (QLoRA).
    """
    targets = set(targets)
    found: list[tuple] = []
    for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        path = tuple(path)
        hits = [i for i, part in enumerate(path) if part in targets]
        if not hits:
            continue
        owner = path[: hits[-1] + 1]
        module = module_at(model, owner)
        if not isinstance(module, nnx.Module):
            raise TrainingError(f"{'.'.join(map(str, path))}: LoRA on MoE experts' stacked weights is not "
                                "implemented; leave the expert projections out of --lora-targets")
        if type(module) is not Linear:
            raise TrainingError(f"{'.'.join(map(str, owner))} is a {type(module).__name__}, not a plain linear map: "
                                "LoRA on it is not implemented")
        if not module.quantizable:
            raise TrainingError(f"{'.'.join(map(str, owner))}: its layer reads the kernel itself, so an adapter "
                                "would be bypassed; LoRA on it is not implemented")
        if owner not in found:
            found.append(owner)
    if not found:
        raise TrainingError(f"no module named {sorted(targets)} in this {model.config.model_type} model")
    return found


# --- served adapters: several at once, one per batch row ---------------------------------------------------------

_ROWS: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("adapter_rows", default=None)


def adapter_rows(rows: jax.Array | None):
    """While tracing a model call: each batch row's adapter slot ([B] int32, 0: none), which every
    `MultiLoRALinear` in the call reads. A trace-time context rather than an argument, so that no layer of any family
    passes it along; the array itself is an input of the traced program. None: the call has no adapted modules."""
    return _tracing_with(_ROWS, rows)


class AdapterStack(nnx.Variable):
    """Served adapters' matrices, one slot per adapter (slot 0: zeros, no adapter). Not an `nnx.Param`: they are not
    in the checkpoint, and neither conversion, the loader's parameter list nor training sees them."""


class MultiLoRALinear(Linear):
    """A `Linear` plus the served adapters of its module, each row of a batch taking its own (the Punica / S-LoRA
    gathered product): y[b] = base(x[b]) + (x[b] A[s_b]^T) B[s_b]^T, with `lora_a` [S, R, I] and `lora_b` [S, O, R],
    B already scaled by its adapter's alpha / r, ranks below R padded with zeros (which add nothing), and s_b the
    row's slot from `adapter_rows`. The base kernel may be quantized: the adapter adds to its output in float."""

    def __init__(self, base: Linear, lora_a, lora_b):
        self.in_shape, self.out_shape = base.in_shape, base.out_shape
        self.kernel, self.bias, self.quantizable = base.kernel, base.bias, base.quantizable
        self.lora_a, self.lora_b = AdapterStack(lora_a), AdapterStack(lora_b)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = super().__call__(x)
        rows = _ROWS.get()
        if rows is None:
            raise RuntimeError("a module with served LoRA adapters was called outside `adapter_rows`: this program "
                               "does not say which adapter each row takes")
        lead = x.shape[: x.ndim - len(self.in_shape)]
        B = rows.shape[0]
        if not lead or lead[0] != B:
            raise RuntimeError(f"adapter rows for {B} batch rows, but the input's leading dims are {lead}")
        with jax.named_scope("lora"):
            flat = x.reshape(B, -1, math.prod(self.in_shape)).astype(self.lora_a.dtype)  # [B, N, I]
            a, b = self.lora_a[...][rows], self.lora_b[...][rows]  # [B, R, I], [B, O, R]
            delta = jnp.einsum("bnr,bor->bno", jnp.einsum("bni,bri->bnr", flat, a), b)
        return y + delta.reshape(*lead, *self.out_shape).astype(y.dtype)
