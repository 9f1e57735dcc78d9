"""Validate: every check of a parsed request against the server's state and limits and the model, before any work.

A request that fails a check gets the typed error at once (400 naming the field; 503 while not ready, 429 when the
queue is full), and nothing reaches the tokenizer or the engine. What only doing the work can tell is refused by the
step that does it, with the same kind of error: an image that does not decode (render), a template that fails
(render), a schema or regex that does not compile (constrain), a prompt longer than the context or a token id
outside the vocabulary (the engine, at submit).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from day0jax.engine.async_engine import AsyncEngine
from day0jax.engine.grammar import GrammarError, malformed_schema_keywords
from day0jax.serve import protocol as P
from day0jax.serve import tools as tools_lib
from day0jax.serve.errors import APIError
from day0jax.serve.state import ServerState, note_dead_engine

MAX_PROMPTS = 32  # prompts in one /v1/completions request
# Template variables the server sets itself; chat_template_kwargs may not name them.
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt")
MAX_STOPS = 16
# A prompt rendering from more than this many characters per context token (--max-prompt-chars 0) is refused before
# it is tokenized: English averages about 4 characters a token and the longest tokens of common vocabularies (runs
# of spaces or punctuation in code) a few dozen, so such a prompt cannot fit the context, and tokenizing megabytes
# only to learn that would hold a worker thread for seconds.
CHARS_PER_TOKEN = 64
# Objects and arrays nested anywhere in a body (a message's parts count 3, a JSON schema's property 2): far beyond
# any real schema or template variable, far below what the recursive steps after validation can take.
MAX_JSON_DEPTH = 64


@dataclass(frozen=True)
class OfferedTools:
    """The tools a chat request offers, checked against the chat template.

    Attributes:
        specs: the OpenAI tool objects, as the chat template takes them.
        syntax: the template's tool-call syntax (how calls are parsed out of the output and forced).
    """

    specs: list[dict]
    syntax: tools_lib.ToolSyntax

    @property
    def parameters(self) -> dict[str, dict]:
        """Each function's JSON-Schema parameters, by name."""
        return {t["function"]["name"]: t["function"].get("parameters") or {} for t in self.specs}


@dataclass(frozen=True)
class Checked:
    """What validation established, for the later steps.

    Attributes:
        engine: the ready engine, whose queue has room for the request.
        stops: the stop strings.
        tools: the offered tools (None: none offered, or tool_choice "none").
    """

    engine: AsyncEngine
    stops: list[str]
    tools: OfferedTools | None = None


def chat(state: ServerState, body: P.ChatCompletionRequest) -> Checked:
    """Checks a chat request.

    Raises:
        APIError: 503 while not ready, 429 when the queue is full, else 400 naming the field: another model, an
            unimplemented OpenAI field, text that is not valid Unicode or too long, more sequences than the queue
            holds, tools the template cannot call, top_logprobs without logprobs, images the model or the server
            does not take, more than one grammar, a logit_bias key that is not a token id, bad stop strings, template
            variables the server sets itself, a reasoning_effort the template does not read.
    """
    engine = _admitted(state, body)
    _check_tool_call_arguments(body.messages)
    _check_rendered_chars(state, body.messages, body.tools, body.template_kwargs())
    _check_sequences(engine, body.n)
    _check_template_variables(state, body)
    tools = _offered_tools(state, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    _check_response_size(state, body, 1, "max_completion_tokens" if body.max_completion_tokens else "max_tokens")
    _check_images(state, body)
    _check_constraints(body)
    return Checked(engine, _stops(body.stop), tools)


def responses(state: ServerState, body: P.ResponsesRequest) -> None:
    """Checks what a Responses API request asks beyond the chat request it amounts to (which `chat` then checks).

    Raises:
        APIError: 400 for an unimplemented OpenAI field (naming it), text that is not valid Unicode, or a request for
            stored responses (`previous_response_id`, `store: true`): nothing is stored.
    """
    _check_fields(body)
    if body.previous_response_id is not None:
        raise APIError(400, "previous_response_id is not supported: this server stores no responses; send the whole "
                       "conversation in input (earlier output items included)", param="previous_response_id",
                       code="unsupported_parameter")
    if body.store:
        raise APIError(400, "store: this server stores no responses; send store: false (or leave it out)",
                       param="store", code="unsupported_parameter")


def tokenize(state: ServerState, body: P.TokenizeRequest) -> None:
    """Checks a /tokenize request.

    Raises:
        APIError: 503 while not ready, else 400 for another model, text that is not valid Unicode or too long, both
            or neither of prompt and messages, continue_final_message, template variables the server sets.
    """
    _served(state, body)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send either prompt or messages", param="prompt" if body.prompt is not None else
                       "messages")
    if body.continue_final_message:
        raise APIError(400, "continue_final_message is not supported", param="continue_final_message",
                       code="unsupported_parameter")
    if body.prompt is not None:
        _check_chars(state, len(body.prompt), "prompt")
    else:
        _check_tool_call_arguments(body.messages)
        _check_rendered_chars(state, body.messages, body.tools, body.chat_template_kwargs or {})
        _check_images(state, body.chat())
    _check_template_variables(state, body)


