"""The server's request path, step by step and in order, without a server: validate -> render -> constrain ->
submit -> stream -> format, each a function of its own module with its own contract (the route only composes them).
The engine is faked (it answers with given tokens), the tokenizer is SmolLM2's.
"""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from day0jax.engine.grammar import MAX_OBJECT_PROPERTIES, MAX_PATTERN_CHARS, MAX_SCHEMA_NODES, GrammarCompiler
from day0jax.engine.requests import TokenEvent
from day0jax.serve import constrain, format, protocol as P, render, stream, submit, validate
from day0jax.serve.errors import APIError
from day0jax.serve.state import ServerState
from day0jax.weights.tokenizer import Tokenizer

MODEL = "m"
CONTEXT = 256
# A Hermes-style template: it reads `tools` and teaches <tool_call> JSON.
HERMES = ("{% if tools %}<|im_start|>system\nCall a function as <tool_call>{\"name\": ..., \"arguments\": ...}"
          "</tool_call>: {% for t in tools %}{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
          "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
USER = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def checkpoint():
    from day0jax.default_model import default_checkpoint

    return default_checkpoint(progress=False)


@pytest.fixture(scope="module")
def grammars(checkpoint):
    tokenizer = Tokenizer(checkpoint)
    return GrammarCompiler(tokenizer.to_json(), tokenizer.vocab_size, [tokenizer.token_id("<|im_end|>")])


@pytest.fixture
def make_state(checkpoint, grammars):
    def make(reply: str = "", template: str | None = None) -> ServerState:
        """A ready server over a fake engine answering `reply`, with SmolLM2's tokenizer (and `template`)."""
        tokenizer = Tokenizer(checkpoint)
        tokenizer.chat_template = template or tokenizer.chat_template
        engine = FakeEngine(tokenizer.encode(reply, add_special_tokens=False), tokenizer.token_id("<|im_end|>"))
        return ServerState(model_name=MODEL, status="ready", engine=engine, tokenizer=tokenizer,
                           max_model_len=CONTEXT, model=SimpleNamespace(vision=None, grammars=grammars))
    return make


class FakeEngine:
    """The `AsyncEngine` face the steps use; each sequence answers with the tokens of `reply`, then EOS."""

    def __init__(self, tokens: list[int], eos: int, max_waiting: int = 8):
        self.tokens, self.eos, self.dead = tokens, eos, None
        self.engine = SimpleNamespace(num_waiting=0, config=SimpleNamespace(max_waiting=max_waiting))
        self.submitted, self.released = [], []

    def submit(self, request_id, prompt, params, images=None):
        self.submitted.append((request_id, list(prompt), params))

        async def events():
            for i in range(params.n):
                for t in self.tokens:
                    yield TokenEvent(request_id, i, t)
                yield TokenEvent(request_id, i, self.eos, finish_reason="stop", stop_token=True)
        return events()

    def abort(self, request_id, index=None):
        pass

    def release(self, request_id, finished):
        self.released.append((request_id, finished))


class Connected:
    """A request whose client stays (Starlette's `Request`: its `state`, `is_disconnected`)."""

    state = SimpleNamespace()

    async def is_disconnected(self):
        return False


def chat_request(**fields) -> P.ChatCompletionRequest:
    return P.ChatCompletionRequest.model_validate({"model": MODEL, "messages": USER, **fields})


@pytest.mark.parametrize("fields,param", [
    ({"model": "other"}, "model"),
    ({"audio": {"voice": "alloy"}}, "audio"),
    ({"stop": ["a", ""]}, "stop"),
    ({"n": 9}, "n"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"guided_regex": "a+", "guided_choice": ["b"]}, "guided_choice"),
    ({"logit_bias": {"one": 1.0}}, "logit_bias"),
    ({"messages": USER + [{"role": "assistant", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,AAAA"}}]}]}, "messages[1].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,AAAA"}}]}]}, "messages"),
])
def test_validate_refuses_with_the_field_named_before_any_work(make_state, fields, param):
    state = make_state()
    with pytest.raises(APIError) as e:
        validate.chat(state, chat_request(**fields))
    assert e.value.status == 400 and e.value.param == param, e.value.message


def nested(depth: int, leaf=None) -> dict:
    """An object nesting `depth` objects deep."""
    value = leaf if leaf is not None else {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def earlier_call(arguments: str) -> list[dict]:
    """A conversation whose assistant turn called a tool with `arguments`."""
    return USER + [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": arguments}}]}, {"role": "tool", "tool_call_id": "c1", "content": "sun"}]


def tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}


@pytest.mark.parametrize("fields,param,message", [
    # Nesting deep enough to exhaust the stack of a recursive step after validation (a 500 before).
    ({"chat_template_kwargs": {"x": nested(5000)}}, "chat_template_kwargs", "more than 64 levels deep"),
    ({"guided_json": nested(3000, {"type": "object"})}, "guided_json", "more than 64 levels deep"),
    ({"messages": earlier_call("[" * 100_000)}, "messages[1].tool_calls[0].function.arguments", "levels deep"),
    ({"messages": earlier_call("[" * 70 + "]" * 70)}, "messages[1].tool_calls[0].function.arguments", "levels deep"),
    # Tool schemas the template would show the model as if they were valid.
    ({"tools": [tool({"type": "object", "properties": 5})]}, "tools[0].function.parameters",
     "'properties' at # must be an object"),
    ({"tools": [tool({"type": "object", "properties": {"city": {"type": "string", "minLength": "3"}}})]},
     "tools[0].function.parameters", "'minLength' at #/properties/city must be a non-negative integer"),
    ({"tools": [tool({"type": "object", "properties": {"u": {"enum": "C"}, "p": {"pattern": 5}}})]},
     "tools[0].function.parameters", "'enum' at #/properties/u must be a non-empty list"),
    ({"tools": [tool({"type": "object", "properties": {"city": 7}})]}, "tools[0].function.parameters",
     "must be an object or a boolean, not int"),
    # A grammar with tools under tool_choice auto would forbid every tool call.
    ({"tools": [WEATHER], "guided_regex": "a+"}, "guided_regex", "tool_choice auto"),
    ({"tools": [WEATHER], "tool_choice": "auto", "response_format": {"type": "json_object"}}, "response_format",
     "tool_choice auto"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only when stream is true"),
])
def test_hostile_chat_requests_are_400s_naming_the_field(make_state, fields, param, message):
    state = make_state(template=HERMES)
    with pytest.raises(APIError) as e:
        validate.chat(state, chat_request(**fields))
    assert (e.value.status, e.value.param) == (400, param) and message in e.value.message, e.value.message


def test_hostile_tokenize_and_completion_requests_are_400s(make_state):
    state = make_state(template=HERMES)
    body = P.TokenizeRequest.model_validate({"messages": earlier_call("{\"a\": " * 100 + "1" + "}" * 100)})
    with pytest.raises(APIError) as e:
        validate.tokenize(state, body)
    assert e.value.param == "messages[1].tool_calls[0].function.arguments"
    # echo (the prompt before the completion) is not implemented: refused, not ignored.
    with pytest.raises(APIError) as e:
        validate.completion(state, P.CompletionRequest.model_validate({"prompt": "hi", "echo": True}))
    assert (e.value.param, e.value.code) == ("echo", "unsupported_parameter")
    validate.completion(state, P.CompletionRequest.model_validate({"prompt": "hi", "echo": False}))


def described_tool(i: int, chars: int) -> dict:
    return {"type": "function", "function": {"name": f"f{i}", "description": "d" * chars, "parameters": {}}}


@pytest.mark.parametrize("fields,param", [
    # Everything the template renders counts, not only the messages' text: the offered tools' JSON, an earlier tool
    # call's arguments, names, reasoning and template variables.
    ({"tools": [described_tool(i, 1000) for i in range(17)]}, "tools"),
    ({"messages": earlier_call(json.dumps({"a": "x" * 16_400}))}, "messages"),
    ({"messages": [{"role": "user", "content": "hi", "name": "n" * 16_400}]}, "messages"),
    ({"messages": USER + [{"role": "assistant", "content": "ok", "reasoning": "r" * 16_400}]}, "messages"),
    ({"chat_template_kwargs": {"notes": "k" * 16_400}}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "m" * 8000}], "tools": [described_tool(0, 9000)]}, "tools"),
])
def test_prompts_rendering_from_too_many_characters_are_refused_before_tokenizing(make_state, fields, param):
    state = make_state(template=HERMES)
    assert validate.prompt_char_limit(state) == CONTEXT * validate.CHARS_PER_TOKEN == 16_384
    state.tokenizer = None  # nothing may be rendered or tokenized
    with pytest.raises(APIError) as e:
        validate.chat(state, chat_request(**fields))
    assert (e.value.status, e.value.param, e.value.code) == (400, param, "context_length_exceeded"), e.value.message
    assert "--max-prompt-chars" in e.value.message
    tokenize = P.TokenizeRequest.model_validate({k: v for k, v in fields.items() if k != "chat_template_kwargs"}
                                                | {"messages": fields.get("messages", USER)})
    if "chat_template_kwargs" not in fields:
        with pytest.raises(APIError) as e:
            validate.tokenize(state, tokenize)
        assert e.value.param == param


def test_the_prompt_character_bound_follows_its_flag(make_state):
    state = make_state(template=HERMES)
    state.max_prompt_chars = 100
    validate.chat(state, chat_request(messages=[{"role": "user", "content": "m" * 100}]))
    with pytest.raises(APIError) as e:
        validate.chat(state, chat_request(messages=[{"role": "user", "content": "m" * 60, "name": "n" * 41}]))
    assert e.value.param == "messages" and "(100, --max-prompt-chars" in e.value.message


def test_nesting_and_schemas_within_the_bounds_pass(make_state):
    state = make_state(template=HERMES)
    schema = nested(30, {"type": "object", "properties": {"city": {"type": "string", "minLength": 1}}})
    validate.chat(state, chat_request(chat_template_kwargs={"x": nested(60)}, guided_json=schema,
                                      messages=earlier_call(json.dumps(nested(60)))))
    validate.chat(state, chat_request(tools=[WEATHER], tool_choice="none", guided_regex="a+"))
    validate.chat(state, chat_request(tools=[WEATHER], tool_choice="required"))


def test_render_gives_the_chat_templates_ids(make_state):
    state = make_state()
    tokenizer = state.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "text", "text": "Hello, "}, {"type": "text", "text": "there."}]}]
    ids, images = asyncio.run(render.chat(state, chat_request(messages=messages), None))
    assert ids == tokenizer.apply_chat_template([messages[0], {"role": "user", "content": "Hello, there."}])
    assert images is None
    assert asyncio.run(render.completion(state, ["Once upon", [5, 6]])) == [tokenizer.encode("Once upon"), [5, 6]]



