"""Format: a request's choices as OpenAI response objects, whole once every choice finished or as server-sent events
while they change, usage included.

One formatter per API (`Chat`, `Completion`, `Responses`), each turning the stream step's `Outputs` into its objects;
`respond` answers with either form, as the request asks. A reasoning model's reasoning goes beside the content
(`reasoning`, and `reasoning_content` as older clients read it; a reasoning item in the Responses API), streamed before
the content.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from day0jax.engine.async_engine import EngineDead
from day0jax.engine.requests import ABORT
from day0jax.serve import protocol as P
from day0jax.serve.errors import error_body
from day0jax.serve.stream import Choice, Detokenizer, Outputs

_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# A whole response of more tokens than this (each logprob alternative counted) is built and encoded off the event
# loop: thousands of logprob objects take milliseconds that every stream would otherwise wait.
LARGE_RESPONSE_ENTRIES = 2048


class Formatter:
    """How one API answers.

    Args:
        model_name: the responses' `model`.
    """

    done: str | None = "data: [DONE]\n\n"  # the stream's last line

    def __init__(self, model_name: str):
        self.model_name = model_name

    def response(self, out: Outputs) -> BaseModel:
        """The whole response, once every choice finished."""
        raise NotImplementedError

    def opening(self, out: Outputs) -> list[BaseModel]:
        """The events streamed before any token."""
        return []

    def chunks(self, out: Outputs, c: Choice) -> list[BaseModel]:
        """The events for a choice that changed, its new text and logprobs marked as sent; none while there is
        nothing to send yet."""
        raise NotImplementedError

    def closing(self, out: Outputs, include_usage: bool) -> list[BaseModel]:
        """The events streamed once every choice finished (usage, when the client asked for it)."""
        return []

    def encode(self, event: BaseModel) -> str:
        """One server-sent event."""
        return sse(event)

    def error(self, message: str) -> str:
        """The server-sent event reporting a failure after the stream began."""
        return "data: " + json.dumps(error_body(message, "server_error")) + "\n\n"


class Chat(Formatter):
    """Chat completions: `chat.completion` whole, `chat.completion.chunk` events streamed (each choice's role first).

    Args:
        model_name: the responses' `model`.
        include_reasoning: whether a reasoning model's reasoning is sent (vLLM's `include_reasoning`).
    """

    def __init__(self, model_name: str, include_reasoning: bool = True):
        super().__init__(model_name)
        self.include_reasoning = include_reasoning

    def response(self, out: Outputs) -> P.ChatCompletionResponse:
        choices = []
        for c in out.choices:
            reasoning = c.reasoning or None if self.include_reasoning else None
            content = (c.text.strip() or None) if c.tool_calls else \
                None if out.reasoning is not None and not c.text else c.text
            choices.append(P.ChatChoice(index=c.index, message=P.ChatResponseMessage(
                content=content, reasoning=reasoning, reasoning_content=reasoning,
                tool_calls=[P.ToolCall(id=t.id, function=P.FunctionCall(name=t.name, arguments=t.arguments))
                            for t in c.tool_calls] or None),
                logprobs=chat_logprobs(c.logprobs, out.detok), finish_reason=finish_reason(c.finish_reason)))
        return P.ChatCompletionResponse(id=out.run.id, model=self.model_name, choices=choices, usage=usage(out))

    def opening(self, out: Outputs) -> list[P.ChatCompletionChunk]:
        return [P.ChatCompletionChunk(id=out.run.id, model=self.model_name, choices=[
            P.ChatChunkChoice(index=c.index, delta=P.ChatDelta(role="assistant", content=""))]) for c in out.choices]

    def chunks(self, out: Outputs, c: Choice) -> list[P.ChatCompletionChunk]:
        reasoning, text = c.sendable()
        if not self.include_reasoning:
            reasoning = ""
        finished = c.finish_reason is not None
        if not (reasoning or text or finished):
            return []
        logprobs = chat_logprobs(_unsent_logprobs(c), out.detok)
        events = []
        if reasoning:  # before the content, in its own chunk
            events.append(self._chunk(out, c, P.ChatDelta(reasoning=reasoning, reasoning_content=reasoning),
                                      None if text or finished else logprobs))
        if text or finished:
            calls = [P.ToolCallDelta(index=i, id=t.id, type="function", function=P.FunctionCallDelta(
                name=t.name, arguments=t.arguments)) for i, t in enumerate(c.tool_calls)] or None
            events.append(self._chunk(out, c, P.ChatDelta(content=text or None, tool_calls=calls), logprobs,
                                      finish_reason(c.finish_reason)))
        return events

    def _chunk(self, out: Outputs, c: Choice, delta: P.ChatDelta, logprobs, finish: str | None = None):
        return P.ChatCompletionChunk(id=out.run.id, model=self.model_name, choices=[P.ChatChunkChoice(
            index=c.index, delta=delta, logprobs=logprobs, finish_reason=finish)])

    def closing(self, out: Outputs, include_usage: bool) -> list[P.ChatCompletionChunk]:
        if not include_usage:
            return []
        return [P.ChatCompletionChunk(id=out.run.id, model=self.model_name, choices=[], usage=usage(out))]


class Completion(Formatter):
    """Completions: `text_completion` whole, and the same object per streamed event."""

    def response(self, out: Outputs) -> P.CompletionResponse:
        choices = [P.CompletionChoice(index=c.index, text=c.text, finish_reason=finish_reason(c.finish_reason),
                                      logprobs=completion_logprobs(c.logprobs, out.detok)) for c in out.choices]
        return P.CompletionResponse(id=out.run.id, model=self.model_name, choices=choices, usage=usage(out))

    def chunks(self, out: Outputs, c: Choice) -> list[P.CompletionResponse]:
        _, text = c.sendable()
        if not text and c.finish_reason is None:
            return []
        return [P.CompletionResponse(id=out.run.id, model=self.model_name, choices=[P.CompletionChoice(
            index=c.index, text=text, logprobs=completion_logprobs(_unsent_logprobs(c), out.detok),
            finish_reason=finish_reason(c.finish_reason))])]

    def closing(self, out: Outputs, include_usage: bool) -> list[P.CompletionResponse]:
        if not include_usage:
            return []
        return [P.CompletionResponse(id=out.run.id, model=self.model_name, choices=[], usage=usage(out))]


class Responses(Formatter):
    """The Responses API: `response` whole. Streamed: `response.created` and `response.in_progress`, then each
    output item as it grows (a reasoning item's `response.reasoning_text.delta`s, a message's
    `response.output_text.delta`s, each function call once parsed, its arguments in one delta), each opened by
    `response.output_item.added` and closed by `response.output_item.done`, and last `response.completed` (or
    `response.incomplete` when max_output_tokens cut it) with the whole response. One choice.

    Args:
        model_name: the responses' `model`.
        body: the request (echoed in the response: instructions, tools, text format, ...).
    """

    done = None

    def __init__(self, model_name: str, body: P.ResponsesRequest):
        super().__init__(model_name)
        self.body = body
        self.created_at = P.now()
        self._sequence = 0
        self._ids = {"reasoning": P.new_id("rs", "_"), "message": P.new_id("msg", "_")}
        self._index: dict[str, int] = {}  # output index of each item streamed ("reasoning", "message")
        self._streamed = {"reasoning": "", "message": ""}  # the text each streamed
        self._open: str | None = None  # the item whose text is streaming
        self._calls: list = []  # the function calls streamed

    def response(self, out: Outputs) -> P.ResponseObject:
        return self._response(out, streamed=False)

    def opening(self, out: Outputs) -> list[P.ResponseEvent]:
        snapshot = self._response(out, streamed=True, status="in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def chunks(self, out: Outputs, c: Choice) -> list[P.ResponseEvent]:
        reasoning, text = c.sendable()
        events = []
        if reasoning and "message" not in self._index:  # (reasoning after the answer began stays in the response)
            if "reasoning" not in self._index:
                events += self._add("reasoning")
            events.append(self._delta("reasoning", "response.reasoning_text.delta", reasoning))
        if text:
            if self._open == "reasoning":
                events += self._close()
            if "message" not in self._index:
                events += self._add("message")
            events.append(self._delta("message", "response.output_text.delta", text, logprobs=[]))
        if c.finish_reason is not None:
            events += self._close()
            if "message" not in self._index and self._message_wanted(c):
                events += self._add("message") + self._close()
            status = _status(c)
            for call in self._function_calls(c):
                index = len(self._index) + len(self._calls)
                self._calls.append(call)
                added = call.model_copy(update={"arguments": "", "status": "in_progress"})
                events += [self._event("response.output_item.added", output_index=index, item=added),
                           self._event("response.function_call_arguments.delta", item_id=call.id, output_index=index,
                                       delta=call.arguments),
                           self._event("response.function_call_arguments.done", item_id=call.id, output_index=index,
                                       arguments=call.arguments),
                           self._event("response.output_item.done", output_index=index,
                                       item=call.model_copy(update={"status": status}))]
        return events

    def closing(self, out: Outputs, include_usage: bool) -> list[P.ResponseEvent]:
        response = self._response(out, streamed=True)
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        return [self._event(kind, response=response)]

    def encode(self, event: P.ResponseEvent) -> str:
        return f"event: {event.type}\n" + sse(event)

    def error(self, message: str) -> str:
        return self.encode(self._event("error", code="server_error", message=message, param=None))

    # --- the items ---

    def _response(self, out: Outputs, streamed: bool, status: str | None = None) -> P.ResponseObject:
        body, items = self.body, []
        c = out.choices[0]
        if status is None:
            status = _status(c)
            items = self._streamed_items(c, status) if streamed else self._items(c, status)
        fmt = body.text.format if body.text and body.text.format else P.ResponsesTextFormat(type="text")
        choice = body.tool_choice or "auto"
        return P.ResponseObject(
            id=out.run.id, created_at=self.created_at, status=status, model=self.model_name, output=items,
            incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
            instructions=body.instructions, max_output_tokens=body.max_output_tokens,
            parallel_tool_calls=body.parallel_tool_calls, temperature=body.temperature, top_p=body.top_p,
            reasoning=body.reasoning.model_dump() if body.reasoning else None, user=body.user,
            text={"format": fmt.model_dump(by_alias=True, exclude_none=True)},
            tool_choice=choice if isinstance(choice, str) else choice.model_dump(),
            tools=[t.model_dump(exclude_none=True) for t in body.tools or []], metadata=body.metadata or {},
            usage=None if status == "in_progress" else self._usage(out))

    def _items(self, c: Choice, status: str) -> list[P.ResponseOutputItem]:
        items: list[P.ResponseOutputItem] = []
        if c.reasoning:
            items.append(self._item("reasoning", c.reasoning, status))
        if self._message_wanted(c):
            items.append(self._item("message", c.text.strip() if c.tool_calls else c.text, status))
        return items + [call.model_copy(update={"status": status}) for call in self._function_calls(c)]

    def _streamed_items(self, c: Choice, status: str) -> list[P.ResponseOutputItem]:
        items = [self._item(kind, self._streamed[kind], status) for kind in sorted(self._index, key=self._index.get)]
        return items + [call.model_copy(update={"status": status}) for call in self._calls]

    def _item(self, kind: str, text: str, status: str) -> P.ResponseOutputItem:
        if kind == "reasoning":
            return P.ResponseReasoningItem(id=self._ids[kind], status=status, content=[
                P.ResponseReasoningText(text=text)])
        return P.ResponseOutputMessage(id=self._ids[kind], status=status, content=[P.ResponseOutputText(text=text)])

    @staticmethod
    def _message_wanted(c: Choice) -> bool:
        return bool(c.text.strip()) or not c.tool_calls

    @staticmethod
    def _function_calls(c: Choice) -> list[P.ResponseFunctionCall]:
        return [P.ResponseFunctionCall(id=f"fc_{t.id}", call_id=t.id, name=t.name, arguments=t.arguments,
                                       status="completed") for t in c.tool_calls]

    def _usage(self, out: Outputs) -> P.ResponseUsage:
        u = usage(out)
        return P.ResponseUsage(
            input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens, total_tokens=u.total_tokens,
            input_tokens_details={"cached_tokens": u.prompt_tokens_details.cached_tokens, "cache_write_tokens": 0},
            output_tokens_details={"reasoning_tokens": u.completion_tokens_details.reasoning_tokens
                                   if u.completion_tokens_details else 0})

    # --- the events ---

    def _event(self, kind: str, **fields) -> P.ResponseEvent:
        self._sequence += 1
        return P.ResponseEvent(type=kind, sequence_number=self._sequence - 1, **fields)

    def _add(self, kind: str) -> list[P.ResponseEvent]:
        """Opens the reasoning or the message item: its output_item.added and content_part.added."""
        index = self._index[kind] = len(self._index)
        self._open = kind
        empty = self._item(kind, "", "in_progress")
        part = empty.content[0]
        return [self._event("response.output_item.added", output_index=index,
                            item=empty.model_copy(update={"content": []})),
                self._event("response.content_part.added", item_id=self._ids[kind], output_index=index,
                            content_index=0, part=part)]

    def _delta(self, kind: str, event: str, text: str, **fields) -> P.ResponseEvent:
        self._streamed[kind] += text
        return self._event(event, item_id=self._ids[kind], output_index=self._index[kind], content_index=0,
                           delta=text, **fields)

    def _close(self) -> list[P.ResponseEvent]:
        """Closes the item whose text is streaming: its text's done event, content_part.done, output_item.done."""
        kind, self._open = self._open, None
        if kind is None:
            return []
        index, text, item_id = self._index[kind], self._streamed[kind], self._ids[kind]
        item = self._item(kind, text, "completed")
        done = self._event("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0,
                           text=text) if kind == "reasoning" else \
            self._event("response.output_text.done", item_id=item_id, output_index=index, content_index=0, text=text,
                        logprobs=[])
        return [done, self._event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                                  part=item.content[0]),
                self._event("response.output_item.done", output_index=index, item=item)]


