"""What the engine is asked and answers: sampling parameters, token events, per-sequence state. Token ids, and a
vision-language model's preprocessed images."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from day0jax.core.errors import GenerationError
from day0jax.engine.sampling import MAX_LOGIT_BIAS, TOP_LOGPROBS
from day0jax.vision.inputs import ImageInputs

STOP, LENGTH, ABORT = "stop", "length", "abort"


class InvalidRequest(GenerationError):
    """A request parameter is out of range; `param` names it (the OpenAI error body's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class QueueFull(GenerationError):
    """The waiting queue is at `max_waiting`; try again later."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (OpenAI / vLLM semantics). top_k <= 0 is off; logprobs k returns the chosen
    token's log-probability and the k (<= 20) most likely. The `n` sequences share the prompt's cached pages; sequence
    i draws from seed + i, so a request's tokens depend only on its prompt, parameters and seed."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, value added to its logit), at most MAX_LOGIT_BIAS
    grammar: Any = None  # a `grammar.Grammar` the output must follow (None: free text)
    speculative: bool = True  # False: this request never speculates, even on an engine that does
    # The prefix cache's scope: cached blocks are shared only between requests with the same salt (None: the
    # unsalted scope), so a tenant cannot learn from cache hits or cached_tokens what another one sent.
    cache_salt: str | None = None
    # A LoRA adapter the model serves (`EngineConfig.lora_modules`), by name; None: the base model.
    adapter: str | None = None

    def validate(self, vocab_size: int) -> None:
        """Raises InvalidRequest naming the first parameter out of range."""
        checks = [
            ("max_tokens", isinstance(self.max_tokens, (int, np.integer)) and self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("top_k", isinstance(self.top_k, (int, np.integer)) and -1 <= self.top_k <= vocab_size,
             f"-1, 0 (off) or a positive integer up to the vocabulary size ({vocab_size})"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "in (0, 10]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= TOP_LOGPROBS, f"in [0, {TOP_LOGPROBS}]"),
            ("n", isinstance(self.n, int) and 1 <= self.n <= 16, "an integer in [1, 16]"),
            ("seed", self.seed is None or isinstance(self.seed, (int, np.integer)), "an integer"),
        ]
        for name, ok, what in checks:
            if not ok:
                raise InvalidRequest(f"{name} must be {what}, got {getattr(self, name)!r}", name)
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})", "stop_token_ids")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}",
                                 "logit_bias")
        bad = [t for t, _ in self.logit_bias if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(f"logit_bias token ids {bad} are outside the vocabulary [0, {vocab_size})",
                                 "logit_bias")
        bad = [v for _, v in self.logit_bias if not -100.0 <= v <= 100.0]
        if bad:
            raise InvalidRequest(f"logit_bias values must be in [-100, 100], got {bad}", "logit_bias")

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def guided(self) -> bool:
        """A grammar or logit biases: the sampler takes per-row masks and biases."""
        return self.grammar is not None or bool(self.logit_bias)

    @property
    def sampled(self) -> bool:
        """Whether the row needs the sampler program (it samples, takes penalties, a grammar or biases, or wants
        logprobs); a step none of whose rows does takes the forward program's greedy tokens."""
        return self.temperature > 0 or self.penalized or self.guided or self.logprobs is not None


@dataclass
class TokenEvent:
    """One new token of one sequence (or only its end, when token is None)."""

    request_id: str
    index: int  # which of the request's n sequences
    token: int | None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while it runs
    stop_token: bool = False  # the token is EOS or a stop token id (servers leave it out of the text)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    # Speculative decoding, so far in this sequence: tokens drafted for it and drafts the target accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(eq=False)
class SequenceState:
    """One sequence while the engine holds it. `tokens`: the prompt and the generated tokens the host has read;
    `in_flight` more are sampled on the device, read a step later. Keys and values exist for the first `num_computed`
    positions. `pending == 1` makes it a decode row; more, a prefill row."""

    request_id: str
    index: int
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    seed: int
    arrival: float
    stops: frozenset
    pages: list[int] = field(default_factory=list)
    slot: int = 0  # its linear-attention state slot while running (0: none)
    slots: list[int] = field(default_factory=list)  # every state slot it holds (k + 1 with speculation)
    num_computed: int = 0
    num_hashed: int = 0  # leading full blocks registered in the prefix cache
    hashes: list[bytes] = field(default_factory=list)
    cached_tokens: int = 0
    wait_for: "SequenceState | None" = None
    finished: bool = False
    in_flight: int = 0
    counts: np.ndarray | None = None  # penalties: generated-token counts
    seen: np.ndarray | None = None  # penalties: tokens in prompt or output
    matcher: Any = None  # its place in `params.grammar` (a `grammar.Matcher`), made on its first sampling
    images: ImageInputs | None = None  # a vision-language model's images, features placed at the image tokens
    # Speculative decoding: this step's drafts (tokens after its input token, scored by the verify step), the
    # proposer's state for it, and its counts.
    drafts: list[int] = field(default_factory=list)
    spec: Any = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def length(self) -> int:
        """Tokens so far, the ones still on the device included."""
        return len(self.tokens) + self.in_flight

    @property
    def num_generated(self) -> int:
        return self.length - self.prompt_len

    @property
    def pending(self) -> int:
        return self.length - self.num_computed
