"""The fine-tuning command line: parse mlx-lm-style flags, load the checkpoint (LoRA: the base in --dtype; full
fine-tuning: in float32, the master weights), apply LoRA (or train every parameter: --fine-tune-type full), train on
DIR/train.jsonl (validation on valid.jsonl, test loss and perplexity on test.jsonl where they exist), write the PEFT
adapter (or a day0jax checkpoint, in its source's dtype) to --adapter-path, with the training state that --resume
continues from. Before the weights are read, the run's memory is planned (`day0jax.train_plan`, as
`python -m day0jax.check --train` prints it): a run that would not fit the device (--device-memory overrides its free
memory) is refused, naming what would fit. --fuse --out DST instead merges the adapter at --adapter-path into the
model and writes the result as a new checkpoint."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import sys
from pathlib import Path

from day0jax.core.errors import Day0Error, TrainingError
from day0jax.train_plan import PAD_MULTIPLE, TRAIN_DTYPES, TrainSetup, default_train_dtype


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m day0jax.train", description=__doc__)
    p.add_argument("--model", required=True, help="day0jax checkpoint folder (python -m convert)")
    p.add_argument("--data", help="folder with train.jsonl (and optionally valid.jsonl, test.jsonl)")
    p.add_argument("--adapter-path", help="folder the PEFT adapter (lora) or the day0jax checkpoint (full) is "
                   "written to")
    p.add_argument("--fine-tune-type", default="lora", choices=("lora", "full"))
    p.add_argument("--lora-rank", type=int, default=TrainSetup.lora_rank)
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lora-dropout", type=float, default=0.0,
                   help="dropout on the adapters' input while training, as PEFT's lora_dropout (masks from --seed)")
    p.add_argument("--lora-targets", default=",".join(TrainSetup.lora_targets),
                   help="comma-separated HF module names whose linear maps take adapters (attention, dense MLPs, "
                   "shared experts: PEFT's target_modules); MoE models' routed experts only when named as PEFT's "
                   "target_parameters: experts.gate_up_proj, experts.down_proj (e.g. "
                   "q_proj,k_proj,v_proj,o_proj,experts.gate_up_proj,experts.down_proj; no --lora-dropout then)")
    p.add_argument("--batch-size", type=int, default=TrainSetup.batch_size)
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--optimizer", default=TrainSetup.optimizer, choices=("adamw", "sgd"))
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--lr-schedule", default="constant", choices=("constant", "cosine"))
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--grad-accumulation", type=int, default=1)
    p.add_argument("--max-seq-length", type=int, default=TrainSetup.max_seq_length)
    p.add_argument("--mask-prompt", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-shuffle", action="store_true")
    p.add_argument("--steps-per-report", type=int, default=10)
    p.add_argument("--steps-per-eval", type=int, default=200)
    p.add_argument("--save-every", type=int, default=100,
                   help="write the adapter (or checkpoint) and the training state every N steps")
    p.add_argument("--mesh", default=None,
                   help="SPEC such as dp=2,tp=2 or 'auto': batches split over dp (and ep), weights over tp as "
                        "inference splits them (default: one device)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the last save under --adapter-path (the same flags, the same data)")
    p.add_argument("--grad-checkpoint", action="store_true",
                   help="gradient checkpointing: recompute each decoder layer's activations in the backward pass "
                   "(less memory, about one more forward pass of compute; the same losses and gradients)")
    p.add_argument("--dtype", choices=TRAIN_DTYPES, default=None,
                   help="the forward and backward passes' precision; bfloat16 keeps float32 master weights, gradients "
                   "and optimizer state, and LoRA's base in bfloat16 only (default: float32 on the CPU backend, "
                   "bfloat16 on accelerators)")
    p.add_argument("--device-memory", metavar="SIZE", help="memory the device may use, e.g. 80GiB (default: its "
                   "free memory; on the CPU backend the machine's available memory): a run planned beyond it is "
                   "refused before its first step")
    p.add_argument("--fuse", action="store_true",
                   help="merge the LoRA adapter at --adapter-path into --model and write the checkpoint --out")
    p.add_argument("--out", help="with --fuse: the fused checkpoint's folder")
    return p


def train_config(args: argparse.Namespace):
    """The `TrainConfig` the flags ask for."""
    from day0jax.train.loop import TrainConfig

    return TrainConfig(iters=args.iters, learning_rate=args.learning_rate, optimizer=args.optimizer,
                       weight_decay=args.weight_decay, lr_schedule=args.lr_schedule, warmup=args.warmup,
                       grad_accumulation=args.grad_accumulation, steps_per_report=args.steps_per_report,
                       steps_per_eval=args.steps_per_eval, save_every=args.save_every,
                       grad_checkpoint=args.grad_checkpoint, seed=args.seed, dtype=args.dtype)


def run_settings(args: argparse.Namespace, train_set) -> dict:
    """What a save records of the run and --resume requires unchanged: the model (its manifest's digest), the
    training data (a digest of its token ids and targets), and every flag the trajectory depends on."""
    import hashlib
    import json

    from day0jax.weights.checkpoint import MANIFEST

    manifest = Path(args.model) / MANIFEST
    data = hashlib.sha256(json.dumps([[list(e.tokens), e.offset] for e in train_set]).encode()).hexdigest()
    flags = ("fine_tune_type", "lora_rank", "lora_alpha", "lora_targets", "batch_size", "iters", "learning_rate",
             "optimizer", "weight_decay", "lr_schedule", "warmup", "grad_accumulation", "max_seq_length",
             "mask_prompt", "seed", "no_shuffle", "lora_dropout", "dtype")
    return {"model": hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else None,
            "train_data": data, **{flag: getattr(args, flag) for flag in flags}}


def check_memory(args: argparse.Namespace, longest: int | None = None):
    """The run's memory plan, from the checkpoint's config alone; prints its total. `longest`: the data's longest
    row in tokens, which bounds the batches' length below --max-seq-length (every batch is padded only to its own
    longest row).

    Returns:
        The `day0jax.train_plan.TrainPlan`.
    Raises:
        TrainingError: the plan exceeds the device's memory (the message names what would fit), or a bad
            --device-memory.
    """
    import jax.numpy as jnp

    from day0jax import models, train_plan
    from day0jax.layers.quantized import specs_from_config
    from day0jax.loader import read_checkpoint_config
    from sharding.cluster import parse_size

    try:
        memory = None if args.device_memory is None else parse_size(args.device_memory)
    except Day0Error as e:
        raise TrainingError(f"--device-memory: {e}") from e
    _, hf = read_checkpoint_config(args.model)
    abstract = models.abstract_model(models.config_from_hf(hf), jnp.float32, quantization=specs_from_config(hf))
    setup = TrainSetup.from_args(args)
    if longest is not None and longest < setup.max_seq_length:
        setup = dataclasses.replace(setup, max_seq_length=longest)
        print(f"planning for the data's longest row, {longest} tokens", flush=True)
    shape = train_plan.TrainShape.of(abstract, setup)
    plan = train_plan.plan(shape, setup, train_plan.available_memory(memory))
    print(plan.summary(), flush=True)
    refusal = train_plan.refusal(shape, plan)
    if refusal:
        raise TrainingError(refusal)
    return plan


def resolve_dtype(dtype: str | None, backend: str | None = None) -> str:
    """--dtype, or its default for `backend` (default: the one in use), said in one line."""
    import jax

    if dtype is not None:
        print(f"precision: {_precision(dtype)} (--dtype)", flush=True)
        return dtype
    backend = backend or jax.default_backend()
    dtype = default_train_dtype(backend)
    print(f"precision: {_precision(dtype)} (the default on the {backend} backend; --dtype to choose)", flush=True)
    return dtype


def _precision(dtype: str) -> str:
    return ("float32" if dtype == "float32" else
            f"{dtype} forward and backward, float32 master weights, gradients and optimizer state")


def run(args: argparse.Namespace) -> None:
    """Everything `main` does, raising typed errors."""
    import jax
    from flax import nnx
    from tqdm import tqdm

    import day0jax
    from day0jax.train import data as data_lib
    from day0jax.train import resume as resume_lib
    from day0jax.train.export import save_checkpoint
    from day0jax.train.lora import LoRAConfig, apply_lora, save_adapter
    from day0jax.train.loop import compute_dtype, evaluate, train
    from day0jax.train.step import default_wrt
    from day0jax.weights.checkpoint import read_manifest

    if args.fuse:
        if args.adapter_path is None or args.out is None:
            raise TrainingError("--fuse needs --adapter-path (the adapter) and --out (the new checkpoint)")
        from day0jax.train.fuse import fuse

        print(f"fused checkpoint written to {fuse(args.model, args.adapter_path, args.out)}", flush=True)
        return
    if args.data is None or args.adapter_path is None:
        raise TrainingError("--data and --adapter-path are required")
    if args.batch_size < 1:
        raise TrainingError(f"--batch-size {args.batch_size}: must be at least 1")
    lora = LoRAConfig(rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout,
                      targets=tuple(t for t in args.lora_targets.split(",") if t))
    args.dtype = resolve_dtype(args.dtype)
    config = train_config(args)
    # LoRA's frozen base in the training dtype only (its adapters are float32); a full fine-tune's weights in float32,
    # the masters the optimizer updates (the step casts them to --dtype).
    model = day0jax.load(args.model, dtype="float32" if args.fine_tune_type == "full" else args.dtype,
                         kernels="reference", mesh=args.mesh)
    if model.tokenizer is None:
        raise TrainingError(f"{args.model}: no tokenizer.json; the jsonl data needs the checkpoint's tokenizer")
    source = read_manifest(Path(args.model)).get("source", {}).get("path") or str(Path(args.model).absolute())
    eos = data_lib.eos_id(model.tokenizer, model.eos_token_ids)
    pad = data_lib.pad_id_of(model.tokenizer, eos)

    def split(name):
        return data_lib.load_split(args.data, name, model.tokenizer, mask_prompt=args.mask_prompt, eos=eos,
                                   max_seq_length=args.max_seq_length)

    train_set = split("train")
    if train_set is None:
        raise TrainingError(f"{args.data}: no train.jsonl")
    valid_set, test_set = split("valid"), split("test")
    check_memory(args, max(len(e.tokens) for part in (train_set, valid_set, test_set) if part for e in part))
    if args.fine_tune_type == "lora":
        adapters = apply_lora(model.module, lora, seed=args.seed)
        n_params = sum(m.lora_a.size + m.lora_b.size for m in adapters.modules(model.module).values())
        print(f"LoRA rank {lora.rank} on {len(adapters.hf_names)} modules "
              f"({', '.join(adapters.target_modules + adapters.target_parameters)}): "
              f"{n_params} trainable parameters; {len(train_set)} training examples", flush=True)
    else:
        n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model.module, nnx.Param)))
        print(f"full fine-tuning: {n_params} trainable parameters; {len(train_set)} training examples", flush=True)
    # A full fine-tune is written in its source's dtype, rounded from the float32 masters (which the training state
    # beside it keeps for --resume).
    source_dtype = read_manifest(Path(args.model)).get("dtype", "float32")
    settings = run_settings(args, train_set)
    saved = resume_lib.read_state(args.adapter_path, settings) if args.resume else None
    if saved is not None:
        print(f"resuming from step {saved.step} ({args.adapter_path})", flush=True)
    multiple = PAD_MULTIPLE  # rows padded to a multiple of 32 tokens: fewer shapes to compile, padding never counts
    batches = data_lib.batches(train_set, args.batch_size, shuffle=not args.no_shuffle, seed=args.seed,
                               pad_id=pad, multiple=multiple, start=0 if saved is None else saved.batches_taken)
    valid = None if valid_set is None else (
        lambda: data_lib.passes(valid_set, args.batch_size, pad_id=pad, multiple=multiple))

    def save(step: int, params, opt_state, final: bool = False) -> None:
        def state(folder: Path) -> None:
            resume_lib.write_state(folder, step=step, batches_taken=step * config.grad_accumulation,
                                   settings=settings, params=params, opt_state=opt_state)

        if args.fine_tune_type == "lora":
            save_adapter(model.module, adapters, args.adapter_path, source, extra=state)
        else:
            save_checkpoint(model.module, args.model, args.adapter_path, extra=state, dtype=source_dtype)
        what = "adapter" if args.fine_tune_type == "lora" else "checkpoint"
        print(f"{'' if final else f'step {step}: '}{what} written to {args.adapter_path}", flush=True)

    result = train(model.module, batches, config, valid=valid, on_save=save, pad_id=pad,
                   progress=sys.stderr.isatty(), report=lambda line: tqdm.write(line, file=sys.stdout), resume=saved)
    save(config.iters, nnx.state(model.module, default_wrt(model.module)), result.opt_state, final=True)
    if test_set is not None:
        loss = evaluate(model.module, data_lib.passes(test_set, args.batch_size, pad_id=pad, multiple=multiple),
                        compute_dtype(model.module, args.dtype))
        print(f"test loss {loss:.4f}, test perplexity {math.exp(loss):.4f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        run(args)
    except Day0Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
