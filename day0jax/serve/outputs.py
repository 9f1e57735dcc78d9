"""Engine token events to OpenAI output: per-choice text, stop strings, streaming chunks, final responses.

A choice's text is decoded incrementally (each token with a few before it as context; a token may complete a
multi-byte character) and streamed only as far as it can no longer change (see `Choice.sendable`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from day0jax.engine.requests import ABORT, TokenEvent
from day0jax.serve import protocol as P


class Detokenizer:
    """Token ids to text, with the single-token texts (logprobs' `token` fields) cached.

    Args:
        tokenizer: the model's tokenizer (`decode(ids, skip_special_tokens=...)`).
    """

    def __init__(self, tokenizer, keep_special: bool = False):
        self.tok, self.keep_special = tokenizer, keep_special
        self._cache: dict[int, str] = {}

    def text(self, ids: list[int]) -> str:
        """The text of a sequence of ids, special tokens left out (unless `keep_special`: a tool-call marker such as
        Mistral's [TOOL_CALLS] is one)."""
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
    ids: list[int] = field(default_factory=list)
    text: str = ""  # text so far (stop strings cut away)
    sent: int = 0  # characters of `text` already streamed
    finish_reason: str | None = None
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    sent_logprobs: int = 0
    generated: int = 0  # tokens generated (stop tokens included), for usage
    first_token_at: float | None = None
    last_token_at: float | None = None
    tools: Any = None  # the tool-call syntax (`tools.ToolSyntax`) when the request offered tools
    tool_params: dict = field(default_factory=dict)  # each offered function's parameters, by name
    tool_calls: list = field(default_factory=list)  # parsed when the choice finished
    _settled: str = ""  # text of finished characters
    _prefix: int = 0  # ids[_prefix:_read] decode to the end of _settled (the context for the next tokens)
    _read: int = 0

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
            # Incremental: decode only the tokens since the last settled text, with the chunk before them as
            # context (a tokenizer may render a token differently at the start of a text), so a long output costs
            # linear time. Text ending in U+FFFD is an unfinished character: it settles with a later token.
            before = detok.text(self.ids[self._prefix:self._read])
            now = detok.text(self.ids[self._prefix:])
            new = now[len(before):] if len(now) > len(before) else ""
            if new and not now.endswith("\ufffd"):
                self._settled += new
                self._prefix, self._read, new = self._read, len(self.ids), ""
            self.text = self._settled + new
        stopped = False
        for stop in self.stops:
            # Search only where a new match can be: the settled text's tail plus everything after it.
            pos = self.text.find(stop, max(0, settled - len(stop) + 1))
            if pos != -1:
                self.text, stopped = self.text[:pos], True
        return stopped

    def sendable(self) -> str:
        """Returns the new text safe to stream, marked as sent: all that is left once the choice finished, else holding
        back an unfinished UTF-8 character or a possible stop-string prefix (the next token settles them)."""
        text = self.text
        end = len(text)
        if self.finish_reason is None:
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
            hold = max((len(s) - 1 for s in self.stops), default=0)
            end = max(self.sent, end - hold)
            if self.tools is not None:  # a tool call's text is never streamed as content
                end = max(self.sent, min(end, self.tools.hold_back(text)))
        new = text[self.sent:end]
        self.sent = end
        return new


    def settle_tools(self) -> None:
        """Once finished: the tool calls in the text become `tool_calls` (the text keeps the content before them)
        and the finish reason "tool_calls"."""
        if self.tools is None or self.finish_reason is None:
            return
        content, calls = self.tools.parse(self.text, self.tool_params)
        if calls:  # streaming held the calls back: what was sent is a prefix of the content
            self.text, self.tool_calls, self.finish_reason = content, calls, "tool_calls"


def finish_reason(reason: str | None) -> str | None:
    """The OpenAI finish reason of an engine one (an abort after a stop string is a "stop")."""
    return "stop" if reason == ABORT else reason


def sse(model) -> str:
    """One server-sent event carrying a response model as JSON."""
    return "data: " + model.model_dump_json() + "\n\n"


def chunk(rid: str, model_name: str, c: Choice, detok: Detokenizer, chat: bool):
    """Returns the next streaming chunk of a choice (`ChatCompletionChunk` or `CompletionResponse`), or None while
    there is nothing to send yet.

    Args:
        rid, model_name: the response's `id` and `model`.
        c: the choice; its new text and logprobs are marked as sent.
        detok: the request's detokenizer.
        chat: a chat completion chunk (else a completion).
    """
    text = c.sendable()
    new_lp = c.logprobs[c.sent_logprobs:]
    if not text and c.finish_reason is None:
        return None  # held back; logprobs go out with the text they belong to
    c.sent_logprobs = len(c.logprobs)
    if chat:
        calls = [P.ToolCallDelta(index=i, id=t.id, type="function", function=P.FunctionCallDelta(
            name=t.name, arguments=t.arguments)) for i, t in enumerate(c.tool_calls)] or None
        return P.ChatCompletionChunk(id=rid, model=model_name, choices=[P.ChatChunkChoice(
            index=c.index, delta=P.ChatDelta(content=text or None, tool_calls=calls),
            logprobs=chat_logprobs(new_lp, detok), finish_reason=finish_reason(c.finish_reason))])
    return P.CompletionResponse(id=rid, model=model_name, choices=[P.CompletionChoice(
        index=c.index, text=text, logprobs=completion_logprobs(new_lp, detok),
        finish_reason=finish_reason(c.finish_reason))])


def final_response(rid: str, model_name: str, choices: list[Choice], usage: P.Usage, detok: Detokenizer, chat: bool):
    """Returns the whole (non-streamed) `ChatCompletionResponse` or `CompletionResponse` once every choice finished.

    Args:
        rid, model_name: the response's `id` and `model`.
        choices: the request's choices, in index order.
        usage: the token counts.
        detok: the request's detokenizer.
        chat: a chat completion (else a completion).
    """
    if chat:
        out = [P.ChatChoice(index=c.index, message=P.ChatResponseMessage(
            content=(c.text.strip() or None) if c.tool_calls else c.text,
            tool_calls=[P.ToolCall(id=t.id, function=P.FunctionCall(name=t.name, arguments=t.arguments))
                        for t in c.tool_calls] or None),
            logprobs=chat_logprobs(c.logprobs, detok), finish_reason=finish_reason(c.finish_reason)) for c in choices]
        return P.ChatCompletionResponse(id=rid, model=model_name, choices=out, usage=usage)
    out = [P.CompletionChoice(index=c.index, text=c.text, finish_reason=finish_reason(c.finish_reason),
                              logprobs=completion_logprobs(c.logprobs, detok)) for c in choices]
    return P.CompletionResponse(id=rid, model=model_name, choices=out, usage=usage)


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
