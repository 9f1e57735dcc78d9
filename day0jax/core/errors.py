"""Typed errors that tell the user what is wrong and what to do about it.

Every error raised at a public boundary (loading, conversion, the readiness report, the server) is one of these,
so callers can catch the family they care about and users see a message instead of a stack trace.
"""


class Day0Error(Exception):
    """Base of every error day0jax raises on purpose."""


class CheckpointError(Day0Error):
    """A source or converted checkpoint is missing, malformed, truncated or does not match the model."""


class UnsupportedArchitecture(Day0Error):
    """The model type, or a config value that changes the math, is not implemented."""


class ConfigError(Day0Error):
    """A config.json is missing, unreadable, or lacks a field the family needs."""


class MeshError(Day0Error):
    """A mesh SPEC is malformed or does not fit the devices or the model."""


class OutOfMemoryPlan(Day0Error):
    """The memory planner predicts the model will not fit on the chosen mesh."""


class GenerationError(Day0Error):
    """A generation request is invalid (prompt too long, max_new_tokens below 1, ...)."""


class UnsupportedKVCache(Day0Error):
    """A KV cache dtype (`kv_cache_dtype`) is not implemented for a kind of cache this model's layers keep.

    Attributes:
        kind: the cache kind ("indexer keys", "compressed entries", ...).
        family: the model family (its `model_type`; None where it is not known).
    """

    def __init__(self, message: str, *, kind: str, family: str | None = None):
        super().__init__(message)
        self.kind, self.family = kind, family


class TrainingError(Day0Error):
    """A fine-tuning request this runtime does not support (named), or training data it cannot use."""


class AdapterError(Day0Error):
    """A LoRA adapter folder that cannot be used: a file missing or malformed, a PEFT option not implemented, or
    tensors that do not fit the model (each named, with the file and the key)."""
