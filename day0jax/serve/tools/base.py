"""What every tool-call syntax shares: the parsed call, the syntax's interface (parse a finished output, hold back
what may become a call while streaming, the grammar that forces a call), and the pieces grammars are built from.

A grammar here is Lark text in llguidance's dialect: `%json {schema}` for a JSON value, `<[id]>` for a special
token, `/regex/` lexemes whose regexes may use `&` (and) and `~` (not).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Mapping

from day0jax.engine.grammar import JSON_FORMAT, GrammarError

Tools = Mapping[str, dict]  # function name -> its JSON-Schema parameters, as the request offered them
# Regex characters that stand for something in a Lark `/.../` lexeme (Rust regex syntax, plus the delimiter).
_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


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
    """One tool-call syntax; `marker` opens the calls in the output text (text before it is the answer's content)."""

    name: str
    marker: str

    @property
    def specials(self) -> tuple[str, ...]:
        """The syntax's fixed strings that a tokenizer may hold as special tokens (a grammar must match those as
        the token, not as text)."""
        return (self.marker,) if self.marker else ()

    def parse(self, text: str, tools: Tools) -> tuple[str, list[ToolCall]]:
        """The content before the calls (unstripped) and the calls, from a finished output; no calls when the text
        holds none in this syntax, or one of them is malformed or names a function not in `tools` (then it all
        stays content)."""
        raise NotImplementedError

    def grammar(self, tools: list[dict], only: str | None, special_ids: dict[str, int], parallel: bool = True) -> str:
        """A Lark grammar for one or more calls (one unless `parallel`) in this syntax, of `only` or any of `tools`
        (OpenAI tool objects), each call's arguments validating against its function's parameters; the syntax's
        special strings that the tokenizer holds as tokens (`special_ids`) are matched as those tokens.

        Raises:
            GrammarError: (param "tools") a parameter schema this syntax cannot force.
        """
        raise NotImplementedError

    def hold_back(self, text: str) -> int:
        """Where streaming must stop sending content: at the marker once it appears, or at the start of what could
        still become it (the next tokens settle it)."""
        at = text.find(self.marker)
        if at >= 0:
            return at
        for k in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if self.marker.startswith(text[-k:]):
                return len(text) - k
        return len(text)


def functions(tools: list[dict], only: str | None) -> list[dict]:
    """The `function` objects a forced call may take: `only`, or all."""
    return [t["function"] for t in tools if only is None or t["function"]["name"] == only]


def parameters(fn: dict) -> dict:
    return fn.get("parameters") or {"type": "object"}


def arguments(fn: dict) -> tuple[dict, list[bool]]:
    """A function's parameters as properties in their declared order, and whether each is required."""
    schema = parameters(fn)
    props = schema.get("properties") or {}
    return props, [key in (schema.get("required") or []) for key in props]


def json_value(schema: dict | bool) -> str:
    """A JSON value validating against `schema`, laid out as models write JSON."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    return f"%json {json.dumps({**schema, 'x-guidance': JSON_FORMAT})}"


def lark_text(part: str, special_ids: dict[str, int]) -> str:
    """`part` as Lark items: its special tokens that the tokenizer holds (`special_ids`) as those tokens
    (`<[id]>`), "{i}" as a call index of up to three digits (bounded: a model must not write digits forever), the
    rest as text."""
    if not part:
        return ""
    specials = sorted(special_ids, key=len, reverse=True)
    pattern = "|".join([re.escape("{i}")] + [re.escape(s) for s in specials])
    items = []
    for piece in re.split(f"({pattern})", part):
        if piece == "{i}":
            items.append("/[0-9]{1,3}/")
        elif piece in special_ids:
            items.append(f"<[{special_ids[piece]}]>")
        elif piece:
            items.append(json.dumps(piece))
    return " ".join(items)


def regex_literal(text: str) -> str:
    """`text` matched literally inside a Lark `/.../` regex."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in _REGEX_META else c for c in text)


def raw_string(schema: dict, close: str, where: str, terminal: str, rules: list[str],
               close_token: str | None = None) -> str:
    """Lark items for a string written bare (not JSON-quoted) and the text `close` that ends it: the string validates
    against `schema` (enum, const, pattern, minLength, maxLength), never contains `close`, and does not start or end
    with whitespace (parsers strip it). String and `close` are one terminal (named `terminal`, its definition added to
    `rules`): as two lexemes, the string's lexeme would swallow the close text, lexemes being greedy. When `close` is
    a special token (`close_token`, its Lark item) the string cannot run into it.

    Raises:
        GrammarError: (param "tools") a string keyword a bare string cannot be held to (format).
    """
    end = close_token or json.dumps(close)
    if "const" in schema:
        return f"{json.dumps(str(schema['const']))} {end}"
    if "enum" in schema:
        return "(" + " | ".join(json.dumps(str(v)) for v in schema["enum"]) + f") {end}"
    if "format" in schema:
        raise GrammarError(f"{where}: string format {schema['format']!r} cannot be forced in this model's tool-call "
                           f"syntax, which writes strings bare", "tools")
    if "pattern" in schema:
        body = schema["pattern"].removeprefix("^").removesuffix("$").replace("/", "\\/")
    else:
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        body = "(?s:.{%d,%s})" % (low, "" if high is None else high)
    value = f"/{body}/ & ~/(?s:\\s.*)/ & ~/(?s:.*\\s)/"
    if close_token:
        rules.append(f"{terminal}: {value}")
        return f"{terminal} {close_token}"
    rules.append(f"{terminal}: ({value} & ~/(?s:.*{regex_literal(close)}.*)/) {json.dumps(close)}")
    return terminal


def sequence(items: list[str], required: list[bool], separator: str) -> str:
    """Lark for `items` in order, the optional ones (`required` False) left out or not, `separator` between those
    present (no separator before the first)."""
    sep = f"{json.dumps(separator)} " if separator else ""

    def tail(k: int) -> str:  # items k.. after at least one item was written
        return " ".join(f"{sep}{items[j]}" if required[j] else f"({sep}{items[j]})?" for j in range(k, len(items)))

    if any(required):
        first = required.index(True)
        # An optional item before the first required one is followed by a separator when present.
        lead = "".join(f"({items[j]} {sep.strip()})? " if sep else f"{items[j]}? " for j in range(first))
        return f"{lead}{items[first]} {tail(first + 1)}".strip()
    options = [f"{items[k]} {tail(k + 1)}".strip() for k in range(len(items))]
    return f"({' | '.join(options)})?" if options else ""


def schema_types(schema) -> tuple[str, ...]:
    """The JSON types a schema admits, in the order it names them (its `type`, then its anyOf/oneOf members')."""
    if not isinstance(schema, dict):
        return ()
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else list(declared or [])
    for key in ("anyOf", "oneOf"):
        for member in schema.get(key) or []:
            types.extend(schema_types(member))
    if "enum" in schema and not types:
        types.extend(_type_of(v) for v in schema["enum"])
    if "const" in schema and not types:
        types.append(_type_of(schema["const"]))
    return tuple(dict.fromkeys(types))


def is_string(schema) -> bool:
    """Whether a value of `schema` can only be a string (such values are written bare in XML-like syntaxes)."""
    return schema_types(schema) == ("string",)


def coerce(raw: str, schema) -> object:
    """A value written bare (`raw`) read as the first type `schema` admits that it parses as; the text itself when
    it parses as none, or when the schema admits strings first or names no type."""
    for kind in schema_types(schema):
        if kind == "string":
            return raw
        try:
            value = json.loads(raw)
        except ValueError:
            continue
        if _type_of(value) == kind or (kind == "number" and _type_of(value) == "integer") or (
                kind == "integer" and isinstance(value, float) and value.is_integer()):
            return int(value) if kind == "integer" else value
    return raw


def _type_of(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if value is None:
        return "null"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "string")
