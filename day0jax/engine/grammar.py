"""Constrained decoding: grammars (a JSON schema, any JSON object, a regex, a choice of strings) compiled for a
model's tokenizer, and a matcher per sequence that gives the next token's allowed set as a bitmask.

Built on llguidance (Rust, no torch): it computes a token mask lazily, per step, from the grammar's lexer and parser
instead of precomputing a state x vocabulary index, so a new schema costs milliseconds to compile and a mask tens to
hundreds of microseconds on a 49k vocabulary (`bench/structured.py` measures both, against outlines-core when it is
installed). The mask is one bit per token, `[ceil(V / 32)]` int32 words per row; the sampler unpacks it on the
device. The engine speaks token ids: grammars are compiled here, from the tokenizer, by whoever builds the request
(the server, `Model.generate`), and reach the engine inside `SamplingParams`.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from day0jax.core.errors import GenerationError

# JSON Schema keywords the grammar enforces. Annotations (title, description, examples, ...) are accepted and
# ignored, as every JSON Schema validator ignores them; anything else is refused by name, never silently dropped.
SCHEMA_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "minLength", "maxLength",
    "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "minProperties", "maxProperties", "patternProperties"})
SCHEMA_ANNOTATIONS = frozenset({"title", "description", "examples", "default", "$schema", "$id", "$comment",
                                "deprecated", "readOnly", "writeOnly", "strict", "x-guidance"})
# Keywords whose value is a schema, a list of schemas or a map of schemas (where the checker recurses).
_SUBSCHEMA = ("items", "additionalProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
# Compiled grammars kept, by source, least recently used evicted first, bounded in bytes: a count bound lets a few
# hundred large schemas hold hundreds of MiB. llguidance's tables live in Rust, out of Python's sight, so each one's
# size is estimated from its grammar text: measured, a JSON schema of 100 optional properties (4 KB of text) grows the
# process by about 500 KB, a short regex by about 25 KB.
CACHE_BYTES = 64 << 20
GRAMMAR_BASE_BYTES = 32 << 10  # the tables of even the smallest grammar
GRAMMAR_BYTES_PER_CHAR = 128  # per character of its grammar text (and source)
# What one grammar may hold, checked before anything is built: the compile's work grows with the schema, and with the
# square of an object's optional properties (2000 of them take seconds), so a request cannot buy unbounded work.
MAX_SCHEMA_NODES = 2048  # schemas, properties, enum values and choices in one grammar
MAX_OBJECT_PROPERTIES = 128  # properties of one object
MAX_PATTERN_CHARS = 4096  # one regular expression (guided_regex, a schema's pattern)
MAX_LITERAL_CHARS = 256 * 1024  # the text of a grammar's enum values and choices together
# JSON as models write it ({"a": 1, "b": [2, 3]}), with no other whitespace: a grammar that allowed any whitespace
# lets a small model pad forever with newlines.
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(GenerationError):
    """A grammar that cannot be compiled or is not supported; `param` names the request field it came from."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def unsupported_schema_keywords(schema: Any, path: str = "#") -> list[str]:
    """The JSON Schema keywords in `schema` that the grammar would not enforce, each with where it is (`#/...`).

    A property *named* like a keyword (inside `properties`) is a name, not a keyword, and is not reported.
    """
    out = []
    for sub, where in _schemas(schema, path):
        if not isinstance(sub, dict):
            out.append(f"{where} (a schema must be an object or a boolean, not {type(sub).__name__})")
        else:
            out += [f"{k!r} at {where}" for k in sub if k not in SCHEMA_KEYWORDS and k not in SCHEMA_ANNOTATIONS]
    return out


def malformed_schema_keywords(schema: Any, path: str = "#") -> list[str]:
    """The keywords in `schema` whose value has the wrong type for JSON Schema (`properties` that is not an object,
    `enum` that is not a list, `minLength` that is not a non-negative integer, ...), each with where it is and what
    it must be: the grammar compiler would fail on them deep inside, or read them as something else."""
    out = []
    for sub, where in _schemas(schema, path):
        if not isinstance(sub, dict):
            out.append(f"the schema at {where} must be an object or a boolean, not {type(sub).__name__}")
        else:
            out += [f"{k!r} at {where} must be {_SHAPES[k][1]}" for k, v in sub.items()
                    if k in _SHAPES and not _SHAPES[k][0](v)]
    return out


