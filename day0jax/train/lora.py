"""LoRA on a loaded model: which `Linear`s take adapters, their Hugging Face module names, and the PEFT export.

The adapters' HF names come from the family's own tensor mapping (`Family.hf_source`, the one the converter reads),
so an exported adapter names the modules of the checkpoint's original HF layout. A GGUF source's q/k rows were
already put back into HF's order by the converter, so its adapters are in that layout too.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from flax import nnx

from day0jax import models
from day0jax.core.errors import TrainingError
from day0jax.layers.linear import Linear
from day0jax.layers.quantized import QuantizedKernel
from day0jax.layers.lora import DENSE_TARGETS, LoRALinear, LoRAParam, lora_targets, module_at, replace_module_at
PREFIX = "base_model.model."  # PEFT's prefix of a causal LM's module names


@dataclass(frozen=True)
class LoRAConfig:
    """rank r, alpha (scale alpha / r), dropout p of the adapters' input while training, and the module names (HF's)
    that take adapters."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DENSE_TARGETS

    def __post_init__(self):
        if self.rank < 1:
            raise TrainingError(f"--lora-rank {self.rank}: the rank must be at least 1")
        if not 0.0 <= self.dropout < 1.0:
            raise TrainingError(f"--lora-dropout {self.dropout}: must be in [0, 1)")


@dataclass
class Adapters:
    """The adapted modules: runtime path (a tuple of attribute names and layer indices) -> HF module name."""

    config: LoRAConfig
    hf_names: dict[tuple, str] = field(default_factory=dict)

    def modules(self, model: nnx.Module) -> dict[str, LoRALinear]:
        """HF module name -> the model's adapted module."""
        return {hf: module_at(model, path) for path, hf in self.hf_names.items()}

    @property
    def target_modules(self) -> list[str]:
        return sorted({hf.rsplit(".", 1)[-1] for hf in self.hf_names.values()})


def _hf_module_name(config: Any, kernel_path: str, kernel) -> str:
    """The HF module whose `weight` the converter reshapes into this kernel (see `models.hf_tensor_name`)."""
    name = models.hf_tensor_name(config, kernel_path, kernel)
    if not name.endswith(".weight"):
        raise TrainingError(f"{config.model_type}: {kernel_path} comes from {name!r}, not a module's weight")
    return name[: -len(".weight")]


def apply_lora(model: nnx.Module, config: LoRAConfig, seed: int = 0) -> Adapters:
    """Replaces every `Linear` named in `config.targets` by a `LoRALinear` around it (A Kaiming-uniform from
    `seed`, B zero), in place.

    Returns:
        The adapted modules with their HF names.
    A quantized base (int8, int4, FP8, ... as loaded) stays as it is, frozen: the adapter trains in float32 on its
    output (QLoRA).

    Raises:
        TrainingError: a target that is not a `Linear` (MoE experts' stacked weights, a map whose kernel a layer
            reads itself), or no module of those names.
    """
    found = lora_targets(model, config.targets)
    rngs = nnx.Rngs(params=seed)
    adapters = Adapters(config)
    # HF names from the float model's kernels, which carry the converter's metadata (a quantized kernel is codes
    # and scales).
    plain = models.abstract_model(model.config)
    for index, owner in enumerate(found):
        kernel_path = ".".join(map(str, owner)) + ".kernel"
        adapters.hf_names[owner] = _hf_module_name(model.config, kernel_path, module_at(plain, owner).kernel)
        replace_module_at(model, owner, LoRALinear(module_at(model, owner), config.rank, config.alpha, rngs=rngs,
                                                   dropout=config.dropout, index=index))
    return adapters


