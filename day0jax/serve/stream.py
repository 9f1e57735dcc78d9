"""Stream: a submitted request's engine events become each choice's text as its tokens arrive.

A choice's text passes, in order: incremental detokenization (each token decoded with a few before it as context; a
token may complete a multi-byte character), stop strings (the text is cut before one, the sequence aborted), the
reasoning split of a reasoning model (the reasoning apart from the answer, `reasoning.Splitter`), then tool-call
parsing of the answer (a call's text is held back while streaming and parsed into `tool_calls` when the choice ends).
What can still change is never sent (`Choice.sendable`). Token metrics (time to first token, inter-token latency,
finish reasons) are counted here. Choices are numbered prompt-major, as OpenAI numbers them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import Request

from day0jax.engine.async_engine import EngineDead
from day0jax.engine.requests import TokenEvent
from day0jax.serve.errors import APIError
from day0jax.serve.reasoning import Reasoning, Splitter
from day0jax.serve.state import ServerState
from day0jax.serve.submit import Run
from day0jax.serve.tools import ToolCall
from day0jax.serve.validate import OfferedTools


MAX_UNFINISHED_TOKENS = 8  # a UTF-8 character is at most 4 bytes, so at most 4 byte tokens


class Detokenizer:
    """Token ids to text, with the single-token texts (logprobs' `token` fields) cached.

    Args:
        tokenizer: the model's tokenizer (`decode(ids, skip_special_tokens=...)`, `special_ids`).
        keep_special: keep special tokens in the text (a tool-call marker such as Mistral's [TOOL_CALLS] is one).
        keep: special tokens kept in the text when the others are left out (a reasoning syntax's markers, such as
            harmony's <|channel|>).
    """

    def __init__(self, tokenizer, keep_special: bool = False, keep: frozenset[int] = frozenset()):
        self.tok, self.keep_special = tokenizer, keep_special
        self._drop = frozenset() if keep_special or not keep else tokenizer.special_ids - keep
        self._cache: dict[int, str] = {}

    def text(self, ids: list[int]) -> str:
        """The text of a sequence of ids, special tokens left out unless `keep_special` (or kept in `keep`)."""
        if self._drop:
            return self.tok.decode([i for i in ids if i not in self._drop], skip_special_tokens=False)
        return self.tok.decode(ids, skip_special_tokens=not self.keep_special)

    def token(self, token_id: int) -> str:
        """The text of one token, special tokens included (as logprobs show them)."""
        if token_id not in self._cache:
            self._cache[token_id] = self.tok.decode([token_id], skip_special_tokens=False)
        return self._cache[token_id]


@dataclass
class Choice:
    """One output sequence of a request (OpenAI's `choices[index]`) as it is generated."""

    index: int
    stops: list[str]
    tools: OfferedTools | None = None  # the offered tools: calls in the answer become `tool_calls`
    splitter: Splitter | None = None  # a reasoning model's: the reasoning apart from the answer
    ids: list[int] = field(default_factory=list)
    text: str = ""  # text so far (stop strings cut away); once finished, the content (reasoning and calls apart)
    sent: int = 0  # characters of the content already streamed
    reasoning: str = ""  # the reasoning, once finished
    reasoning_sent: int = 0  # characters of the reasoning already streamed
    reasoning_tokens: int = 0  # tokens of the reasoning (markup included), once finished
    starts: list[int] = field(default_factory=list)  # where each token's text starts in `text`
    finish_reason: str | None = None
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    sent_logprobs: int = 0
    generated: int = 0  # tokens generated (stop tokens included), for usage
    draft_tokens: int = 0  # speculative decoding: tokens drafted for this choice and drafts accepted, for usage
    accepted_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)  # parsed when the choice finished
    _settled: str = ""  # text of finished characters
    # The tokens decoded for each new one: _window[:_context] decode to the end of _settled (the context for the
    # next tokens), the rest have not settled yet. Tokens that add no text leave it, so it stays short.
    _window: list[int] = field(default_factory=list)
    _context: int = 0

    def add(self, event: TokenEvent, detok: Detokenizer) -> bool:
        """Adds one engine event to the text and logprobs; returns True when a stop string ended the choice (the text
        is cut before it).

        Args:
            event: the engine's event for this choice.
            detok: the request's detokenizer.
        """
        if event.token is not None and event.logprob is not None:
            self.logprobs.append((event.token, event.logprob, event.top_logprobs or []))
        settled = len(self._settled)
        if event.token is not None and not event.stop_token:
            self.ids.append(event.token)
            self.starts.append(len(self.text))
            # Incremental: decode only the tokens since the last settled text, with the chunk before them as
            # context (a tokenizer may render a token differently at the start of a text), so a long output costs
            # linear time. Text ending in U+FFFD is an unfinished character: it settles with a later token, or as
            # it is once more tokens than any character takes have not finished it. Tokens that add nothing (special
            # tokens left out of the text) leave the window: a run of them costs no more than one.
            window, context = self._window, self._context
            window.append(event.token)
            before, now = detok.text(window[:context]), detok.text(window)
            new = now[len(before):] if len(now) > len(before) else ""
            if new and (not now.endswith("\ufffd") or len(window) - context >= MAX_UNFINISHED_TOKENS):
                self._settled += new
                self._window, self._context, new = window[context:], len(window) - context, ""
            elif now == before:
                del window[context:]
            self.text = self._settled + new
        stopped = False
        for stop in self.stops:
            # Search only where a new match can be: the settled text's tail plus everything after it.
            pos = self.text.find(stop, max(0, settled - len(stop) + 1))
            if pos != -1:
                self.text, stopped = self.text[:pos], True
        return stopped

    def sendable(self) -> tuple[str, str]:
        """Returns the new reasoning and the new content safe to stream, marked as sent: all that is left once the
        choice finished, else holding back an unfinished UTF-8 character, a possible stop-string prefix, what may
        still be a reasoning marker, or a tool call (later tokens settle them)."""
        if self.finish_reason is not None:
            reasoning, content = self.reasoning, self.text
            end = len(content)
        else:
            text = self.text
            end = len(text)
            while end > 0 and text[end - 1] == "\ufffd":
                end -= 1
            end = max(0, end - max((len(s) - 1 for s in self.stops), default=0))
            reasoning, content = "", text
            if self.splitter is not None:  # the split of what later tokens cannot change
                split = self.splitter.split(text[:end], final=False)
                reasoning, content = split.reasoning, split.answer
                end = len(content)
            if self.tools is not None:  # a tool call's text is never streamed as content
                end = min(end, self.tools.syntax.hold_back(content))
        end = max(self.sent, end)
        new_reasoning, new = reasoning[self.reasoning_sent:], content[self.sent:end]
        self.reasoning_sent, self.sent = max(self.reasoning_sent, len(reasoning)), end
        return new_reasoning, new

    def finish(self, reason: str) -> None:
        """Ends the choice: a reasoning model's reasoning goes apart from the text (it keeps the answer), the tool
        calls in the answer become `tool_calls` (the text keeps the content before them) and the finish reason
        "tool_calls"."""
        self.finish_reason = reason
        if self.splitter is not None:
            split = self.splitter.split(self.text, final=True)
            self.reasoning, self.text = split.reasoning, split.answer
            self.reasoning_tokens = sum(any(a <= at < b for a, b in split.spans) for at in self.starts)
        if self.tools is None:
            return
        content, calls = self.tools.syntax.parse(self.text, self.tools.parameters)
        if calls:  # streaming held the calls back: what was sent is a prefix of the content
            self.text, self.tool_calls, self.finish_reason = content, calls, "tool_calls"


class Outputs:
    """The choices of a submitted request, following its engine events. Used as an async context (`async with`):
    leaving it releases the run (aborting what has not finished).

    Args:
        state: the server state (tokenizer, metrics).
        run: the submitted request.
        stops: the stop strings.
        tools: the offered tools, or None.
        arrival: `time.monotonic()` when the request arrived (latency metrics count from there).
        reasoning: a reasoning model's reasoning (`render.reasoning`), or None: the text is all answer.
    """

    def __init__(self, state: ServerState, run: Run, stops: list[str], tools: OfferedTools | None, arrival: float,
                 reasoning: Reasoning | None = None):
        self.state, self.run, self.arrival, self.reasoning = state, run, arrival, reasoning
        self.choices = [Choice(k * run.n + j, stops, tools, reasoning.splitter() if reasoning else None)
                        for k in range(len(run.streams)) for j in range(run.n)]
        keep = frozenset(i for t in reasoning.syntax.specials if (i := state.tokenizer.token_id(t)) is not None) \
            if reasoning else frozenset()
        self.detok = Detokenizer(state.tokenizer, keep_special=tools is not None, keep=keep)
        self.cached_tokens = 0  # prompt tokens taken from the prefix cache
        self._tasks: list[asyncio.Task] = []
        self._completed = False

    @property
    def generated(self) -> int:
        return sum(c.generated for c in self.choices)

    async def __aenter__(self) -> "Outputs":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stops following the events and releases the run (aborting what has not finished); again, a no-op."""
        for t in self._tasks:
            t.cancel()
        self.run.release(self._completed)

    async def events(self) -> AsyncIterator[Choice]:
        """Merges the engine requests' events, yielding each choice an event changed, until every choice finished;
        raises EngineDead if the engine fails."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(k, stream):
            try:
                async for ev in stream:
                    await queue.put((k, ev))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await queue.put((k, e))
            finally:
                await queue.put((k, None))

        self._tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(self.run.streams)]
        live = len(self._tasks)
        while live:
            k, ev = await queue.get()
            if ev is None:
                live -= 1
                continue
            if isinstance(ev, BaseException):
                raise ev
            choice = self.choices[k * self.run.n + ev.index]
            if choice.finish_reason is not None:
                continue  # a stop string already ended it; this is the engine's abort echo
            self._apply(k, choice, ev)
            yield choice
        self._completed = True

    def _apply(self, k: int, choice: Choice, ev: TokenEvent) -> None:
        """Adds an event to its choice: token metrics, text, and the end (a stop string aborts the sequence)."""
        metrics = self.state.metrics
        now = time.monotonic()
        if ev.token is not None:
            choice.generated += 1
            choice.draft_tokens, choice.accepted_tokens = ev.num_draft_tokens, ev.num_accepted_tokens
            metrics.generation_tokens.inc()
            if choice.first_token_at is None:
                choice.first_token_at = now
                metrics.ttft.observe(now - self.arrival)
                self.cached_tokens += ev.num_cached_tokens
            else:
                metrics.itl.observe(now - choice.last_token_at)
            choice.last_token_at = now
        if choice.add(ev, self.detok):
            choice.finish("stop")
            self.run.abort(k, ev.index)
        elif ev.finish_reason is not None:
            choice.finish(ev.finish_reason)
        if choice.finish_reason is not None:
            metrics.finished.labels(choice.finish_reason).inc()
            metrics.e2e.observe(now - self.arrival)

    async def wait(self, request: Request) -> None:
        """Follows the events until every choice finished, aborting the run if the client hangs up; releases it.

        Raises:
            APIError: 500 when the engine failed.
        """
        watcher = asyncio.create_task(self._abort_on_disconnect(request))
        async with self:
            try:
                async for _ in self.events():
                    pass
            except EngineDead as e:
                raise APIError(500, f"the engine failed: {e}", "server_error") from None
            finally:
                watcher.cancel()

    async def _abort_on_disconnect(self, request: Request) -> None:
        # A non-streaming client that hangs up should not keep its sequences running.
        while not await request.is_disconnected():
            await asyncio.sleep(0.5)
        self.run.abort()
