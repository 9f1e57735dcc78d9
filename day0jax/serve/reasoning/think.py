"""Reasoning between an open and a close marker before the answer: `<think>...</think>` (Qwen3, Qwen3.5, DeepSeek-R1,
V3.1 to V3.2, GLM-4.5 and later, Kimi K2 thinking, MiniMax-M2, SmolLM3, EXAONE 4, ERNIE 4.5 thinking, Hunyuan),
`<seed:think>...</seed:think>` (Seed-OSS), `[THINK]...[/THINK]` (Mistral's Magistral), Gemma 4's
`<|channel>thought\\n...<channel|>`.

The open marker is written by the model or already by the template at the end of the prompt (thinking switched on),
and a template that switches thinking off ends the prompt with an empty block (`<think></think>`): where the output
starts is read from the prompt's end. The reasoning and the answer are stripped of the whitespace around them.
Hunyuan wraps the answer in `<answer>...</answer>`, which is left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from day0jax.serve.reasoning.base import (EITHER, IN_ANSWER, IN_REASONING, WS_RULE, ReasoningSyntax, Split, Splitter,
                                          partial, text_rules, until)
from day0jax.serve.tools.base import lark_text


@dataclass(frozen=True)
class ThinkSyntax(ReasoningSyntax):
    """Reasoning between `open` and `close`; the answer optionally between `answer_open` and `answer_close`."""

    open: str = "<think>"
    close: str = "</think>"
    answer_open: str = ""
    answer_close: str = ""

    @property
    def specials(self) -> tuple[str, ...]:
        return tuple(s for s in (self.open, self.close, self.answer_open, self.answer_close) if s)

    def start(self, prompt_tail: str) -> str:
        tail = prompt_tail.rstrip()
        if tail.endswith(self.close):
            return IN_ANSWER
        if tail.endswith(self.open):
            return IN_REASONING
        return EITHER

    def splitter(self, start: str) -> Splitter:
        return _ThinkSplitter(self, start)

    def grammar(self, start: str, special_ids: dict[str, int], tool_call: bool) -> str | None:
        answer = "@answer"
        rules = [WS_RULE]
        if self.answer_open:
            answer = (f"({lark_text(self.answer_open, special_ids)} R_WS?)? @answer "
                      f"(R_WS? {lark_text(self.answer_close, special_ids)})?")
        if start == IN_ANSWER:
            if not self.answer_open:
                return None
            return f"start: {answer}\n" + text_rules(rules)
        reasoning = until(self.close, special_ids, "r_reasoning", rules)
        if start == EITHER:
            reasoning = f"({lark_text(self.open, special_ids)} {reasoning})?"
        return f"start: {reasoning} R_WS? {answer}\n" + text_rules(rules)


class _ThinkSplitter(Splitter):
    def __init__(self, syntax: ThinkSyntax, start: str):
        self.syntax, self.start = syntax, start
        self._searched = 0  # no close marker begins before this offset

    def split(self, text: str, final: bool) -> Split:
        s = self.syntax
        if self.start == IN_ANSWER:
            return Split("", self._answer(text, final))
        begin = 0
        if self.start == EITHER:
            rest = text.lstrip()
            if rest.startswith(s.open):
                begin = len(text) - len(rest) + len(s.open)
            elif not final and s.open.startswith(rest):
                return Split("", "")  # may still become the open marker
            else:
                return Split("", self._answer(text, final))
        at = text.find(s.close, max(begin, min(self._searched, len(text))))
        if at < 0:
            self._searched = max(begin, len(text) - len(s.close) + 1)
            body = text[begin:] if final else text[begin:len(text) - partial(text, s.close)]
            return Split(body.strip(), "", ((0, len(text)),))
        end = at + len(s.close)
        return Split(text[begin:at].strip(), self._answer(text[end:].lstrip(), final), ((0, end),))

    def _answer(self, text: str, final: bool) -> str:
        """The answer's text without its own markers (Hunyuan's `<answer>...</answer>`), if the syntax has any."""
        s = self.syntax
        if not s.answer_open:
            return text
        rest = text.lstrip()
        if rest.startswith(s.answer_open):
            text = rest[len(s.answer_open):].lstrip()
        elif not final and s.answer_open.startswith(rest):
            return ""
        at = text.find(s.answer_close)
        if at >= 0:
            return text[:at].rstrip()
        if final:
            return text.rstrip()
        return text[:len(text) - partial(text, s.answer_close)].rstrip()
