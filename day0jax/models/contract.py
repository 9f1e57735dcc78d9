"""What a model family hands the rest of day0jax: its module's `FAMILY`, the only way the runtime, the converter
and the readiness report read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from day0jax.core.hf_tensors import Source
from day0jax.models.base import HFConfig


def no_config_dependent_drops(config: Any) -> dict[str, str]:
    """The default `Family.dropped_for`: the tensors a family drops do not depend on its config."""
    return {}


def plain_hf_names(config: Any, path: str, shape: tuple[int, ...], metadata: dict) -> Source | None:
    """The default `Family.hf_source`: every parameter follows HF's plain naming (`core.hf_tensors.default_source`)."""
    return None


@dataclass(frozen=True)
class Family:
    """One model family: its config, its model and how its parameters map to a Hugging Face checkpoint.

    Attributes:
        model_types: the config.json `model_type`s it implements.
        config: its `HFConfig` class (fields are HF keys; `from_hf(hf)` refuses what the family does not implement).
        model: its model class (usually a `base.CausalLM`), built as `model(config, dtype=..., rngs=...)`.
        dropped: regex -> why, for HF tensors deliberately not read (the converter refuses any other unused one).
        dropped_for: config -> more such regexes, for tensors dropped only under some configs (default: none).
        hf_source: (config, runtime path, runtime shape, parameter metadata) -> the `Source` of a parameter whose
            HF naming or layout differs, or None for `core.hf_tensors.default_source` (the default, for every parameter).
        renames: (regex, replacement) pairs that turn the tensor names of older checkpoints of the family into the
            names `hf_source` reads (HF's `_checkpoint_conversion_mapping`), applied where they match.
        mtp: config -> the regex of the multi-token-prediction tensors its checkpoints ship, for families whose model
            builds them (`make_mtp`; None: the family has none). Conversion keeps them unless `--no-mtp`.
        mtp_refusal: why speculative method "mtp" is refused for a family whose checkpoints ship MTP layers that
            day0jax does not run (None: the generic refusal).
    """

    model_types: tuple[str, ...]
    config: type[HFConfig]
    model: type
    dropped: Mapping[str, str]
    dropped_for: Callable[[Any], Mapping[str, str]] = no_config_dependent_drops
    hf_source: Callable[[Any, str, tuple[int, ...], dict], Source | None] = plain_hf_names
    renames: tuple[tuple[str, str], ...] = ()
    mtp: Callable[[Any], str | None] | None = None
    mtp_refusal: str | None = None