def _status(c: Choice) -> str:
    return "incomplete" if c.finish_reason == "length" else "completed"


async def respond(request: Request, out: Outputs, fmt: Formatter, body):
    """Answers a submitted request: the whole response, or a `StreamingResponse` of server-sent events when
    `body.stream` (usage last when `body.stream_options.include_usage`, then the formatter's last line).

    Raises:
        APIError: 500 when the engine failed before a whole response (a stream reports it as an error event).
    """
    if not body.stream:
        await out.wait(request)
        top = body.logprob_count()
        if out.generated * (1 if top is None else top + 1) <= LARGE_RESPONSE_ENTRIES:
            return fmt.response(out)
        return await asyncio.to_thread(encoded_response, fmt, out)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return _RunStream(out, _events(out, fmt, include_usage), media_type="text/event-stream", headers=_STREAM_HEADERS)


def encoded_response(fmt: Formatter, out: Outputs) -> Response:
    """The whole response, built and encoded as JSON (what FastAPI would do with it on the event loop)."""
    return Response(fmt.response(out).model_dump_json(by_alias=True), media_type="application/json")


class _RunStream(StreamingResponse):
    """The server-sent events of a run, which is released however the response ends. A client gone before the first
    byte (it left during rendering or a grammar compile) cancels the stream before its generator starts, and a
    generator that never started never runs its own cleanup: its sequences would run on, counted in flight."""

    def __init__(self, out: Outputs, content, **kwargs):
        super().__init__(content, **kwargs)
        self.out = out

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.out.close()


