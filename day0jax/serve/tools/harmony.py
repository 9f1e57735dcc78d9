"""gpt-oss's harmony tool calls: a commentary message to `functions.NAME` whose body is the JSON arguments,
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` (the recipient may also stand
before the channel, `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>`, as the template
writes earlier calls). `<|call|>` is a stop token, so one output holds one call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from day0jax.serve.tools.base import ToolCall, ToolSyntax, Tools, functions, json_value, lark_text, parameters

_DECODER = json.JSONDecoder()
_HEADER = re.compile(r"(?:<\|start\|>\s*(?:assistant)?)?\s*(?:to=functions\.(?P<before>[^\s<]+)\s*)?<\|channel\|>\s*"
                     r"commentary\s*(?:to=functions\.(?P<after>[^\s<]+))?\s*(?:<\|constrain\|>\s*)?(?:json)?\s*"
                     r"<\|message\|>")
_ENDS = ("<|call|>", "<|end|>", "<|start|>")


@dataclass(frozen=True)
class HarmonySyntax(ToolSyntax):
    @property
    def specials(self) -> tuple[str, ...]:
        return ("<|channel|>", "<|constrain|>", "<|message|>", "<|call|>", "<|start|>", "<|end|>")

    def parse(self, text: str, tools: Tools) -> tuple[str, list[ToolCall]]:
        first = next((m for m in _HEADER.finditer(text) if m.group("before") or m.group("after")), None)
        if first is None:
            return text, []
        calls, pos = [], first.start()
        while pos < len(text):
            m = _HEADER.match(text, pos)
            name = m and (m.group("before") or m.group("after"))
            if not name or name not in tools:
                return text, []
            try:
                args, end = _DECODER.raw_decode(text, m.end())
            except ValueError:
                return text, []
            if not isinstance(args, dict):
                return text, []
            calls.append(ToolCall.new(name, args))
            rest = text[end:].lstrip()
            for t in _ENDS[:2]:
                rest = rest.removeprefix(t)
            pos = len(text) - len(rest.lstrip())
        return text[:first.start()], calls

    def grammar(self, tools: list[dict], only: str | None, special_ids: dict[str, int], parallel: bool = True) -> str:
        # One call: <|call|> ends the output.
        rules = []
        for k, fn in enumerate(functions(tools, only)):
            head = lark_text(f"<|channel|>commentary to=functions.{fn['name']} <|constrain|>json<|message|>",
                             special_ids)
            rules.append(f"call{k}: {head} args{k} {lark_text('<|call|>', special_ids)}\n"
                         f"args{k}: {json_value(parameters(fn))}")
        names = " | ".join(f"call{k}" for k in range(len(rules)))
        return f"start: {names}\n" + "\n".join(rules) + "\n"


# Held back from <|channel|> on: in the answer a reasoning parser leaves, only a call's header holds one.
SYNTAXES = {"harmony": HarmonySyntax("harmony", "<|channel|>")}
