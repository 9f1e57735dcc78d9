"""LoRA on a loaded model: which `Linear`s and MoE experts take adapters, their Hugging Face names, and the PEFT
export.

The adapters' HF names come from the family's own tensor mapping (`Family.hf_source`, the one the converter reads),
so an exported adapter names the modules of the checkpoint's original HF layout. A GGUF source's q/k rows were
already put back into HF's order by the converter, so its adapters are in that layout too.

Targets: HF module names (`--lora-targets`, default q/k/v/o_proj, gate/up/down_proj) adapt the linear maps of those
names, as PEFT's `target_modules` do: attention, dense MLPs, shared experts. The routed experts' stacked weights are
adapted only when asked for by PEFT's `target_parameters` names, `experts.gate_up_proj` and `experts.down_proj`
(transformers' fused expert parameters); they are exported as PEFT's `ParamWrapper` saves them.
"""

from __future__ import annotations

import json
import os
import re
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
from day0jax.layers.lora import (DENSE_TARGETS, EXPERT_PARAMETERS, ExpertsLoRA, LoRAExperts, LoRALinear, LoRAParam,
                                 lora_targets, module_at, replace_module_at)
from day0jax.layers.moe import Experts
PREFIX = "base_model.model."  # PEFT's prefix of a causal LM's module names


