"""Tool calls written as a Python list of calls with keyword arguments, `[get_weather(city="Oslo"), f(x=1)]`,
between `<|tool_call_start|>` and `<|tool_call_end|>` (LFM2).

Values are read as Python literals (JSON's true/false/null too); a forced call writes them as JSON, which Python
reads the same.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass

from day0jax.serve.tools.base import ToolCall, ToolSyntax, Tools, arguments, functions, json_value, lark_text, \
    sequence

_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


@dataclass(frozen=True)
class PythonicSyntax(ToolSyntax):
    end: str = ""

    @property
    def specials(self) -> tuple[str, ...]:
        return (self.marker, self.end)

    def parse(self, text: str, tools: Tools) -> tuple[str, list[ToolCall]]:
        start = text.find(self.marker)
        if start < 0:
            return text, []
        body = text[start + len(self.marker):]
        if self.end in body:
            body = body[:body.index(self.end)]
        try:
            tree = ast.parse(body.strip(), mode="eval").body
            nodes = tree.elts if isinstance(tree, ast.List) else [tree]
            calls = [_call(node, tools) for node in nodes]
        except (SyntaxError, ValueError):
            return text, []
        return (text[:start], calls) if calls else (text, [])

    def grammar(self, tools: list[dict], only: str | None, special_ids: dict[str, int], parallel: bool = True) -> str:
        rules = []
        for k, fn in enumerate(functions(tools, only)):
            props, required = arguments(fn)
            items = [f"{json.dumps(key + '=')} {json_value(prop)}" for key, prop in props.items()]
            args = sequence(items, required, ", ")
            rules.append(f"call{k}: {json.dumps(fn['name'] + '(')} {args} \")\"")
        names = " | ".join(f"call{k}" for k in range(len(rules)))
        more = ' (", " call)*' if parallel else ""
        return (f'start: {lark_text(self.marker, special_ids)} "[" call{more} "]" {lark_text(self.end, special_ids)}\n'
                f"call: {names}\n" + "\n".join(rules) + "\n")


def _call(node, tools: Tools) -> ToolCall:
    if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
        raise ValueError("not a call with keyword arguments")
    name = ast.unparse(node.func)
    if name not in tools or any(kw.arg is None for kw in node.keywords):
        raise ValueError(f"unknown function {name!r}")
    return ToolCall.new(name, {kw.arg: _literal(kw.value) for kw in node.keywords})


def _literal(node):
    """A Python or JSON literal; anything else (names, calls, expressions) is not an argument value."""
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(k) if k is not None else None for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("dict keys must be strings")
        return {k: _literal(v) for k, v in zip(keys, node.values)}
    value = ast.literal_eval(node)
    if not isinstance(value, (str, int, float, bool)) and value is not None:
        raise ValueError("not a JSON value")
    return value


SYNTAXES = {"lfm2": PythonicSyntax("lfm2", "<|tool_call_start|>", "<|tool_call_end|>")}