def test_render_refuses_an_image_the_models_processor_refuses(make_state):
    """The server's pixel limit may exceed the preprocessing's own: the processor's refusal is a 400 on
    `messages`, not a 500."""
    from day0jax.vision.images import ImageError

    def expand(text, images, tokenizer):
        raise ImageError("an image of 60000000 pixels is over the limit of 50000000")

    state = make_state()
    state.model = SimpleNamespace(vision=object(), images=SimpleNamespace(expand=expand), tokenizer=state.tokenizer)
    with pytest.raises(APIError) as e:
        render._image_inputs(state, "<image>", [object()])
    assert (e.value.status, e.value.param) == (400, "messages") and "over the limit" in str(e.value)

@pytest.mark.parametrize("fields,kind", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}},
     "json_schema"),
    ({"guided_regex": "[ab]+"}, "regex"),
    ({"guided_choice": ["yes", "no"]}, "choice"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "lark"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, None),
])
def test_constrain_builds_the_grammar_the_request_asks_for(make_state, fields, kind):
    state = make_state(template=HERMES)
    body = chat_request(logit_bias={"17": -100}, **fields)
    constraints = asyncio.run(constrain.constraints(state, body, validate.chat(state, body).tools))
    assert (constraints.grammar and constraints.grammar.kind) == kind
    assert constraints.logit_bias == ((17, -100.0),)


