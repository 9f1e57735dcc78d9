"""Model families: `model_type` -> the module that implements it, and the helpers that build models.

Each family module defines `MODEL_TYPES`, a `Config` dataclass (fields = HF keys; `Config.from_hf(hf)` refuses
undeclared keys that are not in `config.IGNORED_KEYS`, and values the family does not implement), a `Model`
(an nnx module, usually a `base.CausalLM`), `DROPPED` (regex -> why those HF tensors are not read; a family may
also define `dropped(config)` for config-dependent ones) and, where
its tensors do not follow HF's plain naming, `hf_source(config, path, shape, metadata)`.
"""

from __future__ import annotations

import difflib
import importlib
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.errors import UnsupportedArchitecture

FAMILIES = {
    "llama": "day0jax.models.llama",
    "mistral": "day0jax.models.mistral",
    "qwen2": "day0jax.models.qwen2",
    "qwen3": "day0jax.models.qwen3",
    "qwen2_moe": "day0jax.models.qwen2_moe",
    "qwen3_moe": "day0jax.models.qwen3_moe",
    "mixtral": "day0jax.models.mixtral",
    "gemma": "day0jax.models.gemma",
    "gemma2": "day0jax.models.gemma2",
    "gemma3_text": "day0jax.models.gemma3_text",
    "phi3": "day0jax.models.phi3",
    "olmo2": "day0jax.models.olmo2",
    "deepseek_v3": "day0jax.models.deepseek_v3",
    "gpt_oss": "day0jax.models.gpt_oss",
    "smollm3": "day0jax.models.smollm3",
    "granite": "day0jax.models.granite",
}


def family(model_type: str) -> ModuleType:
    """The module implementing `model_type`.

    Raises:
        UnsupportedArchitecture: unknown model_type, naming the closest supported one.
    """
    if model_type not in FAMILIES:
        hint = f"; the closest supported family is {closest(str(model_type))!r}"
        raise UnsupportedArchitecture(f"model_type {model_type!r} is not supported{hint} "
                                      f"(supported: {', '.join(sorted(FAMILIES))})")
    return importlib.import_module(FAMILIES[model_type])


def closest(model_type: str) -> str:
    """The supported family nearest `model_type`: the longest shared prefix first ('gemma3' -> 'gemma3_text',
    'qwen3_mo' -> 'qwen3_moe'), then string similarity."""
    def score(name):
        shared = len(os.path.commonprefix([name, model_type]))
        return shared, difflib.SequenceMatcher(None, model_type, name).ratio()
    return max(FAMILIES, key=score)


def config_from_hf(hf: dict) -> Any:
    """The family's Config for a parsed config.json."""
    return family(hf.get("model_type")).Config.from_hf(hf)


def abstract_model(config: Any, dtype=jnp.float32) -> nnx.Module:
    """The model with `jax.ShapeDtypeStruct`s for parameters: shapes and logical axes, no memory."""
    fam = family(config.model_type)
    # Logical axis names are resolved by sharding/rules.py, not by flax's eager sharding.
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: fam.Model(config, dtype=dtype, rngs=nnx.Rngs(0)))


@dataclass(frozen=True)
class ParamInfo:
    """One runtime parameter: dotted path, shape, dtype, logical axis names and the layer's metadata."""

    path: str
    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...]
    metadata: dict


def param_infos(model: nnx.Module) -> list[ParamInfo]:
    """Every parameter of `model` (abstract or real), in a stable order."""
    out = []
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        meta = var.get_metadata()
        value = var.get_value() if hasattr(var, "get_value") else var.value
        axes = tuple(meta.get("out_sharding") or (None,) * len(value.shape))
        out.append(ParamInfo(".".join(str(p) for p in path), tuple(value.shape), value.dtype, axes, meta))
    return out
