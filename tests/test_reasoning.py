"""Reasoning models: the reasoning syntax read from a chat template, the split of outputs into reasoning and answer
(whole and streamed, with markers split across tokens, cut short or malformed), the thinking switches rendered as
transformers renders them, and the request path with the families' released templates (tests/chat_templates;
gpt-oss's with its rendering of tool parameter types abridged):
reasoning beside the content in chat completions and the Responses API, tool calls and structured output after the
reasoning, the usage's reasoning tokens.

Without a server, the engine is faked: it answers with the tokens of a given reply, checked against the request's
grammar when it has one. A server with a tiny model whose weights script its greedy output (`<think>Okay</think>Paris`
after Qwen3's prompt) runs the official `openai` client against it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import jsonschema_rs
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serve_tiny import write_reasoning_tokenizer, write_scripted_checkpoint  # noqa: E402

from day0jax.engine.grammar import GrammarCompiler  # noqa: E402
from day0jax.engine.requests import TokenEvent  # noqa: E402
from day0jax.serve import protocol as P, reasoning as R, render, routes  # noqa: E402
from day0jax.serve.errors import APIError  # noqa: E402
from day0jax.serve.state import ServerState  # noqa: E402
from day0jax.serve.stream import Choice, Detokenizer  # noqa: E402
from day0jax.weights.tokenizer import Tokenizer  # noqa: E402
from launch import serving  # noqa: E402

TEMPLATES = Path(__file__).parent / "chat_templates"
MODEL = "m"
CITY = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                             "parameters": CITY}}


def call(city: str, reasoning: str) -> dict:
    """An earlier assistant turn: its reasoning and one call of get_weather, as a chat request sends them."""
    arguments = json.dumps({"city": city})
    return {"role": "assistant", "content": None, "reasoning": reasoning, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}


def called(city: str, reasoning: str, key: str) -> dict:
    """The same turn as transformers' users pass it: arguments as an object, the reasoning under `key`."""
    return {"role": "assistant", "content": "", key: reasoning, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}]}
