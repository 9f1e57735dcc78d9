"""Model families: `model_type` -> the module that implements it, and the helpers that build models.

Each family module defines `MODEL_TYPES`, a `Config` dataclass (fields = HF keys), a `Model` (an nnx module,
usually a `base.CausalLM`), `DROPPED` (regex -> why those HF tensors are not read) and, where its tensors do not
follow HF's plain naming, `hf_source(config, path, shape, metadata)`.
"""

from __future__ import annotations

import difflib
import importlib
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
}


def family(model_type: str) -> ModuleType:
    """The module implementing `model_type`.

    Raises:
        UnsupportedArchitecture: unknown model_type, naming the closest supported one.
    """
    if model_type not in FAMILIES:
        close = difflib.get_close_matches(str(model_type), list(FAMILIES), n=1, cutoff=0.0)
        hint = f"; the closest supported family is {close[0]!r}" if close else ""
        raise UnsupportedArchitecture(f"model_type {model_type!r} is not supported{hint} "
                                      f"(supported: {', '.join(sorted(FAMILIES))})")
    return importlib.import_module(FAMILIES[model_type])


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
