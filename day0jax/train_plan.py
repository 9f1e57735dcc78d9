"""The memory plan of a fine-tuning run on one device, from the model's shapes alone (no weight is read).

Per device: the frozen parameters, the trainable ones (LoRA's adapters, or every parameter, float32: the masters),
a full fine-tune's bfloat16 compute copy of them (in bfloat16 training), their float32 gradients, the optimizer's
state (AdamW: two float32 moments per trained parameter; SGD: none) and an estimate of the training step's peak
activations (counted in float32 in either precision: an overestimate of bfloat16's). `python -m day0jax.check CKPT
--train` prints it and `python -m day0jax.train` refuses a run that does not fit, both from `plan`; `suggestions`
says what would fit instead. (A top-level module, not one of `day0jax.train`: `check` may not import the trainer's
package.)

The activation estimate follows what XLA keeps live in the compiled training step (measured with
`memory_analysis()` in tests/test_train_plan.py): the float32 logits [B, T, V] and their gradient; without gradient
checkpointing every decoder layer's saved activations (its D-, F- and head-sized outputs, and some of its attention
scores) stay live through the backward pass; with it, only each layer's input stays and one layer at a time is
recomputed, whose backward holds its activations and their gradients. Once the logits' gradient has flowed into the
last layer they are dead, so the peak is the larger of the two phases over what stays.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from day0jax.core.cache_layout import kv_part
from day0jax.core.errors import TrainingError
from day0jax.layers.lora import DENSE_TARGETS

FINE_TUNE_TYPES = ("lora", "full")
OPTIMIZER_MOMENTS = {"adamw": 2, "sgd": 0}  # float32 copies of each trained parameter the optimizer keeps
PAD_MULTIPLE = 32  # the trainer pads each batch to a multiple of this many tokens (fewer shapes to compile)
FLOAT32 = 4  # the trainer keeps the trained parameters (masters), their gradients and moments in float32
# Training precisions (--dtype): the forward and backward's dtype; bfloat16 trains float32 masters (`train.step`).
# No float16: its narrow exponent needs loss scaling, which the trainer does not do.
TRAIN_DTYPES = ("float32", "bfloat16")

# Calibration against XLA:CPU's buffer assignment of the compiled step (tests/test_train_plan.py).
LOGIT_COPIES = 3  # the logits, the softmax their gradient is made from, and the gradient, [B, T, V] float32
# An attention layer's [B, N, T, T] float32 arrays kept until its backward: the backward recomputes the softmax
# weights from q and k, but XLA merges that with the forward's weights and keeps them; 1.2 to 1.8 copies' worth per
# layer measured at T 256 to 2048.
SCORE_COPIES = 1.5
BACKWARD_EXTRA = 0.25  # a layer's backward: the gradients of its activations live beside them, a quarter as many


@dataclasses.dataclass(frozen=True)
class TrainSetup:
    """The run being planned: the trainer's flags of the same names."""

    fine_tune_type: str = "lora"
    lora_rank: int = 8
    lora_targets: tuple[str, ...] = DENSE_TARGETS
    optimizer: str = "adamw"
    batch_size: int = 4
    max_seq_length: int = 2048
    grad_accumulation: int = 1
    grad_checkpoint: bool = False
    dtype: str = "float32"  # the forward and backward's (TRAIN_DTYPES)

    def __post_init__(self):
        if self.dtype not in TRAIN_DTYPES:
            raise TrainingError(f"--dtype {self.dtype!r} is not one of {', '.join(TRAIN_DTYPES)}")
        if self.fine_tune_type not in FINE_TUNE_TYPES:
            raise TrainingError(f"--fine-tune-type {self.fine_tune_type!r} is not one of {', '.join(FINE_TUNE_TYPES)}")
        if self.optimizer not in OPTIMIZER_MOMENTS:
            raise TrainingError(f"--optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZER_MOMENTS)}")
        for flag in ("lora_rank", "batch_size", "max_seq_length", "grad_accumulation"):
            if getattr(self, flag) < 1:
                raise TrainingError(f"--{flag.replace('_', '-')} {getattr(self, flag)}: must be at least 1")

    @classmethod
    def from_args(cls, args: Any) -> "TrainSetup":
        """From parsed flags named as the trainer's (`--lora-targets` a comma-separated list)."""
        targets = getattr(args, "lora_targets", None)
        return cls(fine_tune_type=args.fine_tune_type, lora_rank=args.lora_rank,
                   lora_targets=tuple(t for t in targets.split(",") if t) if targets else DENSE_TARGETS,
                   optimizer=args.optimizer, batch_size=args.batch_size, max_seq_length=args.max_seq_length,
                   grad_accumulation=getattr(args, "grad_accumulation", 1), grad_checkpoint=args.grad_checkpoint,
                   dtype=getattr(args, "dtype", None) or default_train_dtype())

    @property
    def tokens(self) -> int:
        """T: the longest row (--max-seq-length) padded as the trainer pads it."""
        return -(-self.max_seq_length // PAD_MULTIPLE) * PAD_MULTIPLE

    def flags(self) -> str:
        """The flags that change the plan, as a command line spells them."""
        lora = f" --lora-rank {self.lora_rank}" if self.fine_tune_type == "lora" else ""
        return (f"--fine-tune-type {self.fine_tune_type}{lora} --optimizer {self.optimizer} --batch-size "
                f"{self.batch_size} --max-seq-length {self.max_seq_length}"
                + (f" --grad-accumulation {self.grad_accumulation}" if self.grad_accumulation > 1 else "")
                + (" --grad-checkpoint" if self.grad_checkpoint else "") + f" --dtype {self.dtype}")

    @property
    def compute_copy(self) -> bool:
        """Whether the step casts the trained parameters to a bfloat16 copy (a full fine-tune in bfloat16; LoRA's
        adapters compute in float32 on the bfloat16 base's output, as PEFT's do)."""
        return self.dtype != "float32" and self.fine_tune_type == "full"


def default_train_dtype(backend: str | None = None) -> str:
    """The training precision when --dtype is not given: the loader's default dtype for `backend` (a JAX backend's
    name; default: the one in use), float32 on the CPU backend (no native bfloat16 arithmetic there, and float32 is
    what the parity tests compare), bfloat16 with float32 masters on accelerators."""
    from day0jax.loader import default_dtype

    return default_dtype(backend)


@dataclasses.dataclass(frozen=True)
class TrainShape:
    """What the plan needs of a model, read once from its abstract form (`TrainShape.of`)."""

    model: Any  # `sharding.plan.ModelShape`
    parameters: int  # every parameter of the model (elements)
    parameter_bytes: int  # loaded in the run's dtype (--dtype; quantized weights keep their own)
    attention: tuple[bool, ...]  # per decoder layer: whether it attends (keeps [B, N, T, T] scores)
    # LoRA on the targets asked for: adapter elements, and the extra per-token floats a layer saves (x A^T, and the
    # adapter's output beside the base's), the most of any layer; `lora_error` when the targets cannot take LoRA.
    lora_parameters: int = 0
    lora_per_token: int = 0
    lora_error: str | None = None
    # LoRA on MoE experts: the floats of the experts' weights merged with their adapters inside the step (each
    # adapted parameter's delta and merged weight, E * in * out each), over all layers and the most of one layer.
    lora_merged: int = 0
    lora_merged_largest: int = 0

    @classmethod
    def of(cls, abstract: Any, setup: TrainSetup) -> "TrainShape":
        """From the abstract model (`models.abstract_model`, float32), and the LoRA targets, rank and dtype of
        `setup`."""
        import jax.numpy as jnp

        from day0jax import models
        from day0jax.layers.lora import lora_sizes, lora_targets
        from sharding import plan as plan_lib

        infos = models.param_infos(abstract)
        shape = plan_lib.ModelShape.from_model(abstract, infos, 0)
        parameters = sum(math.prod(i.shape) for i in infos)
        nbytes = sum(math.prod(i.shape) * plan_lib.param_itemsize(i, jnp.dtype(setup.dtype)) for i in infos)
        attention = tuple(kv_part(entry) is not None for entry in shape.cache_layout)
        lora_parameters = lora_per_token = 0
        error = None
        per_layer: dict[Any, int] = {}
        merged: dict[Any, int] = {}
        try:
            for owner in lora_targets(abstract, setup.lora_targets):
                E, I, O = lora_sizes(abstract, owner)
                lora_parameters += setup.lora_rank * E * (I + O)
                layer = next((p for p in owner if isinstance(p, int)), None)
                if str(owner[-1]).startswith("lora_"):  # an experts' adapter: merged weights, not per-token products
                    merged[layer] = merged.get(layer, 0) + 2 * E * I * O
                else:
                    per_layer[layer] = per_layer.get(layer, 0) + setup.lora_rank + O
            lora_per_token = max(per_layer.values(), default=0)
        except TrainingError as e:
            error = str(e)
        return cls(shape, parameters, nbytes, attention, lora_parameters, lora_per_token, error,
                   sum(merged.values()), max(merged.values(), default=0))


@dataclasses.dataclass(frozen=True)
class TrainPlan:
    """Per-device bytes of one fine-tuning run; `available_bytes` None: unknown, assumed to fit."""

    setup: TrainSetup
    frozen_bytes: int  # parameters that do not train (LoRA's base; none for full fine-tuning)
    trainable_bytes: int  # LoRA's adapters, or every parameter: float32 (the masters, in bfloat16 training)
    trainable_parameters: int
    compute_copy_bytes: int  # the trained parameters cast to bfloat16 for the forward and backward (full, bfloat16)
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    available_bytes: int | None

    @property
    def total_bytes(self) -> int:
        return (self.frozen_bytes + self.trainable_bytes + self.compute_copy_bytes + self.gradient_bytes
                + self.optimizer_bytes + self.activation_bytes)

    @property
    def fits(self) -> bool:
        return self.available_bytes is None or self.total_bytes <= self.available_bytes

    def rows(self) -> list[dict]:
        """The table `check --train` prints: one row per part, then the total."""
        from sharding.plan import fmt_bytes

        s = self.setup
        masters = " masters" if s.dtype != "float32" else ""
        parts = [("parameters", self.frozen_bytes, f"frozen, {s.dtype}" if s.fine_tune_type == "lora" else
                  "none frozen: every parameter trains"),
                 ("trainable", self.trainable_bytes, f"{self.trainable_parameters:,} float32{masters} "
                  + (f"(LoRA rank {s.lora_rank})" if s.fine_tune_type == "lora" else "(full fine-tuning)")),
                 ("compute copy", self.compute_copy_bytes, f"the trained parameters in {s.dtype} for the forward and "
                  "backward" if s.compute_copy else "none: the trained parameters compute as they are"),
                 ("gradients", self.gradient_bytes, "float32, one per trainable parameter"
                  + (" and their sum over micro-batches" if s.grad_accumulation > 1 else "")),
                 ("optimizer", self.optimizer_bytes, f"{s.optimizer}: {OPTIMIZER_MOMENTS[s.optimizer]} float32 "
                  "moment(s) per trainable parameter"),
                 ("activations", self.activation_bytes, f"{s.batch_size} x {s.tokens} tokens"
                  + (", layers checkpointed" if s.grad_checkpoint else "") + " (estimate)"),
                 ("total", self.total_bytes, "per device; " + ("available memory unknown"
                                                               if self.available_bytes is None else
                                                               f"{fmt_bytes(self.available_bytes)} available"))]
        return [{"part": name, "bytes": fmt_bytes(n), "what": what} for name, n, what in parts]

    def summary(self) -> str:
        from sharding.plan import fmt_bytes

        avail = ("available memory unknown" if self.available_bytes is None
                 else f"{fmt_bytes(self.available_bytes)} available")
        copy = f", compute copy {fmt_bytes(self.compute_copy_bytes)}" if self.compute_copy_bytes else ""
        return (f"training memory {fmt_bytes(self.total_bytes)} per device (parameters {fmt_bytes(self.frozen_bytes)}"
                f", trainable {fmt_bytes(self.trainable_bytes)}{copy}, gradients {fmt_bytes(self.gradient_bytes)}, "
                f"optimizer {fmt_bytes(self.optimizer_bytes)}, activations {fmt_bytes(self.activation_bytes)}) for "
                f"{self.setup.flags()}; {avail}")

    def to_dict(self) -> dict:
        return dict(dataclasses.asdict(self), total_bytes=self.total_bytes, fits=self.fits)


def activation_bytes(shape: TrainShape, setup: TrainSetup) -> int:
    """Estimated peak bytes of the compiled training step beyond its parameters, gradients and optimizer state (see
    the module's docstring): what stays live through the backward pass, plus the larger of the logits' phase and
    one layer's backward, plus the step's token ids and mask."""
    m = shape.model
    B, T = setup.batch_size, setup.tokens
    rows = B * T
    kv = m.kv_layers
    n, k_heads = m.num_heads, max((x.kv_heads for x in kv), default=0)
    k_dim, v_dim = max((x.k_dim for x in kv), default=0), max((x.v_dim for x in kv), default=0)
    # Per token: the residual stream, norms' outputs and projections back to D (5 D), the MLP's gate, up,
    # activation and product (4 F), LoRA's extras (x A^T and the adapter's output per target); an attention layer
    # adds q and k before and after RoPE, v and its output.
    lora = shape.lora_per_token if setup.fine_tune_type == "lora" else 0
    dense = 5 * m.hidden_size + 4 * m.ffn_per_token + lora
    attn = 2 * n * k_dim + 2 * k_heads * k_dim + k_heads * v_dim + n * v_dim
    scores = SCORE_COPIES * B * n * T * T * FLOAT32
    saved = [rows * (dense + (attn if a else 0)) * FLOAT32 + (scores if a else 0) for a in shape.attention]
    largest = max(saved, default=0)
    # Experts' merged weights stay live through the backward pass like activations (one layer's with checkpointing),
    # and a layer's backward adds their gradient.
    lora_on = setup.fine_tune_type == "lora"
    merged_all, merged_one = (shape.lora_merged * FLOAT32, shape.lora_merged_largest * FLOAT32) if lora_on else (0, 0)
    if setup.grad_checkpoint:
        kept = len(saved) * rows * m.hidden_size * FLOAT32
        backward = (1 + BACKWARD_EXTRA) * largest + 2 * merged_one
    else:
        kept, backward = sum(saved) + merged_all, BACKWARD_EXTRA * largest + merged_one
    logits = LOGIT_COPIES * rows * m.vocab_size * FLOAT32
    inputs = 2 * setup.grad_accumulation * rows * 4  # int32 token ids and mask
    return int(kept + max(logits, backward) + inputs)


def plan(shape: TrainShape, setup: TrainSetup, available: int | None) -> TrainPlan:
    """The per-device memory of `setup` on a model of `shape`, against `available` bytes (None: unknown).

    Raises:
        TrainingError: LoRA on targets the model cannot take (named as `apply_lora` names them).
    """
    if setup.fine_tune_type == "lora":
        if shape.lora_error:
            raise TrainingError(shape.lora_error)
        trainable, frozen_bytes = shape.lora_parameters, shape.parameter_bytes
    else:
        trainable, frozen_bytes = shape.parameters, 0
    trainable_bytes = trainable * FLOAT32
    copy = trainable * 2 if setup.compute_copy else 0  # bfloat16
    # The step sums micro-batches' gradients into a carried total: two copies when there are several.
    gradients = trainable_bytes * (2 if setup.grad_accumulation > 1 else 1)
    return TrainPlan(setup, frozen_bytes, trainable_bytes, trainable, copy, gradients,
                     OPTIMIZER_MOMENTS[setup.optimizer] * trainable_bytes, activation_bytes(shape, setup), available)


def suggestions(shape: TrainShape, p: TrainPlan) -> list[str]:
    """What would fit when `p` does not (empty when it fits): the largest batch size, gradient checkpointing, LoRA
    instead of full fine-tuning, a shorter --max-seq-length."""
    if p.fits:
        return []
    from sharding.plan import fmt_bytes

    s, avail = p.setup, p.available_bytes
    hints = []

    def fitting(**change) -> TrainPlan | None:
        q = plan(shape, dataclasses.replace(s, **change), avail)
        return q if q.fits else None

    def largest_batch(**change) -> int | None:
        """The largest --batch-size below this one that fits with `change`, if any."""
        lo, hi = 0, s.batch_size - 1  # the largest batch that fits, by bisection (memory grows with it)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fitting(batch_size=mid, **change) else (lo, mid - 1)
        return lo or None

    batch = largest_batch()
    if batch:
        hints.append(f"--batch-size {batch} ({fmt_bytes(fitting(batch_size=batch).total_bytes)})")
    if not s.grad_checkpoint:
        q = fitting(grad_checkpoint=True)
        if q:
            hints.append(f"--grad-checkpoint ({fmt_bytes(q.total_bytes)})")
        elif (n := largest_batch(grad_checkpoint=True)):
            hints.append(f"--grad-checkpoint --batch-size {n} "
                         f"({fmt_bytes(fitting(grad_checkpoint=True, batch_size=n).total_bytes)})")
    if s.fine_tune_type == "full" and shape.lora_error is None:
        lora = f"--fine-tune-type lora --lora-rank {s.lora_rank}"
        q = fitting(fine_tune_type="lora")
        if q:
            hints.append(f"{lora} ({fmt_bytes(q.total_bytes)})")
        elif (n := largest_batch(fine_tune_type="lora")):
            q = fitting(fine_tune_type="lora", batch_size=n)
            hints.append(f"{lora} --batch-size {n} ({fmt_bytes(q.total_bytes)})")
        elif (q := fitting(fine_tune_type="lora", grad_checkpoint=True, batch_size=1)):
            hints.append(f"{lora} --grad-checkpoint --batch-size 1 ({fmt_bytes(q.total_bytes)})")
    if not hints:
        smallest = plan(shape, dataclasses.replace(s, batch_size=1, grad_checkpoint=True,
                                                   fine_tune_type="lora" if shape.lora_error is None
                                                   else s.fine_tune_type), avail)
        hints.append(f"nothing at this --max-seq-length: the smallest run ({smallest.setup.flags()}) needs "
                     f"{fmt_bytes(smallest.total_bytes)}; use a shorter --max-seq-length, a device with more memory "
                     "or a smaller model")
    return hints


def refusal(shape: TrainShape, p: TrainPlan) -> str | None:
    """The message of a plan that does not fit, naming what would (None when it fits)."""
    if p.fits:
        return None
    return f"the run will not fit: {p.summary()}. Would fit: " + "; or ".join(suggestions(shape, p))


def available_memory(override: int | None = None) -> int | None:
    """Bytes the trainer's one device may use: `override` (--device-memory) where given, else as the inference plan
    measures it (the device's free memory, or on the CPU backend the host's available memory)."""
    if override is not None:
        return override
    import jax

    from sharding.plan import device_memory

    return device_memory(jax.devices()[:1])