USER = [{"role": "user", "content": "Weather in Oslo?"}]
TOOL = {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


# --- the split, whole and streamed ----------------------------------------------------------------------------------

class CharTokenizer:
    """Every character a token: markers arrive split across as many tokens as they have characters."""

    special_ids = frozenset()

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


def split_streamed(syntax: str, start: str, text: str, finish: str = "stop", stops=()) -> tuple[str, str, int]:
    """The reasoning, content and reasoning tokens of `text` streamed a character at a time; asserts that what was
    streamed is what the finished choice holds."""
    c = Choice(0, list(stops), None, R.Reasoning(R.SYNTAXES[syntax], start).splitter())
    detok = Detokenizer(CharTokenizer())
    reasoning = content = ""
    for ch in text:
        if c.add(TokenEvent("r", 0, ord(ch)), detok):
            c.finish("stop")
            break
        r, t = c.sendable()
        reasoning, content = reasoning + r, content + t
    else:
        c.finish(finish)
    r, t = c.sendable()
    assert (reasoning + r, content + t) == (c.reasoning, c.text)
    return c.reasoning, c.text, c.reasoning_tokens


SPLITS = [
    ("think", R.EITHER, "<think>\nLet me think.\n</think>\n\nThe answer is 4.", "Let me think.", "The answer is 4."),
    ("think", R.IN_REASONING, "Reasoned first.\n</think>\n\nAnswer.", "Reasoned first.", "Answer."),
    ("think", R.EITHER, "  No reasoning here.", "", "  No reasoning here."),
    ("think", R.EITHER, "<thin", "", "<thin"),  # what looked like the open marker, until the end
    ("think", R.IN_ANSWER, "<think>Thinking off</think> answer", "", "<think>Thinking off</think> answer"),
    ("think", R.EITHER, "<think>an unclosed tag, cut  ", "an unclosed tag, cut", ""),
    ("think", R.EITHER, "a stray</think> close tag", "", "a stray</think> close tag"),
    ("think", R.IN_REASONING, "once</think>then</think>", "once", "then</think>"),
    ("seed_oss", R.EITHER, "<seed:think>budget</seed:think>Done.", "budget", "Done."),
    ("hunyuan", R.EITHER, "<think>\nr\n</think>\n<answer>\nThe answer\n</answer>", "r", "The answer"),
    ("mistral", R.EITHER, "[THINK]Draft.[/THINK]Final.", "Draft.", "Final."),
    ("gemma4", R.EITHER, "<|channel>thought\nHmm, ok.<channel|>The answer", "Hmm, ok.", "The answer"),
    ("gemma4", R.IN_ANSWER, "The answer", "", "The answer"),
    ("harmony", R.EITHER, "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>"
     "Hello.", "Think.", "Hello."),
    ("harmony", R.EITHER, "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary<|message|>b"
     "<|end|><|start|>assistant<|channel|>final<|message|>c", "a\n\nb", "c"),
    ("harmony", R.EITHER, "<|channel|>analysis<|message|>no final channel<|end|>", "no final channel", ""),
    ("harmony", R.EITHER, "<|channel|>analysis<|message|>cut mid-way", "cut mid-way", ""),
    ("harmony", R.EITHER, "Plain text, no harmony at all", "", "Plain text, no harmony at all"),
    ("harmony", R.EITHER, "<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}', "Need it.",
     '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'),
]


@pytest.mark.parametrize("syntax,start,text,reasoning,content", SPLITS)
def test_split_whole_and_streamed(syntax, start, text, reasoning, content):
    assert split_streamed(syntax, start, text)[:2] == (reasoning, content)
    split = R.SYNTAXES[syntax].splitter(start).split(text, final=True)
    assert (split.reasoning, split.answer) == (reasoning, content)


def test_reasoning_tokens_and_stop_strings():
    assert split_streamed("think", R.EITHER, "<think>ab</think>cd") == ("ab", "cd", len("<think>ab</think>"))
    # A stop string in the answer cuts it; the reasoning is whole.
    assert split_streamed("think", R.EITHER, "<think>ab</think>cd STOP ef", stops=["STOP"])[:2] == ("ab", "cd ")


def test_the_split_matches_transformers_response_parser(tmp_path):
    """Qwen3's <think> and Gemma 4's thought channel read as transformers' response parser reads them (its templates
    start after the assistant's turn opening)."""
    from conftest import run_reference

    cases = [("qwen3", "think", "<think>\nLet me think.\n</think>\n\nThe answer is 4."),
             ("qwen3", "think", "<think>\nunfinished"), ("qwen3", "think", "plain answer"),
             ("gemma4", "gemma4", "<|channel>thought\nHmm ok.<channel|>The answer")]
    out = tmp_path / "parsed.json"
    run_reference([{"op": "parse_tools", "out": str(out), "cases": [
        {"family": family, "text": text, "tools": []} for family, _, text in cases]}], tmp_path)
    for (_, syntax, text), ref in zip(cases, json.loads(out.read_text())):
        split = R.SYNTAXES[syntax].splitter(R.EITHER).split(text, final=True)
        assert (split.reasoning or None, split.answer or None) == (ref["reasoning"], ref["content"] or None), text


# --- the syntax of a template ---------------------------------------------------------------------------------------

class NoTokens:
    def token_id(self, token):
        return None


@pytest.mark.parametrize("name,syntax", [("qwen3", "think"), ("deepseek_r1", "think"), ("deepseek_v3_1", "think"),
                                         ("glm4_5", "think"), ("minimax_m2", "think"), ("gpt_oss", "harmony")])
def test_syntax_is_read_from_the_released_templates(name, syntax):
    assert R.syntax_of(template(name), NoTokens())[0] is R.SYNTAXES[syntax]


def test_syntax_of_other_marks_tokens_and_names(tmp_path, caplog):
    for mark, name in [("<seed:think>", "seed_oss"), ("[THINK]", "mistral"),
                       ("<|channel>thought\n<channel|>", "gemma4"), ("<think>{{ x }}<answer>", "hunyuan"),
                       ("</think>", "think")]:
        assert R.syntax_of("{{ messages }}" + mark, NoTokens())[0].name == name, mark
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert R.syntax_of(plain, NoTokens()) == (None, None)
    # The tokenizer's own <think> tokens are enough.
    thinks = SimpleNamespace(token_id=lambda t: 7 if t in ("<think>", "</think>") else None)
    assert R.syntax_of(plain, thinks)[0].name == "think"
    assert "Granite" in R.syntax_of("Here is my thought process: {{ messages }}", NoTokens())[1]
    assert R.by_name("deepseek_r1") is R.SYNTAXES["think"] and R.by_name("gpt_oss") is R.SYNTAXES["harmony"]
    assert R.by_name("none") is None
    with pytest.raises(ValueError, match="known: .*harmony"):
        R.by_name("nope")
    granite = SimpleNamespace(chat_template="Here is my thought process: {{ messages }}", token_id=lambda t: None)
    with caplog.at_level(logging.INFO, logger="day0jax.serve"):
        assert R.choose(None, granite) is None
        assert R.choose("none", Tokenizer(write_reasoning_tokenizer(tmp_path))) is None
    assert [r.levelname for r in caplog.records if "Granite" in r.message] == ["WARNING"]


# --- the request path, the engine faked -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """A tokenizer folder per released template (SmolLM2's tokenizer plus the families' markup tokens)."""
    root = tmp_path_factory.mktemp("templates")
    return {name: write_reasoning_tokenizer(root / name, template(name))
            for name in ("qwen3", "deepseek_r1", "deepseek_v3_1", "glm4_5", "minimax_m2", "gpt_oss")}


@pytest.fixture(scope="module")
def loaded(tokenizers):
    """Each template's tokenizer, loaded."""
    return {name: Tokenizer(folder) for name, folder in tokenizers.items()}


@pytest.fixture(scope="module")
def grammars(loaded):
    tokenizer = loaded["qwen3"]
    stops = [tokenizer.token_id(t) for t in ("<|im_end|>", "<|return|>", "<|call|>")]
    return GrammarCompiler(tokenizer.to_json(), tokenizer.vocab_size, stops)


class ScriptedEngine:
    """The `AsyncEngine` face the steps use: each sequence answers with `tokens` (up to its max_tokens, then
    "length"), then the stop token; a request with a grammar must find every token allowed by it."""

    def __init__(self, tokens: list[int], stop: int):
        self.tokens, self.stop, self.dead = tokens, stop, None
        self.engine = SimpleNamespace(num_waiting=0, config=SimpleNamespace(max_waiting=8))
        self.submitted = []

    def submit(self, request_id, prompt, params, images=None):
        self.submitted.append((list(prompt), params))
        if params.grammar is not None:
            matcher = params.grammar.matcher()
            for t in self.tokens[:params.max_tokens]:
                assert matcher.consume(t), matcher.error

        async def events():
            for i in range(params.n):
                for k, t in enumerate(self.tokens[:params.max_tokens]):
                    cut = k + 1 == params.max_tokens and len(self.tokens) > params.max_tokens
                    yield TokenEvent(request_id, i, t, finish_reason="length" if cut else None)
                if len(self.tokens) <= params.max_tokens:
                    yield TokenEvent(request_id, i, self.stop, finish_reason="stop", stop_token=True)
        return events()

    def abort(self, request_id, index=None):
        pass

    def release(self, request_id, finished):
        pass


@pytest.fixture
def make_state(loaded, grammars):
    def make(name: str, reply: str = "", stop: str = "<|im_end|>") -> ServerState:
        """A ready server for the template `name` over an engine answering `reply` (then `stop`)."""
        tokenizer = loaded[name]
        engine = ScriptedEngine(tokenizer.encode(reply, add_special_tokens=False), tokenizer.token_id(stop))
        return ServerState(model_name=MODEL, status="ready", engine=engine, tokenizer=tokenizer, max_model_len=2048,
                           model=SimpleNamespace(vision=None, grammars=grammars),
                           reasoning=R.choose(None, tokenizer))
    return make


class Connected:
    """A request whose client stays (Starlette's `Request`: its `state`, `is_disconnected`)."""

    state = SimpleNamespace()

    async def is_disconnected(self):
        return False


def chat(state: ServerState, **fields):
    """A chat request through the route's steps: the whole response, or the streamed chunks' JSON."""
    body = P.ChatCompletionRequest.model_validate({"messages": USER, **fields})
    return asyncio.run(_answer(routes.chat_completions(body, Connected(), state), body.stream))


def responses(state: ServerState, **fields):
    """A Responses API request through its route: the whole response, or the streamed events' JSON."""
    body = P.ResponsesRequest.model_validate({"input": "Weather in Oslo?", **fields})
    return asyncio.run(_answer(routes.responses(body, Connected(), state), body.stream))


async def _answer(call, stream: bool):
    response = await call
    if not stream:
        return response
    out = []
    async for event in response.body_iterator:
        data = next((line[6:] for line in event.splitlines() if line.startswith("data: {")), None)
        if data:
            out.append(json.loads(data))
    return out


def streamed_chat(chunks) -> tuple[str, str, list]:
    """The reasoning and content a chat stream spelled (asserting no reasoning follows the content), and its
    finish reasons."""
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    reasoning = content = ""
    for d in deltas:
        if d["delta"].get("reasoning"):
            assert not content, "reasoning after the content"
            assert d["delta"]["reasoning_content"] == d["delta"]["reasoning"]
            reasoning += d["delta"]["reasoning"]
        content += d["delta"].get("content") or ""
    return reasoning, content, [d["finish_reason"] for d in deltas if d["finish_reason"]]


# (template, request fields, reply, stop token, reasoning, content, finish reason)
CHATS = [
    ("qwen3", {}, "<think>\nThe user asks.\n</think>\n\nIt is sunny.", "<|im_end|>", "The user asks.", "It is sunny.",
     "stop"),
    ("qwen3", {"chat_template_kwargs": {"enable_thinking": False}}, "It is sunny.", "<|im_end|>", None,
     "It is sunny.", "stop"),
    ("qwen3", {"max_tokens": 6}, "<think>\nA long chain of thought that goes on and on", "<|im_end|>",
     "A long chain of", None, "length"),
    ("qwen3", {}, "Oops</think> a stray close tag", "<|im_end|>", None, "Oops</think> a stray close tag", "stop"),
    ("qwen3", {}, "<think>\nNever closed", "<|im_end|>", "Never closed", None, "stop"),
    ("deepseek_r1", {}, "Reasoning from the prompt's <think>.\n</think>\n\nAnswer.", "<|im_end|>",
     "Reasoning from the prompt's <think>.", "Answer.", "stop"),
    ("deepseek_v3_1", {"chat_template_kwargs": {"thinking": True}}, "Thinking on.</think>Answer.", "<|im_end|>",
     "Thinking on.", "Answer.", "stop"),
    ("deepseek_v3_1", {}, "Thinking off.", "<|im_end|>", None, "Thinking off.", "stop"),
    ("glm4_5", {}, "<think>Short.</think>\nAnswer.", "<|im_end|>", "Short.", "Answer.", "stop"),
    ("minimax_m2", {}, "Interleaved.\n</think>\n\nAnswer.", "<|im_end|>", "Interleaved.", "Answer.", "stop"),
    ("gpt_oss", {"reasoning_effort": "high"}, "<|channel|>analysis<|message|>Think hard.<|end|><|start|>assistant"
     "<|channel|>final<|message|>Sunny.", "<|return|>", "Think hard.", "Sunny.", "stop"),
    ("gpt_oss", {}, "<|channel|>analysis<|message|>No final channel.<|end|>", "<|return|>", "No final channel.", None,
     "stop"),
]


@pytest.mark.parametrize("name,fields,reply,stop,reasoning,content,finish", CHATS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CHATS)])
def test_chat_reasoning_whole_and_streamed(make_state, name, fields, reply, stop, reasoning, content, finish):
    state = make_state(name, reply, stop)
    whole = chat(state, **fields)
    choice = whole.choices[0]
    assert (choice.message.reasoning, choice.message.content, choice.finish_reason) == (reasoning, content, finish)
    assert choice.message.reasoning_content == reasoning
    tokenizer = state.tokenizer
    reply_ids = tokenizer.encode(reply, add_special_tokens=False)
    details = whole.usage.completion_tokens_details
    if reasoning is None:
        assert details.reasoning_tokens == 0
    elif content is not None:  # the tokens up to the end of the reasoning's markup
        assert 0 < details.reasoning_tokens < len(reply_ids)
        assert reasoning in tokenizer.decode(reply_ids[:details.reasoning_tokens])
    chunks = chat(state, stream=True, **fields)
    assert streamed_chat(chunks) == (reasoning or "", content or "", [finish])


