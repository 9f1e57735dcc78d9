"""Tool calling: which tool-call syntax a chat template teaches its model, parsing that syntax out of the output, and
the grammar that forces a call (tool_choice "required" or a named function) with arguments that validate.

The syntaxes of the supported families' templates:
- "hermes": `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, once per call (Qwen 2.5/3, SmolLM3,
  Hermes, and templates written after them);
- "llama3_json": one JSON object `{"name": ..., "parameters": {...}}` as the whole answer, optionally after
  `<|python_tag|>` (Llama 3.1-3.3);
- "mistral": `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}` (Mistral's v3 templates);
- "deepseek_v3", "deepseek_v31", "kimi_k2": sections of special tokens around each call's name and JSON arguments.
A template that mentions tools in another syntax is refused by name rather than served with calls left in the text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from day0jax.engine.grammar import JSON_FORMAT, GrammarError

_DECODER = json.JSONDecoder()
_SPECIAL = re.compile(r"<｜[^｜]*｜>|<\|[^|]*\|>")  # DeepSeek's <｜...｜> and the <|...|> of most others


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

    @property
    def specials(self) -> tuple[str, ...]:
        """The syntax's fixed strings that a tokenizer may hold as special tokens (a grammar must match those as
        the token, not as text)."""
        return (self.marker,) if self.marker else ()

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
        marker = _lark_text(self.marker, special_ids)
        if self.name == "hermes":
            return (f'start: call{"+" if parallel else ""}\ncall: {marker} "\\n" body "\\n</tool_call>" "\\n"?\n'
                    f'body: %json {body}\n')
        if self.name == "mistral":
            more = '(", " body)*' if parallel else ""
            return f'start: {marker} "[" body {more} "]"\nbody: %json {body}\n'
        return f"start: %json {body}\n"


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

    def parse(self, text: str, known: set[str]) -> tuple[str, list[ToolCall]]:
        start = text.find(self.marker)
        if start < 0:
            return text, []
        section = text[start + len(self.marker):]
        if self.section_end in section:
            section = section[:section.index(self.section_end)]
        calls, covered = [], 0
        for m in self._pattern().finditer(section):
            if section[covered:m.start()].strip() or m.group("name") not in known:
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
        for k, t in enumerate(t for t in tools if only is None or t["function"]["name"] == only):
            fn = t["function"]
            body = json.dumps({**(fn.get("parameters") or {"type": "object"}), "x-guidance": JSON_FORMAT})
            items = [_lark_text(p, special_ids) for p in (self.begin, self.before) if p] + [json.dumps(fn["name"])]
            items += [_lark_text(self.after, special_ids)] if self.after else []
            rules.append(f"call{k}: {' '.join(items)} args{k} {_lark_text(self.end, special_ids)}\n"
                         f"args{k}: %json {body}")
            names.append(f"call{k}")
        more = f" ({json.dumps(self.separator)} call)*" if parallel and self.separator else " call*" if parallel \
            else ""
        return (f"start: {_lark_text(self.marker, special_ids)} call{more} {_lark_text(self.section_end, special_ids)}"
                f"\ncall: {' | '.join(names)}\n"
                + "\n".join(rules) + "\n")


SYNTAXES = {
    "hermes": ToolSyntax("hermes", "<tool_call>", "arguments"),
    "mistral": ToolSyntax("mistral", "[TOOL_CALLS]", "arguments"),
    "llama3_json": ToolSyntax("llama3_json", "", "parameters"),
    # <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>
    "deepseek_v3": SectionSyntax("deepseek_v3", "<｜tool▁calls▁begin｜>", "arguments", "<｜tool▁calls▁end｜>",
                                 "<｜tool▁call▁begin｜>", "function<｜tool▁sep｜>", "\n```json\n",
                                 "\n```<｜tool▁call▁end｜>", "\n"),
    # <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>
    "deepseek_v31": SectionSyntax("deepseek_v31", "<｜tool▁calls▁begin｜>", "arguments", "<｜tool▁calls▁end｜>",
                                  "<｜tool▁call▁begin｜>", "", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"),
    # <|tool_call_begin|>functions.NAME:i<|tool_call_argument_begin|>ARGS<|tool_call_end|>
    "kimi_k2": SectionSyntax("kimi_k2", "<|tool_calls_section_begin|>", "arguments", "<|tool_calls_section_end|>",
                             "<|tool_call_begin|>", "functions.", ":{i}<|tool_call_argument_begin|>",
                             "<|tool_call_end|>"),
}


# Tool-call syntaxes of released templates that are recognized but not parsed yet, by a mark in the template
# (checked first: GLM's also contains "<tool_call>", with arguments as tag pairs instead of JSON).
UNPARSED = {"<arg_key>": "GLM's <tool_call> with <arg_key>/<arg_value> pairs",
            "｜DSML｜": "DeepSeek V3.2's DSML <｜DSML｜invoke> calls",
            "<|tool_call_start|>": "LFM2's pythonic <|tool_call_start|>[f(x=1)] calls"}
PARSED = "Hermes <tool_call> JSON, Llama 3 JSON, Mistral [TOOL_CALLS], DeepSeek V3/V3.1 and Kimi K2 sections"


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
                               f"yet (it parses {PARSED})", "tools")
    if "tool▁calls▁begin" in template:  # V3 wraps the arguments in a json code block, V3.1 writes them bare
        return SYNTAXES["deepseek_v3" if "```json" in template else "deepseek_v31"]
    if "<|tool_calls_section_begin|>" in template:
        return SYNTAXES["kimi_k2"]
    if "<tool_call>" in template:
        return SYNTAXES["hermes"]
    if "[TOOL_CALLS]" in template:
        return SYNTAXES["mistral"]
    if "<|python_tag|>" in template or "ipython" in template:
        return SYNTAXES["llama3_json"]
    raise GrammarError(f"this model's chat template calls tools in a syntax day0jax does not parse (it parses "
                       f"{PARSED})", "tools")


def _lark_text(part: str, special_ids: dict[str, int]) -> str:
    """`part` as Lark items: its special tokens that the tokenizer holds (`special_ids`) as those tokens
    (`<[id]>`), "{i}" as a call index of up to three digits (bounded: a model must not write digits forever), the
    rest as text."""
    items = []
    for piece in re.split(r"(\{i\}|" + _SPECIAL.pattern + ")", part):
        if piece == "{i}":
            items.append("/[0-9]{1,3}/")
        elif piece in special_ids:
            items.append(f"<[{special_ids[piece]}]>")
        elif piece:
            items.append(json.dumps(piece))
    return " ".join(items)


def _json_start(text: str) -> int:
    stripped = text.lstrip()
    if stripped.startswith("<|python_tag|>"):
        stripped = stripped[len("<|python_tag|>"):].lstrip()
    return len(text) - len(stripped) if stripped.startswith("{") else -1
