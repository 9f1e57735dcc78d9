"""The serving engine: continuous batching over a paged KV cache, with chunked prefill and prefix reuse.

It speaks token ids. `add_request` queues a prompt with its `SamplingParams`; each `step()` admits waiting
sequences while pages are free, runs one decode step for every sequence that has a token to extend and prefill
chunks (up to a token budget) for those still reading their prompt, samples, and returns the new tokens as
`TokenEvent`s. A finished or aborted sequence gives its pages back at once. When a decode step finds no free
page, the most recently admitted sequence is preempted: its pages are released (their full blocks stay in the
prefix cache) and it waits to be recomputed from its prompt plus what it already generated, which it has kept.

Every sequence has `len(tokens) - num_computed >= 1` pending tokens while it runs: exactly one (the token it
just sampled) makes it a decode row, more make it a prefill row.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from day0jax.engine.block_pool import BlockPool, OutOfPages, block_hash
from day0jax.engine.runner import ModelRunner, pick
from day0jax.engine.sampling import TOP_LOGPROBS, row_mode
from day0jax.engine.paged_cache import TRASH_PAGE
from day0jax.errors import GenerationError

log = logging.getLogger(__name__)

STOP, LENGTH, ABORT = "stop", "length", "abort"


class InvalidRequest(GenerationError):
    """A request parameter is out of range; `param` names it (the OpenAI error body's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (OpenAI / vLLM semantics).

    top_k <= 0 disables top-k; logprobs None returns none, an int k returns the chosen token's log-probability
    and the k most likely (k <= 20). `n` sequences share the prompt's cached pages.
    """

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

    def validate(self, vocab_size: int) -> None:
        """Raises InvalidRequest naming the first parameter out of range."""
        checks = [
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= -1, "-1, 0 (off) or a positive integer"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "in (0, 10]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= TOP_LOGPROBS, f"in [0, {TOP_LOGPROBS}]"),
            ("n", isinstance(self.n, int) and 1 <= self.n <= 16, "an integer in [1, 16]"),
            ("seed", self.seed is None or isinstance(self.seed, int), "an integer"),
        ]
        for name, ok, what in checks:
            if not ok:
                raise InvalidRequest(f"{name} must be {what}, got {getattr(self, name)!r}", name)
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})", "stop_token_ids")

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


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


@dataclass
class _Seq:
    request_id: str
    index: int
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    seed: int
    arrival: float
    stops: frozenset
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_hashed: int = 0  # leading full blocks registered in the prefix cache
    hashes: list[bytes] = field(default_factory=list)
    cached_tokens: int = 0
    wait_for: "_Seq | None" = None
    finished: bool = False
    counts: np.ndarray | None = None  # penalties: generated-token counts
    seen: np.ndarray | None = None  # penalties: tokens in prompt or output

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.num_computed


@dataclass(frozen=True)
class EngineConfig:
    """Runtime choices of the engine (not the model's config).

    Attributes:
        page_size: tokens per KV page.
        max_model_len: longest prompt + output (default: the model's context).
        max_num_seqs: most sequences running at once (the largest decode batch).
        kv_cache_tokens: pool capacity in tokens (default: max(max_model_len, 512 per running sequence)).
        batch_buckets: decode batch sizes compiled (default: powers of two up to max_num_seqs).
        chunk_buckets: prefill chunk lengths compiled; the largest is also the prefill token budget per step.
        min_width: the smallest block-table width of decode steps, in tokens. Decode widths double up to
            `fine_width` (attention over the table is a large part of a CPU decode step, so tight buckets pay),
            then grow 4x up to max_model_len. Prefill widths start at max(min_width, 256) and grow 4x.
        max_waiting: most queued sequences; more are refused (the server answers 429).
        prefix_caching: reuse cached full blocks across requests.
    """

    page_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 16  # a CPU gains little past 16 rows; accelerators want more
    kv_cache_tokens: int | None = None
    batch_buckets: tuple[int, ...] | None = None
    chunk_buckets: tuple[int, ...] = (32, 256)
    min_width: int = 128
    fine_width: int = 1024
    max_waiting: int = 256
    prefix_caching: bool = True


def _widths(smallest: int, fine_until: int, largest: int) -> tuple[int, ...]:
    """Block-table widths in pages: doubling below `fine_until`, then 4x, always ending at `largest`."""
    widths, w = [], max(1, min(smallest, largest))
    while w < largest:
        widths.append(w)
        w *= 2 if w < fine_until else 4
    return tuple(widths) + (largest,)


class QueueFull(GenerationError):
    """The waiting queue is at `max_waiting`; try again later."""


class Engine:
    """Continuous-batching engine over a `ModelRunner`. Not thread-safe except `add_request`/`abort`, which
    queue commands that the thread calling `step()` applies.

    Args:
        module, mesh, dtype: the loaded model (see `day0jax.load`): nnx module, mesh, KV cache dtype.
        context_length: the model's longest sequence.
        eos_token_ids: tokens that end a sequence unless `ignore_eos`.
        config: the `EngineConfig`.
    Raises:
        GenerationError: a config value that cannot work (a pool smaller than one sequence, ...).
    """

    def __init__(self, module, mesh, dtype, *, context_length: int, eos_token_ids: Sequence[int] = (),
                 config: EngineConfig = EngineConfig()):
        c = config
        self.max_model_len = min(c.max_model_len or context_length, context_length)
        page = c.page_size
        max_pages_per_seq = -(-self.max_model_len // page)
        kv_tokens = c.kv_cache_tokens or max(self.max_model_len, 512 * c.max_num_seqs)
        num_pages = -(-kv_tokens // page) + 1
        if num_pages - 1 < max_pages_per_seq:
            raise GenerationError(f"kv_cache_tokens={kv_tokens} cannot hold one sequence of max_model_len="
                                  f"{self.max_model_len}")
        if c.max_num_seqs < 1:
            raise GenerationError(f"max_num_seqs must be >= 1, got {c.max_num_seqs}")
        # Powers of two below max_num_seqs, and max_num_seqs itself: every running batch has a bucket.
        batch_buckets = c.batch_buckets or tuple(1 << i for i in range(c.max_num_seqs.bit_length()))
        batch_buckets = tuple(sorted({b for b in batch_buckets if b < c.max_num_seqs} | {c.max_num_seqs}))
        decode_widths = _widths(c.min_width // page, c.fine_width // page, max_pages_per_seq)
        prefill_widths = _widths(max(c.min_width, 256) // page, 0, max_pages_per_seq)
        chunk_buckets = tuple(sorted(min(x, self.max_model_len) for x in c.chunk_buckets))
        self.config, self.page_size = c, page
        self.eos_token_ids = frozenset(eos_token_ids)
        self.runner = ModelRunner(module, mesh, dtype, num_pages=num_pages, page_size=page,
                                  batch_buckets=batch_buckets, chunk_buckets=chunk_buckets,
                                  decode_widths=decode_widths, prefill_widths=prefill_widths)
        self.pool = BlockPool(num_pages, page)
        self.vocab_size = self.runner.vocab_size
        self.waiting: collections.deque[_Seq] = collections.deque()
        self.running: list[_Seq] = []
        self._commands: collections.deque = collections.deque()
        self._by_request: dict[str, list[_Seq]] = {}
        self._lock = threading.Lock()
        # Counters for metrics (read from other threads; plain ints are safe to read).
        self.num_preemptions = 0
        self.prompt_tokens_computed = 0
        self.generated_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_steps = 0

    @classmethod
    def from_model(cls, model, config: EngineConfig = EngineConfig()) -> "Engine":
        """An engine for a `day0jax.load`ed `Model`."""
        import jax.numpy as jnp

        return cls(model.module, model.mesh, getattr(jnp, model.dtype), context_length=model.context_length,
                   eos_token_ids=model.eos_token_ids, config=config)

    # --- shapes and warm-up ----------------------------------------------------------------------------------
    def program_shapes(self) -> list[tuple[int, int, int]]:
        """Every (rows, tokens, width) forward shape the scheduler can ask for."""
        r = self.runner
        return ([(b, 1, w) for w in r.decode_widths for b in r.batch_buckets] +
                [(1, c, w) for w in r.prefill_widths for c in r.chunk_buckets])

    def programs(self, max_len: int | None = None) -> list:
        """Every program to compile before serving: the forward shapes of `warmup_shapes(max_len)` and all the
        sampler's variants (`ModelRunner.all_programs`)."""
        return self.runner.all_programs(self.warmup_shapes(max_len))

    def warm_up(self, progress=None, max_len: int | None = None, *, store=None, workers: int | None = None,
                timeline=None) -> list:
        """Compiles (or loads from the caches) the programs before traffic arrives, in parallel.

        Args:
            progress: optional callable(done, total).
            max_len: warm up only forward programs whose attention span is at most this many tokens (None: all);
                the others compile on first use (a pause of seconds on that request).
            store: a `day0jax.startup.program_store.ProgramStore`, to load programs without tracing (None: trace all).
            workers: compile threads (default: one per core).
            timeline: a `day0jax.startup.timeline.Timeline` receiving one record per program.
        Returns:
            The `CompileRecord`s, one per program.
        """
        from day0jax.startup.warmup import compile_programs

        return compile_programs(self.runner, self.programs(max_len), store=store, workers=workers,
                                timeline=timeline, progress=progress)

    def warmup_shapes(self, max_len: int | None = None) -> list[tuple[int, int, int]]:
        shapes = self.program_shapes()
        if max_len:
            shapes = [s for s in shapes if s[2] * self.page_size <= max(max_len, self.page_size * min(
                self.runner.decode_widths[0], self.runner.prefill_widths[0]))]
        return shapes

    # --- requests (any thread) -------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(1 for cmd in list(self._commands) if cmd[0] == "add")

    def add_request(self, request_id: str, prompt: Sequence[int], params: SamplingParams) -> None:
        """Queues a prompt (token ids); its tokens come out of `step()` as `TokenEvent`s.

        Raises:
            InvalidRequest: empty prompt, ids outside the vocabulary, prompt + max_tokens beyond max_model_len,
                or parameters out of range.
            QueueFull: the waiting queue is full.
        """
        prompt = list(prompt)
        params.validate(self.vocab_size)
        if not prompt:
            raise InvalidRequest("the prompt is empty", "prompt")
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise InvalidRequest(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                                 f"{len(prompt)} tokens and max_tokens is {params.max_tokens} "
                                 f"({len(prompt) + params.max_tokens} in total)", "max_tokens")
        with self._lock:
            if self.num_waiting + params.n > self.config.max_waiting:
                raise QueueFull(f"the queue is full ({self.config.max_waiting} waiting)")
            self._commands.append(("add", request_id, prompt, params))

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Stops a request (or only its sequence `index`); its pages are freed at the next step, and each
        stopped sequence ends with a `TokenEvent` whose finish_reason is "abort"."""
        self._commands.append(("abort", request_id, index))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._commands)

    # --- the step --------------------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Applies queued commands, schedules, runs the model once per row group, samples; returns new tokens."""
        events: list[TokenEvent] = []
        self._apply_commands(events)
        self._admit()
        decode, prefill = self._schedule()
        if not decode and not prefill:
            return events
        self.num_steps += 1
        sampled_rows: list[tuple[_Seq, Any, int]] = []  # (seq, logits, row)
        if decode:
            logits = self._run_decode(decode)
            sampled_rows += [(s, logits, i) for i, s in enumerate(decode)]
        for seq, n in prefill:
            logits = self._run_prefill(seq, n)
            if seq.num_computed == len(seq.tokens):  # the whole prompt is in: the last logits give a token
                sampled_rows.append((seq, logits, 0))
        self._sample_and_emit(sampled_rows, events)
        return events

    def _apply_commands(self, events: list[TokenEvent]) -> None:
        while self._commands:
            cmd = self._commands.popleft()
            if cmd[0] == "add":
                self._add(*cmd[1:])
            else:
                _, request_id, index = cmd
                for seq in self._by_request.get(request_id, []):
                    if not seq.finished and index in (None, seq.index):
                        self._finish(seq, ABORT)
                        events.append(TokenEvent(seq.request_id, seq.index, None, ABORT))
                if all(s.finished for s in self._by_request.get(request_id, [])):
                    self._by_request.pop(request_id, None)

    def _add(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        now = time.monotonic()
        base_seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        seqs = []
        for i in range(params.n):
            seq = _Seq(request_id, i, list(prompt), len(prompt), params, (base_seed + i) & 0xFFFFFFFF, now, stops)
            # The other n - 1 wait for the first to compute the prompt, then find its blocks in the prefix cache.
            seq.wait_for = seqs[0] if seqs else None
            seqs.append(seq)
            self.waiting.append(seq)
        self._by_request[request_id] = seqs

    def _hashes(self, seq: _Seq, upto_blocks: int) -> list[bytes]:
        while len(seq.hashes) < upto_blocks:
            i = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else None
            seq.hashes.append(block_hash(parent, seq.tokens[i * self.page_size:(i + 1) * self.page_size]))
        return seq.hashes[:upto_blocks]

    def _admit(self) -> None:
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
                hits = self.pool.lookup(self._hashes(seq, queried))
            needed = -(-len(seq.tokens) // page) - len(hits)
            if self.pool.free_count_after_taking(hits) < needed:
                break  # first come, first served: wait for pages rather than let later ones overtake
            self.waiting.popleft()
            self.pool.take_cached(hits, queried)
            seq.pages = list(hits) + [self.pool.allocate() for _ in range(needed)]
            seq.num_computed, seq.num_hashed = len(hits) * page, len(hits)
            if seq.num_generated == 0:
                seq.cached_tokens = len(hits) * page
            self.prefix_hit_tokens += len(hits) * page
            seq.wait_for = None
            self.running.append(seq)
        self.waiting.extendleft(reversed(skipped))

    def _schedule(self) -> tuple[list[_Seq], list[tuple[_Seq, int]]]:
        page = self.page_size
        decode = []
        for seq in list(self.running):
            if seq.finished or seq.pending != 1 or seq not in self.running:
                continue
            # The token to write sits at position num_computed; it may need a new page.
            while seq.num_computed // page >= len(seq.pages):
                try:
                    seq.pages.append(self.pool.allocate())
                except OutOfPages:
                    victim = self.running[-1]
                    self._preempt(victim)
                    if victim is seq:
                        break
            if seq in self.running:
                decode.append(seq)
        budget = self.runner.chunk_buckets[-1]
        prefill = []
        for seq in self.running:
            if seq.pending > 1 and budget > 0:
                n = min(seq.pending, budget, self.runner.chunk_buckets[-1])
                prefill.append((seq, n))
                budget -= n
        return decode, prefill

    def _preempt(self, seq: _Seq) -> None:
        log.info("preempting %s/%d (%d tokens) for lack of KV pages", seq.request_id, seq.index, len(seq.tokens))
        self.num_preemptions += 1
        self.running.remove(seq)
        self.pool.release(seq.pages)
        seq.pages, seq.num_computed, seq.num_hashed = [], 0, 0
        self.waiting.appendleft(seq)

    # --- model calls -----------------------------------------------------------------------------------------
    def _table(self, seqs: Sequence[_Seq], rows: int, width: int) -> np.ndarray:
        table = np.full((rows, width), TRASH_PAGE, np.int32)
        for i, s in enumerate(seqs):
            table[i, :len(s.pages)] = s.pages[:width]
        return table

    def _run_decode(self, seqs: list[_Seq]):
        r = self.runner
        rows = pick(r.batch_buckets, len(seqs))
        width = pick(r.decode_widths, max(s.num_computed // self.page_size + 1 for s in seqs))
        batch = r.empty_batch(rows, 1, width)
        for i, s in enumerate(seqs):
            batch.tokens[i, 0] = s.tokens[s.num_computed]
            batch.positions[i, 0] = s.num_computed
            batch.kv_lengths[i] = s.num_computed + 1
        batch.block_tables[:] = self._table(seqs, rows, width)
        logits = r.forward(batch)
        for s in seqs:
            s.num_computed += 1
            self._register_blocks(s)
        return logits

    def _run_prefill(self, seq: _Seq, n: int):
        r = self.runner
        chunk = pick(r.chunk_buckets, n)
        start = seq.num_computed
        width = pick(r.prefill_widths, -(-(start + n) // self.page_size))
        batch = r.empty_batch(1, chunk, width)
        batch.tokens[0, :n] = seq.tokens[start:start + n]
        batch.positions[0, :n] = np.arange(start, start + n)
        batch.kv_lengths[0] = start + n
        batch.last_index[0] = n - 1
        batch.block_tables[:] = self._table([seq], 1, width)
        logits = r.forward(batch)
        seq.num_computed += n
        self.prompt_tokens_computed += n
        self._register_blocks(seq)
        return logits

    def _register_blocks(self, seq: _Seq) -> None:
        if not self.config.prefix_caching:
            return
        full = seq.num_computed // self.page_size
        if full > seq.num_hashed:
            for i, h in enumerate(self._hashes(seq, full)[seq.num_hashed:], start=seq.num_hashed):
                self.pool.register(seq.pages[i], h)
            seq.num_hashed = full

    # --- sampling and outputs --------------------------------------------------------------------------------
    def _sample_and_emit(self, rows: list[tuple[_Seq, Any, int]], events: list[TokenEvent]) -> None:
        # Rows that share one logits array (the decode batch) are sampled together.
        groups: dict[int, tuple[Any, list[tuple[_Seq, int]]]] = {}
        for seq, logits, i in rows:
            groups.setdefault(id(logits), (logits, []))[1].append((seq, i))
        for logits, members in groups.values():
            B = logits.shape[0]
            # Members are the logits' leading rows in order (decode rows 0..n-1, or a prefill's single row).
            assert [i for _, i in members] == list(range(len(members)))
            p = [s.params for s, _ in members]
            pad = B - len(members)

            def col(values, dtype, fill):
                return np.array(list(values) + [fill] * pad, dtype)

            arr = dict(seeds=col((s.seed for s, _ in members), np.uint32, 0),
                       counters=col((s.num_generated for s, _ in members), np.int32, 0),
                       temperature=col((q.temperature for q in p), np.float32, 0.0),
                       top_k=col((q.top_k for q in p), np.int32, 0),
                       top_p=col((q.top_p for q in p), np.float32, 1.0),
                       min_p=col((q.min_p for q in p), np.float32, 0.0))
            penalties = None
            if any(q.penalized for q in p):
                penalties = self._penalty_arrays(members, B)
            mode = row_mode(arr["temperature"], arr["top_k"], arr["top_p"], arr["min_p"])
            want_lp = any(q.logprobs is not None for q in p)
            out = self.runner.sample(logits, arr, penalties, mode, want_lp)
            for seq, i in members:
                if seq.finished:
                    continue
                token = int(out["tokens"][i])
                lp = top = None
                if want_lp and seq.params.logprobs is not None:
                    lp = float(out["logprob"][i])
                    k = seq.params.logprobs
                    top = [(int(t), float(v)) for t, v in zip(out["top_ids"][i][:k], out["top_logprobs"][i][:k])]
                events.append(self._append_token(seq, token, lp, top))

    def _penalty_arrays(self, members, B):
        V = self.vocab_size
        counts, seen = np.zeros((B, V), np.float32), np.zeros((B, V), bool)
        presence, frequency, repetition = np.zeros(B, np.float32), np.zeros(B, np.float32), np.ones(B, np.float32)
        for seq, i in members:
            q = seq.params
            if not q.penalized:
                continue
            if seq.counts is None:
                seq.counts = np.zeros(V, np.float32)
                np.add.at(seq.counts, np.asarray(seq.tokens[seq.prompt_len:], np.int64), 1)
                seq.seen = np.zeros(V, bool)
                seq.seen[np.asarray(seq.tokens, np.int64)] = True
            counts[i], seen[i] = seq.counts, seq.seen
            presence[i], frequency[i], repetition[i] = q.presence_penalty, q.frequency_penalty, q.repetition_penalty
        return counts, seen, presence, frequency, repetition

    def _append_token(self, seq: _Seq, token: int, logprob, top) -> TokenEvent:
        seq.tokens.append(token)
        if seq.counts is not None:
            seq.counts[token] += 1
            seq.seen[token] = True
        self.generated_tokens += 1
        is_stop = token in seq.stops
        finish = None
        if is_stop:
            finish = STOP
        elif seq.num_generated >= seq.params.max_tokens or len(seq.tokens) >= self.max_model_len:
            finish = LENGTH
        event = TokenEvent(seq.request_id, seq.index, token, finish, is_stop, logprob, top,
                           num_prompt_tokens=seq.prompt_len, num_cached_tokens=seq.cached_tokens)
        if finish:
            self._finish(seq, finish)
            seqs = self._by_request.get(seq.request_id, [])
            if all(s.finished for s in seqs):
                self._by_request.pop(seq.request_id, None)
        return event

    def _finish(self, seq: _Seq, reason: str) -> None:
        seq.finished = True
        if seq in self.running:
            self.running.remove(seq)
            self.pool.release(seq.pages)
            seq.pages = []
        elif seq in self.waiting:
            self.waiting.remove(seq)

    # --- introspection ---------------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Gauges and counters for metrics: queue, batch, pages, prefix cache, tokens."""
        return dict(waiting=self.num_waiting, running=len(self.running), kv_blocks_used=self.pool.num_used,
                    kv_blocks_free=self.pool.num_free, kv_blocks_total=self.pool.usable,
                    prefix_hit_blocks=self.pool.hits, prefix_query_blocks=self.pool.queries,
                    prefix_hit_tokens=self.prefix_hit_tokens, preemptions=self.num_preemptions,
                    prompt_tokens_computed=self.prompt_tokens_computed, generated_tokens=self.generated_tokens,
                    steps=self.num_steps)
