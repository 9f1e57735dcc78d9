"""The fine-tuning command line: parse mlx-lm-style flags, load the checkpoint in float32, apply LoRA (or train every
parameter: --fine-tune-type full), train on DIR/train.jsonl (validation on valid.jsonl, test loss and perplexity on
test.jsonl where they exist), write the PEFT adapter (or a day0jax checkpoint) to --adapter-path."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

from day0jax.core.errors import Day0Error, TrainingError

# Flags of the full interface that this version refuses by name rather than ignores.
NOT_IMPLEMENTED = {
    "mesh": "--mesh (sharded training) is not implemented yet: training runs on one device",
    "resume": "--resume is not implemented yet",
    "fuse": "--fuse (merging an adapter into a checkpoint) is not implemented yet",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m day0jax.train", description=__doc__)
    p.add_argument("--model", required=True, help="day0jax checkpoint folder (python -m convert)")
    p.add_argument("--data", help="folder with train.jsonl (and optionally valid.jsonl, test.jsonl)")
    p.add_argument("--adapter-path", help="folder the PEFT adapter (lora) or the day0jax checkpoint (full) is "
                   "written to")
    p.add_argument("--fine-tune-type", default="lora", choices=("lora", "full"))
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--lr-schedule", default="constant", choices=("constant", "cosine"))
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--grad-accumulation", type=int, default=1)
    p.add_argument("--max-seq-length", type=int, default=2048)
    p.add_argument("--mask-prompt", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-shuffle", action="store_true")
    p.add_argument("--steps-per-report", type=int, default=10)
    p.add_argument("--steps-per-eval", type=int, default=200)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--mesh", default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--grad-checkpoint", action="store_true",
                   help="gradient checkpointing: recompute each decoder layer's activations in the backward pass "
                   "(less memory, about one more forward pass of compute; the same losses and gradients)")
    p.add_argument("--fuse", action="store_true")
    return p


def train_config(args: argparse.Namespace):
    """The `TrainConfig` the flags ask for."""
    from day0jax.train.loop import TrainConfig

    return TrainConfig(iters=args.iters, learning_rate=args.learning_rate, optimizer=args.optimizer,
                       weight_decay=args.weight_decay, lr_schedule=args.lr_schedule, warmup=args.warmup,
                       grad_accumulation=args.grad_accumulation, steps_per_report=args.steps_per_report,
                       steps_per_eval=args.steps_per_eval, save_every=args.save_every,
                       grad_checkpoint=args.grad_checkpoint)


def run(args: argparse.Namespace) -> None:
    """Everything `main` does, raising typed errors."""
    import jax
    from flax import nnx
    from tqdm import tqdm

    import day0jax
    from day0jax.train import data as data_lib
    from day0jax.train.export import save_checkpoint
    from day0jax.train.lora import LoRAConfig, apply_lora, save_adapter
    from day0jax.train.loop import evaluate, train
    from day0jax.weights.checkpoint import read_manifest

    for flag, why in NOT_IMPLEMENTED.items():
        if getattr(args, flag):
            raise TrainingError(why)
    if args.data is None or args.adapter_path is None:
        raise TrainingError("--data and --adapter-path are required")
    if args.batch_size < 1:
        raise TrainingError(f"--batch-size {args.batch_size}: must be at least 1")
    lora = LoRAConfig(rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout,
                      targets=tuple(t for t in args.lora_targets.split(",") if t))
    config = train_config(args)
    # Float32 throughout: the adapters train in float32 and the base is read at that precision.
    model = day0jax.load(args.model, dtype="float32", kernels="reference")
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
    if args.fine_tune_type == "lora":
        adapters = apply_lora(model.module, lora, seed=args.seed)
        n_params = sum(m.lora_a.size + m.lora_b.size for m in adapters.modules(model.module).values())
        print(f"LoRA rank {lora.rank} on {len(adapters.hf_names)} modules ({', '.join(adapters.target_modules)}): "
              f"{n_params} trainable parameters; {len(train_set)} training examples", flush=True)
    else:
        n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model.module, nnx.Param)))
        print(f"full fine-tuning: {n_params} trainable parameters; {len(train_set)} training examples", flush=True)
    multiple = 32  # rows padded to a multiple of 32 tokens: fewer shapes to compile, the padding never counts
    batches = data_lib.batches(train_set, args.batch_size, shuffle=not args.no_shuffle, seed=args.seed,
                               pad_id=pad, multiple=multiple)
    valid = None if valid_set is None else (
        lambda: data_lib.passes(valid_set, args.batch_size, pad_id=pad, multiple=multiple))

    def save(step: int | None = None) -> None:
        if args.fine_tune_type == "lora":
            save_adapter(model.module, adapters, args.adapter_path, source)
        else:
            save_checkpoint(model.module, args.model, args.adapter_path)
        what = "adapter" if args.fine_tune_type == "lora" else "checkpoint"
        print(f"{'' if step is None else f'step {step}: '}{what} written to {args.adapter_path}", flush=True)

    train(model.module, batches, config, valid=valid, on_save=save, pad_id=pad, progress=sys.stderr.isatty(),
          report=lambda line: tqdm.write(line, file=sys.stdout))
    save()
    if test_set is not None:
        loss = evaluate(model.module, data_lib.passes(test_set, args.batch_size, pad_id=pad, multiple=multiple))
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
