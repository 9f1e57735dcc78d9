"""LoRA adapters served beside their base model (vLLM's `--lora-modules name=PATH`).

Each adapter is a PEFT folder (`adapter_config.json`, `adapter_model.safetensors`), read and checked when the model
is prepared, before any weight: a folder that is not PEFT's, an option not implemented, a rank over the limit, a
tensor naming no module of the model or of another shape is refused with the file and the key. The adapters of one
module are stacked into slots on every device, slot 0 all zeros (no adapter), and each row of a batch takes its
own slot (`layers.lora.MultiLoRALinear`), so requests for different adapters, and for none, share decode steps.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from flax import nnx

from day0jax.core.errors import AdapterError, CheckpointError, Day0Error
from day0jax.engine.config import MAX_LORA_RANK, MAX_LORAS
from day0jax.layers.lora import MultiLoRALinear, module_at, replace_module_at

ADAPTER_CONFIG, ADAPTER_TENSORS = "adapter_config.json", "adapter_model.safetensors"
# PEFT's names for a causal LM's LoRA matrices (saved without the adapter's own name).
_TENSOR = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight")


@dataclass(frozen=True)
class AdapterConfig:
    """What a PEFT LoRA folder's `adapter_config.json` says: rank r, lora_alpha, the target module names, and the
    target parameters (MoE experts' fused weights, PEFT's `target_parameters`; empty for most adapters)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    parameters: tuple[str, ...] = ()

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def read_adapter_config(folder: Path) -> AdapterConfig:
    """The config of a PEFT LoRA folder.

    Raises:
        AdapterError: the file missing or unreadable, or a PEFT option not implemented here (DoRA, rsLoRA's scale,
            fan_in_fan_out, per-module ranks or alphas, layers trained in full beside the adapter, trained biases),
            naming the file and the field.
    """
    path = Path(folder) / ADAPTER_CONFIG
    if not path.is_file():
        raise AdapterError(f"{path} does not exist: not a PEFT LoRA adapter folder")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path}: unreadable ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path}: not a JSON object")
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type is {config.get('peft_type')!r}; only LORA adapters are implemented")
    for key in ("use_dora", "use_rslora", "fan_in_fan_out"):
        if config.get(key):
            raise AdapterError(f"{path}: {key} is set; such adapters are not implemented")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise AdapterError(f"{path}: {key} gives some modules their own rank or alpha; not implemented")
    if config.get("modules_to_save"):
        raise AdapterError(f"{path}: modules_to_save {config['modules_to_save']} trains whole layers beside the "
                           "adapter; not implemented")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{path}: bias is {config['bias']!r}; adapters that train biases are not implemented")
    targets, parameters = config.get("target_modules"), config.get("target_parameters") or []
    if not isinstance(parameters, list) or not all(isinstance(p, str) for p in parameters):
        raise AdapterError(f"{path}: target_parameters is {parameters!r}; a list of parameter names is needed")
    if isinstance(targets, str) or not (targets or parameters):
        raise AdapterError(f"{path}: target_modules is {targets!r}; the list of module names is needed")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if type(rank) is not int or rank < 1:
        raise AdapterError(f"{path}: r is {rank!r}; a positive integer is needed")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"{path}: lora_alpha is {alpha!r}; a number is needed")
    return AdapterConfig(rank=rank, alpha=float(alpha), targets=tuple(targets or ()), parameters=tuple(parameters))


def adapter_tensors_file(folder: Path):
    """The folder's `adapter_model.safetensors`, its header checked (`SafetensorsFile`; tensors read on demand).

    Raises:
        AdapterError: the file missing (or only PEFT's pickled `adapter_model.bin`), or not safetensors.
    """
    from convert.safetensors_file import SafetensorsFile

    path = Path(folder) / ADAPTER_TENSORS
    if not path.is_file():
        pickled = " (adapter_model.bin, a pickle, is not read: save with safe_serialization)" \
            if (Path(folder) / "adapter_model.bin").exists() else ""
        raise AdapterError(f"{path} does not exist{pickled}")
    try:
        return SafetensorsFile(path)
    except CheckpointError as e:
        raise AdapterError(str(e)) from None


