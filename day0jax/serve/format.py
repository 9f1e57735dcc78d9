"""Format: a request's choices as OpenAI response objects, whole once every choice finished or as server-sent events
while they change, usage included.

One formatter per API (`Chat`, `Completion`), each turning the stream step's `Outputs` into its objects; `respond`
answers with either form, as the request asks.
"""

from __future__ import annotations

import json
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from day0jax.engine.async_engine import EngineDead
from day0jax.engine.requests import ABORT
from day0jax.serve import protocol as P
from day0jax.serve.errors import error_body
from day0jax.serve.stream import Choice, Detokenizer, Outputs

_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Formatter:
    """How one API answers.

    Args:
        model_name: the responses' `model`.
    """

    def __init__(self, model_name: str):
        self.model_name = model_name

    def response(self, out: Outputs) -> BaseModel:
        """The whole response, once every choice finished."""
        raise NotImplementedError

    def opening(self, out: Outputs) -> list[BaseModel]:
        """The events streamed before any token."""
        return []

    def chunk(self, out: Outputs, c: Choice) -> BaseModel | None:
        """The event for a choice that changed, its new text and logprobs marked as sent; None while there is
        nothing to send yet."""
        raise NotImplementedError

    def usage_chunk(self, out: Outputs) -> BaseModel:
        """The last event when the client asked for usage."""
        raise NotImplementedError


class Chat(Formatter):
    """Chat completions: `chat.completion` whole, `chat.completion.chunk` events streamed (each choice's role first)."""

    def response(self, out: Outputs) -> P.ChatCompletionResponse:
        choices = [P.ChatChoice(index=c.index, message=P.ChatResponseMessage(
            content=(c.text.strip() or None) if c.tool_calls else c.text,
            tool_calls=[P.ToolCall(id=t.id, function=P.FunctionCall(name=t.name, arguments=t.arguments))
                        for t in c.tool_calls] or None),
            logprobs=chat_logprobs(c.logprobs, out.detok), finish_reason=finish_reason(c.finish_reason))
            for c in out.choices]
        return P.ChatCompletionResponse(id=out.run.id, model=self.model_name, choices=choices, usage=usage(out))

    def opening(self, out: Outputs) -> list[P.ChatCompletionChunk]:
        return [P.ChatCompletionChunk(id=out.run.id, model=self.model_name, choices=[
            P.ChatChunkChoice(index=c.index, delta=P.ChatDelta(role="assistant", content=""))]) for c in out.choices]

    def chunk(self, out: Outputs, c: Choice) -> P.ChatCompletionChunk | None:
        new = _unsent(c)
        if new is None:
            return None
        text, logprobs = new
        calls = [P.ToolCallDelta(index=i, id=t.id, type="function", function=P.FunctionCallDelta(
            name=t.name, arguments=t.arguments)) for i, t in enumerate(c.tool_calls)] or None
        return P.ChatCompletionChunk(id=out.run.id, model=self.model_name, choices=[P.ChatChunkChoice(
            index=c.index, delta=P.ChatDelta(content=text or None, tool_calls=calls),
            logprobs=chat_logprobs(logprobs, out.detok), finish_reason=finish_reason(c.finish_reason))])

    def usage_chunk(self, out: Outputs) -> P.ChatCompletionChunk:
        return P.ChatCompletionChunk(id=out.run.id, model=self.model_name, choices=[], usage=usage(out))


class Completion(Formatter):
    """Completions: `text_completion` whole, and the same object per streamed event."""

    def response(self, out: Outputs) -> P.CompletionResponse:
        choices = [P.CompletionChoice(index=c.index, text=c.text, finish_reason=finish_reason(c.finish_reason),
                                      logprobs=completion_logprobs(c.logprobs, out.detok)) for c in out.choices]
        return P.CompletionResponse(id=out.run.id, model=self.model_name, choices=choices, usage=usage(out))

    def chunk(self, out: Outputs, c: Choice) -> P.CompletionResponse | None:
        new = _unsent(c)
        if new is None:
            return None
        text, logprobs = new
        return P.CompletionResponse(id=out.run.id, model=self.model_name, choices=[P.CompletionChoice(
            index=c.index, text=text, logprobs=completion_logprobs(logprobs, out.detok),
            finish_reason=finish_reason(c.finish_reason))])

    def usage_chunk(self, out: Outputs) -> P.CompletionResponse:
        return P.CompletionResponse(id=out.run.id, model=self.model_name, choices=[], usage=usage(out))


