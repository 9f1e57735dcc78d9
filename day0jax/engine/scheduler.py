"""Who runs in the next step: admission from the waiting queue, decode rows and prefill chunks, preemption.

A decode row that finds no free page preempts the most recently admitted sequence: its pages are released (full blocks
stay cached) and it waits to be recomputed from its prompt plus what it generated, which it keeps.

With speculative decoding a decode row also gets the pages its drafts are written to (and those its proposer's own
look-ahead writes to). Only positions the target has verified count as computed (`num_computed`), so a page is
offered to the prefix cache only once every token in it is verified: a rejected draft's keys, which the row
overwrites later, are never shared.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass
from typing import Sequence

from day0jax.engine.block_pool import BlockPool, OutOfPages, block_hash, salted_root
from day0jax.engine.config import EngineConfig, EngineLayout, first_chunk
from day0jax.engine.requests import SamplingParams, SequenceState
from day0jax.vision.inputs import ImageInputs

log = logging.getLogger(__name__)


@dataclass
class Work:
    """One step's rows: sequences extended by one token, and (sequence, tokens) prefill chunks."""

    decode: list[SequenceState]
    prefill: list[tuple[SequenceState, int]]


class NeedTokens(Exception):
    """Scheduling needs tokens still on the device (a preemption, or penalties over a token not read yet)."""


