"""What a request asks of the output beyond sampling: a grammar (response_format, vLLM's guided_* fields, a forced
tool call), logit biases, and the tools and tool history a chat template renders."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from day0jax.engine.grammar import GrammarError, unsupported_schema_keywords
from day0jax.serve import protocol as P
from day0jax.serve import tools as tools_lib
from day0jax.serve.errors import APIError
from day0jax.serve.state import ServerState

GRAMMAR_SECONDS = 10.0  # a response_format, guided_* or forced tool call that takes longer to compile is refused


def logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias (token ids as strings) as (id, value) pairs; the engine checks ranges and vocabulary.

    Raises:
        APIError: 400 for a key that is not an integer.
    """
    out = []
    for key, value in (bias or {}).items():
        try:
            out.append((int(key), float(value)))
        except ValueError:
            raise APIError(400, f"logit_bias keys are token ids, got {key!r}", param="logit_bias") from None
    return tuple(out)


def template_message(m: P.ChatMessage, images: dict[int, Any] | None = None) -> dict:
    """A chat message as chat templates take it (as transformers passes them): an assistant's tool-call arguments
    as objects, not JSON text.

    Args:
        m: the request's message.
        images: the decoded images of the message's image parts, by index in its content. When given, the content
            stays a list of parts (text parts, and `{"type": "image", "image": ...}` parts, which
            `models.vision_language.chat_images` turns into what templates expect); else it is the text alone.
    Returns:
        The message as a dict.
    """
    content: Any = m.text()
    if images:
        content = [{"type": "image", "image": images[j]} if isinstance(part, P.ImagePart) else
                   {"type": "text", "text": part.text} for j, part in enumerate(m.content)]
    out = {"role": m.role, "content": content}
    if m.name:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def offered_tools(state: ServerState, body) -> tuple[list[dict] | None, tools_lib.ToolSyntax | None]:
    """The request's tools as the chat template takes them and the template's tool-call syntax, or (None, None)
    when it offers none or says tool_choice "none".

    Raises:
        APIError: 400 for tool_choice without tools, duplicate function names, a named tool_choice that is not
            among the tools, or a template without tool support or with a syntax not parsed here.
    """
    choice = body.tool_choice
    if choice is not None and not body.tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if not body.tools or choice == "none":
        return None, None
    names = [t.function.name for t in body.tools]
    if len(set(names)) != len(names):
        raise APIError(400, "function names in tools must be unique", param="tools")
    if isinstance(choice, P.NamedToolChoice) and choice.function.name not in names:
        raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools "
                       f"({', '.join(names)})", param="tool_choice")
    try:
        syntax = tools_lib.syntax_of(state.tokenizer.chat_template)
    except GrammarError as e:
        raise APIError(400, str(e), param=e.param) from None
    return [t.model_dump(exclude_none=True) for t in body.tools], syntax


async def guidance(state: ServerState, body, tools: list[dict] | None = None,
                   syntax: tools_lib.ToolSyntax | None = None):
    """The grammar a request's response_format, guided_json, guided_regex, guided_choice or tool_choice ("required"
    or a named function: a call in the template's syntax whose arguments validate) asks for (None: free text),
    compiled off the event loop (cached by source; a first compile of a large schema can take a while).

    Raises:
        APIError: 400 for more than one of them, one that is invalid or unsupported (naming the keyword), one
            that takes longer than GRAMMAR_SECONDS to compile, or a checkpoint that cannot do structured output.
    """
    fmt = body.response_format
    choice = getattr(body, "tool_choice", None)
    forced = tools is not None and (choice == "required" or isinstance(choice, P.NamedToolChoice))
    asked = [name for name, on in (("response_format", fmt is not None and fmt.type != "text"),
                                   ("guided_json", body.guided_json is not None),
                                   ("guided_regex", body.guided_regex is not None),
                                   ("guided_choice", body.guided_choice is not None),
                                   ("tool_choice", forced)) if on]
    if len(asked) > 1:
        raise APIError(400, f"at most one of response_format, guided_json, guided_regex, guided_choice and a forced "
                       f"tool_choice; got {', '.join(asked)}", param=asked[1])
    if not asked:
        return None
    if fmt is not None and fmt.type == "json_schema" and (fmt.json_schema is None or fmt.json_schema.schema_ is None):
        raise APIError(400, "response_format of type json_schema needs json_schema.schema",
                       param="response_format.json_schema")

    def compile_it():
        grammars = state.model.grammars
        if asked[0] == "response_format":
            if fmt.type == "json_object":
                return grammars.json_object()
            return grammars.json_schema(fmt.json_schema.schema_, "response_format.json_schema.schema")
        if asked[0] == "guided_json":
            return grammars.json_schema(body.guided_json, "guided_json")
        if asked[0] == "guided_regex":
            return grammars.regex(body.guided_regex)
        if asked[0] == "guided_choice":
            return grammars.choice(body.guided_choice)
        for i, tool in enumerate(tools):
            bad = unsupported_schema_keywords(tool["function"].get("parameters") or {})
            if bad:
                raise GrammarError(f"the parameters of {tool['function']['name']!r} use what structured output does "
                                   f"not support: {', '.join(bad)}", f"tools[{i}].function.parameters")
        only = choice.function.name if isinstance(choice, P.NamedToolChoice) else None
        special = {t: state.tokenizer.token_id(t) for t in syntax.specials}
        return grammars.lark(syntax.grammar(tools, only, {k: v for k, v in special.items() if v is not None},
                                            body.parallel_tool_calls), "tool_choice")

    try:
        return await asyncio.wait_for(asyncio.to_thread(compile_it), GRAMMAR_SECONDS)
    except GrammarError as e:
        raise APIError(400, str(e), param=e.param or asked[0]) from None
    except asyncio.TimeoutError:
        raise APIError(400, f"the {asked[0]} took longer than {GRAMMAR_SECONDS:g} s to compile; simplify it",
                       param=asked[0]) from None