@dataclass(frozen=True)
class LoRAConfig:
    """rank r, alpha (scale alpha / r), dropout p of the adapters' input while training, and the module names (HF's)
    that take adapters."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DENSE_TARGETS  # module names, and `layers.lora.EXPERT_TARGETS` for MoE experts

    def __post_init__(self):
        if self.rank < 1:
            raise TrainingError(f"--lora-rank {self.rank}: the rank must be at least 1")
        if not 0.0 <= self.dropout < 1.0:
            raise TrainingError(f"--lora-dropout {self.dropout}: must be in [0, 1)")


@dataclass
class Adapters:
    """The adapters: runtime path (a tuple of attribute names and layer indices) -> the name PEFT saves its tensors
    under (an HF module; for experts, PEFT's name of the `ParamWrapper`, `<experts>.base_layer` for an inner one);
    `parameters`: the experts' adapters' paths -> the fused parameter each adapts (gate_up_proj, down_proj)."""

    config: LoRAConfig
    hf_names: dict[tuple, str] = field(default_factory=dict)
    parameters: dict[tuple, str] = field(default_factory=dict)

    def modules(self, model: nnx.Module) -> dict[str, LoRALinear | ExpertsLoRA]:
        """PEFT name -> the model's adapter module (each with `lora_a` and `lora_b` in PEFT's layouts)."""
        return {hf: module_at(model, path) for path, hf in self.hf_names.items()}

    @property
    def target_modules(self) -> list[str]:
        return sorted({hf.rsplit(".", 1)[-1] for path, hf in self.hf_names.items() if path not in self.parameters})

    @property
    def target_parameters(self) -> list[str]:
        """PEFT's `target_parameters`: `experts.<fused parameter>` of those adapted, in the experts' order."""
        return [f"experts.{name}" for name in EXPERT_PARAMETERS if name in self.parameters.values()]


def _hf_module_name(config: Any, kernel_path: str, kernel) -> str:
    """The HF module whose `weight` the converter reshapes into this kernel (see `models.hf_tensor_name`)."""
    name = models.hf_tensor_name(config, kernel_path, kernel)
    if not name.endswith(".weight"):
        raise TrainingError(f"{config.model_type}: {kernel_path} comes from {name!r}, not a module's weight")
    return name[: -len(".weight")]


def _hf_experts_module(config: Any, experts_path: str, gate) -> str:
    """The HF experts module (transformers 5: fused `gate_up_proj` and `down_proj` parameters) the runtime experts at
    `experts_path` are converted from, read off the family's mapping of their gate_proj (`gate`, a variable).

    Raises:
        TrainingError: the checkpoint stores these experts in another layout or under other names (Mixtral's
            `block_sparse_moe` w1/w3/w2), which this version does not map to PEFT's names.
    """
    from day0jax.core.hf_tensors import default_source

    path = f"{experts_path}.gate_proj"
    fam = models.family(config.model_type)
    shape, metadata = tuple(gate.shape), gate.get_metadata()
    first = (fam.hf_source(config, path, shape, metadata) or default_source(path, shape, metadata)).names[0]
    for pattern in (r"(.+\.experts)\.0\.gate_proj\.weight", r"(.+\.experts)\.gate_up_proj"):
        if m := re.fullmatch(pattern, first):
            return m[1]
    raise TrainingError(f"{config.model_type}: {path} comes from {first!r}, not from HF's experts module "
                        "(`<experts>.<e>.gate_proj.weight` or `<experts>.gate_up_proj`): naming these experts as "
                        "PEFT names transformers' fused parameters is not implemented, so LoRA on them is not either")


def apply_lora(model: nnx.Module, config: LoRAConfig, seed: int = 0) -> Adapters:
    """Replaces every `Linear` named in `config.targets` by a `LoRALinear` around it, and every MoE experts module
    whose fused parameters it names (`experts.gate_up_proj`, `experts.down_proj`) by a `LoRAExperts` (A
    Kaiming-uniform from `seed`, B zero), in place.

    Returns:
        The adapters with their PEFT names.
    A quantized base `Linear` (int8, int4, FP8, ... as loaded) stays as it is, frozen: the adapter trains in float32
    on its output (QLoRA).

    Raises:
        TrainingError: a target that is not a `Linear` (a map whose kernel a layer reads itself), experts that
            cannot take LoRA (see `lora_targets`, `_hf_experts_module`), dropout with experts (PEFT's ParamWrapper
            refuses it), or no module of those names.
    """
    found = lora_targets(model, config.targets)
    rngs = nnx.Rngs(params=seed)
    adapters = Adapters(config)
    # HF names from the float model's kernels, which carry the converter's metadata (a quantized kernel is codes
    # and scales).
    plain = models.abstract_model(model.config)
    experts: dict[tuple, list[str]] = {}  # experts module -> its fused parameters to adapt
    for owner in found:
        if isinstance(module_at(model, owner[:-1]), Experts):  # an `ExpertsLoRA`'s path
            experts.setdefault(owner[:-1], []).append(owner[-1][len("lora_"):])
    if experts and config.dropout:
        raise TrainingError(f"--lora-dropout {config.dropout} with MoE experts' targets: PEFT's adapters of fused "
                            "parameters (ParamWrapper) take no dropout (the input of each expert's A cannot be "
                            "factored out); use --lora-dropout 0")
    for index, owner in enumerate(found):
        if owner[:-1] in experts:
            continue
        kernel_path = ".".join(map(str, owner)) + ".kernel"
        adapters.hf_names[owner] = _hf_module_name(model.config, kernel_path, module_at(plain, owner).kernel)
        replace_module_at(model, owner, LoRALinear(module_at(model, owner), config.rank, config.alpha, rngs=rngs,
                                                   dropout=config.dropout, index=index))
    for path, names in experts.items():
        hf = _hf_experts_module(model.config, ".".join(map(str, path)), module_at(plain, path).gate_proj)
        for i, name in enumerate(names):
            # PEFT wraps the parameters in the module's order, each wrapper around the previous one: all but the
            # last are reached through `base_layer`s.
            adapters.hf_names[path + (f"lora_{name}",)] = hf + ".base_layer" * (len(names) - 1 - i)
            adapters.parameters[path + (f"lora_{name}",)] = name
        replace_module_at(model, path, LoRAExperts(module_at(model, path), names, config.rank, config.alpha,
                                                   rngs=rngs))
    return adapters


def merge_adapters(model: nnx.Module, adapters: Adapters) -> None:
    """Folds each adapter into its base, kernel + scale * B @ A in float32 (PEFT's `merge_and_unload`; experts: each
    expert's stacked weights + its own scale * B_e @ A_e), and puts a plain `Linear` back in place of each
    `LoRALinear` and a plain `Experts` in place of each `LoRAExperts`, in place: the model then has no adapters, and
    its parameters are the paths and shapes of the checkpoint it was loaded from."""
    import jax.numpy as jnp

    for path in {p[:-1] for p in adapters.parameters}:
        m: LoRAExperts = module_at(model, path)
        for name in (n for names in EXPERT_PARAMETERS.values() for n in names):
            delta = m.delta(name)  # each expert's own scale * B_e @ A_e, [E, in, out]
            if delta is not None:
                w = getattr(m, name)
                w[...] = jnp.asarray(np.asarray(w[...], np.float32) + np.asarray(delta, np.float32), w.dtype)
        replace_module_at(model, path, m.plain())
    for owner in adapters.hf_names:
        if owner in adapters.parameters:
            continue
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
    """PEFT's tensors: `base_model.model.<HF module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]; for a
    fused expert parameter `base_model.model.<experts>[.base_layer].lora_A.weight` [r*E, in] and `.lora_B.weight`
    [out, r*E] (`layers.lora.ExpertsLoRA`)."""
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
        if adapters.parameters:
            config["target_parameters"] = adapters.target_parameters
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
