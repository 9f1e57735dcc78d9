"""The engine: continuous batching over a paged KV cache, with chunked prefill and prefix reuse. Token ids only.
`Model.generate`, `python -m day0jax.generate` and the server all run it: it is the one path from prompt to tokens.

The host never waits for a step before dispatching the next: sampled tokens stay on the device for the next forward and
are read while it runs, so a sequence that ended on a stop token computes one extra position, whose token is dropped.
When the plan needs the tokens (a preemption, penalties), the step reads them first.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Sequence

import jax
import numpy as np

from day0jax.engine.config import EngineConfig, smallest_bucket
from day0jax.engine.paged_cache import TRASH_PAGE
from day0jax.engine.requests import (ABORT, LENGTH, STOP, ImageInputs, InvalidRequest, QueueFull,
                                     SamplingParams, SequenceState, TokenEvent)
from day0jax.engine.runner import ModelRunner, Program
from day0jax.engine.scheduler import NeedTokens, Scheduler, Work
from day0jax.core.cache_layout import layer_windows

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Sampled:
    """One sampler call whose output is still on the device: row i belongs to seqs[i]."""

    seqs: list[SequenceState]
    out: dict[str, jax.Array]


class Engine:
    """Continuous batching over a `ModelRunner`; only `add_request`/`abort` are thread-safe (they queue commands).

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
        self.layout = config.layout(context_length, layer_windows(module.cache_layout()))
        self.max_model_len, self.page_size = self.layout.max_model_len, self.layout.page_size
        if "pp" in mesh.axis_names:
            from day0jax.engine.pipeline import PipelinedRunner

            self.runner = PipelinedRunner(module, mesh, dtype, self.layout)
        else:
            self.runner = ModelRunner(module, mesh, dtype, self.layout)
        if self.runner.has_state and config.prefix_caching:
            log.info("prefix caching is off: this model's linear-attention layers keep a state per sequence that "
                     "cached KV pages cannot restore")
            config = dataclasses.replace(config, prefix_caching=False)
        if self.layout.rings and config.prefix_caching:
            log.info("prefix caching is off: sliding-window layers keep only their window per sequence (window_kv), "
                     "so cached pages would lack their keys")
            config = dataclasses.replace(config, prefix_caching=False)
        self.config = config
        self.scheduler = Scheduler(config, self.layout, eos_token_ids, platform=mesh.devices.flat[0].platform)
        self.vocab_size = self.runner.vocab_size
        self._commands: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._in_flight: list[_Sampled] = []
        self._sources: dict[SequenceState, tuple[_Sampled, int]] = {}  # where each in-flight token sits
        self._undelivered: list[TokenEvent] = []  # events of a step that then failed, for `recover` to return
        # Metrics counters, read from other threads (plain ints are safe to read).
        self.prompt_tokens_computed = self.generated_tokens = self.num_steps = 0

    def attach(self, module, eos_token_ids: Sequence[int]) -> None:
        """Gives an engine built on an abstract model (see `loader.Prepared.engine`) its restored weights and the
        checkpoint's end-of-sequence tokens; the programs compiled meanwhile stay installed."""
        self.runner.attach(module)
        self.scheduler.eos_token_ids = frozenset(eos_token_ids)

    def programs(self, max_len: int | None = None, warmup: str = "all") -> list:
        """The programs to compile before serving: every one (`ModelRunner.all_programs`, with `max_len` only the
        forward programs attending over at most that many tokens), the ready set (`warmup="ready"`:
        `ModelRunner.ready_programs`) or none."""
        if warmup == "none":
            return []
        return self.runner.ready_programs() if warmup == "ready" else self.runner.all_programs(max_len)

    def programs_for(self, rows: int, longest_prompt: int, max_len: int, *, sampled: bool, penalized: bool,
                     guided: bool) -> list:
        """The programs `rows` sequences can take whose prompts are at most `longest_prompt` tokens and which end by
        `max_len`: decode for each batch bucket up to `rows`' and each span width up to `max_len`, prefill for each
        chunk up to the longest prompt's, and (`sampled`: some row samples, takes penalties, a grammar or logprobs)
        the sampler per row count."""
        layout = self.layout

        def up_to(buckets, n):  # the buckets up to the one that covers n
            return [b for b in buckets if b <= smallest_bucket(buckets, n)]

        pages = -(-max_len // layout.page_size)
        prompt_pages = -(-longest_prompt // layout.page_size)
        top = min(rows, layout.max_rows)
        shapes = [(r, 1, w) for w in up_to(layout.decode_widths, pages) for r in up_to(layout.batch_buckets, top)]
        shapes += [(1, c, w) for w in up_to(layout.prefill_widths, prompt_pages)
                   for c in up_to(layout.chunk_buckets, longest_prompt)]
        forward = [p for shape in shapes for p in self.runner.forward_programs(shape)]
        samplers = [Program("sample", (r,), penalized, guided) for r in layout.sampler_batches()
                    if r <= smallest_bucket(layout.batch_buckets, top)]
        return forward + (samplers if sampled else [])

    def warm_up(self, progress=None, max_len: int | None = None, *, store=None, workers: int | None = None,
                timeline=None, warmup: str = "all") -> list:
        """Compiles (or loads from the caches) the programs before traffic arrives, in parallel.

        Args:
            progress: optional callable(done, total).
            max_len, warmup: which programs (`programs`); the others compile on first use (a pause of seconds on
                that request) or in the background (`startup.warmup.BackgroundCompiler`).
            store: a `ProgramStore`, to load programs without tracing (None: trace all).
            workers: compile threads (default: one per core).
            timeline: a `Timeline` receiving one record per program.
        Returns:
            The `CompileRecord`s, one per program.
        """
        from day0jax.startup.warmup import compile_programs

        return compile_programs(self.runner, self.programs(max_len, warmup), store=store, workers=workers,
                                timeline=timeline, progress=progress)

    def compile_in_background(self, store=None):
        """Starts compiling every program not installed yet on a background thread, most likely needed first and
        while no request is being served; until it is done, a step whose program is missing runs on a larger
        installed one or makes its own ready first (never traced inline). Returns the `BackgroundCompiler`."""
        from day0jax.startup.warmup import BackgroundCompiler

        runner = self.runner
        ready = [p for p in runner.all_programs() if runner.installed(p)]
        compiler = BackgroundCompiler(runner, runner.background_programs(ready), store=store, busy=self.has_work)
        runner.ensure = compiler.ensure
        compiler.start()
        return compiler

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + sum(1 for cmd in list(self._commands) if cmd[0] == "add")

    def add_request(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                    images: ImageInputs | None = None) -> None:
        """Queues a prompt (token ids); its tokens come out of `step()` as `TokenEvent`s. A vision-language model's
        prompt holds each image's placeholder tokens already expanded, and `images` the preprocessed images.

        Raises:
            InvalidRequest: empty prompt, ids outside the vocabulary, prompt + max_tokens > max_model_len, bad params,
                images the model cannot take or whose count does not match the placeholders.
            QueueFull: the waiting queue is full.
        """
        prompt = [int(t) for t in prompt]
        params.validate(self.vocab_size)
        if not prompt:
            raise InvalidRequest("the prompt is empty", "prompt")
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise InvalidRequest(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                                 f"{len(prompt)} tokens and {params.max_tokens} more were asked for "
                                 f"({len(prompt) + params.max_tokens} in total)", "max_tokens")
        self._check_images(prompt, images)
        with self._lock:
            if self.num_waiting + params.n > self.config.max_waiting:
                raise QueueFull(f"the queue is full ({self.config.max_waiting} waiting)")
            self._commands.append(("add", request_id, prompt, params, images))

    def _check_images(self, prompt: list[int], images: ImageInputs | None) -> None:
        vision = self.runner.vision
        if vision is None:
            if images is not None and len(images):
                raise InvalidRequest("this model takes no images", "images")
            return
        placeholders = sum(t == vision.image_token_id for t in prompt)
        given = 0 if images is None else len(images)
        needed = 0 if images is None else sum(images.counts)
        if placeholders != needed:
            raise InvalidRequest(f"the prompt has {placeholders} image placeholder tokens (id {vision.image_token_id})"
                                 f" and its {given} image(s) take {needed}; expand each image's placeholder as "
                                 "`Model.prepare` does", "images")
        if given and vision.pixel_shape is not None and images.pixels.shape[1:] != vision.pixel_shape:
            raise InvalidRequest(f"images are preprocessed to {vision.pixel_shape}, got {images.pixels.shape[1:]}",
                                 "images")
        if given and vision.mrope is not None:
            images.rope_positions, images.rope_delta = vision.mrope(prompt, images.grids)
        if given and vision.bidirectional:
            images.spans = token_runs(prompt, vision.image_token_id)
            longest, chunk = max(e - s for s, e in images.spans), self.layout.chunk_buckets[-1]
            if longest > chunk:
                raise InvalidRequest(f"this model's image tokens attend to each other, so one image's {longest} "
                                     f"tokens are prefilled in one chunk, and the engine's largest chunk is {chunk} "
                                     "(EngineConfig.chunk_buckets)", "images")

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Stops a request (or only its sequence `index`); its pages are freed at the next step, and each
        stopped sequence ends with a `TokenEvent` whose finish_reason is "abort"."""
        self._commands.append(("abort", request_id, index))

    def has_work(self) -> bool:
        s = self.scheduler
        return bool(s.waiting or s.running or self._commands or self._in_flight)

    def step(self, apply_commands: bool = True) -> list[TokenEvent]:
        """Applies commands (unless told not to), schedules and dispatches this step, then returns the previous
        step's tokens as events."""
        events: list[TokenEvent] = []
        try:
            if apply_commands:
                self._apply_commands(events)
            self.scheduler.admit()
            try:
                work = self.scheduler.schedule()
                previous = self._previous_tokens(work.decode)
            except NeedTokens:
                events += self._read_in_flight()
                work, previous = self.scheduler.schedule(), None
            sampled = self._run(work, previous)
            events += self._read_in_flight()  # the previous step's programs ran before this step's
        except BaseException:
            self._undelivered += events  # what happened before the failure still reaches its requests
            raise
        self._in_flight = sampled
        return events

    def recover(self) -> tuple[list[TokenEvent], list[str]]:
        """After `step()` raised: finds the requests a step fails on and ends them, keeping every other one.

        Every sequence is preempted, keeping the tokens read so far (it recomputes its cache and goes on as it
        would have: the same seed and position give the same draws, so tokens sampled but never read come out
        again). Then each request steps alone, the others held back (new requests and aborts wait too), until it
        has a new token or ends; a request whose step raises again is ended. Requests that pass stay running.

        Returns:
            The events of the recovery (tokens of the requests that passed) and the ids of the requests ended.
        Raises:
            Whatever a step raises with no request left to blame (the engine cannot recover).
        """
        events, self._undelivered = self._undelivered, []
        try:
            events += self._read_in_flight()  # tokens sampled before the failure, if they can still be read
        except Exception:  # noqa: BLE001 - lost with the device's state; recomputing brings them back
            log.warning("tokens of the failed step's predecessor could not be read; they will be recomputed")
        self._in_flight, self._sources = [], {}
        s = self.scheduler
        for seq in reversed(list(s.running)):  # preempt puts each at the front of the queue: keep their order
            seq.in_flight = 0
            s.preempt(seq)
        for seq in s.waiting:
            seq.in_flight = 0
        suspects = list(dict.fromkeys(seq.request_id for seq in s.waiting))
        failed = []
        for rid in suspects:
            mine = [q for q in s.waiting if q.request_id == rid]
            held = [q for q in s.waiting if q.request_id != rid]
            if not mine:
                continue
            s.waiting = collections.deque(mine)
            # Enough steps to prefill it in the smallest chunks and sample once, more than it can need.
            limit = 4 + max(len(q.tokens) for q in mine) // self.layout.chunk_buckets[0] + len(mine)
            try:
                generated = min(q.num_generated for q in mine)
                for _ in range(limit):
                    if all(q.finished for q in mine) or min(q.num_generated for q in mine) > generated:
                        break
                    events += self.step(apply_commands=False)
                events += self._read_in_flight()
                self._in_flight = []
            except Exception:  # noqa: BLE001 - this request makes steps fail: it alone is ended
                log.exception("request %s makes the engine step fail; ending it", rid)
                failed.append(rid)
                self._in_flight, self._sources = [], {}
                for q in s.by_request.get(rid, list(mine)):
                    if not q.finished:
                        s.finish(q)
                for q in list(s.running):  # the others that passed: recompute, as after the first failure
                    q.in_flight = 0
                    s.preempt(q)
            finally:
                s.waiting.extend(held)
        return events, failed

    def _apply_commands(self, events: list[TokenEvent]) -> None:
        while self._commands:
            cmd = self._commands.popleft()
            if cmd[0] == "add":
                self.scheduler.add(*cmd[1:])
                continue
            _, request_id, index = cmd
            for seq in list(self.scheduler.by_request.get(request_id, [])):
                if not seq.finished and index in (None, seq.index):
                    self.scheduler.finish(seq)
                    events.append(TokenEvent(seq.request_id, seq.index, None, ABORT))

    def _previous_tokens(self, decode: list[SequenceState]) -> jax.Array | None:
        """The one sampler output holding the decode rows' in-flight input tokens (None when none is); raises
        NeedTokens when they sit in several (a prefill just ended beside running decode rows)."""
        outputs = {id(self._sources[s][0]): self._sources[s][0] for s in decode if s.in_flight}
        if len(outputs) > 1:
            raise NeedTokens("input tokens in several sampler outputs")
        return next(iter(outputs.values())).out["tokens"] if outputs else None

    def _run(self, work: Work, previous: jax.Array | None) -> list[_Sampled]:
        sampled = []
        if work.decode:
            sampled.append(self._sample(work.decode, *self._run_decode(work.decode, previous)))
        for seq, n in work.prefill:
            outputs = self._run_prefill(seq, n)
            if seq.num_computed == seq.length:  # the whole prompt is in: the last logits give a token
                sampled.append(self._sample([seq], *outputs))
        self.num_steps += bool(work.decode or work.prefill)
        return sampled

    def _table(self, seqs: Sequence[SequenceState], rows: int, width: int) -> np.ndarray:
        table = np.full((rows, width), TRASH_PAGE, np.int32)
        for i, s in enumerate(seqs):
            table[i, :len(s.pages)] = s.pages[:width]
        return table

    def _run_decode(self, seqs: list[SequenceState], previous: jax.Array | None):
        rows = smallest_bucket(self.layout.batch_buckets, len(seqs))
        width = smallest_bucket(self.layout.decode_widths, max(s.num_computed // self.page_size + 1 for s in seqs))
        batch = self.runner.empty_batch(rows, 1, width)
        for i, s in enumerate(seqs):
            if s.num_computed < len(s.tokens):
                batch.tokens[i, 0] = s.tokens[s.num_computed]
            else:  # sampled last step, not read yet
                batch.token_source[i] = self._sources[s][1]
            batch.positions[i, 0] = s.num_computed
            if batch.rope_positions is not None:  # past the prompt: the index plus the images' offset
                batch.rope_positions[i, 0] = s.num_computed + (s.images.rope_delta if s.images is not None else 0)
            batch.kv_lengths[i] = s.num_computed + 1
            batch.state_slots[i] = s.slot
        batch.block_tables[:] = self._table(seqs, rows, width)
        outputs = self.runner.forward(batch, previous)
        for s in seqs:
            s.num_computed += 1
            self.scheduler.register_blocks(s)
        return outputs

    def _run_prefill(self, seq: SequenceState, n: int):
        chunk = smallest_bucket(self.layout.chunk_buckets, n)
        start = seq.num_computed
        width = smallest_bucket(self.layout.prefill_widths, -(-(start + n) // self.page_size))
        batch = self.runner.empty_batch(1, chunk, width)
        batch.tokens[0, :n] = seq.tokens[start:start + n]
        batch.positions[0, :n] = np.arange(start, start + n)
        if batch.rope_positions is not None:
            batch.rope_positions[0, :n] = self._rope_positions(seq, start, n)
        batch.kv_lengths[0] = start + n
        batch.last_index[0] = n - 1
        batch.state_slots[0] = seq.slot
        batch.block_tables[:] = self._table([seq], 1, width)
        if seq.images is not None:
            self._place_image_features(seq, batch, start, n)
        outputs = self.runner.forward(batch)
        seq.num_computed += n
        self.prompt_tokens_computed += n
        self.scheduler.register_blocks(seq)
        return outputs

    @staticmethod
    def _rope_positions(seq: SequenceState, start: int, n: int) -> np.ndarray:
        """Multimodal RoPE positions [n, 3] of the sequence's tokens [start, start + n): the prompt's from its
        images' layout, the rest (generated, or all of a text-only prompt) the index plus the images' offset."""
        index = np.arange(start, start + n)
        images = seq.images
        if images is None or images.rope_positions is None:
            return np.repeat(index[:, None], 3, axis=1)
        out = np.repeat((index + images.rope_delta)[:, None], 3, axis=1)
        inside = index < len(images.rope_positions)
        out[inside] = images.rope_positions[index[inside]]
        return out

    def _place_image_features(self, seq: SequenceState, batch, start: int, n: int) -> None:
        """Fills the chunk's image features (and DeepStack features): the sequence's image tokens in
        [start, start + n) take theirs in order (encoded once, on its first chunk)."""
        images = seq.images
        if images.features is None:
            images.features, images.deepstack = self.runner.encode_images(images)
        image_token = self.runner.vision.image_token_id
        is_image = np.asarray(seq.tokens[:seq.prompt_len], np.int32) == image_token
        first = int(is_image[:start].sum())  # features before this chunk
        mask = is_image[start:start + n]
        where = np.flatnonzero(mask)
        batch.image_mask[0, :len(mask)] = mask
        batch.image_features[0, where] = images.features[first:first + len(where)]
        if images.deepstack is not None:
            batch.deepstack[:, 0, where] = images.deepstack[:, first:first + len(where)]

    def _sample(self, seqs: list[SequenceState], logits, greedy) -> _Sampled:
        """Dispatches the sampler (reading nothing) for the leading rows of `logits`, one per sequence."""
        B, pad = logits.shape[0], logits.shape[0] - len(seqs)
        p = [s.params for s in seqs]

        def col(values, dtype, fill):
            return np.array(list(values) + [fill] * pad, dtype)

        rows = dict(seeds=col((s.seed for s in seqs), np.uint32, 0),
                    counters=col((s.num_generated for s in seqs), np.int32, 0),
                    temperature=col((q.temperature for q in p), np.float32, 0.0),
                    top_k=col((q.top_k for q in p), np.int32, 0),
                    top_p=col((q.top_p for q in p), np.float32, 1.0),
                    min_p=col((q.min_p for q in p), np.float32, 0.0))
        penalties = self._penalty_arrays(seqs, B) if any(q.penalized for q in p) else None
        # The forward program is already dispatched: the grammar masks are computed while it runs.
        guidance = self._guidance_arrays(seqs, B) if any(q.guided for q in p) else None
        if not any(q.sampled for q in p):
            sampled = _Sampled(seqs, {"tokens": greedy})
        else:
            want_logprobs = any(q.logprobs is not None for q in p)
            sampled = _Sampled(seqs, self.runner.sample(logits, rows, penalties, want_logprobs, guidance))
        for i, s in enumerate(seqs):
            s.in_flight += 1
            self._sources[s] = (sampled, i)
        return sampled

    def _penalty_arrays(self, seqs: list[SequenceState], B: int):
        V = self.vocab_size
        counts, seen = np.zeros((B, V), np.float32), np.zeros((B, V), bool)
        presence, frequency, repetition = np.zeros(B, np.float32), np.zeros(B, np.float32), np.ones(B, np.float32)
        for i, seq in enumerate(seqs):
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

    def _guidance_arrays(self, seqs: list[SequenceState], B: int):
        """Each row's grammar mask (for the token its matcher is at) and logit biases, as `apply_guidance` takes
        them."""
        allowed, bias_ids, bias = self.runner.neutral_guidance(B)
        for i, seq in enumerate(seqs):
            q = seq.params
            if q.grammar is not None:
                if seq.matcher is None:
                    seq.matcher = q.grammar.matcher()
                seq.matcher.fill(allowed[i])
            for j, (token, value) in enumerate(q.logit_bias):
                bias_ids[i, j], bias[i, j] = token, value
        return allowed, bias_ids, bias

    def _read_in_flight(self) -> list[TokenEvent]:
        """Reads every sampler output still on the device (waiting for it) and emits its tokens."""
        events = []
        for sampled in self._in_flight:
            out = self.runner.read(sampled.out)
            for i, seq in enumerate(sampled.seqs):
                seq.in_flight -= 1
                if self._sources.get(seq, (None,))[0] is sampled:
                    del self._sources[seq]
                if seq.finished:
                    continue  # aborted, or ended by the token before this one: this one is dropped
                lp = top = None
                if "logprob" in out and seq.params.logprobs is not None:
                    lp, k = float(out["logprob"][i]), seq.params.logprobs
                    top = [(int(t), float(v)) for t, v in zip(out["top_ids"][i][:k], out["top_logprobs"][i][:k])]
                events.append(self._append_token(seq, int(out["tokens"][i]), lp, top))
        self._in_flight = []
        return events

    def _append_token(self, seq: SequenceState, token: int, logprob, top) -> TokenEvent:
        seq.tokens.append(token)
        if seq.counts is not None:
            seq.counts[token] += 1
            seq.seen[token] = True
        self.generated_tokens += 1
        self.scheduler.register_blocks(seq)
        is_stop = token in seq.stops
        # Only tokens read count here: the next one may already be on the device.
        full = len(seq.tokens) - seq.prompt_len >= seq.params.max_tokens or len(seq.tokens) >= self.max_model_len
        finish = STOP if is_stop else LENGTH if full else None
        if seq.matcher is not None and not is_stop:
            if not seq.matcher.consume(token):
                log.warning("request %s left its grammar at token %d (%s); stopping it", seq.request_id, token,
                            seq.matcher.error)
                finish = STOP
            elif seq.matcher.done:  # the output is complete: only end-of-sequence could follow
                finish = STOP
        if finish:
            self.scheduler.finish(seq)
        return TokenEvent(seq.request_id, seq.index, token, finish, is_stop, logprob, top,
                          num_prompt_tokens=seq.prompt_len, num_cached_tokens=seq.cached_tokens)

    def stats(self) -> dict[str, int]:
        """Gauges and counters for metrics: queue, batch, pages, prefix cache, tokens."""
        s, pool = self.scheduler, self.scheduler.pool
        return dict(waiting=self.num_waiting, running=len(s.running), kv_blocks_used=pool.num_used,
                    kv_blocks_free=pool.num_free, kv_blocks_total=pool.usable, prefix_hit_blocks=pool.hits,
                    prefix_query_blocks=pool.queries, prefix_hit_tokens=s.prefix_hit_tokens,
                    preemptions=s.num_preemptions, prompt_tokens_computed=self.prompt_tokens_computed,
                    generated_tokens=self.generated_tokens, steps=self.num_steps)


def token_runs(tokens: Sequence[int], token: int) -> list[tuple[int, int]]:
    """[(start, end)] of each maximal run of `token` in `tokens` (end exclusive)."""
    runs, start = [], None
    for i, t in enumerate(list(tokens) + [None]):
        if t == token and start is None:
            start = i
        elif t != token and start is not None:
            runs.append((start, i))
            start = None
    return runs