def test_thinking_switches_reach_the_template(make_state):
    state = make_state("qwen3", "It is sunny.")
    chat(state, chat_template_kwargs={"enable_thinking": False})
    prompt = state.tokenizer.decode(state.engine.submitted[-1][0])
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    state = make_state("gpt_oss", "<|channel|>final<|message|>Hi.", "<|return|>")
    chat(state, reasoning_effort="minimal")
    assert "Reasoning: low" in state.tokenizer.decode(state.engine.submitted[-1][0])


def test_include_reasoning_false_drops_it(make_state):
    state = make_state("qwen3", "<think>\nPrivate.\n</think>\n\nPublic.")
    whole = chat(state, include_reasoning=False)
    assert (whole.choices[0].message.reasoning, whole.choices[0].message.content) == (None, "Public.")
    assert streamed_chat(chat(state, include_reasoning=False, stream=True))[:2] == ("", "Public.")


@pytest.mark.parametrize("fields,param", [
    ({"reasoning_effort": "high"}, "reasoning_effort"),  # Qwen3's template never reads it
    ({"reasoning_effort": "extreme"}, None),  # not an effort (the parse step's 400)
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
])
def test_switches_the_template_does_not_take_are_400s(make_state, fields, param):
    if param is None:
        with pytest.raises(Exception, match="reasoning_effort"):
            P.ChatCompletionRequest.model_validate({"messages": USER, **fields})
        return
    with pytest.raises(APIError) as e:
        chat(make_state("qwen3"), **fields)
    assert (e.value.status, e.value.param) == (400, param), e.value.message


