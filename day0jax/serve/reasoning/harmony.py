"""gpt-oss's harmony format: the output is a sequence of messages, each a header and a body,
`<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...` (the prompt ends with
`<|start|>assistant`, and the last message ends with the stop token `<|return|>` or `<|call|>`).

The analysis channel and commentary without a recipient are reasoning, the final channel is the answer, and a
commentary message to `functions.NAME` is a tool call whose body is its JSON arguments: it joins the answer's text as
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS`, where the harmony tool syntax
(`tools/harmony.py`) reads it. A message's kind is known once its header is complete; text that is not harmony at
all (no header) is the answer as it is, and a harmony output without a final channel has an empty answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from day0jax.serve.reasoning.base import EITHER, ReasoningSyntax, Split, Splitter, partial, text_rules, until
from day0jax.serve.tools.base import lark_text

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
CALL, RETURN, CONSTRAIN = "<|call|>", "<|return|>", "<|constrain|>"
SPECIALS = (START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN)
_ENDS = (END, CALL, RETURN, START)  # what ends a message's body (a new <|start|> without <|end|> too)
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_HEADS = (START, CHANNEL, "assistant", "to=")  # how a message may begin
REASONING_CHANNELS = ("analysis", "commentary")


@dataclass(frozen=True)
class Message:
    """One harmony message of an output.

    Attributes:
        start: where the message begins in the text (its <|start|> or its header).
        channel: its channel ("" without one).
        recipient: its recipient (`functions.NAME` for a tool call), or None.
        body: its body so far (all of it once `closed`).
        closed: a terminator ended it.
        terminator: the terminator that ended it ("" while open).
        end: where the message ends (after its terminator, or the end of the text).
    """

    start: int
    channel: str
    recipient: str | None
    body: str
    closed: bool
    terminator: str
    end: int

    @property
    def is_call(self) -> bool:
        return bool(self.recipient and self.recipient.startswith("functions."))

    @property
    def is_reasoning(self) -> bool:
        return self.channel in REASONING_CHANNELS and not self.recipient


def messages(text: str, final: bool) -> tuple[list[Message], int, bool]:
    """The messages of an output's text whose headers are complete, where the rest begins, and whether the rest is
    plain text (not harmony: no header) rather than a header not complete yet (never, when `final`)."""
    out, pos = [], 0
    while pos < len(text):
        at = pos
        if text.startswith(START, at):
            at += len(START)
        head = text[at:at + 64].lstrip()
        if not any(head.startswith(h) or (not final and h.startswith(head)) for h in _HEADS):
            return out, pos, True  # not a header
        body_at = text.find(MESSAGE, at)
        if body_at < 0:
            return out, pos, final  # the header is not complete
        header = text[at:body_at]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        body_at += len(MESSAGE)
        stops = [(i, t) for t in _ENDS if (i := text.find(t, body_at)) >= 0]
        if stops:
            i, terminator = min(stops)
            closed, body, end = True, text[body_at:i], i + (0 if terminator == START else len(terminator))
        else:
            closed, terminator, end = False, "", len(text)
            body = text[body_at:]
            if not final:
                body = body[:len(body) - max(partial(body, t) for t in _ENDS)]
        out.append(Message(pos, channel.group(1) if channel else "", recipient.group(1) if recipient else None, body,
                           closed, terminator if terminator != START else "", end))
        pos = end
    return out, pos, False


def call_text(m: Message) -> str:
    """A tool-call message as the answer's text holds it (the form the harmony tool syntax reads and forces)."""
    return (f"{CHANNEL}commentary to={m.recipient} {CONSTRAIN}json{MESSAGE}{m.body}"
            + (CALL if m.terminator == CALL else ""))


@dataclass(frozen=True)
class HarmonySyntax(ReasoningSyntax):
    @property
    def specials(self) -> tuple[str, ...]:
        return SPECIALS

    def start(self, prompt_tail: str) -> str:
        return EITHER

    def splitter(self, start: str) -> Splitter:
        return _HarmonySplitter()

    def grammar(self, start: str, special_ids: dict[str, int], tool_call: bool) -> str | None:
        rules = []
        body = until(END, special_ids, "r_body", rules)
        channel, message = lark_text(CHANNEL, special_ids), lark_text(MESSAGE, special_ids)
        answer = "@answer" if tool_call else f'{channel} "final" {message} @answer'
        return (f"start: r_message* {answer}\n"
                f'r_message: {channel} ("analysis" | "commentary") {message} {body} {lark_text(START, special_ids)} '
                f'"assistant"\n' + text_rules(rules))


class _HarmonySplitter(Splitter):
    def __init__(self):
        self._done: tuple[int, list[Message]] = (0, [])  # closed messages, and where they end

    def split(self, text: str, final: bool) -> Split:
        # Closed messages never change: parse only from the end of the last one (unless the text was cut before it).
        offset, closed = self._done
        if offset > len(text):
            offset, closed = 0, []
        found, rest, plain = messages(text[offset:], final)
        found = [Message(m.start + offset, m.channel, m.recipient, m.body, m.closed, m.terminator, m.end + offset)
                 for m in found]
        settled = [m for m in found if m.closed]
        if settled and all(m.closed for m in found[:len(settled)]):
            self._done = (settled[-1].end, closed + settled)
        every = closed + found
        reasoning = "\n\n".join(m.body for m in every if m.is_reasoning and m.body)
        answer = "\n\n".join(m.body for m in every if not m.is_reasoning and not m.is_call and m.body)
        if plain:
            answer += text[offset + rest:]  # not harmony: the text as it is
        answer += "".join(call_text(m) for m in every if m.is_call)
        spans = tuple((m.start, m.end) for m in every if m.is_reasoning)
        return Split(reasoning, answer, spans)
