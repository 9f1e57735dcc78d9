"""Low-rank adapters (LoRA) on a `Linear`: y = base(x) + scale * (dropout(x) A^T) B^T, as PEFT's `lora.Linear`
computes it, with A [r, in] and B [out, r] in PEFT's layouts (the map's input and output dims flattened); and on MoE
experts' stacked weights, as PEFT's `ParamWrapper` adapts transformers' fused expert parameters: each expert's weight
plus scale * B_e @ A_e (`LoRAExperts`).

`LoRALinear` and `LoRAExperts` hold one trainable adapter (fine-tuning); `MultiLoRALinear` holds the served adapters
of a module, one slot each, and each batch row takes its own (serving several adapters at once, `day0jax.adapters`).
"""

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
from day0jax.layers.moe import Experts
from day0jax.layers.quantized import QuantizedExperts

DENSE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# transformers' fused expert parameters (`mlp.experts.gate_up_proj` [E, 2F, D], `mlp.experts.down_proj` [E, D, F]),
# in the order its experts module registers them (PEFT nests its wrappers in that order), and the runtime `Experts`
# weights each is made of (gate_up_proj: gate_proj's rows, then up_proj's).
EXPERT_PARAMETERS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
EXPERT_TARGETS = tuple(f"experts.{name}" for name in EXPERT_PARAMETERS)  # as PEFT's `target_parameters` spell them


def expert_parameter(target: str) -> str | None:
    """The fused expert parameter a target name asks for: PEFT's `target_parameters` spelling (`experts.gate_up_proj`,
    `experts.down_proj`, or a longer suffix such as `mlp.experts.down_proj`), or `gate_up_proj` alone, which names
    nothing else; None for a module name (`down_proj` alone names the dense MLPs' linear maps)."""
    parts = target.split(".")
    if parts[-1] == "gate_up_proj" or (parts[-1] == "down_proj" and len(parts) > 1 and parts[-2] == "experts"):
        return parts[-1]
    return None


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