def wide_object(properties: int, prefix: str = "p") -> dict:
    return {"type": "object", "properties": {f"{prefix}{i}": {"type": "integer"} for i in range(properties)}}


@pytest.mark.parametrize("fields,param,message", [
    # A compile's work grows with the square of an object's properties: bounded per object and in all.
    ({"guided_json": wide_object(MAX_OBJECT_PROPERTIES + 1)}, "guided_json", "129 properties, more than 128"),
    ({"guided_json": {"type": "object", "properties": {f"o{k}": wide_object(100) for k in range(21)}}},
     "guided_json", "more than 2048 schemas"),
    ({"guided_json": {"enum": list(range(MAX_SCHEMA_NODES))}}, "guided_json", "more than 2048 schemas"),
    ({"guided_json": {"enum": ["x" * 70_000] * 4}}, "guided_json", "more than 262144 characters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "string", "pattern": "a" * (MAX_PATTERN_CHARS + 1)}}}}, "response_format.json_schema.schema",
     "4097 characters"),
    ({"guided_regex": "(ab|cd)" * 600}, "guided_regex", "more than 4096"),
    ({"guided_choice": [f"option {i}" for i in range(MAX_SCHEMA_NODES + 1)]}, "guided_choice", "at most 2048"),
    ({"tools": [tool(wide_object(200))], "tool_choice": "required"}, "tools[0].function.parameters",
     "200 properties"),
    ({"tools": [{"type": "function", "function": {"name": f"f{k}", "parameters": wide_object(100)}}
                for k in range(21)], "tool_choice": "required"}, "tools", "together are too large"),
])
def test_grammars_over_the_size_bounds_are_refused_before_any_build(make_state, monkeypatch, fields, param, message):
    builds = []
    monkeypatch.setattr(GrammarCompiler, "_compile", lambda self, *args: builds.append(args))
    state = make_state(template=HERMES)
    state.max_prompt_chars = 1 << 22  # the tools' JSON would exceed the small context's prompt bound first
    body = chat_request(**fields)
    with pytest.raises(APIError) as e:
        asyncio.run(constrain.constraints(state, body, validate.chat(state, body).tools))
    assert (e.value.status, e.value.param) == (400, param) and message in e.value.message, e.value.message
    assert builds == []