@dataclass(frozen=True)
class PeftAdapter:
    """One served adapter: its name (what a request's `model` says), folder, config, and its LoRA matrices' shapes
    by HF module: (A [r, in], B [out, r])."""

    name: str
    path: Path
    config: AdapterConfig
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]

    def read(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """HF module -> (A, B) in float32."""
        f = adapter_tensors_file(self.path)
        return {m: tuple(np.asarray(f.read(f"base_model.model.{m}.lora_{ab}.weight"), np.float32) for ab in "AB")
                for m in self.shapes}


def read_peft(name: str, folder: str | Path, max_rank: int) -> PeftAdapter:
    """An adapter folder's config and tensor shapes, checked (no tensor is read).

    Raises:
        AdapterError: as `read_adapter_config`; an adapter of MoE experts' fused weights (`target_parameters`); a
            rank over `max_rank`; a tensor that is not a linear module's LoRA A or B, or of a shape that does not
            match r; a module with A but no B (or B but no A).
    """
    folder = Path(folder).absolute()
    if not folder.is_dir():
        raise AdapterError(f"--lora-modules {name}={folder}: no such folder")
    config = read_adapter_config(folder)
    if config.parameters:
        raise AdapterError(f"{folder / ADAPTER_CONFIG}: target_parameters {list(config.parameters)} adapts MoE "
                           "experts' stacked weights; serving such adapters is not implemented (merge it into the "
                           "model instead: python -m day0jax.train --fuse)")
    if config.rank > max_rank:
        raise AdapterError(f"{folder / ADAPTER_CONFIG}: rank r={config.rank} is over --max-lora-rank {max_rank}")
    f = adapter_tensors_file(folder)
    halves: dict[str, dict[str, tuple]] = {}
    for key, info in f.tensors.items():
        m = _TENSOR.fullmatch(key)
        if m is None:
            raise AdapterError(f"{f.path}: tensor {key!r} is not a linear module's lora_A or lora_B weight "
                               "(embedding adapters and DoRA magnitudes are not implemented)")
        at = 0 if m["ab"] == "A" else 1
        if len(info.shape) != 2 or info.shape[at] != config.rank:
            want = "[r, in]" if at == 0 else "[out, r]"
            raise AdapterError(f"{f.path}: tensor {key!r} has shape {list(info.shape)}; expected {want} with "
                               f"r={config.rank}")
        halves.setdefault(m["module"], {})[m["ab"]] = info.shape
    for module, ab in halves.items():
        if len(ab) != 2:
            missing = "B" if "A" in ab else "A"
            raise AdapterError(f"{f.path}: module {module!r} has no lora_{missing}.weight")
    if not halves:
        raise AdapterError(f"{f.path}: no LoRA tensors")
    return PeftAdapter(name, folder, config, {m: (ab["A"], ab["B"]) for m, ab in sorted(halves.items())})


def adaptable_modules(model: nnx.Module) -> dict[str, tuple]:
    """HF module name -> the runtime path of the `Linear` that is that module's weight, for every linear map an
    adapter may target: made from one HF tensor by a reshape alone (the converter's mapping, inverted), applied as
    a map (not read by its layer), outside the multi-token-prediction layers (speculative drafting runs the base)."""
    from day0jax import models
    from day0jax.layers.linear import Linear

    # The float model's kernels carry the metadata the mapping reads, where the served one's may be quantized.
    plain = models.abstract_model(model.config)
    out = {}
    for path, module in nnx.iter_modules(plain):
        path = tuple(path)
        if type(module) is not Linear or not module.quantizable or (path and path[0] == "mtp"):
            continue
        try:
            name = models.hf_tensor_name(model.config, ".".join(map(str, path)) + ".kernel", module.kernel)
        except Day0Error:
            continue  # fused from several tensors or re-laid out: no one HF module to adapt
        if name.endswith(".weight"):
            out[name[: -len(".weight")]] = path
    return out


class ServedAdapters:
    """The adapters a model serves: slot i + 1 is `adapters[i]`'s; every module any of them targets becomes a
    `MultiLoRALinear` whose slots hold each adapter's matrices (zeros where it does not target the module), padded
    to the largest rank among them, B scaled by its adapter's alpha / r.

    Args:
        modules: (name, folder) pairs, in slot order.
        model: the (abstract) model they adapt.
        max_loras: the most adapters (`--max-loras`).
        max_rank: the largest rank accepted (`--max-lora-rank`).
    Raises:
        AdapterError: too many adapters, an empty name or one given twice, a vision-language model, a folder that
            `read_peft` refuses, or a tensor naming no module of the model or of another shape than its module.
    """

    def __init__(self, modules: Sequence[tuple[str, str]], model: nnx.Module, max_loras: int = MAX_LORAS,
                 max_rank: int = MAX_LORA_RANK):
        names = [n for n, _ in modules]
        if len(modules) > max_loras:
            raise AdapterError(f"--lora-modules gives {len(modules)} adapters, more than --max-loras {max_loras}")
        for i, n in enumerate(names):
            if not n or n in names[:i]:
                what = "empty" if not n else "given twice"
                raise AdapterError(f"--lora-modules: adapter name {n!r} is {what}; each adapter needs its own name")
        if getattr(model, "vision_spec", None) is not None:
            raise AdapterError(f"{model.config.model_type}: serving LoRA adapters on a vision-language model is not "
                               "implemented")
        self.adapters = [read_peft(n, p, max_rank) for n, p in modules]
        adaptable = adaptable_modules(model)
        self.modules: dict[str, tuple] = {}  # HF module -> runtime path, of the modules some adapter targets
        for a in self.adapters:
            for module, (a_shape, b_shape) in a.shapes.items():
                path = adaptable.get(module)
                if path is None:
                    raise AdapterError(f"{a.path / ADAPTER_TENSORS}: module {module!r} is not one of this "
                                       f"{model.config.model_type} model's adaptable linear maps (another model's "
                                       "adapter, or a map this model keeps fused or quantized as a whole)")
                linear = module_at(model, path)
                want = (math.prod(linear.in_shape), math.prod(linear.out_shape))
                if (a_shape[1], b_shape[0]) != want:
                    raise AdapterError(f"{a.path / ADAPTER_TENSORS}: module {module!r} maps {a_shape[1]} -> "
                                       f"{b_shape[0]} features; this model's maps {want[0]} -> {want[1]}")
                self.modules[module] = path
        self.rank = max(a.config.rank for a in self.adapters)

    def shapes(self, model: nnx.Module) -> dict[tuple, tuple[tuple, tuple]]:
        """Runtime path -> the shapes of its stacked A [S, R, in] and B [S, out, R]."""
        S = len(self.adapters) + 1
        out = {}
        for path in self.modules.values():
            linear = module_at(model, path)
            out[path] = ((S, self.rank, math.prod(linear.in_shape)), (S, math.prod(linear.out_shape), self.rank))
        return out

    def attach(self, model: nnx.Module, values: dict[tuple, tuple]) -> None:
        """Replaces each targeted `Linear` of `model` by a `MultiLoRALinear` holding `values[path]` (its A and B
        stacks: arrays, or shapes for an abstract model), in place."""
        for path, (a, b) in values.items():
            replace_module_at(model, path, MultiLoRALinear(module_at(model, path), a, b))

    def stacked(self, model: nnx.Module, dtype) -> dict[tuple, tuple[np.ndarray, np.ndarray]]:
        """Runtime path -> (A [S, R, in], B [S, out, R]) of `dtype`, read from the adapters' files: slot 0 zeros,
        ranks padded with zeros, B times its adapter's alpha / r (in float32, then cast)."""
        out = {path: (np.zeros(a, np.float32), np.zeros(b, np.float32)) for path, (a, b) in self.shapes(model).items()}
        for slot, adapter in enumerate(self.adapters, start=1):
            r = adapter.config.rank
            for module, (a, b) in adapter.read().items():
                A, B = out[self.modules[module]]
                A[slot, :r] = a
                B[slot, :, :r] = b * np.float32(adapter.config.scale)
        return {p: (A.astype(dtype), B.astype(dtype)) for p, (A, B) in out.items()}

    def nbytes(self, model: nnx.Module, itemsize: int) -> int:
        """Bytes of the stacked matrices, which every device holds whole."""
        return itemsize * sum(math.prod(a) + math.prod(b) for a, b in self.shapes(model).values())

    def describe(self) -> str:
        return ", ".join(f"{a.name} (r={a.config.rank}, {len(a.shapes)} modules)" for a in self.adapters)