def schema_size_problem(schema: Any) -> str | None:
    """What makes `schema` larger than one grammar may be (MAX_SCHEMA_NODES, MAX_OBJECT_PROPERTIES, MAX_PATTERN_CHARS,
    MAX_LITERAL_CHARS), with where it is; None when it is within the bounds. Counts without building anything."""
    nodes = literal_chars = 0
    for sub, where in _schemas(schema, "#"):
        nodes += 1
        if not isinstance(sub, dict):
            continue
        properties, enum, pattern = sub.get("properties"), sub.get("enum"), sub.get("pattern")
        if isinstance(properties, dict) and len(properties) > MAX_OBJECT_PROPERTIES:
            return f"the object at {where} has {len(properties)} properties, more than {MAX_OBJECT_PROPERTIES}"
        if isinstance(pattern, str) and len(pattern) > MAX_PATTERN_CHARS:
            return f"the pattern at {where} has {len(pattern)} characters, more than {MAX_PATTERN_CHARS}"
        for value in enum if isinstance(enum, list) else []:
            nodes += 1
            literal_chars += len(value) if isinstance(value, str) else 0
        if nodes > MAX_SCHEMA_NODES:
            return f"the schema holds more than {MAX_SCHEMA_NODES} schemas, properties and enum values"
        if literal_chars > MAX_LITERAL_CHARS:
            return f"the schema's enum values hold more than {MAX_LITERAL_CHARS} characters"
    return None