def test_grammars_at_the_size_bounds_compile(make_state):
    state = make_state(template=HERMES)
    for fields in ({"guided_json": wide_object(MAX_OBJECT_PROPERTIES)},
                   {"guided_choice": [f"option {i}" for i in range(MAX_SCHEMA_NODES)]},
                   {"tools": [tool(wide_object(MAX_OBJECT_PROPERTIES))], "tool_choice": "required"}):
        body = chat_request(**fields)
        assert asyncio.run(constrain.constraints(state, body, validate.chat(state, body).tools)).grammar is not None


def test_the_grammar_cache_is_bounded_in_bytes_least_recently_used_first(checkpoint, grammars):
    """Kept grammars stay within the cache's bytes, however many are compiled; one used again outlives older ones, and
    a large grammar evicts as many small ones as its size needs."""
    first, text = grammars.regex("[a-z]{1}"), Tokenizer(checkpoint).to_json()
    compiler = GrammarCompiler(text, grammars.vocab_size, [0], cache_bytes=4 * first.nbytes)
    small = [compiler.regex(f"[a-z]{{{k}}}") for k in range(1, 4)]
    assert len(compiler._cache) == 3 and compiler.cached_bytes == sum(g.nbytes for g in small)
    assert compiler.regex("[a-z]{1}") is small[0]  # a hit: now the most recently used
    for k in range(4, 12):
        compiler.regex(f"[a-z]{{{k}}}")
        assert compiler.cached_bytes == sum(g.nbytes for g in compiler._cache.values()) <= compiler.cache_bytes
    assert len(compiler._cache) < 8
    recent = compiler.regex("[b-z]{2}")
    large = compiler.json_schema(wide_object(8))
    assert large.nbytes > 2 * first.nbytes and compiler.cached_bytes <= compiler.cache_bytes
    assert list(compiler._cache.values())[-2:] == [recent, large]
    huge = GrammarCompiler(text, grammars.vocab_size, [0], cache_bytes=first.nbytes - 1)
    assert huge.regex("[a-z]{1}").matcher() is not None and huge.cached_bytes == 0  # used, never kept