class ExpertsLoRA(nnx.Module):
    """LoRA on one fused expert parameter, laid out as PEFT's `ParamWrapper` lays it out: `lora_a` [r*E, I], expert
    e's A_e its rows e*r .. e*r + r - 1, and `lora_b` [O, r*E], B_e its columns j*E + e for j < r (PEFT reshapes A to
    [E, r, I] but B to [O, r, E]); expert e's HF weight [O, I] gains alpha / r * B_e @ A_e. I, O: the HF map's input
    and output features (gate_up_proj: D -> 2F, down_proj: F -> D). Initialised as PEFT initialises it (A
    Kaiming-uniform, U(-1/sqrt(I), 1/sqrt(I)); B zero)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, rank: int, alpha: float, *,
                 rngs: nnx.Rngs):
        E, I, O = num_experts, in_features, out_features
        bound = 1.0 / math.sqrt(I)
        self.lora_a = LoRAParam(jax.random.uniform(rngs.params(), (rank * E, I), jnp.float32, -bound, bound))
        self.lora_b = LoRAParam(jnp.zeros((O, rank * E), jnp.float32))
        self.num_experts, self.rank, self.alpha = E, rank, float(alpha)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def delta(self) -> jax.Array:
        """Each expert's added weight, float32 [E, I, O]: the runtime `Experts` layout, HF's [E, O, I] transposed."""
        E, r = self.num_experts, self.rank
        a = self.lora_a[...].reshape(E, r, -1)  # [E, r, I]
        b = self.lora_b[...].reshape(-1, r, E)  # [O, r, E]
        return jnp.einsum("ore,eri->eio", b, a) * self.scale


class LoRAExperts(Experts):
    """`Experts` with their stacked weights (shared with the base, frozen by the trainer) plus an `ExpertsLoRA` for
    each fused parameter adapted (`lora_gate_up_proj`, `lora_down_proj`; None where not): each expert computes with
    its weights plus its own scale * B_e @ A_e, added inside the traced call. The merged weights cost E*I*O floats per
    adapted parameter while the call lives; in exchange the product is PEFT's exactly and the grouped matmul and its
    routing stay as they are."""

    def __init__(self, base: Experts, parameters, rank: int, alpha: float, *, rngs: nnx.Rngs):
        for name, value in vars(base).items():  # the base's weights and settings, shared
            if not name.startswith("_"):
                setattr(self, name, value)
        E, D, F = base.up_proj.shape
        adapted = set(parameters)
        self.lora_gate_up_proj = ExpertsLoRA(E, D, 2 * F, rank, alpha, rngs=rngs) if "gate_up_proj" in adapted \
            else None
        self.lora_down_proj = ExpertsLoRA(E, F, D, rank, alpha, rngs=rngs) if "down_proj" in adapted else None

    def delta(self, name: str) -> jax.Array | None:
        """What the adapters add to the stacked weight `name` (gate_proj, up_proj, down_proj), float32 [E, in, out];
        None where it is not adapted."""
        fused = next(f for f, parts in EXPERT_PARAMETERS.items() if name in parts)
        adapter = getattr(self, f"lora_{fused}")
        if adapter is None:
            return None
        delta = adapter.delta()
        F = delta.shape[-1] // len(EXPERT_PARAMETERS[fused])
        at = EXPERT_PARAMETERS[fused].index(name) * F
        return delta[..., at:at + F]

    def weight(self, name: str):
        w = super().weight(name)
        delta = self.delta(name)
        return w if delta is None else (w.astype(jnp.float32) + delta).astype(w.dtype)

    def plain(self) -> Experts:
        """An `Experts` holding this module's stacked weights and settings, without the adapters."""
        E, D, F = self.up_proj.shape
        with nnx.use_eager_sharding(False):
            plain = nnx.eval_shape(lambda: Experts(E, D, F, self.glu, use_bias=self.down_proj_bias is not None,
                                                   scale_inputs=self.scale_inputs, gated=self.gate_proj is not None,
                                                   rngs=nnx.Rngs(0)))
        for name, value in vars(plain).items():
            if not name.startswith("_"):
                setattr(plain, name, getattr(self, name))
        return plain


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
    """The paths of the adapters `targets` asks for, in parameter order, then the experts': a `Linear` named by an HF
    module name (q_proj, ...: the path of the `LoRALinear` it becomes), and for each MoE experts module the fused
    parameters named as PEFT's `target_parameters` (`experts.gate_up_proj`, `experts.down_proj`; see
    `expert_parameter`): the path `<experts>.lora_<parameter>` of its `ExpertsLoRA`. Module names adapt linear maps
    only, as PEFT's `target_modules` do: attention, dense MLPs and shared experts, never the routed experts' stacked
    weights. The model may be abstract (`nnx.eval_shape`): the fine-tuning memory plan walks it before any weight is
    read.

    Raises:
        TrainingError: a target that is not a plain `Linear` (a map whose kernel a layer reads itself), experts whose
            weights PEFT has no layout for (ungated, with biases) or that are quantized, or nothing of those names.
            A quantized base `Linear` is a target: it stays frozen (QLoRA).
    """
    targets = set(targets)
    parameters = {expert_parameter(t) for t in targets} - {None}
    names = {t for t in targets if expert_parameter(t) is None}
    experts = {tuple(path): m for path, m in nnx.iter_modules(model) if isinstance(m, Experts)}
    found: list[tuple] = []
    for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        path = tuple(path)
        hits = [i for i, part in enumerate(path) if part in names]
        if not hits:
            continue
        owner = path[: hits[-1] + 1]
        if owner[:-1] in experts:
            continue  # a routed experts' stacked weight: adapted only when its fused parameter is asked for
        module = module_at(model, owner)
        if not isinstance(module, nnx.Module) or type(module) is not Linear:
            kind = type(module).__name__ if isinstance(module, nnx.Module) else "stacked weight"
            raise TrainingError(f"{'.'.join(map(str, owner))} is a {kind}, not a plain linear map: LoRA on it is not "
                                "implemented")
        if not module.quantizable:
            raise TrainingError(f"{'.'.join(map(str, owner))}: its layer reads the kernel itself, so an adapter "
                                "would be bypassed; LoRA on it is not implemented")
        if owner not in found:
            found.append(owner)
    for path, m in experts.items() if parameters else ():
        where = ".".join(map(str, path))
        if m.gate_proj is None or m.down_proj_bias is not None:
            raise TrainingError(f"{where}: experts {'without a gate' if m.gate_proj is None else 'with biases'} have "
                                f"no fused gate_up_proj [E, 2F, D] layout in PEFT; LoRA on them is not implemented "
                                f"(leave {', '.join(sorted(EXPERT_TARGETS))} out of --lora-targets)")
        if isinstance(m.up_proj, QuantizedExperts):
            raise TrainingError(f"{where}: the experts are quantized; LoRA on quantized experts is not implemented "
                                "(convert the base in float, or leave the experts out of --lora-targets)")
        found += [path + (f"lora_{name}",) for name in EXPERT_PARAMETERS if name in parameters]
    if not found:
        missing = ([f"no module named {sorted(names)}"] if names or not parameters else []) + (
            [f"no MoE experts for {sorted(t for t in targets if expert_parameter(t))}"] if parameters else [])
        raise TrainingError(f"{' and '.join(missing)} in this {model.config.model_type} model")
    return found


def lora_sizes(model: nnx.Module, path: tuple) -> tuple[int, int, int]:
    """(E, I, O) of the adapter `lora_targets` names `path`: E experts (1 for a linear map) and the map's input and
    output features, so that it holds r * E * (I + O) parameters."""
    if path[-1] in {f"lora_{name}" for name in EXPERT_PARAMETERS}:
        E, D, F = module_at(model, path[:-1]).up_proj.shape
        return (E, D, 2 * F) if path[-1] == "lora_gate_up_proj" else (E, F, D)
    m = module_at(model, path)
    return 1, math.prod(m.in_shape), math.prod(m.out_shape)


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