async def respond(request: Request, out: Outputs, fmt: Formatter, body):
    """Answers a submitted request: the whole response, or a `StreamingResponse` of server-sent events when
    `body.stream` (usage last when `body.stream_options.include_usage`, then `[DONE]`).

    Raises:
        APIError: 500 when the engine failed before a whole response (a stream reports it as an error event).
    """
    if not body.stream:
        await out.wait(request)
        return fmt.response(out)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return StreamingResponse(_events(out, fmt, include_usage), media_type="text/event-stream",
                             headers=_STREAM_HEADERS)


async def _events(out: Outputs, fmt: Formatter, include_usage: bool) -> AsyncIterator[str]:
    async with out:
        try:
            for event in fmt.opening(out):
                yield sse(event)
            async for c in out.events():
                event = fmt.chunk(out, c)
                if event is not None:
                    yield sse(event)
            if include_usage:
                yield sse(fmt.usage_chunk(out))
        except EngineDead as e:
            yield "data: " + json.dumps(error_body(f"the engine failed: {e}", "server_error")) + "\n\n"
    yield "data: [DONE]\n\n"


def sse(model: BaseModel) -> str:
    """One server-sent event carrying a response object as JSON."""
    return "data: " + model.model_dump_json() + "\n\n"


def _unsent(c: Choice) -> tuple[str, list] | None:
    """A choice's text and logprobs not sent yet, marked as sent; None while nothing can be sent (logprobs go out
    with the text they belong to)."""
    text = c.sendable()
    if not text and c.finish_reason is None:
        return None
    logprobs = c.logprobs[c.sent_logprobs:]
    c.sent_logprobs = len(c.logprobs)
    return text, logprobs


def finish_reason(reason: str | None) -> str | None:
    """The OpenAI finish reason of an engine one (an abort after a stop string is a "stop")."""
    return "stop" if reason == ABORT else reason


def usage(out: Outputs) -> P.Usage:
    """The token counts of a request."""
    prompt = out.run.prompt_tokens
    drafted = sum(c.draft_tokens for c in out.choices)
    spec = P.SpeculativeUsage(draft_tokens=drafted, accepted_tokens=sum(c.accepted_tokens for c in out.choices)) \
        if drafted else None
    return P.Usage(prompt_tokens=prompt, completion_tokens=out.generated, total_tokens=prompt + out.generated,
                   prompt_tokens_details=P.PromptTokensDetails(cached_tokens=out.cached_tokens), speculative=spec)


def chat_logprobs(entries, detok: Detokenizer) -> P.ChatLogprobs | None:
    """Chat-style logprobs (one entry per token, with bytes and the top alternatives), or None for no entries."""
    if not entries:
        return None
    out = []
    for token, lp, top in entries:
        text = detok.token(token)
        out.append(P.TokenLogprob(token=text, logprob=lp, bytes=list(text.encode()), top_logprobs=[
            P.TopLogprob(token=detok.token(t), logprob=v, bytes=list(detok.token(t).encode())) for t, v in top]))
    return P.ChatLogprobs(content=out)


def completion_logprobs(entries, detok: Detokenizer) -> P.CompletionLogprobs | None:
    """Completion-style logprobs (parallel lists: tokens, logprobs, top alternatives, text offsets), or None."""
    if not entries:
        return None
    out = P.CompletionLogprobs()
    offset = 0
    for token, lp, top in entries:
        text = detok.token(token)
        out.text_offset.append(offset)
        offset += len(text)
        out.tokens.append(text)
        out.token_logprobs.append(lp)
        out.top_logprobs.append({detok.token(t): v for t, v in top})
    return out