def serve(state: ServerState, body: P.ChatCompletionRequest):
    """The chat route's steps, in order."""
    checked = validate.chat(state, body)
    prompt, images = asyncio.run(render.chat(state, body, checked.tools.specs if checked.tools else None))
    constraints = asyncio.run(constrain.constraints(state, body, checked.tools))
    run = submit.submit(state, checked.engine, "chatcmpl-test", body, [prompt], constraints)
    outputs = stream.Outputs(state, run, checked.stops, checked.tools, arrival=0.0)

    async def answer():
        response = await format.respond(Connected(), outputs, format.Chat(MODEL), body)
        if not body.stream:
            return response
        return [json.loads(line[6:]) async for line in response.body_iterator if line.startswith("data: {")]
    return prompt, asyncio.run(answer())


def test_a_chat_request_through_every_step(make_state):
    """Whole and streamed: the text the engine's tokens spell, cut at a stop string, with its usage; the engine
    got the rendered prompt and a token limit of what the context leaves, and every engine request is released."""
    state = make_state(reply="It is sunny. Bye!")
    prompt, whole = serve(state, chat_request(stop=[" Bye"], n=2))
    assert [c.message.content for c in whole.choices] == ["It is sunny."] * 2
    assert [c.finish_reason for c in whole.choices] == ["stop"] * 2
    assert whole.usage.prompt_tokens == len(prompt) and whole.id == "chatcmpl-test"
    (rid, ids, params), = state.engine.submitted
    assert ids == prompt and params.max_tokens == CONTEXT - len(prompt) and params.n == 2
    chunks = serve(state, chat_request(stop=[" Bye"], stream=True, stream_options={"include_usage": True}))[1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "It is sunny."
    assert chunks[-1]["usage"]["completion_tokens"] == whole.usage.completion_tokens // 2
    assert all(finished for _, finished in state.engine.released) and state.in_flight == 0


@pytest.mark.parametrize("fields,limit,param", [
    ({"n": 8, "logprobs": True, "top_logprobs": 20, "max_tokens": 200}, 1 << 15, "max_tokens"),
    ({"logprobs": True, "top_logprobs": 20}, 5000, "max_tokens"),  # no max_tokens: what the context leaves (256)
    ({"n": 4, "max_completion_tokens": 100, "logprobs": True}, 399, "max_completion_tokens"),
])
def test_responses_larger_than_the_bound_are_refused_before_running(make_state, fields, limit, param):
    """A whole response with logprobs: prompts x n x max_tokens x (top_logprobs + 1) over --max-response-entries is
    a 400 naming the parameters; at the bound it passes. Streamed, or without logprobs, it is not bounded."""
    state = make_state()
    state.max_response_entries = limit
    with pytest.raises(APIError) as e:
        validate.chat(state, chat_request(**fields))
    assert (e.value.status, e.value.param, e.value.code) == (400, param, "response_too_large"), e.value.message
    assert f"n {fields.get('n', 1)}" in e.value.message and "--max-response-entries" in e.value.message
    validate.chat(state, chat_request(**fields, stream=True))
    validate.chat(state, chat_request(**dict(fields, logprobs=False, top_logprobs=None)))
    state.max_response_entries = 1 << 30
    validate.chat(state, chat_request(**fields))
    state.max_response_entries = 2 * 2 * 100 * 3
    body = P.CompletionRequest.model_validate({"prompt": ["a", "b"], "n": 2, "max_tokens": 100, "logprobs": 2})
    validate.completion(state, body)
    state.max_response_entries -= 1
    with pytest.raises(APIError) as e:
        validate.completion(state, body)
    assert e.value.param == "max_tokens" and "2 prompts x n 2 x max_tokens 100 x (top logprobs 2 + 1)" in \
        e.value.message


def test_large_whole_responses_are_built_off_the_event_loop(make_state, monkeypatch):
    """A whole response of many tokens is built and encoded on a worker thread, as the same JSON; a small one on the
    event loop."""
    state = make_state(reply=" ok" * 700)
    built = []
    response = format.Chat.response
    monkeypatch.setattr(format.Chat, "response", lambda self, out: built.append(threading.current_thread()) or
                        response(self, out))
    _, small = serve(state, chat_request(max_tokens=700))
    _, large = serve(state, chat_request(max_tokens=700, logprobs=True, top_logprobs=2))
    assert built[0] is threading.main_thread() and built[1] is not threading.main_thread()
    assert large.media_type == "application/json"
    assert json.loads(large.body)["choices"][0]["message"] == small.model_dump(mode="json")["choices"][0]["message"]


def test_a_stream_whose_client_left_before_it_began_releases_its_run(make_state):
    """The client hung up while the request was rendered: the disconnect is waiting when the stream starts, and the
    stream is cancelled before its first event; the run is still released (aborted) and no longer in flight."""
    state = make_state(reply="It is sunny.")
    body = chat_request(stream=True)
    checked = validate.chat(state, body)
    prompt, _ = asyncio.run(render.chat(state, body, None))
    run = submit.submit(state, checked.engine, "chatcmpl-gone", body, [prompt], constrain.Constraints())
    outputs = stream.Outputs(state, run, checked.stops, None, arrival=0.0)
    sent = []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        await asyncio.sleep(0)  # a socket write gives way to other tasks, as a server's send does
        sent.append(message)

    async def answer():
        response = await format.respond(Connected(), outputs, format.Chat(MODEL), body)
        await response({"type": "http", "asgi": {"spec_version": "2.0"}}, receive, send)
    assert state.in_flight == 1
    asyncio.run(answer())
    assert not any(m.get("body") for m in sent)  # it ended before its first event
    assert state.in_flight == 0 and state.engine.released == [("chatcmpl-gone-0", False)]


def test_a_cache_salt_reaches_the_engine(make_state):
    state = make_state(reply="Hi.")
    serve(state, chat_request(cache_salt="tenant-7"))
    assert state.engine.submitted[0][2].cache_salt == "tenant-7"
    # An API key's tenant salts the chain under the request's own salt: no request names another tenant's chain.
    salts = set()
    for tenant, salt in [(None, None), ("api-key-0", None), ("api-key-1", None), ("api-key-0", "s"),
                         ("api-key-1", "s")]:
        run = submit.submit(state, state.engine, f"r-{tenant}-{salt}", chat_request(cache_salt=salt), [[1, 2, 3]],
                            constrain.Constraints(), tenant=tenant)
        salts.add(state.engine.submitted[-1][2].cache_salt)
        run.release(completed=True)
    assert len(salts) == 5 and None in salts
    assert P.ResponsesRequest.model_validate({"input": "hi", "cache_salt": "tenant-7"}).chat().cache_salt == "tenant-7"
    with pytest.raises(ValueError, match="cache_salt"):
        chat_request(cache_salt="")


def test_health_shows_no_exception_text_of_a_failed_engine(make_state):
    from day0jax.serve import routes

    state = make_state()
    state.engine.dead = "RuntimeError: device lost at /secret/path/weights"
    response = asyncio.run(routes.health(state))
    assert response.status_code == 503 and json.loads(response.body) == {"status": "failed",
                                                                          "detail": "see the server's log"}
    assert "device lost" in state.detail  # the state keeps it (the engine logged it); /health does not show it


def test_a_forced_tool_call_through_every_step(make_state):
    """The call's text is parsed into `tool_calls`, whole and streamed, never sent as content."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    state = make_state(reply=call, template=HERMES)
    body = {"tools": [WEATHER], "tool_choice": "required"}
    _, whole = serve(state, chat_request(**body))
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    assert state.engine.submitted[0][2].grammar.kind == "lark"
    chunks = serve(state, chat_request(stream=True, **body))[1]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert not any(d.get("content") for d in deltas)
    calls = [t for d in deltas for t in d.get("tool_calls") or []]
    assert [t["function"]["name"] for t in calls] == ["get_weather"]


def test_the_guard_names_the_tenant_of_each_key():
    """With several API keys each is a tenant (`request.state.tenant`); with one there are no tenants; a wrong or
    missing key is a 401 that never reaches the app."""
    from day0jax.serve.middleware import GuardMiddleware

    def call(keys: tuple[str, ...], token: str | None):
        seen, sent = [], []

        async def app(scope, receive, send):
            seen.append(scope.get("state", {}).get("tenant"))

        async def send(message):
            sent.append(message)
        headers = [(b"host", b"127.0.0.1")] + ([(b"authorization", f"Bearer {token}".encode())] if token else [])
        scope = {"type": "http", "path": "/v1/models", "method": "GET", "headers": headers}
        asyncio.run(GuardMiddleware(app, ServerState(model_name=MODEL, api_keys=keys))(scope, None, send))
        return seen, [m["status"] for m in sent if m["type"] == "http.response.start"]

    assert call(("a", "b"), "b") == (["api-key-1"], [])
    assert call(("a", "b"), "a") == (["api-key-0"], [])
    assert call(("a",), "a") == ([None], [])
    assert call(("a", "b"), "c") == ([], [401])
    assert call(("a", "b"), None) == ([], [401])


class GoneRequest:
    """A request whose client has hung up (Starlette's `Request.is_disconnected`)."""

    state = SimpleNamespace()

    async def is_disconnected(self) -> bool:
        return True


def test_a_client_gone_before_submit_is_never_queued(make_state):
    """A client that hangs up while its request is rendered and constrained gets nothing queued: no engine request,
    nothing in flight (the 499 is never sent; no one is listening)."""
    from day0jax.serve import routes

    state = make_state(reply="Hi.")
    with pytest.raises(APIError) as chat:
        asyncio.run(routes._chat(state, chat_request(), GoneRequest(), format.Chat(MODEL), "chatcmpl-gone"))
    with pytest.raises(APIError) as completion:
        asyncio.run(routes.completions(P.CompletionRequest.model_validate({"model": MODEL, "prompt": "Hi"}),
                                       GoneRequest(), state))
    assert chat.value.status == completion.value.status == 499
    assert state.engine.submitted == [] and state.in_flight == 0


def test_a_chunked_body_reaches_the_app_whole_and_within_the_limit():
    """A body sent in many small chunks (no Content-Length) is handed on whole; one past the limit is a 413 before
    the app sees it."""
    from day0jax.serve.middleware import GuardMiddleware

    def send_in_chunks(body: bytes, limit: int):
        chunks = [body[i:i + 3] for i in range(0, len(body), 3)]
        messages = [{"type": "http.request", "body": c, "more_body": i + 1 < len(chunks)} for i, c in enumerate(chunks)]
        got, sent = [], []

        async def receive():
            return messages.pop(0)

        async def app(scope, receive, send):
            got.append((await receive())["body"])

        async def send(message):
            sent.append(message)
        scope = {"type": "http", "path": "/v1/completions", "method": "POST", "headers": [(b"host", b"127.0.0.1")]}
        asyncio.run(GuardMiddleware(app, ServerState(model_name=MODEL, max_body_bytes=limit))(scope, receive, send))
        return got, [m["status"] for m in sent if m["type"] == "http.response.start"]

    body = json.dumps({"model": MODEL, "prompt": "x" * 3000}).encode()
    assert send_in_chunks(body, len(body)) == ([body], [])
    assert send_in_chunks(body, len(body) - 1) == ([], [413])


# JSON schemas as clients send them, well- and ill-formed: the structured-output keywords with values of the right
# and of the wrong types, nested a few levels (bounded sizes).
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.floats(-1e3, 1e3, allow_nan=False),
                    st.sampled_from(["", "a", "[a-z]+", "(", "\\d{2,3}", "string", "object", "date-time"]))
KEYWORDS = ["type", "properties", "items", "enum", "const", "required", "additionalProperties", "minLength",
            "maxLength", "pattern", "minimum", "maximum", "minItems", "maxItems", "anyOf", "oneOf", "allOf",
            "format", "$ref", "$defs", "description", "title", "default", "not", "if"]
TYPES = st.sampled_from(["object", "array", "string", "integer", "number", "boolean", "null"])
SCHEMAS = st.recursive(
    st.one_of(st.booleans(), st.fixed_dictionaries({"type": TYPES}), st.dictionaries(st.sampled_from(KEYWORDS),
                                                                                      SCALARS, max_size=3)),
    lambda inner: st.one_of(
        st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(
            st.text("abcxyz_", min_size=1, max_size=4), inner, max_size=4)},
            optional={"required": st.lists(st.text("abcxyz_", min_size=1, max_size=4), max_size=3),
                      "additionalProperties": st.one_of(st.booleans(), inner)}),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner},
                              optional={"minItems": SCALARS, "maxItems": SCALARS}),
        st.fixed_dictionaries({"anyOf": st.lists(inner, max_size=3)}),
        st.dictionaries(st.sampled_from(KEYWORDS), st.one_of(SCALARS, inner, st.lists(inner, max_size=3)),
                        max_size=4)),
    max_leaves=12)