def detokenize(state: ServerState, body: P.DetokenizeRequest) -> None:
    """Checks a /detokenize request.

    Raises:
        APIError: 503 while not ready, else 400 for another model or a token id outside the vocabulary.
    """
    _served(state, body)
    size = state.tokenizer.vocab_size
    for i, token in enumerate(body.tokens):
        if not 0 <= token < size:
            raise APIError(400, f"token id {token} is outside the vocabulary (0 to {size - 1})",
                           param=f"tokens[{i}]")


def completion(state: ServerState, body: P.CompletionRequest) -> Checked:
    """Checks a completion request.

    Raises:
        APIError: as `chat` does, and 400 for more than MAX_PROMPTS prompts.
    """
    engine = _admitted(state, body)
    prompts = body.prompts()
    if len(prompts) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt")
    for p in prompts:
        if isinstance(p, str):
            _check_chars(state, len(p), "prompt")
    _check_sequences(engine, len(prompts) * body.n)
    _check_response_size(state, body, len(prompts), "max_tokens")
    _check_constraints(body)
    return Checked(engine, _stops(body.stop))


def ready(state: ServerState) -> AsyncEngine:
    """The engine, once the server is ready.

    Raises:
        APIError: 503 with Retry-After while loading, warming up, draining or failed.
    """
    note_dead_engine(state)
    if state.status != "ready" or state.engine is None:
        what = {"draining": "the server is shutting down"}.get(state.status, f"the model is {state.status}")
        raise APIError(503, f"{what}; retry later", "service_unavailable", headers={"Retry-After": "5"})
    return state.engine


