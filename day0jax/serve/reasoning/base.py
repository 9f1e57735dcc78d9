"""What every reasoning syntax shares: where the output starts (inside the reasoning, after it, or either), the split
of an output's text into its reasoning and its answer, and the grammar that lets the reasoning run free and holds
the answer to a request's grammar.

A grammar here is Lark text in llguidance's dialect in which `@answer` stands for the request's own grammar (the
JSON schema, regex, choice or tool call it asks for), compiled as a second grammar beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from day0jax.serve.tools.base import lark_text

# Where the output starts, read from the end of the rendered prompt.
IN_REASONING = "reasoning"  # the template opened the reasoning (the prompt ends with the open marker)
IN_ANSWER = "answer"  # the template closed it, or switched thinking off: the output is the answer
EITHER = "either"  # the model may open reasoning first, or answer at once
# Whitespace between the end of the reasoning and a constrained answer (bounded: a model must not pad forever).
WS_RULE = "R_WS: /[ \\t\\r\\n]{1,4}/"
FREE_RULE = "R_FREE: /(?s:.*)/"


@dataclass(frozen=True)
class Split:
    """An output's text split in two.

    Attributes:
        reasoning: the reasoning's text (markup left out).
        answer: the rest: the text the answer's parsers (tool calls) read.
        spans: where the reasoning lies in the output's text, markup included, as (start, end) offsets (its tokens
            are the usage's reasoning tokens).
    """

    reasoning: str
    answer: str
    spans: tuple[tuple[int, int], ...] = ()


class Splitter:
    """One output's split, asked again as its text grows (a splitter may keep where it searched)."""

    def split(self, text: str, final: bool) -> Split:
        """The split of `text`; unless `final`, only what later text cannot change (a marker's beginning, or
        whitespace that may turn out to end the reasoning, is held back)."""
        raise NotImplementedError


@dataclass(frozen=True)
class ReasoningSyntax:
    """One reasoning syntax."""

    name: str

    @property
    def specials(self) -> tuple[str, ...]:
        """The syntax's fixed strings that a tokenizer may hold as (special) tokens: kept when decoding, matched as
        those tokens by grammars."""
        raise NotImplementedError

    def start(self, prompt_tail: str) -> str:
        """Where an output starts (IN_REASONING, IN_ANSWER or EITHER), from the end of its prompt's text (special
        tokens written out)."""
        raise NotImplementedError

    def splitter(self, start: str) -> Splitter:
        """A splitter for one output starting at `start`."""
        raise NotImplementedError

    def grammar(self, start: str, special_ids: dict[str, int], tool_call: bool) -> str | None:
        """The Lark grammar of an output starting at `start` whose reasoning runs free and whose answer is `@answer`
        (a call in the template's tool syntax when `tool_call`); None when the output is the answer from its first
        token (the request's grammar applies as it is). The syntax's special strings that the tokenizer holds as
        tokens (`special_ids`) are matched as those tokens."""
        raise NotImplementedError


@dataclass(frozen=True)
class Reasoning:
    """The reasoning of one request's outputs: the server's syntax and where its prompt leaves the output.

    Attributes:
        syntax: the reasoning syntax.
        start: IN_REASONING, IN_ANSWER or EITHER.
    """

    syntax: ReasoningSyntax
    start: str

    def splitter(self) -> Splitter:
        return self.syntax.splitter(self.start)

    def grammar(self, special_ids: dict[str, int], tool_call: bool = False) -> str | None:
        return self.syntax.grammar(self.start, special_ids, tool_call)


def partial(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` without being all of it (what the next text may
    complete into the marker)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def until(marker: str, special_ids: dict[str, int], rule: str, rules: list[str]) -> str:
    """Lark items for free text up to and including `marker`, the first time it appears. A marker that begins with a
    special token ends the text at that token (text never holds one); other markers end it with a lazy lexeme, which
    stops at the marker's first occurrence. Rules the items need are added to `rules` (`rule` names the lazy one).
    """
    items = lark_text(marker, special_ids)
    if items.startswith("<["):
        rules.append(FREE_RULE)
        return f"R_FREE {items}"
    rules.append(f"{rule}[lazy]: R_TEXT {items}")
    rules.append("R_TEXT: /(?s:.*)/")
    return rule


def text_rules(rules: list[str]) -> str:
    """The rules, each once, in order, as Lark lines."""
    return "".join(f"{r}\n" for r in dict.fromkeys(rules))
