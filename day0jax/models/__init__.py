"""Model families: `model_type` -> the module whose `FAMILY` (a `contract.Family`, the only thing read from it)
implements it, and the helpers that build models."""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
from flax import nnx

from day0jax.core.errors import UnsupportedArchitecture

if TYPE_CHECKING:  # the family modules import it; importing it here would load every layer up front
    from day0jax.models.contract import Family

FAMILIES = {name: f"day0jax.models.{name}" for name in (
    "llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "gemma", "gemma2", "gemma3_text", "phi3",
    "olmo2", "deepseek_v3", "gpt_oss", "smollm3", "granite",
    "minimax_m2", "glm4_moe", "olmo3", "seed_oss", "exaone4", "ernie4_5", "ernie4_5_moe",
    "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "glm4", "arcee",
    "afmoe", "mistral4", "laguna",
    "qwen3_next", "deepseek_v32", "glm_moe_dsa", "kimi_linear",
    "lfm2", "lfm2_moe", "lfm3", "llava", "gemma3", "qwen3_vl", "qwen3_vl_text", "kimi_k25", "qwen3_vl_moe",
    "qwen3_vl_moe_text", "mistral3", "lfm2_vl",
    "ministral", "exaone", "nemotron_h", "granitemoehybrid", "bamba", "falcon_h1", "mimo_v2_flash", "deepseek_v2",
    "dots1", "cohere", "cohere2", "olmoe", "starcoder2")}
# Model types a module implements besides its own name (the text model of a multimodal family); Qwen3.5's text
# models and its released, multimodal checkpoints.
FAMILIES.update({"qwen3_5_text": "day0jax.models.qwen3_5", "qwen3_5_moe_text": "day0jax.models.qwen3_5_moe",
                 "qwen3_5": "day0jax.models.qwen3_5_vl", "qwen3_5_moe": "day0jax.models.qwen3_5_vl"})
FAMILIES.update({"kimi_k2": "day0jax.models.deepseek_v3"})
FAMILIES.update({"step3p7": "day0jax.models.step3p7", "step3p5": "day0jax.models.step3p7"})
FAMILIES.update({"llama4": "day0jax.models.llama4", "llama4_text": "day0jax.models.llama4"})
FAMILIES.update({"gemma4": "day0jax.models.gemma4_vl", "gemma4_text": "day0jax.models.gemma4"})
FAMILIES.update({"mistral_large4": "day0jax.models.mistral_large4",
                 "mistral_large4_text": "day0jax.models.mistral_large4"})
FAMILIES.update({"deepseek_v4": "day0jax.models.deepseek_v4", "hy_v4": "day0jax.models.hy_v4"})
FAMILIES.update({"minimax_m3_vl_text": "day0jax.models.minimax_m3", "minimax_m3_vl": "day0jax.models.minimax_m3"})
FAMILIES.update({"glm5_next": "day0jax.models.glm5_next", "glm5_next_text": "day0jax.models.glm5_next"})
FAMILIES.update({"qwen4_exp_text": "day0jax.models.qwen4_exp", "qwen4_exp": "day0jax.models.qwen4_exp"})


def hf_tensor_name(config: Any, path: str, var) -> str:
    """The HF tensor the converter reshapes into the runtime parameter `path` (an nnx variable `var`): the inverse
    of the family's mapping, for parameters made from one tensor by a reshape alone (where fine-tuning exports
    adapters to, and where served adapters come from).

    Raises:
        UnsupportedArchitecture: the family builds the parameter from several tensors or another layout (fused,
            transposed or stacked), which this version does not map back.
    """
    from day0jax.core.hf_tensors import default_source, same

    fam = family(config.model_type)
    metadata = var.get_metadata()
    shape = tuple(var.shape)
    src = fam.hf_source(config, path, shape, metadata) or default_source(path, shape, metadata)
    if len(src.names) != 1 or src.combine is not same or src.alternative is not None:
        raise UnsupportedArchitecture(f"{config.model_type}: {path} is made from {list(src.names)} by more than a "
                                      "reshape; mapping it back to Hugging Face's layout is not implemented")
    return src.names[0]


def family(model_type: str) -> Family:
    """The family implementing `model_type`: the `FAMILY` of its module in `FAMILIES`.

    Raises:
        UnsupportedArchitecture: unknown model_type, naming the closest supported one.
    """
    if model_type not in FAMILIES:
        hint = f"; the closest supported family is {closest(str(model_type))!r}"
        raise UnsupportedArchitecture(f"model_type {model_type!r} is not supported{hint} "
                                      f"(supported: {', '.join(sorted(FAMILIES))})")
    return importlib.import_module(FAMILIES[model_type]).FAMILY


def closest(model_type: str) -> str:
    """The supported family nearest `model_type`: one that extends it or that it extends ('gemma3' -> 'gemma3_text'),
    then the most similar ('lama' -> 'llama', not 'laguna' for its longer shared prefix)."""
    def score(name):
        return (name.startswith(model_type), model_type.startswith(name),
                difflib.SequenceMatcher(None, model_type, name).ratio())
    return max(FAMILIES, key=score)


def config_from_hf(hf: dict) -> Any:
    """The family's Config for a parsed config.json."""
    return family(hf.get("model_type")).config.from_hf(hf)


def abstract_model(config: Any, dtype=jnp.float32, quantization: dict | None = None, mtp: bool = False) -> nnx.Module:
    """The model with `jax.ShapeDtypeStruct`s for parameters: shapes and logical axes, no memory.

    Args:
        config: the family's config.
        dtype: of float parameters.
        quantization: module path -> `layers.quantized.QuantSpec`, the modules whose weights stay quantized.
        mtp: with the multi-token-prediction layers (`mtp.*`, speculative decoding's "mtp" proposer).
    Raises:
        UnsupportedArchitecture: `mtp` for a family or config without them.
    """
    from day0jax.layers.quantized import quantize_modules

    fam = family(config.model_type)
    if mtp and not has_mtp(config):
        raise UnsupportedArchitecture(f"{config.model_type}: {fam.mtp_refusal}; use speculative method 'ngram' or "
                                      "'draft'" if fam.mtp_refusal else
                                      f"this {config.model_type} config declares no multi-token-prediction layers; "
                                      "speculative method 'mtp' needs them (use 'ngram' or 'draft')")
    kwargs = {"mtp": True} if mtp else {}
    # Logical axis names are resolved by sharding/rules.py, not by flax's eager sharding.
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: quantize_modules(fam.model(config, dtype=dtype, rngs=nnx.Rngs(0), **kwargs),
                                                       quantization or {}))


MTP_PREFIX = "mtp."  # runtime parameter paths of multi-token-prediction layers: an optional part of a checkpoint


def mtp_tensors(config: Any) -> str | None:
    """The regex of the multi-token-prediction tensors a checkpoint of this config ships (None: none)."""
    fam = family(config.model_type)
    return fam.mtp(config) if fam.mtp is not None else None


def has_mtp(config: Any) -> bool:
    """Whether the family builds multi-token-prediction layers for this config."""
    return bool(mtp_tensors(config))


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