def test_any_schema_is_a_grammar_or_a_400(make_state):
    """Whatever schema a client sends (as guided_json, a response_format, a forced tool call's parameters or an
    offered tool's), the request path either builds its grammar or answers 400 naming the field: never another
    exception. The generated schemas reach both outcomes, so both paths are exercised."""
    state = make_state(template=HERMES)
    outcomes = {"built": 0, "refused": 0}

    @settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(schema=SCHEMAS, path=st.sampled_from(["guided_json", "response_format", "tool_choice", "tools"]))
    def request(schema, path):
        fields = {"guided_json": {"guided_json": schema},
                  "response_format": {"response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "s", "schema": schema}}},
                  "tool_choice": {"tools": [tool(schema)], "tool_choice": "required"},
                  "tools": {"tools": [tool(schema)]}}[path]
        try:
            body = chat_request(**fields)
        except ValueError:  # the body's own schema refuses it: FastAPI's 400
            outcomes["refused"] += 1
            return
        try:
            checked = validate.chat(state, body)
            asyncio.run(render.chat(state, body, checked.tools.specs if checked.tools else None))
            asyncio.run(constrain.constraints(state, body, checked.tools))
            outcomes["built"] += 1
        except APIError as e:
            assert e.status == 400 and e.param, (e.status, e.param, e.message)
            outcomes["refused"] += 1

    request()
    assert outcomes["built"] >= 20 and outcomes["refused"] >= 20, outcomes