def _schemas(schema: Any, path: str):
    """`schema` and every schema inside it, each with where it is, in the schema's order and without recursion (a
    deep schema cannot exhaust the stack)."""
    stack = [(schema, path)]
    while stack:
        sub, where = stack.pop()
        if isinstance(sub, bool):
            continue
        yield sub, where
        if not isinstance(sub, dict):
            continue
        found = [(sub[key], f"{where}/{key}") for key in _SUBSCHEMA if isinstance(sub.get(key), (dict, bool))]
        for key in _SUBSCHEMA_LISTS:
            if isinstance(sub.get(key), list):
                found += [(item, f"{where}/{key}/{i}") for i, item in enumerate(sub[key])]
        for key in _SUBSCHEMA_MAPS:
            if isinstance(sub.get(key), dict):
                found += [(item, f"{where}/{key}/{name}") for name, item in sub[key].items()]
        stack.extend(reversed(found))


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
# What each keyword's value must be: a test, and the words for the error.
_SHAPES = {
    "type": (lambda v: v in _TYPES or (isinstance(v, list) and bool(v) and all(t in _TYPES for t in v)),
             f"one of {', '.join(_TYPES)} or a non-empty list of them"),
    "required": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "enum": (lambda v: isinstance(v, list) and bool(v), "a non-empty list"),
    "pattern": (lambda v: isinstance(v, str), "a string (a regular expression)"),
    "format": (lambda v: isinstance(v, str), "a string"),
    "$ref": (lambda v: isinstance(v, str), "a string"),
    "multipleOf": (lambda v: _number(v) and v > 0, "a number above 0"),
    **{k: (lambda v: isinstance(v, (dict, bool)), "a schema (an object or a boolean)") for k in _SUBSCHEMA},
    **{k: (lambda v: isinstance(v, list) and bool(v), "a non-empty list of schemas") for k in _SUBSCHEMA_LISTS},
    **{k: (lambda v: isinstance(v, dict), "an object mapping names to schemas") for k in _SUBSCHEMA_MAPS},
    **{k: (_count, "a non-negative integer") for k in ("minItems", "maxItems", "minLength", "maxLength",
                                                       "minProperties", "maxProperties")},
    **{k: (_number, "a number") for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")},
}


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar for one tokenizer: `matcher()` starts a sequence on it. `kind` and `source` say what it
    was made from (for errors and logs)."""

    kind: str  # "json_schema", "json_object", "regex", "choice" or "lark"
    source: str
    _template: Any = field(repr=False, compare=False)  # an llguidance LLMatcher at the start state
    _words: int = field(repr=False, compare=False)  # int32 words in a mask row
    _definition: str = field(default="", repr=False, compare=False)  # llguidance's grammar text (JSON or Lark)

    @property
    def nbytes(self) -> int:
        """The estimated memory its compiled tables hold (see CACHE_BYTES), a mask row included."""
        text = len(self._definition) + len(self.source)
        return GRAMMAR_BASE_BYTES + GRAMMAR_BYTES_PER_CHAR * text + 4 * self._words

    def matcher(self) -> "Matcher":
        return Matcher(self._template.deep_copy(), self._words)


class Matcher:
    """One sequence's place in its grammar."""

    def __init__(self, llmatcher, words: int):
        self._m, self.words = llmatcher, words

    def fill(self, row: np.ndarray) -> None:
        """Writes the next token's allowed set into `row` ([words] int32, bit t of word t // 32 for token t)."""
        assert row.dtype == np.int32 and row.flags["C_CONTIGUOUS"] and row.size == self.words
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def consume(self, token: int) -> bool:
        """Advances past `token`; False when the grammar does not allow it (the matcher is then in error)."""
        return self._m.consume_token(int(token))

    def rollback(self, n: int) -> None:
        """Undoes the last `n` tokens consumed (speculative drafts scored against the grammar)."""
        if n:
            self._m.rollback(int(n))

    @property
    def done(self) -> bool:
        """Nothing but end-of-sequence can follow (the grammar is complete, or the matcher is in error)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()


class GrammarCompiler:
    """Compiles grammars for one tokenizer and keeps the most recently used by source, within `cache_bytes` of their
    estimated sizes (`Grammar.nbytes`; thread-safe: the server compiles off its event loop).

    Args:
        tokenizer_json: the tokenizer.json text (the `tokenizers` library's serialization).
        vocab_size: the model's vocabulary (its logits' width; ids the tokenizer lacks are never allowed).
        eos_token_ids: the tokens that end a sequence (allowed once the grammar is complete).
        cache_bytes: the bound on the kept grammars' estimated bytes (the server's --grammar-cache-mb); a grammar
            larger than it is compiled and used but not kept.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_bytes: int = CACHE_BYTES):
        import llguidance

        self._ll = llguidance
        eos = [int(t) for t in eos_token_ids]
        if not eos:
            raise GrammarError("structured output needs the model's end-of-sequence token; this checkpoint names none")
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self.cache_bytes = cache_bytes
        self.cached_bytes = 0  # the kept grammars' estimated bytes
        self._lock = threading.Lock()

    def json_schema(self, schema: dict | bool, param: str = "response_format") -> Grammar:
        """Output that validates against `schema` (see SCHEMA_KEYWORDS).

        Raises:
            GrammarError: a keyword outside SCHEMA_KEYWORDS (named with its place), a keyword of the wrong type, a
                schema over the size bounds (`schema_size_problem`), or a schema that does not compile.
        """
        if schema is False:
            raise GrammarError("the JSON schema is `false`, which no output satisfies", param)
        schema = {} if schema is True else schema  # any JSON value
        bad = unsupported_schema_keywords(schema)
        if bad:
            raise GrammarError(f"the JSON schema uses what structured output does not support: {', '.join(bad)}",
                               param)
        malformed = malformed_schema_keywords(schema)
        if malformed:
            raise GrammarError(f"the JSON schema is malformed: {'; '.join(malformed)}", param)
        too_large = schema_size_problem(schema)
        if too_large:
            raise GrammarError(f"the JSON schema is too large for structured output: {too_large}", param)
        text = json.dumps(schema)  # key order kept: properties are generated in the schema's order
        return self._compile("json_schema", text, lambda: self._ll.LLMatcher.grammar_from_json_schema(
            text, defaults=JSON_FORMAT), param)

    def json_object(self, param: str = "response_format") -> Grammar:
        """Any JSON object."""
        return self._compile("json_object", "", lambda: self._ll.LLMatcher.grammar_from_json_schema(
            '{"type": "object"}', defaults=JSON_FORMAT), param)

    def regex(self, pattern: str, param: str = "guided_regex") -> Grammar:
        """Output that matches `pattern` entirely.

        Raises:
            GrammarError: a pattern of more than MAX_PATTERN_CHARS characters, or one that does not compile.
        """
        if len(pattern) > MAX_PATTERN_CHARS:
            raise GrammarError(f"the regular expression has {len(pattern)} characters, more than {MAX_PATTERN_CHARS}",
                               param)
        return self._compile("regex", pattern, lambda: self._ll.LLMatcher.grammar_from_regex(pattern), param)

    def choice(self, options: Sequence[str], param: str = "guided_choice") -> Grammar:
        """Exactly one of `options`.

        Raises:
            GrammarError: no options, an empty one, more than MAX_SCHEMA_NODES or more than MAX_LITERAL_CHARS in all.
        """
        if not options or not all(isinstance(o, str) and o for o in options):
            raise GrammarError("the choices must be a non-empty list of non-empty strings", param)
        if len(options) > MAX_SCHEMA_NODES or sum(map(len, options)) > MAX_LITERAL_CHARS:
            raise GrammarError(f"at most {MAX_SCHEMA_NODES} choices of {MAX_LITERAL_CHARS} characters in all, got "
                               f"{len(options)} of {sum(map(len, options))}", param)
        lark = "start: " + " | ".join(json.dumps(o) for o in options)
        return self._compile("choice", json.dumps(list(options)), lambda: self._ll.LLMatcher.grammar_from_lark(lark),
                             param)

    def lark(self, grammar: str, param: str) -> Grammar:
        """Output in a Lark grammar (llguidance's dialect: `%json {schema}` embeds a JSON schema)."""
        return self._compile("lark", grammar, lambda: self._ll.LLMatcher.grammar_from_lark(grammar), param)

    def around(self, outer: str, inner: Grammar, param: str) -> Grammar:
        """Output in the Lark grammar `outer`, in which `@answer` stands for output in `inner` (a grammar this compiler
        made): free text before a constrained part, for instance. The result keeps `inner`'s kind.

        Raises:
            GrammarError: `outer` is invalid.
        """
        definition = inner._definition
        parts = json.loads(definition)["grammars"] if definition.lstrip().startswith("{") else [
            {"lark_grammar": definition}]
        parts = [dict(parts[0], name="answer"), *parts[1:]]
        text = json.dumps({"grammars": [{"name": "outer", "lark_grammar": outer}, *parts]})
        return self._compile(inner.kind, f"{outer}\n@answer: {inner.source}", lambda: text, param)

    def _compile(self, kind: str, source: str, make, param: str) -> Grammar:
        key = (kind, source)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            text = make()
        except (ValueError, TypeError) as e:
            raise GrammarError(f"invalid {kind.replace('_', ' ')}: {e}", param) from None
        is_error, messages = self._ll.LLMatcher.validate_grammar_with_warnings(text, self.tokenizer)
        if is_error:
            raise GrammarError(f"invalid {kind.replace('_', ' ')}: {messages[0] if messages else 'rejected'}", param)
        template = self._ll.LLMatcher(self.tokenizer, text, log_level=0)
        if template.is_error():
            raise GrammarError(f"invalid {kind.replace('_', ' ')}: {template.get_error()}", param)
        grammar = Grammar(kind, source, template, self.words, text)
        with self._lock:
            if key not in self._cache:  # another thread may have compiled it meanwhile
                self._cache[key] = grammar
                self.cached_bytes += grammar.nbytes
            while self._cache and self.cached_bytes > self.cache_bytes:
                self.cached_bytes -= self._cache.popitem(last=False)[1].nbytes
        return grammar
