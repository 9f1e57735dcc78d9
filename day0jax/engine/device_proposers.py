"""Speculative decoding's device proposers: they draft on the device right after the step that verified a row's
last drafts (or sampled a prompt's first token), so the host reads the row's kept tokens and its next drafts at once.

- `DraftModelProposer` ("draft"): a smaller model with the same vocabulary, its own KV pools in the target's layout
  (the same pages and block tables: position p of a row sits in the same page and slot in both). It runs every
  prefill chunk the target runs; after a verify it takes the kept tokens (catching up over the positions the
  target just verified, whose drafts it had already seen as its own inputs) and drafts k tokens greedily.
- `MTPProposer` ("mtp"): the model's own multi-token-prediction layers, on the target's hidden states (their own KV
  pools, under the same page table; with n chained layers, the hidden states of each sequence's last n - 1 kept
  positions carried from one call to the next): see `ModelRunner.mtp_propose`.

A row's proposer state must follow every token the target keeps, so a device proposer's row that misses a step (a
plain decode step, where speculation is off for the batch) stops speculating for good (`Speculation.turn_off`).
"""

from __future__ import annotations

import weakref
from typing import Sequence

import jax
import numpy as np

from day0jax.engine.input_batch import Batch
from day0jax.engine.requests import SequenceState
from day0jax.engine.speculative import Proposer


class DeviceProposer(Proposer):
    """Drafts on the device: `after_chunk` after each prefill chunk but a prompt's last, `after_prompt` after the
    last (with the token sampled from it), `after_verify` after each verify step; the last two return the drafts
    [rows, k] as a device array the engine reads with the step's tokens."""

    on_device = True

    def __init__(self, runner):
        self.runner = runner
        self.k = runner.layout.spec_tokens

    def after_chunk(self, batch: Batch, seq: SequenceState) -> None:
        raise NotImplementedError

    def after_prompt(self, batch: Batch, seq: SequenceState, sampled: jax.Array) -> jax.Array:
        raise NotImplementedError

    def after_verify(self, batch: Batch, seqs: Sequence[SequenceState], out: dict) -> jax.Array:
        raise NotImplementedError

    def _tables(self, seqs: Sequence[SequenceState], rows: int, last: Sequence[int]) -> np.ndarray:
        """Block tables of decode width covering each row's position `last[i]` (the proposer's look-ahead)."""
        return self.runner.inputs.block_tables(seqs, rows, max(last))

    def _slots(self, seqs: Sequence[SequenceState], rows: int) -> np.ndarray:
        slots = np.zeros(rows, np.int32)
        slots[:len(seqs)] = [s.slot for s in seqs]
        return slots


class DraftModelProposer(DeviceProposer):
    """A draft model's greedy drafts (`ModelRunner.attach_draft`, `ModelRunner.propose`)."""

    method = "draft"

    def after_chunk(self, batch: Batch, seq: SequenceState) -> None:
        self.runner.draft_prefill(batch)

    def after_prompt(self, batch: Batch, seq: SequenceState, sampled: jax.Array) -> jax.Array:
        self.runner.draft_prefill(batch)
        base = seq.num_computed - 1  # the prompt's last position; the sampled token goes after it
        tables = self._tables([seq], 1, [base + self.k])
        return self.runner.propose(np.zeros((1, 1), np.int32), sampled, np.ones(1, bool), np.zeros(1, np.int32),
                                   np.array([base], np.int32), tables, self._slots([seq], 1))

    def after_verify(self, batch: Batch, seqs: Sequence[SequenceState], out: dict) -> jax.Array:
        rows, T = batch.tokens.shape
        base = np.zeros(rows, np.int32)
        base[:len(seqs)] = [s.num_computed for s in seqs]  # each row's input position (not advanced yet)
        tables = self._tables(seqs, rows, [s.num_computed + T + self.k for s in seqs])
        return self.runner.propose(out["tokens"], np.zeros(self.runner.layout.max_rows, np.int32),
                                   np.zeros(rows, bool), out["accepted"], base, tables, self._slots(seqs, rows))


class MTPProposer(DeviceProposer):
    """The model's own multi-token-prediction layers (`ModelRunner.attach_mtp`, `ModelRunner.mtp_propose`)."""

    method = "mtp"

    def __init__(self, runner):
        super().__init__(runner)
        # Each sequence's slot list when its MTP layers last ran: one admitted again (after a preemption) holds a
        # new list, and its slot's carried columns are then another sequence's.
        self._admissions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _chunk(self, batch: Batch, seq: SequenceState, last: bool):
        """The MTP layers over a prefill chunk: each position takes the target's hidden state there and the next
        prompt token (after a prompt's last position, the sampled one: `override`)."""
        s = int(batch.positions[0, 0])
        m = int(batch.kv_lengths[0]) - s  # the chunk's real tokens
        tokens = np.zeros(batch.tokens.shape, np.int32)
        following = seq.tokens[s + 1:s + m + (0 if last else 1)]
        tokens[0, :len(following)] = following
        return tokens, np.array([m - 1], np.int32), np.array([s], np.int32)

    def after_chunk(self, batch: Batch, seq: SequenceState) -> None:
        self._run([seq], *self._chunk(batch, seq, last=False), np.zeros(self.runner.layout.max_rows, np.int32),
                  np.zeros(1, bool), batch.block_tables)

    def after_prompt(self, batch: Batch, seq: SequenceState, sampled: jax.Array) -> jax.Array:
        return self._run([seq], *self._chunk(batch, seq, last=True), sampled, np.ones(1, bool), batch.block_tables)

    def after_verify(self, batch: Batch, seqs: Sequence[SequenceState], out: dict) -> jax.Array:
        rows, T = batch.tokens.shape
        base = np.zeros(rows, np.int32)
        base[:len(seqs)] = [s.num_computed for s in seqs]  # the verify's first position (not advanced yet)
        tables = self._tables(seqs, rows, [s.num_computed + T + self.k for s in seqs])
        return self._run(seqs, out["tokens"], out["accepted"], base, np.zeros(self.runner.layout.max_rows, np.int32),
                         np.zeros(rows, bool), tables)

    def _run(self, seqs: Sequence[SequenceState], tokens, accepted, base: np.ndarray, last_token,
             override: np.ndarray, tables: np.ndarray) -> jax.Array:
        prefix, slots, fresh = self._carry(seqs, len(base), base[:len(seqs)])
        return self.runner.mtp_propose(prefix, tokens, last_token, override, accepted, base, tables, slots, fresh)

    def _carry(self, seqs: Sequence[SequenceState], rows: int, bases: Sequence[int]):
        """Each row's carry slot, the tokens after its carried columns (t(base - n + 2) .. t(base)), and whether
        the carry is not its own (or one of those tokens is still on the device)."""
        E = self.runner.mtp_carried
        prefix, slots, fresh = np.zeros((rows, E), np.int32), np.zeros(rows, np.int32), np.ones(rows, bool)
        for i, (seq, base) in enumerate(zip(seqs, bases)):
            known = seq.tokens[max(base - E + 1, 0):base + 1] if E else []
            prefix[i, E - len(known):] = known
            slots[i] = seq.slots[0]
            fresh[i] = self._admissions.get(seq) is not seq.slots or len(seq.tokens) <= base
            self._admissions[seq] = seq.slots
        return prefix, slots, fresh