def test_structured_output_constrains_the_answer_only(make_state):
    """The reasoning runs free, the JSON after it follows the schema (the scripted engine checks every token
    against the grammar); with thinking switched off the grammar is the schema's alone."""
    reply = '<think>\nThe schema wants a city; "{" is fine here.\n</think>\n\n{"city": "Paris"}'
    state = make_state("qwen3", reply)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    whole = chat(state, response_format=fmt)
    assert json.loads(whole.choices[0].message.content) == {"city": "Paris"}
    assert whole.choices[0].message.reasoning.startswith("The schema wants a city")
    assert state.engine.submitted[-1][1].grammar.kind == "json_schema"
    state = make_state("qwen3", '{"city": "Oslo"}')
    whole = chat(state, response_format=fmt, chat_template_kwargs={"enable_thinking": False})
    assert json.loads(whole.choices[0].message.content) == {"city": "Oslo"}
    assert state.engine.submitted[-1][1].grammar is state.model.grammars.json_schema(CITY)
    with pytest.raises(AssertionError):  # a reply the grammar refuses: the answer is constrained
        chat(make_state("qwen3", "<think>\nok\n</think>\n\nnot JSON"), response_format=fmt)


@pytest.mark.parametrize("syntax", list(R.SYNTAXES))
def test_every_reasoning_grammar_compiles_around_an_answer(loaded, grammars, syntax):
    """Each syntax's grammar, from each place an output may start, with its markers as tokens and as text, around a
    schema and around a forced call; an answer grammar alone where the prompt closed the reasoning."""
    schema = grammars.json_schema(CITY)
    tokenizer = loaded["qwen3"]
    s = R.SYNTAXES[syntax]
    for special in ({t: i for t in s.specials if (i := tokenizer.token_id(t)) is not None}, {}):
        for start in (R.IN_REASONING, R.EITHER, R.IN_ANSWER):
            outer = R.Reasoning(s, start).grammar(special)
            if outer is None:
                assert start == R.IN_ANSWER
                continue
            assert "@answer" in outer
            grammars.around(outer, schema, "response_format")
            grammars.around(R.Reasoning(s, start).grammar(special, tool_call=True),
                            grammars.lark('start: "call"', "tool_choice"), "tool_choice")


