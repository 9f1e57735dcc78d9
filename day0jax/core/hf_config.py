"""Model configs: frozen dataclasses whose fields are the Hugging Face `config.json` keys, word for word.

Undeclared keys are kept in `unknown_keys` so the readiness report can list them, unless in `IGNORED_KEYS`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from day0jax.core.errors import ConfigError, UnsupportedArchitecture

# Keys that describe training, tooling or tokenization and never change the forward pass.
IGNORED_KEYS = frozenset({
    "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id", "decoder_start_token_id",
    "initializer_range", "attention_dropout", "hidden_dropout", "embd_pdrop", "resid_pdrop", "dropout",
    "_name_or_path", "_model_name_or_path", "_attn_implementation", "_attn_implementation_autoset",
    "output_attentions", "output_hidden_states", "return_dict", "is_encoder_decoder", "tie_encoder_decoder",
    "pretraining_tp", "quantization_config", "id2label", "label2id", "task_specific_params", "problem_type",
    "chunk_size_feed_forward", "add_cross_attention", "is_decoder", "cross_attention_hidden_size",
    "finetuning_task", "tokenizer_class", "prefix", "bad_words_ids", "begin_suppress_tokens",
    "suppress_tokens", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "max_length", "min_length", "do_sample", "early_stopping",
    "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "torchscript", "tf_legacy_loss",
    "pruned_heads", "use_bfloat16", "model_type", "layer_types_pattern", "max_window_layers", "router_aux_loss_coef",
    "output_router_logits", "use_sliding_window_default", "mlp_dropout", "embedding_dropout",
    "cache_implementation",  # generate()'s default cache class (Gemma 2/3 write "hybrid"), not the math
})

C = TypeVar("C")


def from_hf(cls: type[C], hf: dict[str, Any]) -> C:
    """Returns a config dataclass built from a `config.json` dict, every undeclared, not-ignored key in `unknown_keys`.

    Args:
        cls: a frozen dataclass whose fields are HF keys (plus `unknown_keys`).
        hf: the parsed `config.json`.
    Raises:
        ConfigError: a required field is missing.
    """
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in hf.items() if k in names and k != "unknown_keys"}
    unknown = {k: v for k, v in hf.items() if k not in names and k not in IGNORED_KEYS}
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in kwargs]
    if missing:
        raise ConfigError(f"config.json (model_type {hf.get('model_type')!r}) lacks required field(s): "
                          + ", ".join(missing))
    return cls(**kwargs, unknown_keys=tuple(sorted(unknown)))


def vision_from_hf(cls: type[C], hf: dict[str, Any], tower: str) -> C:
    """`from_hf` for a `vision_config` dict, refusing every undeclared key.

    Raises:
        UnsupportedArchitecture: a key that is not implemented by `tower` (it may change the math), naming it.
    """
    config = from_hf(cls, hf)
    if config.unknown_keys:
        shown = ", ".join(f"{k}={hf[k]!r}" for k in config.unknown_keys)
        raise UnsupportedArchitecture(f"vision_config key(s) not implemented by {tower}: {shown}. They may change "
                                      "the math, so day0jax refuses to run them")
    return config


def read_config_json(path: Path) -> dict[str, Any]:
    """Reads a `config.json`, with a `ConfigError` naming the file when it is missing or malformed."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config.json not found")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(data).__name__}")
    if "model_type" not in data:
        raise ConfigError(f"{path}: no 'model_type' field, so the architecture cannot be known")
    return decode_special_floats(data)


SPECIAL_FLOATS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def decode_special_floats(obj: Any) -> Any:
    """`obj` with transformers 5's encoding of the floats JSON lacks (`{"__float__": "Infinity"}`, which it writes
    for Mamba2's default `time_step_limit`) read back as floats."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"} and obj["__float__"] in SPECIAL_FLOATS:
            return SPECIAL_FLOATS[obj["__float__"]]
        return {k: decode_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_special_floats(v) for v in obj]
    return obj


def refuse(key: str, value: Any, why: str = "is not implemented") -> NoReturn:
    """Raises `UnsupportedArchitecture` naming the config key and its value: never run with wrong numbers."""
    raise UnsupportedArchitecture(f"config {key}={value!r} {why}")
