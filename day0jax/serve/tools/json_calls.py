"""Tool-call syntaxes whose arguments are one JSON object per call.

- "hermes": `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, once per call (Qwen 2.5/3, SmolLM3,
  Hermes, and templates written after them);
- "llama3_json": one JSON object `{"name": ..., "parameters": {...}}` as the whole answer, optionally after
  `<|python_tag|>` (Llama 3.1-3.3, Llama 4);
- "mistral": `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}` (Mistral's v3 templates);
- "mistral_args": `[TOOL_CALLS]NAME[ARGS]{...}` once per call (Mistral's v11 and later templates);
- "deepseek_v3", "deepseek_v31", "kimi_k2": sections of special tokens around each call's name and JSON arguments.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from day0jax.serve.tools.base import ToolCall, ToolSyntax, Tools, functions, json_value, lark_text, parameters

_DECODER = json.JSONDecoder()
_SPECIAL = re.compile(r"<｜[^｜]*｜>|<\|[^|]*\|>")  # DeepSeek's <｜...｜> and the <|...|> of most others


@dataclass(frozen=True)
class JsonSyntax(ToolSyntax):
    """Each call a JSON object with the function's name and its arguments under `arguments_key`."""

    arguments_key: str = "arguments"
    close: str = ""  # what ends each call (Hermes's </tool_call>, a token in Qwen's tokenizers)

    @property
    def specials(self) -> tuple[str, ...]:
        return tuple(s for s in (self.marker, self.close) if s)

    def parse(self, text: str, tools: Tools) -> tuple[str, list[ToolCall]]:
        start = text.find(self.marker) if self.marker else _json_start(text)
        if start < 0:
            return text, []
        content, rest = text[:start], text[start + len(self.marker):]
        try:
            objects = self._objects(rest)
        except ValueError:
            return text, []
        calls = []
        for obj in objects:
            if not isinstance(obj, dict) or obj.get("name") not in tools:
                return text, []
            args = obj.get(self.arguments_key, obj.get("arguments", obj.get("parameters", {})))
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    return text, []
            if not isinstance(args, dict):
                return text, []
            calls.append(ToolCall.new(obj["name"], args))
        return content, calls

    def _objects(self, rest: str) -> list:
        if self.name == "hermes":
            out = []
            for part in rest.split(self.marker):
                obj, end = _DECODER.raw_decode(part.strip())
                if not part.strip()[end:].strip().startswith("</tool_call>"):
                    raise ValueError("unterminated tool call")
                out.append(obj)
            return out
        value, end = _DECODER.raw_decode(rest.strip())
        if rest.strip()[end:].strip():
            raise ValueError("text after the tool calls")
        if self.name == "mistral":
            if not isinstance(value, list):
                raise ValueError("[TOOL_CALLS] is followed by a list")
            return value
        return [value]

    def hold_back(self, text: str) -> int:
        if not self.marker:  # llama3_json: an answer that starts as JSON may be a call
            stripped = text.lstrip()
            return 0 if not stripped or stripped[0] in "{<" else len(text)
        return super().hold_back(text)

    def grammar(self, tools: list[dict], only: str | None, special_ids: dict[str, int], parallel: bool = True) -> str:
        variants = [{"type": "object", "properties": {
            "name": {"const": fn["name"]}, self.arguments_key: parameters(fn)},
            "required": ["name", self.arguments_key], "additionalProperties": False} for fn in functions(tools, only)]
        body = json_value({"anyOf": variants} if len(variants) > 1 else variants[0])
        marker = lark_text(self.marker, special_ids)
        if self.name == "hermes":
            close = lark_text(self.close, special_ids)
            return (f'start: call{"+" if parallel else ""}\ncall: {marker} "\\n" body "\\n" {close} "\\n"?\n'
                    f'body: {body}\n')
        if self.name == "mistral":
            more = '(", " body)*' if parallel else ""
            return f'start: {marker} "[" body {more} "]"\nbody: {body}\n'
        return f"start: {body}\n"