MINIMAX_CALL = ('I need the weather.\n</think>\n\n<minimax:tool_call>\n<invoke name="get_weather">\n'
                '<parameter name="city">Oslo</parameter>\n</invoke>\n</minimax:tool_call>')
HARMONY_CALL = ("<|channel|>analysis<|message|>I need the weather.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}')


@pytest.mark.parametrize("name,reply,stop", [("minimax_m2", MINIMAX_CALL, "<|im_end|>"),
                                             ("gpt_oss", HARMONY_CALL, "<|call|>")])
@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_tool_calls_after_reasoning(make_state, name, reply, stop, tool_choice):
    """MiniMax-M2's interleaved thinking (the earlier turn's reasoning kept in the prompt) and gpt-oss's commentary
    call: the reasoning apart, the call in `tool_calls`, never streamed as content; a forced call's grammar lets the
    reasoning run first."""
    state = make_state(name, reply, stop)
    history = USER + [call("Paris", "Earlier thought."), TOOL, {"role": "user", "content": "And Oslo?"}] \
        if name == "minimax_m2" else USER
    fields = {"messages": history, "tools": [WEATHER], "tool_choice": tool_choice}
    whole = chat(state, **fields)
    choice = whole.choices[0]
    assert choice.message.reasoning == "I need the weather." and choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Oslo"})]
    if tool_choice == "required":
        assert state.engine.submitted[-1][1].grammar is not None
    chunks = chat(state, stream=True, **fields)
    assert streamed_chat(chunks) == ("I need the weather.", "", ["tool_calls"])
    calls = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls") or []]
    assert [json.loads(t["function"]["arguments"]) for t in calls] == [{"city": "Oslo"}]
    if name == "minimax_m2":  # the earlier reasoning, after the last user message but one, is not rendered
        prompt = state.tokenizer.decode(state.engine.submitted[-1][0])
        assert "Earlier thought." not in prompt and prompt.endswith("]~b]ai\n<think>\n")


def test_minimax_keeps_reasoning_of_the_current_turn(make_state):
    """Interleaved thinking: a tool round trip inside the current turn keeps its reasoning in the prompt."""
    state = make_state("minimax_m2", "Got it.\n</think>\n\nSunny in Paris.")
    history = USER + [call("Paris", "Check Paris first."), TOOL]
    whole = chat(state, messages=history, tools=[WEATHER])
    assert whole.choices[0].message.content == "Sunny in Paris."
    prompt = state.tokenizer.decode(state.engine.submitted[-1][0])
    assert "<think>\nCheck Paris first.\n</think>" in prompt


def test_responses_api_items_and_events(make_state):
    """The Responses API over gpt-oss's harmony: a reasoning item then the message, whole and as events; a
    function call item from a commentary call."""
    state = make_state("gpt_oss", "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final"
                       "<|message|>Sunny.", "<|return|>")
    whole = responses(state, instructions="Be brief.", reasoning={"effort": "low"})
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "Think." and whole.output[1].content[0].text == "Sunny."
    assert whole.status == "completed" and whole.usage.output_tokens_details["reasoning_tokens"] > 0
    assert "Reasoning: low" in state.tokenizer.decode(state.engine.submitted[-1][0])
    events = responses(state, stream=True)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Sunny."
    final = events[-1]["response"]["output"]
    assert [(i["type"], i["content"][0]["text"]) for i in final] == [("reasoning", "Think."), ("message", "Sunny.")]
    assert [i["id"] for i in final] == [e["item"]["id"] for e in events if e["type"] == "response.output_item.done"]
    state = make_state("gpt_oss", HARMONY_CALL, "<|call|>")
    whole = responses(state, tools=[{"type": "function", **WEATHER["function"]}], tool_choice="required")
    assert [item.type for item in whole.output] == ["reasoning", "function_call"]
    assert json.loads(whole.output[1].arguments) == {"city": "Oslo"}
    events = responses(state, stream=True, tools=[{"type": "function", **WEATHER["function"]}])
    done = [e["arguments"] for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [json.loads(a) for a in done] == [{"city": "Oslo"}]


def test_responses_refusals_name_their_fields(make_state):
    state = make_state("qwen3", "Hi.")
    for fields, param in [({"previous_response_id": "resp_1"}, "previous_response_id"), ({"store": True}, "store"),
                          ({"background": True}, "background"), ({"reasoning": {"effort": "high"}},
                                                                 "reasoning.effort"),
                          ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
                          ({"input": [{"role": "assistant", "content": [{"type": "input_image",
                                                                        "image_url": "data:,"}]}]}, "input")]:
        with pytest.raises(APIError) as e:
            responses(state, **fields)
        assert (e.value.status, e.value.param) == (400, param), (fields, e.value.message)


def test_render_reads_where_the_output_starts(make_state):
    expect = [("qwen3", {}, R.EITHER), ("qwen3", {"enable_thinking": False}, R.IN_ANSWER),
              ("deepseek_r1", {}, R.IN_REASONING), ("deepseek_v3_1", {}, R.IN_ANSWER),
              ("deepseek_v3_1", {"thinking": True}, R.IN_REASONING), ("glm4_5", {}, R.EITHER),
              ("glm4_5", {"enable_thinking": False}, R.IN_ANSWER), ("minimax_m2", {}, R.IN_REASONING),
              ("gpt_oss", {}, R.EITHER)]
    for name, kwargs, start in expect:
        state = make_state(name)
        body = P.ChatCompletionRequest.model_validate({"messages": USER, "chat_template_kwargs": kwargs})
        prompt, _ = asyncio.run(render.chat(state, body, None))
        assert render.reasoning(state, prompt).start == start, (name, kwargs)


# (template, chat request fields, the same conversation as transformers' users pass it (the request's messages, unless
# its fields hold their own), template variables)
HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
RENDERINGS = [
    ("qwen3", {"chat_template_kwargs": {"enable_thinking": False}}, USER, {"enable_thinking": False}),
    ("qwen3", {"chat_template_kwargs": {"enable_thinking": True}}, USER, {"enable_thinking": True}),
    ("qwen3", {"messages": HISTORY + [{"role": "assistant", "content": "Sunny.", "reasoning_content": "Look it up."},
                                      {"role": "user", "content": "And Oslo?"}, call("Oslo", "Call it."), TOOL],
               "tools": [WEATHER]},
     HISTORY + [{"role": "assistant", "content": "Sunny.", "reasoning_content": "Look it up."},
                {"role": "user", "content": "And Oslo?"}, called("Oslo", "Call it.", "reasoning_content"), TOOL],
     {"tools": [WEATHER]}),
    ("glm4_5", {"chat_template_kwargs": {"enable_thinking": False}}, USER, {"enable_thinking": False}),
    ("deepseek_v3_1", {"chat_template_kwargs": {"thinking": True}}, HISTORY, {"thinking": True}),
    ("deepseek_v3_1", {}, HISTORY, {}),
    ("deepseek_r1", {}, HISTORY + [{"role": "assistant", "content": "<think>old</think>Sunny."},
                                   {"role": "user", "content": "Sure?"}], {}),
    ("minimax_m2", {"messages": HISTORY + [call("Paris", "Check."), TOOL], "tools": [WEATHER]},
     HISTORY + [called("Paris", "Check.", "reasoning_content"), TOOL], {"tools": [WEATHER]}),
    ("gpt_oss", {"reasoning_effort": "high", "messages": HISTORY + [call("Paris", "Call the tool."), TOOL],
                 "tools": [WEATHER]},
     HISTORY + [called("Paris", "Call the tool.", "thinking"), TOOL], {"tools": [WEATHER], "reasoning_effort": "high"}),
]


def test_rendering_matches_transformers(make_state, tokenizers, tmp_path):
    """The thinking switches (chat_template_kwargs, reasoning_effort) and earlier turns' reasoning reach each
    released template as transformers' apply_chat_template passes them: the same prompt, token for token."""
    from conftest import run_reference

    out = tmp_path / "rendered.json"
    run_reference([{"op": "render_chat", "out": str(out), "cases": [
        {"model": str(tokenizers[name]), "messages": messages, "tools": kwargs.get("tools"),
         "kwargs": {k: v for k, v in kwargs.items() if k != "tools"}} for name, _, messages, kwargs in RENDERINGS]}],
        tmp_path)
    for (name, fields, messages, _), text in zip(RENDERINGS, json.loads(out.read_text())):
        state = make_state(name)
        body = P.ChatCompletionRequest.model_validate({"messages": messages, **fields})
        prompt, _ = asyncio.run(render.chat(state, body, [WEATHER] if body.tools else None))
        assert state.tokenizer.decode(prompt) == text, name
        assert prompt == state.tokenizer.encode(text, add_special_tokens=False), name


# --- the server, with the official client -------------------------------------------------------------------------

# Qwen3's prompt ends with "\n" (thinking) or "\n\n" (switched off); the model answers <think>Okay</think>Paris.
SCRIPT = {"\n": "<think>", "<think>": "Okay", "Okay": "</think>", "</think>": "Paris", "Paris": "<|im_end|>",
          "\n\n": "Paris"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = write_scripted_checkpoint(tmp_path_factory.mktemp("reasoning"), template("qwen3"), SCRIPT)
    with serving(["--model", str(ckpt), "--max-num-seqs", "2", "--chunk-sizes", "128", "--max-model-len", "512",
                  "--min-width", "512"]) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_server_logs_the_parser_it_chose(server):
    assert "reasoning: split as think (read from the chat template)" in server.log_text()


def test_openai_chat_reads_reasoning(client):
    r = client.chat.completions.create(model="tiny-reasoning", messages=USER, max_tokens=16, temperature=0)
    message = r.choices[0].message
    assert (message.reasoning, message.reasoning_content, message.content) == ("Okay", "Okay", "Paris")
    assert r.usage.completion_tokens_details.reasoning_tokens == 3  # <think> Okay </think>
    stream = client.chat.completions.create(model="tiny-reasoning", messages=USER, max_tokens=16, temperature=0,
                                            stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == "Okay"
    assert "".join(d.content or "" for d in deltas) == "Paris"
    off = client.chat.completions.create(messages=USER, max_tokens=16, temperature=0, model="tiny-reasoning",
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert (getattr(off.choices[0].message, "reasoning", None), off.choices[0].message.content) == (None, "Paris")
    cut = client.chat.completions.create(model="tiny-reasoning", messages=USER, max_tokens=2, temperature=0)
    assert cut.choices[0].finish_reason == "length"
    assert (cut.choices[0].message.reasoning, cut.choices[0].message.content) == ("Okay", None)


def test_openai_json_schema_after_reasoning(client):
    r = client.chat.completions.create(model="tiny-reasoning", messages=USER, max_tokens=32, temperature=0,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "city", "schema": CITY}})
    assert r.choices[0].message.reasoning == "Okay" and r.choices[0].finish_reason == "stop"
    jsonschema_rs.validate(CITY, json.loads(r.choices[0].message.content))


def test_openai_responses_text_stream_and_json_schema(client):
    r = client.responses.create(model="tiny-reasoning", input="Capital of France?", max_output_tokens=16,
                                temperature=0)
    assert [item.type for item in r.output] == ["reasoning", "message"] and r.status == "completed"
    assert r.output[0].content[0].text == "Okay" and r.output_text == "Paris"
    assert r.usage.output_tokens_details.reasoning_tokens == 3
    with client.responses.stream(model="tiny-reasoning", input="Capital of France?", max_output_tokens=16,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Okay"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Paris"
    assert final.output_text == "Paris" and final.id == events[0].response.id
    r = client.responses.create(model="tiny-reasoning", input="Which city?", max_output_tokens=32, temperature=0,
                                text={"format": {"type": "json_schema", "name": "city", "schema": CITY}})
    jsonschema_rs.validate(CITY, json.loads(r.output_text))


def test_openai_responses_function_call_round_trip(client):
    tools = [{"type": "function", **WEATHER["function"]}]
    first = client.responses.create(model="tiny-reasoning", input=USER, tools=tools, tool_choice="required",
                                    max_output_tokens=64, temperature=0)
    assert [item.type for item in first.output] == ["reasoning", "function_call"], first.output
    call = first.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Oslo", "Paris")
    follow = USER + [item.model_dump(exclude_none=True) for item in first.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}]
    second = client.responses.create(model="tiny-reasoning", input=follow, tools=tools, max_output_tokens=16,
                                     temperature=0)
    assert second.output_text == "Paris" and second.output[0].type == "reasoning"
    with client.responses.stream(model="tiny-reasoning", input=USER, tools=tools, tool_choice="required",
                                 max_output_tokens=64, temperature=0) as stream:
        final = stream.get_final_response()
    assert [(i.type, getattr(i, "arguments", None)) for i in final.output][1] == ("function_call", call.arguments)


def test_tokenize_and_detokenize(server, tmp_path):
    tokenizer = Tokenizer(write_reasoning_tokenizer(tmp_path, template("qwen3")))
    r = httpx.post(server.url + "/tokenize", json={"messages": USER}).json()
    assert r["tokens"] == tokenizer.apply_chat_template(USER) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 512
    r = httpx.post(server.url + "/tokenize", json={"messages": USER, "add_generation_prompt": False,
                                                    "chat_template_kwargs": {"enable_thinking": False},
                                                    "return_token_strs": True}).json()
    assert r["tokens"] == tokenizer.apply_chat_template(USER, add_generation_prompt=False)
    assert "".join(r["token_strs"]) == tokenizer.decode(r["tokens"])
    r = httpx.post(server.url + "/tokenize", json={"model": "tiny-reasoning", "prompt": "<think>Hi"}).json()
    assert r["tokens"] == tokenizer.encode("<think>Hi")
    assert httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "<think>Hi"}
    for route, body, param in [("/tokenize", {"prompt": "x", "messages": USER}, "prompt"),
                               ("/tokenize", {"model": "other", "prompt": "x"}, "model"),
                               ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens[1]")]:
        e = httpx.post(server.url + route, json=body)
        assert e.status_code == 400 and e.json()["error"]["param"] == param, e.text
