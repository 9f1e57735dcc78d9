"""`--fuse`: a PEFT LoRA adapter folded into its base, written as a new day0jax checkpoint (float32) that
`day0jax.load` and the server take like a converted one, with no adapter to load beside it."""

from __future__ import annotations

from pathlib import Path

from day0jax.adapters import ADAPTER_CONFIG, adapter_tensors_file, read_adapter_config
from day0jax.core.errors import AdapterError, TrainingError
from day0jax.layers.lora import EXPERT_PARAMETERS
from day0jax.train.lora import LoRAConfig


def fuse(model_path: str | Path, adapter_path: str | Path, out: str | Path) -> Path:
    """Writes the checkpoint `model_path` with the adapter `adapter_path` merged into it (each target's kernel
    + alpha / r * B @ A, in float32) to `out`, beside the source's config and tokenizer files.

    Raises:
        AdapterError: the adapter's config or tensors file missing or malformed, or an option not implemented
            (`read_adapter_config`, `adapter_tensors_file`).
        TrainingError: its tensors not fitting the model (another model's adapter): naming the file and the tensor.
        CheckpointError: `out` exists and is not a checkpoint, or cannot be written.
    """
    import day0jax
    from day0jax.train.export import save_checkpoint
    from day0jax.train.lora import apply_lora, load_adapter_arrays, merge_adapters

    adapter_path = Path(adapter_path)
    c = read_adapter_config(adapter_path)
    # PEFT matches a target parameter by its name's end: any spelling of a fused expert parameter is that one.
    parameters = tuple(f"experts.{p.rsplit('.', 1)[-1]}" for p in c.parameters)
    unknown = [p for p in c.parameters if p.rsplit(".", 1)[-1] not in EXPERT_PARAMETERS]
    if unknown:
        raise AdapterError(f"{adapter_path / ADAPTER_CONFIG}: target_parameters {unknown} names no MoE experts' fused "
                           f"parameter ({', '.join(EXPERT_PARAMETERS)}); LoRA on it is not implemented")
    config = LoRAConfig(rank=c.rank, alpha=c.alpha, targets=c.targets + parameters)
    tensors = adapter_tensors_file(adapter_path)
    arrays = {name: tensors.read(name) for name in tensors.tensors}
    model = day0jax.load(model_path, dtype="float32", kernels="reference")
    adapters = apply_lora(model.module, config)
    try:
        load_adapter_arrays(model.module, adapters, arrays)
    except TrainingError as e:
        raise TrainingError(f"{tensors.path} does not fit {model_path} (an adapter of another model?): {e}") from None
    merge_adapters(model.module, adapters)
    source = str(Path(model_path).absolute())
    return save_checkpoint(model.module, model_path, out,
                           manifest_extra={"fine_tuned_from": source, "fused_adapter": str(adapter_path.absolute())})