@dataclass(frozen=True)
class MistralArgsSyntax(ToolSyntax):
    """`[TOOL_CALLS]NAME[ARGS]{...}` per call, as Mistral's v11+ templates write them; a `[CALL_ID]...` between the
    name and `[ARGS]` (v13) is read and dropped."""

    args: str = "[ARGS]"

    @property
    def specials(self) -> tuple[str, ...]:
        return (self.marker, self.args, "[CALL_ID]")

    def parse(self, text: str, tools: Tools) -> tuple[str, list[ToolCall]]:
        start = text.find(self.marker)
        if start < 0:
            return text, []
        calls = []
        for part in text[start + len(self.marker):].split(self.marker):
            name, sep, rest = part.partition(self.args)
            name = name.split("[CALL_ID]")[0].strip()
            try:
                args, end = _DECODER.raw_decode(rest.strip())
            except ValueError:
                return text, []
            if not sep or name not in tools or not isinstance(args, dict) or rest.strip()[end:].strip():
                return text, []
            calls.append(ToolCall.new(name, args))
        return text[:start], calls

    def grammar(self, tools: list[dict], only: str | None, special_ids: dict[str, int], parallel: bool = True) -> str:
        marker, args = lark_text(self.marker, special_ids), lark_text(self.args, special_ids)
        rules = [f"call{k}: {marker} {json.dumps(fn['name'])} {args} {json_value(parameters(fn))}"
                 for k, fn in enumerate(functions(tools, only))]
        names = " | ".join(f"call{k}" for k in range(len(rules)))
        return f"start: call{'+' if parallel else ''}\ncall: {names}\n" + "\n".join(rules) + "\n"


@dataclass(frozen=True)
class SectionSyntax(ToolSyntax):
    """Calls inside a section of special tokens, each call `begin` + `before` + name + `after` + JSON arguments +
    `end` (the arguments alone, not wrapped with the name): DeepSeek V3 and V3.1, Kimi K2.

    `after` may hold "{i}", the call's index in the section (Kimi numbers its calls)."""

    section_end: str = ""
    begin: str = ""
    before: str = ""
    after: str = ""
    end: str = ""
    separator: str = ""

    @property
    def specials(self) -> tuple[str, ...]:
        parts = (self.marker, self.section_end, self.begin, self.before, self.after, self.end)
        return tuple(dict.fromkeys(t for part in parts for t in _SPECIAL.findall(part)))

    def _pattern(self) -> re.Pattern:
        after = re.escape(self.after).replace(re.escape("{i}"), r"\d+")
        return re.compile(re.escape(self.begin) + r"\s*" + re.escape(self.before) + r"(?P<name>[A-Za-z0-9_.-]+)"
                          + after + r"\s*(?P<args>\{.*?\})\s*" + re.escape(self.end), re.S)

    def parse(self, text: str, tools: Tools) -> tuple[str, list[ToolCall]]:
        start = text.find(self.marker)
        if start < 0:
            return text, []
        section = text[start + len(self.marker):]
        if self.section_end in section:
            section = section[:section.index(self.section_end)]
        calls, covered = [], 0
        for m in self._pattern().finditer(section):
            if section[covered:m.start()].strip() or m.group("name") not in tools:
                return text, []
            try:
                args = json.loads(m.group("args"))
            except ValueError:
                return text, []
            if not isinstance(args, dict):
                return text, []
            calls.append(ToolCall.new(m.group("name"), args))
            covered = m.end()
        if not calls or section[covered:].strip():
            return text, []
        return text[:start], calls

    def grammar(self, tools: list[dict], only: str | None, special_ids: dict[str, int], parallel: bool = True) -> str:
        rules, names = [], []
        for k, fn in enumerate(functions(tools, only)):
            items = [lark_text(p, special_ids) for p in (self.begin, self.before) if p] + [json.dumps(fn["name"])]
            items += [lark_text(self.after, special_ids)] if self.after else []
            rules.append(f"call{k}: {' '.join(items)} args{k} {lark_text(self.end, special_ids)}\n"
                         f"args{k}: {json_value(parameters(fn))}")
            names.append(f"call{k}")
        more = f" ({json.dumps(self.separator)} call)*" if parallel and self.separator else " call*" if parallel \
            else ""
        return (f"start: {lark_text(self.marker, special_ids)} call{more} {lark_text(self.section_end, special_ids)}"
                f"\ncall: {' | '.join(names)}\n"
                + "\n".join(rules) + "\n")


def _json_start(text: str) -> int:
    stripped = text.lstrip()
    if stripped.startswith("<|python_tag|>"):
        stripped = stripped[len("<|python_tag|>"):].lstrip()
    return len(text) - len(stripped) if stripped.startswith("{") else -1
