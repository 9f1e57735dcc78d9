"""Fine-tuning day0jax's models: LoRA adapters (exported in PEFT's format) or every parameter, with optax.

From Python: `apply_lora(model.module, LoRAConfig(...))`, then `loss_and_grads(module, batch)` or
`train(module, batches, TrainConfig(...))` (`grad_checkpoint=True`: per-layer gradient checkpointing; `resume=`
a `resume.read_state` save; `dtype='bfloat16'`: bfloat16 forward and backward on float32 master weights);
`save_adapter` writes the PEFT folder, `merge_adapters` folds the adapters into the base (`fuse.fuse`: an adapter
folder into a new checkpoint). Batches come from `data.load_split` / `data.batches` (mlx-lm's jsonl formats) or
`data.collate` of token ids.
"""

from day0jax.train.data import Batch, Example, batches, collate, load_split
from day0jax.train.lora import (DENSE_TARGETS, Adapters, LoRAConfig, adapter_arrays, apply_lora, merge_adapters,
                                save_adapter)
from day0jax.train.loop import TrainConfig, TrainResult, evaluate, train
from day0jax.train.step import learning_rate, loss_and_grads

__all__ = ["Adapters", "Batch", "DENSE_TARGETS", "Example", "LoRAConfig", "TrainConfig", "TrainResult",
           "adapter_arrays", "apply_lora", "batches", "collate", "evaluate", "learning_rate", "load_split",
           "loss_and_grads", "merge_adapters", "save_adapter", "train"]
