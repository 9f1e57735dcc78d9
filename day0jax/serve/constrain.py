"""Constrain: what a request asks of its output beyond sampling, as the engine applies it: the grammar of its
response_format, guided_json, guided_regex, guided_choice or forced tool call, and its logit biases.

For a reasoning model the grammar holds the answer only: the reasoning runs free up to its end marker, and the
request's grammar starts there (or at once, where the prompt already closed the reasoning: thinking switched off).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from day0jax.engine.grammar import Grammar, GrammarError, unsupported_schema_keywords
from day0jax.serve import protocol as P
from day0jax.serve.errors import APIError
from day0jax.serve.reasoning import Reasoning
from day0jax.serve.state import ServerState
from day0jax.serve.validate import OfferedTools

GRAMMAR_SECONDS = 10.0  # a response_format, guided_* or forced tool call that takes longer to compile is refused


@dataclass(frozen=True)
class Constraints:
    """The output constraints of a request, as `SamplingParams` takes them.

    Attributes:
        grammar: the grammar the output must follow (None: free text).
        logit_bias: (token id, bias) pairs.
    """

    grammar: Grammar | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()


async def constraints(state: ServerState, body, tools: OfferedTools | None = None,
                      reasoning: Reasoning | None = None) -> Constraints:
    """The constraints of a validated chat or completion request (`guidance`, `logit_bias`).

    Raises:
        APIError: 400 as `guidance` does.
    """
    return Constraints(await guidance(state, body, tools, reasoning), logit_bias(body.logit_bias))


async def guidance(state: ServerState, body, tools: OfferedTools | None = None,
                   reasoning: Reasoning | None = None) -> Grammar | None:
    """The grammar the request's one grammar field asks for (`grammar_fields`; None: free text): a tool_choice
    "required" or naming a function asks for a call in the template's syntax whose arguments validate. With
    `reasoning` (`render.reasoning`), the grammar applies to the answer after the reasoning. Compiled off the event
    loop (cached by source; a first compile of a large schema can take a while).

    Raises:
        APIError: 400 for a grammar that is invalid or unsupported (naming the keyword and where it is), that takes
            longer than GRAMMAR_SECONDS to compile, or a checkpoint that cannot do structured output.
    """
    asked = body.grammar_fields()
    if not asked:
        return None
    field = asked[0]

    def compile_it():
        grammar = _answer(state, body, tools, field)
        if reasoning is None:
            return grammar
        outer = reasoning.grammar(_special_ids(state, reasoning.syntax.specials), tool_call=field == "tool_choice")
        return grammar if outer is None else state.model.grammars.around(outer, grammar, field)

    try:
        return await asyncio.wait_for(asyncio.to_thread(compile_it), GRAMMAR_SECONDS)
    except GrammarError as e:
        raise APIError(400, str(e), param=e.param or field) from None
    except asyncio.TimeoutError:
        raise APIError(400, f"the {field} took longer than {GRAMMAR_SECONDS:g} s to compile; simplify it",
                       param=field) from None


def _answer(state: ServerState, body, tools: OfferedTools | None, field: str) -> Grammar:
    """The grammar `field` asks for.

    Raises:
        GrammarError: as the compiler does.
    """
    grammars = state.model.grammars
    fmt = body.response_format
    if field == "response_format":
        if fmt.type == "json_object":
            return grammars.json_object()
        return grammars.json_schema(fmt.json_schema.schema_, "response_format.json_schema.schema")
    if field == "guided_json":
        return grammars.json_schema(body.guided_json, "guided_json")
    if field == "guided_regex":
        return grammars.regex(body.guided_regex)
    if field == "guided_choice":
        return grammars.choice(body.guided_choice)
    return grammars.lark(_tool_call_grammar(state, body, tools), "tool_choice")


def _special_ids(state: ServerState, strings) -> dict[str, int]:
    """The token id of each of `strings` that the tokenizer holds as one token."""
    ids = {t: state.tokenizer.token_id(t) for t in strings}
    return {t: i for t, i in ids.items() if i is not None}


def _tool_call_grammar(state: ServerState, body: P.ChatCompletionRequest, tools: OfferedTools) -> str:
    """The Lark grammar of a forced call (of the named function, or any) in the template's syntax.

    Raises:
        GrammarError: a function's parameters use what the grammar cannot enforce (naming the tool).
    """
    for i, tool in enumerate(tools.specs):
        bad = unsupported_schema_keywords(tool["function"].get("parameters") or {})
        if bad:
            raise GrammarError(f"the parameters of {tool['function']['name']!r} use what structured output does "
                               f"not support: {', '.join(bad)}", f"tools[{i}].function.parameters")
    choice = body.tool_choice
    only = choice.function.name if isinstance(choice, P.NamedToolChoice) else None
    return tools.syntax.grammar(tools.specs, only, _special_ids(state, tools.syntax.specials), body.parallel_tool_calls)


def logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias (token ids as strings, checked by validate) as (id, value) pairs; the engine checks
    ranges and vocabulary."""
    return tuple((int(key), float(value)) for key, value in (bias or {}).items())
