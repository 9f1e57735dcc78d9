"""Gemma 4's tool calls: `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:42,flags:[true,false]}<tool_call|>` per call,
concatenated. Keys are bare, strings sit between `<|"|>` tokens, other values are written as in JSON; objects and
arrays nest in the same notation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from day0jax.engine.grammar import GrammarError
from day0jax.serve.tools.base import ToolCall, ToolSyntax, Tools, functions, json_value, lark_text, parameters, \
    raw_string, sequence

_SCALAR = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?|true|false|null")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class Gemma4Syntax(ToolSyntax):
    end: str = "<tool_call|>"
    quote: str = '<|"|>'

    @property
    def specials(self) -> tuple[str, ...]:
        return (self.marker, self.end, self.quote)

    def parse(self, text: str, tools: Tools) -> tuple[str, list[ToolCall]]:
        start = text.find(self.marker)
        if start < 0:
            return text, []
        calls, pos = [], start
        while text.startswith(self.marker, pos):
            m = re.compile(r"call:(?P<name>[^{\s]+)\{").match(text, pos + len(self.marker))
            if m is None or m.group("name") not in tools:
                return text, []
            try:
                args, pos = self._object(text, m.end() - 1)
            except ValueError:
                return text, []
            if not text.startswith(self.end, pos):
                return text, []
            calls.append(ToolCall.new(m.group("name"), args))
            pos += len(self.end)
            pos += len(text[pos:]) - len(text[pos:].lstrip())
        return text[:start], calls

    def _value(self, text: str, pos: int):
        if text.startswith(self.quote, pos):
            end = text.find(self.quote, pos + len(self.quote))
            if end < 0:
                raise ValueError("unterminated string")
            return text[pos + len(self.quote):end], end + len(self.quote)
        if text.startswith("{", pos):
            return self._object(text, pos)
        if text.startswith("[", pos):
            out, pos = [], pos + 1
            while not text.startswith("]", pos):
                value, pos = self._value(text, pos)
                out.append(value)
                if text.startswith(",", pos):
                    pos += 1
                elif not text.startswith("]", pos):
                    raise ValueError("expected , or ]")
            return out, pos + 1
        m = _SCALAR.match(text, pos)
        if m is None:
            raise ValueError(f"no value at {pos}")
        return json.loads(m.group()), m.end()

    def _object(self, text: str, pos: int) -> tuple[dict, int]:
        out, pos = {}, pos + 1  # past "{"
        while not text.startswith("}", pos):
            key = _KEY.match(text, pos)
            if key is None or not text.startswith(":", key.end()):
                raise ValueError("expected key:")
            out[key.group()], pos = self._value(text, key.end() + 1)
            if text.startswith(",", pos):
                pos += 1
            elif not text.startswith("}", pos):
                raise ValueError("expected , or }")
        return out, pos + 1

    def grammar(self, tools: list[dict], only: str | None, special_ids: dict[str, int], parallel: bool = True) -> str:
        rules: list[str] = []
        quote = lark_text(self.quote, special_ids)
        token = quote if self.quote in special_ids else None

        def value(schema, where: str) -> str:
            if schema is True or schema == {}:
                raise GrammarError(f"{where}: a parameter without a type cannot be forced in Gemma 4's call syntax",
                                   "tools")
            for key in ("anyOf", "oneOf"):
                if key in schema:
                    return "(" + " | ".join(value(s, f"{where}.{key}[{i}]") for i, s in enumerate(schema[key])) + ")"
            if "const" in schema or "enum" in schema:
                options = [schema["const"]] if "const" in schema else schema["enum"]
                return "(" + " | ".join(f"{quote} {json.dumps(v)} {quote}" if isinstance(v, str)
                                        else json.dumps(json.dumps(v)) for v in options) + ")"
            kind = schema.get("type")
            if isinstance(kind, list):
                return "(" + " | ".join(value({**schema, "type": t}, where) for t in kind) + ")"
            if kind == "string":
                return f"{quote} {raw_string(schema, self.quote, where, f'TEXT{len(rules)}', rules, token)}"
            if kind == "object":
                props = schema.get("properties") or {}
                required = set(schema.get("required") or [])
                items = [f'{json.dumps(k + ":")} {value(p, f"{where}.{k}")}' for k, p in props.items()]
                return f'"{{" {sequence(items, [k in required for k in props], ",")} "}}"'
            if kind == "array":
                item = value(schema.get("items", {}), where + "[]")
                name = f"item{len(rules)}"  # named after the item's own rules: nested arrays get their own
                rules.append(f"{name}: {item}")
                low, high = schema.get("minItems", 0), schema.get("maxItems")
                more = f'("," {name}){{{max(low - 1, 0)},{"" if high is None else max(high - 1, 0)}}}'
                body = f"{name} {more}" if high != 0 else ""
                return f'"[" {body if low else f"({body})?" if body else ""} "]"'
            if kind in ("integer", "number", "boolean", "null"):
                return json_value(schema)
            raise GrammarError(f"{where}: type {kind!r} cannot be forced in Gemma 4's call syntax", "tools")

        names = []
        for k, fn in enumerate(functions(tools, only)):
            schema = parameters(fn)
            body = value({**schema, "type": "object"}, fn["name"])
            rules.append(f"call{k}: {lark_text(self.marker, special_ids)} {json.dumps('call:' + fn['name'])} {body} "
                         f"{lark_text(self.end, special_ids)}")
            names.append(f"call{k}")
        return f"start: call{'+' if parallel else ''}\ncall: {' | '.join(names)}\n" + "\n".join(rules) + "\n"


SYNTAXES = {"gemma4": Gemma4Syntax("gemma4", "<|tool_call>")}