async def _events(out: Outputs, fmt: Formatter, include_usage: bool) -> AsyncIterator[str]:
    async with out:
        try:
            for event in fmt.opening(out):
                yield fmt.encode(event)
            async for c in out.events():
                for event in fmt.chunks(out, c):
                    yield fmt.encode(event)
            for event in fmt.closing(out, include_usage):
                yield fmt.encode(event)
        except EngineDead as e:
            yield fmt.error(f"the engine failed: {e}")
    if fmt.done:
        yield fmt.done


def sse(model: BaseModel) -> str:
    """One server-sent event carrying a response object as JSON."""
    return "data: " + model.model_dump_json() + "\n\n"


def _unsent_logprobs(c: Choice) -> list:
    """A choice's logprobs not sent yet, marked as sent (they go out with the text they belong to)."""
    logprobs = c.logprobs[c.sent_logprobs:]
    c.sent_logprobs = len(c.logprobs)
    return logprobs


def finish_reason(reason: str | None) -> str | None:
    """The OpenAI finish reason of an engine one (an abort after a stop string is a "stop")."""
    return "stop" if reason == ABORT else reason


def usage(out: Outputs) -> P.Usage:
    """The token counts of a request (a reasoning model's reasoning tokens among the completion's)."""
    prompt = out.run.prompt_tokens
    drafted = sum(c.draft_tokens for c in out.choices)
    spec = P.SpeculativeUsage(draft_tokens=drafted, accepted_tokens=sum(c.accepted_tokens for c in out.choices)) \
        if drafted else None
    details = None if out.reasoning is None else P.CompletionTokensDetails(
        reasoning_tokens=sum(c.reasoning_tokens for c in out.choices))
    return P.Usage(prompt_tokens=prompt, completion_tokens=out.generated, total_tokens=prompt + out.generated,
                   prompt_tokens_details=P.PromptTokensDetails(cached_tokens=out.cached_tokens),
                   completion_tokens_details=details, speculative=spec)


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