def _admitted(state: ServerState, body) -> AsyncEngine:
    """The engine, for a generation request it may take: the fields are served, the server is ready, its queue has
    room and `body.model` is the served model (or left out)."""
    _check_fields(body)
    engine = ready(state)
    e = engine.engine
    if e.num_waiting >= e.config.max_waiting:
        raise APIError(429, f"the server is at capacity ({e.num_waiting} requests queued); retry later",
                       "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    _check_model(state, body)
    return engine


def _served(state: ServerState, body) -> AsyncEngine:
    """The engine, for a request whose fields are served, once the server is ready and `body.model` (when given) is
    the served model."""
    _check_fields(body)
    engine = ready(state)
    _check_model(state, body)
    return engine


def _check_model(state: ServerState, body) -> None:
    if body.model is not None and body.model != state.model_name and body.model not in state.adapters:
        served = ", ".join(map(repr, [state.model_name, *state.adapters]))
        raise APIError(400, f"the model {body.model!r} does not exist; this server serves {served}",
                       param="model", code="model_not_found")


def model_of(state: ServerState, body) -> str:
    """The model a request runs, as its responses name it: the LoRA adapter its `model` names, else the base."""
    return adapter_of(state, body) or state.model_name


def adapter_of(state: ServerState, body) -> str | None:
    """The LoRA adapter a request's `model` names (None: the base model)."""
    return body.model if body.model in state.adapters else None


def _check_fields(body) -> None:
    """Refuses what the server cannot serve as asked: an OpenAI field it does not implement, unless it carries its
    neutral value (`protocol.UNIMPLEMENTED`), and text that is not valid Unicode (JSON lets a string hold a lone
    surrogate, which no tokenizer can encode)."""
    for name, neutral in P.UNIMPLEMENTED.get(type(body).__name__, {}).items():
        value = (body.model_extra or {}).get(name)
        if value is not None and not neutral(value, body):
            raise APIError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")
    _check_text(body, "")


def _check_text(value, path: str) -> None:
    """Walks a parsed body (without recursion: its depth is what is checked) for strings that are not valid Unicode
    and for objects and arrays nested more than MAX_JSON_DEPTH deep, which recursive steps further on (the chat
    template, the schema checks and compiler, JSON encoding) would run out of stack on: a 500, not a 400."""
    stack = [(value, path, 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            field = re.split(r"[.\[]", path, maxsplit=1)[0]
            raise APIError(400, f"{field} nests objects and arrays more than {MAX_JSON_DEPTH} levels deep",
                           param=field)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(400, f"{path} is not valid Unicode text (it holds a lone surrogate)",
                               param=path) from None
        elif isinstance(value, P.BaseModel):
            for name, info in reversed(type(value).model_fields.items()):
                name_in_body = info.alias or name
                stack.append((getattr(value, name), f"{path}.{name_in_body}" if path else name_in_body, depth + 1))
        elif isinstance(value, (list, tuple)):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in reversed(list(enumerate(value))))
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                stack.append((item, f"{path}.{key}", depth + 1))
                stack.append((key, path, depth + 1))


def _check_tool_call_arguments(messages: list[P.ChatMessage]) -> None:
    """Refuses earlier tool calls whose arguments (JSON text the template is given as objects) nest deeper than
    MAX_JSON_DEPTH; arguments that are not JSON are passed on as text."""
    for i, m in enumerate(messages):
        for j, call in enumerate(m.tool_calls or []):
            try:
                too_deep = _depth(json.loads(call.function.arguments)) > MAX_JSON_DEPTH
            except ValueError:
                continue
            except RecursionError:
                too_deep = True
            if too_deep:
                param = f"messages[{i}].tool_calls[{j}].function.arguments"
                raise APIError(400, f"{param} nests objects and arrays more than {MAX_JSON_DEPTH} levels deep",
                               param=param)


def _depth(value) -> int:
    """How deep objects and arrays nest in a parsed JSON value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        value, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(value, dict):
            stack.extend((item, depth + 1) for item in value.values())
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)
    return deepest


def _check_sequences(engine: AsyncEngine, sequences: int) -> None:
    """Refuses a request of more sequences (prompts x n) than the waiting queue can ever hold: a 429 would tell its
    client to retry something that can never be served."""
    limit = engine.engine.config.max_waiting
    if sequences > limit:
        raise APIError(400, f"the request asks for {sequences} sequences (prompts x n); this server queues at most "
                       f"{limit}", param="n")


def prompt_char_limit(state: ServerState) -> int:
    """The most characters a prompt may render from: --max-prompt-chars, or CHARS_PER_TOKEN per context token."""
    return state.max_prompt_chars or state.max_model_len * CHARS_PER_TOKEN


def _check_chars(state: ServerState, n: int, param: str) -> None:
    """Refuses a text far too long to be worth tokenizing (`prompt_char_limit`)."""
    limit = prompt_char_limit(state)
    if n > limit:
        raise APIError(400, f"the {param} has {n} characters, more than this server accepts ({limit}; "
                       f"the model's context is {state.max_model_len} tokens)", param=param,
                       code="context_length_exceeded")


def _check_response_size(state: ServerState, body, prompts: int, max_tokens_param: str) -> None:
    """Refuses a whole response with logprobs that could carry more than `state.max_response_entries` entries:
    prompts x n x max_tokens (what the context leaves without one) x (top_logprobs + 1), known before it runs, so
    that no response grows past what the server can hold and encode. Streamed responses are sent as they are made,
    and a whole one without logprobs holds a few bytes per token (its count bounded by n and the context): neither
    is bounded here, so a long-context model keeps its n without a max_tokens."""
    top = body.logprob_count()
    if body.stream or top is None:
        return
    max_tokens = body.max_new_tokens() or state.max_model_len
    entries = prompts * body.n * max_tokens * (top + 1)
    if entries > state.max_response_entries:
        what = " x ".join([f"{prompts} prompts"] * (prompts > 1) + [f"n {body.n}", f"{max_tokens_param} {max_tokens}"]
                          + [f"(top logprobs {top} + 1)"])
        raise APIError(400, f"the response could carry {entries} tokens and logprobs ({what}), more than this server "
                       f"returns ({state.max_response_entries}, --max-response-entries); lower n, "
                       f"{max_tokens_param} or the logprobs asked for", param=max_tokens_param,
                       code="response_too_large")


def rendered_chars(messages: list[P.ChatMessage], tools, template_kwargs: dict) -> dict[str, int]:
    """The characters a chat prompt renders from, by field: the messages (text, names, reasoning, earlier tool calls'
    ids, names and arguments), the offered tools as the template writes them (JSON) and the template variables."""
    text = 0
    for m in messages:
        text += len(m.text()) + len(m.name or "") + len(m.tool_call_id or "") + len(m.reasoning or "") + \
            len(m.reasoning_content or "")
        for call in m.tool_calls or []:
            text += len(call.id or "") + len(call.function.name) + len(call.function.arguments or "")
    specs = [t.model_dump(exclude_none=True) for t in tools or []]
    return {"messages": text, "tools": len(json.dumps(specs, default=str)) if specs else 0,
            "chat_template_kwargs": len(json.dumps(template_kwargs, default=str)) if template_kwargs else 0}


def _check_rendered_chars(state: ServerState, messages, tools, template_kwargs: dict) -> None:
    """Refuses a chat whose prompt renders from more than `prompt_char_limit` characters, everything counted
    (`rendered_chars`), before anything is rendered or tokenized; the error names the largest part."""
    parts = rendered_chars(messages, tools, template_kwargs)
    total, limit = sum(parts.values()), prompt_char_limit(state)
    if total > limit:
        param = max(parts, key=parts.get)
        detail = ", ".join(f"{k} {v}" for k, v in parts.items() if v)
        raise APIError(400, f"the prompt would render from {total} characters ({detail}), more than this server "
                       f"accepts ({limit}, --max-prompt-chars; the model's context is {state.max_model_len} tokens)",
                       param=param, code="context_length_exceeded")


def _check_template_variables(state: ServerState, body) -> None:
    """Refuses chat_template_kwargs naming a variable the server sets (messages, tools, add_generation_prompt), and
    a reasoning_effort for a template that never reads it (it would be silently ignored)."""
    for key in body.chat_template_kwargs or {}:
        if key in RESERVED_TEMPLATE_VARIABLES:
            raise APIError(400, f"chat_template_kwargs may not set {key!r}: the request's own fields do",
                           param=f"chat_template_kwargs.{key}")
    if getattr(body, "reasoning_effort", None) is not None and "reasoning_effort" not in (
            state.tokenizer.chat_template or ""):
        raise APIError(400, "reasoning_effort is not supported by this model: its chat template does not read it "
                       "(where the template reads a thinking switch, such as enable_thinking, set it with "
                       "chat_template_kwargs)", param="reasoning_effort", code="unsupported_parameter")


def _offered_tools(state: ServerState, body: P.ChatCompletionRequest) -> OfferedTools | None:
    """The request's tools and the template's tool-call syntax, or None when it offers none or says tool_choice
    "none". Refuses tool_choice without tools, duplicate function names, a named tool_choice that is not among
    the tools, parameters that are not a valid JSON schema (the template shows them to the model even when no
    grammar enforces them), and a template without tool support or with a syntax not parsed here."""
    choice = body.tool_choice
    if choice is not None and not body.tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if not body.tools or choice == "none":
        return None
    names = [t.function.name for t in body.tools]
    if len(set(names)) != len(names):
        raise APIError(400, "function names in tools must be unique", param="tools")
    if isinstance(choice, P.NamedToolChoice) and choice.function.name not in names:
        raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools "
                       f"({', '.join(names)})", param="tool_choice")
    for i, tool in enumerate(body.tools):
        malformed = malformed_schema_keywords(tool.function.parameters or {})
        if malformed:
            raise APIError(400, f"the parameters of {tool.function.name!r} are not a valid JSON schema: "
                           f"{'; '.join(malformed)}", param=f"tools[{i}].function.parameters")
    try:
        syntax = tools_lib.syntax_of(state.tokenizer.chat_template)
    except GrammarError as e:
        raise APIError(400, str(e), param=e.param) from None
    return OfferedTools([t.model_dump(exclude_none=True) for t in body.tools], syntax)


def _check_images(state: ServerState, body: P.ChatCompletionRequest) -> None:
    """Refuses an image in a message that is not the user's (naming the part), images for a model that takes none,
    and more than `state.max_images_per_request`; each image's bytes and pixels are checked as render reads it."""
    parts = body.image_parts()
    if not parts:
        return
    for i, j, _ in parts:
        if body.messages[i].role != "user":
            raise APIError(400, f"images are accepted in user messages only, not in a {body.messages[i].role} "
                           "message", param=f"messages[{i}].content[{j}]")
    if getattr(state.model, "vision", None) is None:
        raise APIError(400, f"this model takes no images ({state.model_name} is a text-only model); send text only",
                       param="messages")
    if len(parts) > state.max_images_per_request:
        raise APIError(400, f"the messages hold {len(parts)} images; this server takes at most "
                       f"{state.max_images_per_request} per request (--max-images-per-request)", param="messages")


def _check_constraints(body) -> None:
    """Refuses more than one field asking for a grammar, a grammar with tools the model may or may not call
    (tool_choice auto), stream_options without stream, a json_schema response_format without its schema, and
    logit_bias keys that are not token ids (their range is the engine's to check)."""
    asked = body.grammar_fields()
    if len(asked) > 1:
        raise APIError(400, f"at most one of response_format, guided_json, guided_regex, guided_choice and a forced "
                       f"tool_choice; got {', '.join(asked)}", param=asked[1])
    if asked and getattr(body, "tools", None) and body.tool_choice in (None, "auto"):
        # The grammar would hold the whole output, leaving no room for the tool calls the tools offer.
        raise APIError(400, f"{asked[0]} cannot be combined with tools under tool_choice auto: the output would have "
                       f"to follow {asked[0]}, so no tool could be called; send tool_choice \"none\" (answer in "
                       f"{asked[0]}) or \"required\" (call a tool), or leave {asked[0]} out", param=asked[0])
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is read only when stream is true", param="stream_options")
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_schema" and (fmt.json_schema is None or fmt.json_schema.schema_ is None):
        raise APIError(400, "response_format of type json_schema needs json_schema.schema",
                       param="response_format.json_schema")
    for key in body.logit_bias or {}:
        try:
            int(key)
        except ValueError:
            raise APIError(400, f"logit_bias keys are token ids, got {key!r}", param="logit_bias") from None


def _stops(stop) -> list[str]:
    """The request's `stop` as a list, refusing an empty stop string and more than MAX_STOPS."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise APIError(400, "stop strings must not be empty", param="stop")
    if len(stops) > MAX_STOPS:
        raise APIError(400, f"at most {MAX_STOPS} stop strings", param="stop")
    return stops