class Scheduler:
    """Waiting and running sequences over a `BlockPool`.

    Args:
        config: the engine config (max_num_seqs, prefix_caching).
        layout: its resolution for the model (page size and count, chunk sizes, max_model_len).
        eos_token_ids: tokens that end a sequence unless its request says `ignore_eos`.
        platform: of the devices, for `EngineConfig.step_tokens`.
    """

    def __init__(self, config: EngineConfig, layout: EngineLayout, eos_token_ids: Sequence[int], platform: str,
                 state_copies: int = 1, draft_reach: int = 0):
        self.config, self.layout, self.page_size = config, layout, layout.page_size
        # State slots per running sequence (k + 1 for a model with state layers that speculates), and how far past
        # its last draft a speculating row's proposer writes keys (its own look-ahead).
        self.state_copies, self.draft_reach = state_copies, draft_reach
        self.step_tokens = config.step_tokens(platform)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.pool = BlockPool(layout.num_pages, layout.page_size)
        # Linear-attention state slots (slot 0 is the trash slot) in groups of `layout.state_copies`, one group per
        # running sequence, which holds the first `state_copies` of its group; a window's ring is its group's
        # (`paged_cache.layer_caches`), whichever of its slots holds the state.
        self.group_size = layout.state_copies
        self.free_groups = list(range((layout.state_slots - 1) // self.group_size - 1, -1, -1))
        self.waiting: collections.deque[SequenceState] = collections.deque()
        self.running: list[SequenceState] = []
        self.by_request: dict[str, list[SequenceState]] = {}
        self.num_preemptions = self.prefix_hit_tokens = 0

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, images: ImageInputs | None = None
            ) -> None:
        """Queues the request's `n` sequences; the later ones wait for the first to cache the prompt's blocks."""
        now = time.monotonic()
        base_seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        seqs = []
        for i in range(params.n):
            seq = SequenceState(request_id, i, list(prompt), len(prompt), params, (base_seed + i) & 0xFFFFFFFF,
                                now, stops, images=images)
            seq.wait_for = seqs[0] if seqs else None
            seqs.append(seq)
            self.waiting.append(seq)
        self.by_request[request_id] = seqs

    def admit(self) -> None:
        """Moves waiting sequences to running while rows and pages allow, in arrival order."""
        page = self.page_size
        skipped = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            parent = seq.wait_for
            if parent is not None and not parent.finished and parent.num_computed < parent.prompt_len:
                skipped.append(self.waiting.popleft())  # its prompt blocks are not cached yet
                continue
            # At least one token is always computed, so the last prompt position yields logits.
            hits: list[int] = []
            queried = 0
            if self.config.prefix_caching:
                queried = (len(seq.tokens) - 1) // page
                hits = self.pool.lookup(self.hashes(seq, queried))
            needed = -(-len(seq.tokens) // page) - len(hits)
            if self.pool.free_count_after_taking(hits) < needed:
                break  # first come, first served: wait for pages rather than let later ones overtake
            self.waiting.popleft()
            self.pool.take_cached(hits, queried)
            seq.pages = list(hits) + [self.pool.allocate() for _ in range(needed)]
            first = 1 + self.free_groups.pop() * self.group_size
            seq.slots = list(range(first, first + self.state_copies))
            seq.slot = seq.slots[0]
            seq.num_computed, seq.num_hashed = len(hits) * page, len(hits)
            if seq.num_generated == 0:
                seq.cached_tokens = len(hits) * page
            self.prefix_hit_tokens += len(hits) * page
            seq.wait_for = None
            self.running.append(seq)
        self.waiting.extendleft(reversed(skipped))

    def schedule(self) -> Work:
        """This step's decode rows (each given the page its next token needs) and prefill chunks.

        Raises:
            NeedTokens: the step cannot be planned before the tokens still on the device are read.
        """
        page = self.page_size
        decode = []
        for seq in list(self.running):
            if seq.finished or seq.pending != 1 or seq not in self.running or self._exhausted(seq):
                continue
            if seq.in_flight and (seq.params.penalized or seq.params.grammar is not None):
                raise NeedTokens("penalties count, and a grammar advances past, the token still on the device")
            # The token to write sits at position num_computed, its drafts after it; they may need new pages.
            last = seq.num_computed + len(seq.drafts) + (self.draft_reach if seq.drafts else 0)
            last = min(last, self.layout.max_model_len - 1)
            while last // page >= len(seq.pages):
                try:
                    seq.pages.append(self.pool.allocate())
                except OutOfPages:
                    if seq.num_computed // page < len(seq.pages):
                        # Its own token fits: it keeps the drafts that fit rather than preempt anyone for them.
                        del seq.drafts[max(len(seq.pages) * page - 1 - seq.num_computed, 0):]
                        break
                    victim = self.running[-1]
                    if victim.in_flight:
                        raise NeedTokens("a preempted sequence keeps every token it generated") from None
                    self.preempt(victim)
                    if victim is seq:
                        break
            if seq in self.running:
                decode.append(seq)
        budget = self.layout.chunk_buckets[-1]
        prefill = []
        for seq in self.running:
            if seq.pending > 1 and budget > 0:
                n = min(seq.pending, budget)
                if seq.images is not None and seq.images.spans:  # spans a small chunk could not hold: no split
                    n = whole_spans(seq.num_computed, n, seq.images.spans)
                else:
                    n = first_chunk(n, self.layout.chunk_buckets, self.step_tokens)
                if n:
                    prefill.append((seq, n))
                    budget -= n
        return Work(decode, prefill)

    def _exhausted(self, seq: SequenceState) -> bool:
        """Every token the sequence may have is sampled (it ends when the last one is read)."""
        return seq.num_generated >= seq.params.max_tokens or seq.length >= self.layout.max_model_len

    def preempt(self, seq: SequenceState) -> None:
        log.info("preempting %s/%d (%d tokens) for lack of KV pages", seq.request_id, seq.index, len(seq.tokens))
        self.num_preemptions += 1
        self.running.remove(seq)
        self.pool.release(seq.pages)
        self._release_slot(seq)
        seq.pages, seq.num_computed, seq.num_hashed, seq.drafts = [], 0, 0, []
        self.waiting.appendleft(seq)

    def finish(self, seq: SequenceState) -> None:
        """Ends a sequence: its pages go back to the pool; its request is forgotten once all its sequences end."""
        seq.finished = True
        if seq in self.running:
            self.running.remove(seq)
            self.pool.release(seq.pages)
            self._release_slot(seq)
            seq.pages = []
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if all(s.finished for s in self.by_request.get(seq.request_id, [])):
            self.by_request.pop(seq.request_id, None)

    def _release_slot(self, seq: SequenceState) -> None:
        if seq.slots:
            self.free_groups.append((seq.slots[0] - 1) // self.group_size)
        seq.slot, seq.slots = 0, []

    @property
    def free_slots(self) -> list[int]:
        """The state slots no running sequence holds (of each free group, those a sequence would take)."""
        return [1 + g * self.group_size + j for g in self.free_groups for j in range(self.state_copies)]

    def commit_state(self, seq: SequenceState, accepted: int) -> None:
        """After a verify step that kept `accepted` drafts: the state slot after the last accepted token (the verify
        wrote the state after its j-th token into `seq.slots[j]`) becomes the sequence's."""
        if len(seq.slots) > 1:
            seq.slot = seq.slots[accepted]

    def hashes(self, seq: SequenceState, upto_blocks: int) -> list[bytes]:
        """The prefix-cache hashes of the sequence's first `upto_blocks` full blocks (computed once)."""
        while len(seq.hashes) < upto_blocks:
            i = len(seq.hashes)
            # A sequence with images starts its chain from their digest, a salted one from its salt, one with a
            # LoRA adapter from the adapter's name: its blocks never match those of another's.
            parent = seq.hashes[-1] if seq.hashes else seq.images.digest if seq.images is not None else None
            if not seq.hashes and seq.params.cache_salt is not None:
                parent = salted_root(parent, seq.params.cache_salt)
            if not seq.hashes and seq.params.adapter is not None:
                parent = salted_root(parent, seq.params.adapter, "adapter")
            seq.hashes.append(block_hash(parent, seq.tokens[i * self.page_size:(i + 1) * self.page_size]))
        return seq.hashes[:upto_blocks]

    def register_blocks(self, seq: SequenceState) -> None:
        """Offers the sequence's computed full blocks to the prefix cache (only blocks whose tokens are read)."""
        if not self.config.prefix_caching:
            return
        full = min(seq.num_computed, len(seq.tokens)) // self.page_size
        if full > seq.num_hashed and seq.pages:
            for i, h in enumerate(self.hashes(seq, full)[seq.num_hashed:], start=seq.num_hashed):
                self.pool.register(seq.pages[i], h)
            seq.num_hashed = full


def whole_spans(start: int, n: int, spans: list[tuple[int, int]]) -> int:
    """A chunk of at most `n` tokens from `start` that ends inside none of `spans` ([start, end) runs a chunk must
    hold whole): `n`, or shortened to end where the span it would cut begins; 0 when that leaves nothing (the chunk
    starts inside a span whose rest it cannot hold: it waits for a step with more budget)."""
    end = start + n
    for s, e in spans:
        if s < end < e:
            return max(s - start, 0)
    return n
