"""Tool calling: which tool-call syntax a chat template teaches its model, parsing that syntax out of the output, and
the grammar that forces a call (tool_choice "required" or a named function) with arguments that validate.

Three syntaxes cover the supported families' templates:
- "hermes": `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, once per call (Qwen 2.5/3, SmolLM3,
  Hermes, and templates written after them);
- "llama3_json": one JSON object `{"name": ..., "parameters": {...}}` as the whole answer, optionally after
  `<|python_tag|>` (Llama 3.1-3.3);
- "mistral": `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}` (Mistral's v3 templates).
A template that mentions tools in another syntax is refused by name rather than served with calls left in the text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from day0jax.engine.grammar import JSON_FORMAT, GrammarError

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = ""

    @staticmethod
    def new(name: str, arguments) -> "ToolCall":
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return ToolCall(name, text, f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class ToolSyntax:
    """One tool-call syntax: `marker` opens the calls in the output text (text before it is the answer's content);
    `arguments_key` names the arguments in each call's JSON."""

    name: str
    marker: str
    arguments_key: str

    def parse(self, text: str, known: set[str]) -> tuple[str, list[ToolCall]]:
        """The content before the calls (unstripped) and the calls, from a finished output; no calls when the text
        holds none in this syntax, or one of them is malformed or names a function not in `known` (then it all
        stays content)."""
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
            if not isinstance(obj, dict) or obj.get("name") not in known:
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
        """Where streaming must stop sending content: at the marker once it appears, or at the start of what could
        still become it (the next tokens settle it)."""
        if not self.marker:  # llama3_json: an answer that starts as JSON may be a call
            stripped = text.lstrip()
            return 0 if not stripped or stripped[0] in "{<" else len(text)
        at = text.find(self.marker)
        if at >= 0:
            return at
        for k in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if self.marker.startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def grammar(self, tools: list[dict], only: str | None, special_ids: dict[str, int], parallel: bool = True) -> str:
        """A Lark grammar (llguidance's dialect) for one or more calls (one unless `parallel`) in this syntax, of
        `only` or any of `tools`, each call's arguments validating against its function's parameters; a marker
        that is a special token (`special_ids`) is matched as that token."""
        calls = [t for t in tools if only is None or t["function"]["name"] == only]
        variants = [{"type": "object", "properties": {
            "name": {"const": t["function"]["name"]},
            self.arguments_key: t["function"].get("parameters") or {"type": "object"}},
            "required": ["name", self.arguments_key], "additionalProperties": False} for t in calls]
        # The same JSON layout as response_format's (no free whitespace to pad with), set inside the schema.
        body = json.dumps({**({"anyOf": variants} if len(variants) > 1 else variants[0]), "x-guidance": JSON_FORMAT})
        if self.name == "hermes":
            marker = f"<[{special_ids[self.marker]}]>" if self.marker in special_ids else json.dumps(self.marker)
            return (f'start: call{"+" if parallel else ""}\ncall: {marker} "\\n" body "\\n</tool_call>" "\\n"?\n'
                    f'body: %json {body}\n')
        if self.name == "mistral":
            marker = f"<[{special_ids[self.marker]}]>" if self.marker in special_ids else json.dumps(self.marker)
            more = '(", " body)*' if parallel else ""
            return f'start: {marker} "[" body {more} "]"\nbody: %json {body}\n'
        return f"start: %json {body}\n"


SYNTAXES = {
    "hermes": ToolSyntax("hermes", "<tool_call>", "arguments"),
    "mistral": ToolSyntax("mistral", "[TOOL_CALLS]", "arguments"),
    "llama3_json": ToolSyntax("llama3_json", "", "parameters"),
}


# Tool-call syntaxes of released templates that are recognized but not parsed yet, by a mark in the template
# (checked first: GLM's also contains "<tool_call>", with arguments as tag pairs instead of JSON).
UNPARSED = {"<arg_key>": "GLM's <tool_call> with <arg_key>/<arg_value> pairs",
            "tool▁calls▁begin": "DeepSeek's <｜tool▁calls▁begin｜> sections",
            "<|tool_calls_section_begin|>": "Kimi's <|tool_calls_section_begin|> sections"}


def syntax_of(template: str | None) -> ToolSyntax:
    """The tool-call syntax a chat template teaches.

    Raises:
        GrammarError: (param "tools") no template, a template that never reads `tools`, or a syntax not parsed here.
    """
    if not template or not re.search(r"\btools\b", template):
        raise GrammarError("this model's chat template has no tool support (it never reads `tools`)", "tools")
    for mark, what in UNPARSED.items():
        if mark in template:
            raise GrammarError(f"this model's chat template calls tools with {what}, which day0jax does not parse "
                               "yet (it parses Hermes <tool_call> JSON, Llama 3 JSON and Mistral [TOOL_CALLS])",
                               "tools")
    if "<tool_call>" in template:
        return SYNTAXES["hermes"]
    if "[TOOL_CALLS]" in template:
        return SYNTAXES["mistral"]
    if "<|python_tag|>" in template or "ipython" in template:
        return SYNTAXES["llama3_json"]
    raise GrammarError("this model's chat template calls tools in a syntax day0jax does not parse (it parses "
                       "Hermes <tool_call>, Llama 3 JSON and Mistral [TOOL_CALLS])", "tools")


def _json_start(text: str) -> int:
    stripped = text.lstrip()
    if stripped.startswith("<|python_tag|>"):
        stripped = stripped[len("<|python_tag|>"):].lstrip()
    return len(text) - len(stripped) if stripped.startswith("{") else -1