def merge_adapters(model: nnx.Module, adapters: Adapters) -> None:
    """Folds each adapter into its base, kernel + scale * B @ A in float32 (PEFT's `merge_and_unload`), and puts a
    plain `Linear` back in place of each `LoRALinear`, in place: the model then has no adapters, and its parameters
    are the paths and shapes of the checkpoint it was loaded from."""
    import jax.numpy as jnp

    for owner in adapters.hf_names:
        m = module_at(model, owner)
        if isinstance(m.kernel, QuantizedKernel):
            raise TrainingError(f"{'.'.join(map(str, owner))} is quantized: merging an adapter into quantized "
                                "weights is not implemented; serve it beside the model (--lora-modules), or fuse "
                                "into the base converted in float (--dequantize)")
        w = np.asarray(m.kernel[...], np.float32)
        delta = m.scale * (np.asarray(m.lora_b[...], np.float32) @ np.asarray(m.lora_a[...], np.float32))  # [O, I]
        m.kernel[...] = jnp.asarray(w + delta.reshape(w.shape))  # the kernel is out_shape + in_shape, [O, I] flat
        axes = (None,) * (len(m.in_shape) + len(m.out_shape))  # unused: the kernel and bias are m's own variables
        with nnx.use_eager_sharding(False):
            plain = nnx.eval_shape(lambda m=m: Linear(m.in_shape, m.out_shape, axes, use_bias=m.bias is not None,
                                                      rngs=nnx.Rngs(0)))
        plain.kernel, plain.bias, plain.quantizable = m.kernel, m.bias, m.quantizable
        replace_module_at(model, owner, plain)


def adapter_arrays(model: nnx.Module, adapters: Adapters) -> dict[str, np.ndarray]:
    """PEFT's tensors: `base_model.model.<HF module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]."""
    out = {}
    for hf, module in adapters.modules(model).items():
        out[f"{PREFIX}{hf}.lora_A.weight"] = np.asarray(module.lora_a[...], np.float32)
        out[f"{PREFIX}{hf}.lora_B.weight"] = np.asarray(module.lora_b[...], np.float32)
    return out


def load_adapter_arrays(model: nnx.Module, adapters: Adapters, arrays: dict[str, np.ndarray]) -> None:
    """Sets the adapters from PEFT's tensors (`adapter_arrays`' names and shapes), in place.

    Raises:
        TrainingError: a tensor missing, of another shape, or one that names no adapted module.
    """
    import jax.numpy as jnp

    modules = adapters.modules(model)
    wanted = {f"{PREFIX}{hf}.lora_{ab}.weight": (m, ab) for hf, m in modules.items() for ab in "AB"}
    extra = sorted(set(arrays) - set(wanted))
    if extra:
        raise TrainingError(f"adapter tensor {extra[0]!r} names no adapted module of this model")
    for name, (module, ab) in wanted.items():
        if name not in arrays:
            raise TrainingError(f"adapter tensor {name!r} is missing")
        var = module.lora_a if ab == "A" else module.lora_b
        if tuple(arrays[name].shape) != tuple(var.shape):
            raise TrainingError(f"adapter tensor {name!r} has shape {tuple(arrays[name].shape)}, expected "
                                f"{tuple(var.shape)}")
        var[...] = jnp.asarray(arrays[name], jnp.float32)


def save_adapter(model: nnx.Module, adapters: Adapters, folder: str | Path, base_model: str,
                 extra: Callable[[Path], None] | None = None) -> Path:
    """Writes a PEFT LoRA folder (`adapter_config.json`, `adapter_model.safetensors`) that
    `peft.PeftModel.from_pretrained` loads on the HF model `base_model` names. Atomically: the files go into a
    hidden folder beside it, renamed into place once complete, so a crash mid-save (a periodic save included)
    leaves the previous adapter whole. An existing `folder` is replaced only if it holds an adapter or nothing.
    `extra(hidden folder)` writes more files into the save before the rename (the training state of --resume).

    Raises:
        TrainingError: `folder` exists and is neither an adapter folder nor empty.
    """
    from safetensors.numpy import save_file

    from convert.writer import fsync_path

    folder = Path(folder).absolute()
    if folder.exists() and not (folder.is_dir() and not folder.is_symlink()
                                and ((folder / "adapter_config.json").is_file() or not any(folder.iterdir()))):
        raise TrainingError(f"{folder}: exists and is not a LoRA adapter folder (no adapter_config.json); "
                            "choose another --adapter-path")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        c = adapters.config
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": c.rank, "lora_alpha": c.alpha,
                  "lora_dropout": c.dropout, "target_modules": adapters.target_modules, "bias": "none",
                  "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
                  "base_model_name_or_path": base_model}
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(adapter_arrays(model, adapters), str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        for f in tmp.iterdir():
            fsync_path(f)
        if extra is not None:
            extra(tmp)
        fsync_path(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp's folder is the owner's alone
        if folder.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
            os.rename(folder, old / "adapter")
            os.rename(tmp, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def lora_filter():
    """The nnx filter of the adapters' parameters (what LoRA training differentiates and updates)."""
    return LoRAParam
