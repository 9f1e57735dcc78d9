"""Speculative decoding's proposers and per-row policy: which decode rows draft this step, and what.

A proposer drafts up to k tokens per row; the engine's verify step scores them with the target (the acceptance is
`sampling.accept_drafts`, beside the sampler). Proposers share one interface (`Proposer`):

- `ngram` (`NgramProposer`): prompt lookup, on the host. The longest n-gram (ngram_max down to ngram_min) ending the
  row's tokens that occurred before in them; its most recent earlier occurrence's continuation is the draft. Free,
  and right where the output copies its input (rewriting, summarizing, editing code). It drafts without waiting for
  the row's last token (the continuation guesses it), so steps without drafts keep host and device work overlapped.
- `draft` and `mtp` draft on the device, right after each verify (a small model with its own KV pages, or the
  model's own multi-token-prediction layers): see `day0jax.engine.device_proposers`.

`Speculation` is the engine's policy: a row speculates while the decode batch is at most `max_batch` rows, its request
allows it, and its drafts keep being accepted; a host proposer's row that keeps failing (no match, or nothing
accepted) skips a growing number of steps.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from flax import nnx

from day0jax.core.errors import GenerationError
from day0jax.engine.config import SpeculativeConfig
from day0jax.engine.requests import SequenceState

# A host proposer's row skips 2, 4, ... up to this many steps after consecutive failures.
MAX_SKIP = 16
# A device proposer's row stops speculating for good after this many verify steps in a row that accepted nothing.
MAX_FAILURES = 8


class Proposer:
    """Drafts tokens for decode rows. Host proposers draft from the row's tokens when the step is planned
    (`propose`; the row's last token may still be on the device, `seq.in_flight`); device proposers (`on_device`)
    leave their drafts for each row when the engine reads a verify step's outputs."""

    method: str = ""
    on_device: bool = False

    def propose(self, seq: SequenceState, limit: int) -> list[int]:
        """Up to `limit` drafted tokens to follow the row's tokens and the `seq.in_flight` ones still on the
        device."""
        raise NotImplementedError


class NgramProposer(Proposer):
    """Prompt lookup over the row's own tokens (prompt and output).

    Args:
        ngram_min, ngram_max: the n-gram lengths tried, longest first.
        lookback: how many of the row's last tokens are searched (bounds the host work per step).
    """

    method = "ngram"

    def __init__(self, ngram_min: int, ngram_max: int, lookback: int = 4096):
        self.ngram_min, self.ngram_max, self.lookback = ngram_min, ngram_max, lookback

    def propose(self, seq: SequenceState, limit: int) -> list[int]:
        # A token still on the device: the match's continuation guesses it and the drafts follow the guess (a wrong
        # guess only costs rejected drafts: the verify step scores them after the real token).
        skip = seq.in_flight
        return ngram_drafts(seq.tokens[-self.lookback:], self.ngram_min, self.ngram_max, limit + skip)[skip:]


def ngram_drafts(tokens: Sequence[int], ngram_min: int, ngram_max: int, limit: int) -> list[int]:
    """The continuation (up to `limit` tokens) of the most recent earlier occurrence of the longest n-gram, n from
    `ngram_max` down to `ngram_min`, that ends `tokens`; [] when none occurs."""
    L = len(tokens)
    if limit <= 0 or L < ngram_min + 1:
        return []
    arr = np.asarray(tokens, np.int64)
    for n in range(min(ngram_max, L - 1), ngram_min - 1, -1):
        # Windows of n tokens starting at 0 .. L - n - 1 (the suffix itself, at L - n, excluded).
        windows = np.lib.stride_tricks.sliding_window_view(arr[:L - 1], n)
        hits = np.flatnonzero((windows == arr[L - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + limit].tolist()
    return []


@dataclass
class RowState:
    """A row's speculation state: steps left to skip and failures in a row."""

    skip: int = 0
    failures: int = 0
    off: bool = False
    next: list[int] | None = None  # a device proposer's drafts for the row's next step


@dataclass
class SpecStats:
    """Counters for metrics: verify rows that carried drafts, tokens drafted and accepted, and acceptances per draft
    position (how often the i-th draft of a row was kept)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step of a row that drafted: 1 (the target's own) + accepted drafts per such step."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0


class Speculation:
    """The engine's speculative decoding: the proposer, which rows draft, and the acceptance counters.

    Args:
        config: the `SpeculativeConfig`.
        proposer: the `Proposer` for its method.
        max_model_len: no draft reaches past it.
        backoff: turn speculation down for rows whose drafts keep failing (tests that need every row to speculate
            turn it off).
    """

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int, backoff: bool = True):
        self.config, self.proposer, self.max_model_len, self.backoff = config, proposer, max_model_len, backoff
        self.k = config.num_tokens
        self.stats = SpecStats(accepted_per_position=[0] * self.k)
        self.propose_seconds = 0.0  # the host proposer's time (profiling)
        # Test hook: every draft counts as accepted (to time a verify step at full acceptance; the tokens are then
        # the drafts, not the target's).
        self.force_accept = False

    def row(self, seq: SequenceState) -> RowState:
        if seq.spec is None:
            seq.spec = RowState()
        return seq.spec

    def limit(self, seq: SequenceState) -> int:
        """How many drafts the row may take: k, fewer near max_tokens or max_model_len (a verify step emits up to
        drafts + 1 tokens)."""
        left = min(seq.params.max_tokens - seq.num_generated, self.max_model_len - seq.length) - 1
        return max(0, min(self.k, left))

    def active(self, decode_rows: int) -> bool:
        """Whether a decode batch of this many rows speculates at all."""
        return 0 < decode_rows <= self.config.rows

    def wants(self, seq: SequenceState) -> bool:
        """Whether the row drafts this step (a host proposer's skipping row counts its step down here)."""
        if not seq.params.speculative:
            return False
        state = self.row(seq)
        if state.off:
            return False
        if state.skip > 0:
            state.skip -= 1
            return False
        return self.limit(seq) > 0

    def propose(self, seq: SequenceState) -> None:
        """Fills `seq.drafts`: from a host proposer (a miss counts as a failure), or a device proposer's drafts
        read with the row's last tokens (a row without them missed a step: it stops speculating)."""
        if self.proposer.on_device:
            state = self.row(seq)
            if state.next is None:
                state.off = True
                seq.drafts = []
                return
            seq.drafts, state.next = state.next[:self.limit(seq)], None
            return
        t0 = time.perf_counter()
        drafts = self.proposer.propose(seq, self.limit(seq))
        self.propose_seconds += time.perf_counter() - t0
        seq.drafts = drafts
        if not drafts:
            self._failed(seq)

    def store_drafts(self, seqs: Sequence[SequenceState], drafts: np.ndarray) -> None:
        """A device proposer's drafts for each row's next step ([rows, k]), read with its tokens."""
        for i, seq in enumerate(seqs):
            self.row(seq).next = drafts[i].tolist()

    def record(self, seq: SequenceState, drafted: int, accepted: int) -> None:
        """A verify step kept `accepted` of the row's `drafted` drafts."""
        seq.num_draft_tokens += drafted
        seq.num_accepted_tokens += accepted
        if not drafted:
            return
        s = self.stats
        s.drafts += 1
        s.draft_tokens += drafted
        s.accepted_tokens += accepted
        for i in range(accepted):
            s.accepted_per_position[i] += 1
        if accepted:
            self.row(seq).failures = 0
        else:
            self._failed(seq)

    def _failed(self, seq: SequenceState) -> None:
        if not self.backoff:
            return
        state = self.row(seq)
        state.failures += 1
        if self.proposer.on_device:
            state.off = state.off or state.failures >= MAX_FAILURES
        elif state.failures >= 2:
            state.skip = min(1 << (state.failures - 1), MAX_SKIP)

    def turn_off(self, seq: SequenceState) -> None:
        """The row stops speculating for good (a device proposer's row that missed a step its state needed)."""
        self.row(seq).off = True


def refuse_unverifiable_state(module) -> None:
    """Refuses speculative decoding on a model with a per-sequence state its layers cannot keep token by token: a
    verify step must leave the state after each of its tokens (`StateCache.targets`) so that the accepted one can
    become the sequence's; a layer that writes only the state after the last token would keep rejected drafts in it.

    Raises:
        GenerationError: such a layer (one with a `state_layout` but without `per_token_states`), named.
    """
    lacking = sorted({type(m).__name__ for _, m in nnx.iter_modules(module)
                      if hasattr(m, "state_layout") and not getattr(m, "per_token_states", False)})
    if lacking:
        raise GenerationError(f"speculative decoding is not implemented for models with {', '.join(lacking)} "
                              "layers (their state after each verified token is not kept)")


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The host proposer for `config.method` (device proposers are made by the engine, which holds their models).

    Raises:
        ValueError: a device method.
    """
    if config.method == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    raise ValueError(f"{config.method} drafts on the device")
