"""`--fuse`: a PEFT LoRA adapter folded into its base, written as a new day0jax checkpoint (float32) that
`day0jax.load` and the server take like a converted one, with no adapter to load beside it."""

from __future__ import annotations

import json
from pathlib import Path

from day0jax.core.errors import TrainingError
from day0jax.train.lora import LoRAConfig

ADAPTER_CONFIG, ADAPTER_TENSORS = "adapter_config.json", "adapter_model.safetensors"


def read_adapter_config(folder: Path) -> LoRAConfig:
    """The `LoRAConfig` of a PEFT LoRA folder.

    Raises:
        TrainingError: the file missing or unreadable, or a PEFT option this merge does not implement (DoRA,
            rsLoRA's scale, fan_in_fan_out, per-module ranks or alphas), naming the file and the field.
    """
    path = folder / ADAPTER_CONFIG
    if not path.is_file():
        raise TrainingError(f"{path} does not exist: --adapter-path must be a PEFT LoRA folder")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TrainingError(f"{path}: unreadable ({e})") from None
    if config.get("peft_type") != "LORA":
        raise TrainingError(f"{path}: peft_type is {config.get('peft_type')!r}; only LORA adapters can be fused")
    for key in ("use_dora", "use_rslora", "fan_in_fan_out"):
        if config.get(key):
            raise TrainingError(f"{path}: {key} is set; fusing such an adapter is not implemented")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise TrainingError(f"{path}: {key} gives some modules their own rank or alpha; fusing such an adapter "
                                "is not implemented")
    targets = config.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise TrainingError(f"{path}: target_modules is {targets!r}; fusing needs the list of module names")
    try:
        return LoRAConfig(rank=int(config["r"]), alpha=float(config["lora_alpha"]), targets=tuple(targets))
    except KeyError as e:
        raise TrainingError(f"{path}: no field {e.args[0]!r}") from None


def fuse(model_path: str | Path, adapter_path: str | Path, out: str | Path) -> Path:
    """Writes the checkpoint `model_path` with the adapter `adapter_path` merged into it (each target's kernel
    + alpha / r * B @ A, in float32) to `out`, beside the source's config and tokenizer files.

    Raises:
        TrainingError: the adapter folder or a file of it missing, an option not implemented, or tensors that do
            not fit the model (another model's adapter): naming the file and the tensor.
        CheckpointError: `out` exists and is not a checkpoint, or cannot be written.
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    import day0jax
    from day0jax.train.export import save_checkpoint
    from day0jax.train.lora import apply_lora, load_adapter_arrays, merge_adapters

    adapter_path = Path(adapter_path)
    config = read_adapter_config(adapter_path)
    tensors_path = adapter_path / ADAPTER_TENSORS
    if not tensors_path.is_file():
        raise TrainingError(f"{tensors_path} does not exist: --adapter-path must be a PEFT LoRA folder")
    try:
        arrays = load_file(str(tensors_path))
    except (OSError, SafetensorError) as e:
        raise TrainingError(f"{tensors_path}: unreadable ({e})") from None
    model = day0jax.load(model_path, dtype="float32", kernels="reference")
    adapters = apply_lora(model.module, config)
    try:
        load_adapter_arrays(model.module, adapters, arrays)
    except TrainingError as e:
        raise TrainingError(f"{tensors_path} does not fit {model_path} (an adapter of another model?): {e}") from None
    merge_adapters(model.module, adapters)
    source = str(Path(model_path).absolute())
    return save_checkpoint(model.module, model_path, out,
                           manifest_extra={"fine_tuned_from": source, "fused_adapter": str(adapter_path.absolute())})
