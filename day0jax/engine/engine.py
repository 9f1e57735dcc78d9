"""The engine: continuous batching over a paged KV cache, with chunked prefill and prefix reuse. Token ids only.
`Model.generate`, `python -m day0jax.generate` and the server all run it: it is the one path from prompt to tokens.

The host never waits for a step before dispatching the next: sampled tokens stay on the device for the next forward and
are read while it runs, so a sequence that ended on a stop token computes one extra position, whose token is dropped.
When the plan needs the tokens (a preemption, penalties), the step reads them first.

With speculative decoding (`EngineConfig.speculative`), a decode row may carry drafts (`engine/speculative.py`): the
step then runs the verify program over every decode row (its input token and drafts, [B, k + 1]) and the acceptance,
and reads the outcome before it ends, since how many tokens each row keeps decides the next step's positions.
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

from day0jax.core.cache_layout import layer_windows
from day0jax.core.errors import GenerationError
from day0jax.engine.config import EngineConfig
from day0jax.engine.device_proposers import DraftModelProposer, MTPProposer
from day0jax.engine.requests import (ABORT, LENGTH, STOP, InvalidRequest, QueueFull, SamplingParams, SequenceState,
                                     TokenEvent)
from day0jax.engine.paged_cache import kv_cache_refusal
from day0jax.engine.runner import ModelRunner
from day0jax.engine.scheduler import NeedTokens, Scheduler, Work
from day0jax.engine.speculative import Speculation, make_proposer, refuse_unverifiable_state
from day0jax.startup.warmup import BackgroundCompiler, compile_programs
from day0jax.vision.inputs import ImageInputs

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Sampled:
    """One sampler call whose output is still on the device: row i belongs to seqs[i]. A verify step's acceptance
    (`drafted`: each row's number of drafts) gives each row its kept drafts and the next token."""

    seqs: list[SequenceState]
    out: dict[str, jax.Array]
    drafted: list[int] | None = None
    drafts: jax.Array | None = None  # a device proposer's next drafts for each row [rows, k]


class Engine:
    """Continuous batching over a `ModelRunner`: the lifecycle of requests, the scheduler's steps, the overlap of
    host and device work, recovery from a failing step. Only `add_request`/`abort` are thread-safe (they queue
    commands).

    Args:
        module, mesh, dtype: the loaded model (see `day0jax.load`): nnx module, mesh, KV cache dtype.
        context_length: the model's longest sequence.
        eos_token_ids: tokens that end a sequence unless `ignore_eos`.
        config: the `EngineConfig`.
        runner: a `ModelRunner` already made for this model and config's layout (`Model.runner`, which may have
            compiled programs), instead of a new one.
        draft: the draft model (an nnx module on the same mesh) of speculative method "draft".
    Raises:
        GenerationError: a config value that cannot work (a pool smaller than one sequence, ...).
    """

    def __init__(self, module, mesh, dtype, *, context_length: int, eos_token_ids: Sequence[int] = (),
                 config: EngineConfig = EngineConfig(), runner: ModelRunner | None = None, draft=None):
        self.layout = config.layout(context_length, layer_windows(module.cache_layout()))
        kv_cache_refusal(module.cache_layout(), module.config.model_type, config.kv_cache_dtype)
        self.max_model_len, self.page_size = self.layout.max_model_len, self.layout.page_size
        if runner is not None and runner.layout != self.layout:
            raise ValueError("the runner was made for another engine layout")
        self.runner = runner or ModelRunner(module, mesh, dtype, self.layout)
        self.runner.allocate_pools()
        if self.runner.has_state and config.prefix_caching:
            log.info("prefix caching is off: this model's linear-attention layers keep a state per sequence that "
                     "cached KV pages cannot restore")
            config = dataclasses.replace(config, prefix_caching=False)
        if self.layout.rings and config.prefix_caching:
            log.info("prefix caching is off: sliding-window layers keep only their window per sequence (window_kv), "
                     "so cached pages would lack their keys")
            config = dataclasses.replace(config, prefix_caching=False)
        self.config = config
        self.spec = None
        if config.speculative is not None and self.layout.spec_tokens:
            refuse_unverifiable_state(module)
            self.spec = Speculation(config.speculative, self._proposer(config.speculative, draft),
                                    self.layout.max_model_len)
        copies = self.layout.state_copies if self.runner.has_state else 1
        reach = self.layout.spec_tokens if self.spec is not None and self.spec.proposer.on_device else 0
        self.scheduler = Scheduler(config, self.layout, eos_token_ids, platform=mesh.devices.flat[0].platform,
                                   state_copies=copies, draft_reach=reach)
        self.vocab_size = self.runner.vocab_size
        self._commands: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._in_flight: list[_Sampled] = []
        self._sources: dict[SequenceState, tuple[_Sampled, int]] = {}  # where each in-flight token sits
        self._undelivered: list[TokenEvent] = []  # events of a step that then failed, for `recover` to return
        # Metrics counters, read from other threads (plain ints are safe to read).
        self.prompt_tokens_computed = self.generated_tokens = self.num_steps = 0

    def _proposer(self, spec, draft):
        if spec.method == "ngram":
            return make_proposer(spec)
        if spec.method == "draft":
            if draft is None and self.runner.draft is None:
                raise GenerationError("speculative method 'draft' needs the draft model loaded (day0jax.load does "
                                      "it from EngineConfig.speculative.draft_model)")
            if draft is not None:
                self.runner.attach_draft(draft)
            self.runner.catalog.proposer = "draft"
            return DraftModelProposer(self.runner)
        self.runner.attach_mtp()
        self.runner.catalog.proposer = "mtp"
        return MTPProposer(self.runner)

    def attach(self, module, eos_token_ids: Sequence[int]) -> None:
        """Gives an engine built on an abstract model (see `loader.Prepared.engine`) its restored weights and the
        checkpoint's end-of-sequence tokens; the programs compiled meanwhile stay installed."""
        self.runner.attach(module)
        self.scheduler.eos_token_ids = frozenset(eos_token_ids)

    def programs(self, max_len: int | None = None, warmup: str = "all") -> list:
        """The programs to compile before serving: every one (`ProgramCatalog.all`, with `max_len` only the forward
        programs attending over at most that many tokens), the ready set (`warmup="ready"`: `ProgramCatalog.ready`)
        or none."""
        if warmup == "none":
            return []
        catalog = self.runner.catalog
        return catalog.ready() if warmup == "ready" else catalog.all(max_len)

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
        return compile_programs(self.runner, self.programs(max_len, warmup), store=store, workers=workers,
                                timeline=timeline, progress=progress)

    def compile_in_background(self, store=None):
        """Starts compiling every program not installed yet on a background thread, most likely needed first and
        while no request is being served; until it is done, a step whose program is missing runs on a larger
        installed one or makes its own ready first (never traced inline). Returns the `BackgroundCompiler`."""
        runner = self.runner
        ready = [p for p in runner.catalog.all() if runner.installed(p)]
        compiler = BackgroundCompiler(runner, runner.catalog.background(ready), store=store, busy=self.has_work)
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
                images the model cannot take or whose count does not match the placeholders, a LoRA adapter the
                model does not serve.
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
        self.runner.inputs.check_images(prompt, images)
        self.runner.inputs.adapter_slot(params.adapter)
        with self._lock:
            if self.num_waiting + params.n > self.config.max_waiting:
                raise QueueFull(f"the queue is full ({self.config.max_waiting} waiting)")
            self._commands.append(("add", request_id, prompt, params, images))

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
            if self.spec is not None:
                events += self._plan_drafts()
            try:
                work = self.scheduler.schedule()
                previous = self._previous_tokens(work.decode)
            except NeedTokens:
                events += self._read_in_flight()
                work, previous = self.scheduler.schedule(), None
            sampled = self._run(work, previous)
            events += self._read_in_flight()  # the previous step's programs ran before this step's
            if any(x.drafted is not None for x in sampled):
                # A verify step's outcome decides the next step's positions: read now.
                self._in_flight, sampled = sampled, []
                events += self._read_in_flight()
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

    def _plan_drafts(self) -> list[TokenEvent]:
        """Gives this step's decode rows their drafts (`seq.drafts`), when the batch is small enough to speculate
        and the row's request and record allow it; with a device proposer, whose drafts come with a row's last
        tokens, reads the tokens still on the device first. Returns the events of that read."""
        spec, s = self.spec, self.scheduler
        for seq in s.running:
            seq.drafts = []
        rows = [q for q in s.running if not q.finished and q.pending == 1 and not s._exhausted(q)]
        if not spec.active(len(rows)):
            return []
        wanted = [q for q in rows if spec.wants(q)]
        device = spec.proposer.on_device
        events = self._read_in_flight() if device and any(q.in_flight for q in wanted) else []
        for q in wanted:
            if not q.finished:
                spec.propose(q)
        return events

    def _run(self, work: Work, previous: jax.Array | None) -> list[_Sampled]:
        sampled = []
        device = self.spec is not None and self.spec.proposer.on_device
        if work.decode and any(s.drafts for s in work.decode):
            sampled.append(self._verify(work.decode, previous))
        elif work.decode:
            if device:  # their proposer misses these tokens
                for s in work.decode:
                    self.spec.turn_off(s)
            sampled.append(self._sample(work.decode, *self._run_decode(work.decode, previous)))
        for seq, n in work.prefill:
            batch, outputs = self._run_prefill(seq, n)
            if seq.num_computed == seq.length:  # the whole prompt is in: the last logits give a token
                sampled.append(self._sample([seq], *outputs))
                if device:
                    sampled[-1].drafts = self.spec.proposer.after_prompt(batch, seq, sampled[-1].out["tokens"])
            elif device:
                self.spec.proposer.after_chunk(batch, seq)
        self.num_steps += bool(work.decode or work.prefill)
        return sampled

    def _run_decode(self, seqs: list[SequenceState], previous: jax.Array | None):
        batch = self.runner.inputs.decode(seqs, lambda s: self._sources[s][1])
        outputs = self.runner.forward(batch, previous)
        for s in seqs:
            s.num_computed += 1
            self.scheduler.register_blocks(s)
        return outputs

    def _verify(self, seqs: list[SequenceState], previous: jax.Array | None) -> _Sampled:
        """Dispatches the verify program and the acceptance over the decode rows (reading nothing)."""
        inputs = self.runner.inputs
        batch = inputs.verify(seqs, lambda s: self._sources[s][1])
        logits = self.runner.verify(batch, previous)
        rows, T = batch.tokens.shape
        drafts, counts = inputs.drafts(seqs, rows)
        force = counts > 0 if self.spec.force_accept else None
        out = self.runner.accept(logits, inputs.sampling(seqs, rows, positions=T), drafts, counts, force=force)
        proposed = self.spec.proposer.after_verify(batch, seqs, out) if self.spec.proposer.on_device else None
        for s in seqs:
            s.in_flight += 1
        return _Sampled(seqs, out, drafted=[len(s.drafts) for s in seqs], drafts=proposed)

    def _run_prefill(self, seq: SequenceState, n: int):
        batch = self.runner.inputs.prefill(seq, n)
        outputs = self.runner.forward(batch)
        seq.num_computed += n
        self.prompt_tokens_computed += n
        self.scheduler.register_blocks(seq)
        return batch, outputs

    def _sample(self, seqs: list[SequenceState], logits, greedy) -> _Sampled:
        """Dispatches the sampler (reading nothing) for the leading rows of `logits`, one per sequence. The forward
        program is already dispatched: the grammar masks are computed while it runs."""
        meta = self.runner.inputs.sampling(seqs, logits.shape[0])
        sampled = _Sampled(seqs, self.runner.sample(logits, meta) if meta.sampled else {"tokens": greedy})
        for i, s in enumerate(seqs):
            s.in_flight += 1
            self._sources[s] = (sampled, i)
        return sampled

    def _read_in_flight(self) -> list[TokenEvent]:
        """Reads every sampler output still on the device (waiting for it) and emits its tokens."""
        events = []
        for sampled in self._in_flight:
            out = self.runner.read(sampled.out)
            if sampled.drafts is not None:
                self.spec.store_drafts(sampled.seqs, np.asarray(sampled.drafts))
            if sampled.drafted is not None:
                events += self._read_verified(sampled, out)
                continue
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

    def _read_verified(self, sampled: _Sampled, out: dict) -> list[TokenEvent]:
        """Each verify row's kept drafts and next token, through `_append_token` one at a time (so EOS, stop tokens,
        max_tokens and grammars end the run where plain decoding would); the row's verified positions, state slot
        and acceptance counts move on."""
        events = []
        for i, seq in enumerate(sampled.seqs):
            seq.in_flight -= 1
            if seq.finished:
                continue
            accepted, drafted = int(out["accepted"][i]), sampled.drafted[i]
            seq.num_computed += accepted + 1  # its input token and the kept drafts
            self.scheduler.commit_state(seq, accepted)
            self.spec.record(seq, drafted, accepted)
            for j in range(accepted + 1):
                lp = top = None
                if "logprob" in out and seq.params.logprobs is not None:
                    lp, k = float(out["logprob"][i, j]), seq.params.logprobs
                    top = [(int(t), float(v)) for t, v in zip(out["top_ids"][i, j][:k], out["top_logprobs"][i, j][:k])]
                events.append(self._append_token(seq, int(out["tokens"][i, j]), lp, top))
                if seq.finished:
                    break
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
                          num_prompt_tokens=seq.prompt_len, num_cached_tokens=seq.cached_tokens,
                          num_draft_tokens=seq.num_draft_tokens, num_accepted_tokens=seq.num_accepted_tokens)

    def stats(self) -> dict[str, int]:
        """Gauges and counters for metrics: queue, batch, pages, prefix cache, tokens."""
        s, pool = self.scheduler, self.scheduler.pool
        out = dict(waiting=self.num_waiting, running=len(s.running), kv_blocks_used=pool.num_used,
                   kv_blocks_free=pool.num_free, kv_blocks_total=pool.usable, prefix_hit_blocks=pool.hits,
                   prefix_query_blocks=pool.queries, prefix_hit_tokens=s.prefix_hit_tokens,
                   preemptions=s.num_preemptions, prompt_tokens_computed=self.prompt_tokens_computed,
                   generated_tokens=self.generated_tokens, steps=self.num_steps)
        if self.spec is not None:
            st = self.spec.stats
            out.update(spec_drafts=st.drafts, spec_draft_tokens=st.draft_tokens,
                       spec_accepted_tokens=st.accepted_tokens, spec_mean_acceptance_length=st.mean_acceptance_length,
                       spec_accepted_per_position=list(st.accepted_per_position))
        return out

