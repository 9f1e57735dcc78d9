"""Tool calling: the tool-call syntax read from a chat template, parsing calls out of the output, the grammar that
forces a call (tool_choice "required" or a named function) for each syntax, and the server end to end with the
official `openai` client on a tiny random model whose template is Hermes-style: calls in `message.tool_calls`
whose arguments validate, streamed as deltas that assemble into the same call, tool history rendered through the
template, and the 400s.

A random model would never call a tool on its own: with a forced tool_choice the grammar makes every output a
valid call, so a leak in the grammar or a parser mistake shows on some seed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import jsonschema_rs
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serve_tiny import CONFIG, write_tiny_chat_checkpoint  # noqa: E402

import day0jax  # noqa: E402
from day0jax.engine.grammar import GrammarError  # noqa: E402
from day0jax.engine.requests import SamplingParams  # noqa: E402
from day0jax.engine.config import EngineConfig  # noqa: E402
from day0jax.serve import tools as T  # noqa: E402
from day0jax.serve.launch import serving  # noqa: E402

# Chat templates written for these tests in each syntax's style (the shapes Qwen, Mistral and Llama 3 use).
HERMES = """{%- if tools %}<|im_start|>system
Call functions like this: <tool_call>
{"name": "f", "arguments": {}}
</tool_call>
<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools><|im_end|>
{% endif %}{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
MISTRAL = """{%- for message in messages %}
{%- if message.role == "user" %}
{%- if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
[INST]{{ message.content }}[/INST]
{%- elif message.tool_calls %}[TOOL_CALLS]{{ message.tool_calls | tojson }}</s>
{%- else %}{{ message.content }}</s>{%- endif %}{%- endfor %}"""
LLAMA3 = """{%- if tools %}<|start_header_id|>system<|end_header_id|>
Respond with a JSON function call {"name": ..., "parameters": ...}; results come back as ipython.
{% for tool in tools %}{{ tool | tojson }}{% endfor %}<|eot_id|>{% endif %}
{%- for message in messages %}<|start_header_id|>{{ message.role }}<|end_header_id|>
{{ message.content }}<|eot_id|>{%- endfor %}<|start_header_id|>assistant<|end_header_id|>
"""
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string", "maxLength": 20},
                                                 "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                 "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "pattern": "^UTC[+-][0-9]{1,2}$"}},
    "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def check_call(name: str, arguments: str) -> None:
    assert name in PARAMETERS
    jsonschema_rs.validate(PARAMETERS[name], json.loads(arguments))


# --- syntaxes and parsers -----------------------------------------------------------------------------------------

DEEPSEEK_V3 = """{% for m in messages %}{% if m.tool_calls %}<｜tool▁calls▁begin｜>{% for t in m.tool_calls %}\
<｜tool▁call▁begin｜>{{ t.type }}<｜tool▁sep｜>{{ t.function.name }}\n```json\n{{ t.function.arguments | tojson }}\n```\
<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜>{% else %}{{ m.content }}{% endif %}{% endfor %}{{ tools }}"""
DEEPSEEK_V31 = DEEPSEEK_V3.replace("{{ t.type }}<｜tool▁sep｜>{{ t.function.name }}\n```json\n", "{{ t.function.name }}"
                                   "<｜tool▁sep｜>").replace("\n```\\\n", "")
KIMI = """{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}\
<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>"""


def test_syntax_is_read_from_the_template():
    assert T.syntax_of(HERMES).name == "hermes"
    assert T.syntax_of(MISTRAL).name == "mistral"
    assert T.syntax_of(LLAMA3).name == "llama3_json"
    assert "```json" in DEEPSEEK_V3 and "```json" not in DEEPSEEK_V31
    assert T.syntax_of(DEEPSEEK_V3).name == "deepseek_v3" and T.syntax_of(DEEPSEEK_V31).name == "deepseek_v31"
    assert T.syntax_of(KIMI).name == "kimi_k2"
    with pytest.raises(GrammarError, match="no tool support"):
        T.syntax_of("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(GrammarError, match="does not parse"):
        T.syntax_of("{% if tools %}<function_calls>{{ tools }}{% endif %}")
    glm = "{% if tools %}<tool_call>{{ name }}<arg_key>{{ k }}</arg_key><arg_value>{{ v }}</arg_value>{% endif %}"
    with pytest.raises(GrammarError, match="GLM's <tool_call> with <arg_key>"):
        T.syntax_of(glm)  # contains <tool_call>, but is not Hermes JSON


@pytest.mark.parametrize("syntax,text,content,calls", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
     '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC+1"}}\n</tool_call>',
     "Let me check.\n", [("get_weather", {"city": "Oslo", "unit": "celsius"}), ("get_time", {"zone": "UTC+1"})]),
    ("hermes", '<tool_call>\n{"name": "delete_all", "arguments": {}}\n</tool_call>', None, []),  # unknown function
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC+1"}', None, []),  # cut short
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC-5"}}]', "",
     [("get_time", {"zone": "UTC-5"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC+9"}}', "<|python_tag|>",
     [("get_time", {"zone": "UTC+9"})]),
    ("llama3_json", 'The answer is {"name": "get_time"}.', None, []),  # JSON inside prose is not a call
    ("deepseek_v3", 'Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
     '{"city": "Oslo", "unit": "celsius"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time'
     '\n```json\n{"zone": "UTC+1"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Checking.",
     [("get_weather", {"city": "Oslo", "unit": "celsius"}), ("get_time", {"zone": "UTC+1"})]),
    ("deepseek_v31", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "UTC-3"}'
     '<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "", [("get_time", {"zone": "UTC-3"})]),
    ("deepseek_v31", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": ', None, []),
    ("kimi_k2", '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>'
     '{"zone": "UTC+2"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>'
     '{"city": "Rome", "unit": "celsius"}<|tool_call_end|><|tool_calls_section_end|>', "",
     [("get_time", {"zone": "UTC+2"}), ("get_weather", {"city": "Rome", "unit": "celsius"})]),
])
def test_parsers(syntax, text, content, calls):
    got_content, got = T.SYNTAXES[syntax].parse(text, set(PARAMETERS))
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert got_content == (text if content is None else content)
    assert all(c.id.startswith("call_") for c in got) and len({c.id for c in got}) == len(got)


def test_streaming_holds_back_what_may_become_a_call():
    hermes = T.SYNTAXES["hermes"]
    assert hermes.hold_back("Sure, <tool_") == len("Sure, ")
    assert hermes.hold_back("Sure, <tool_call>\n{") == len("Sure, ")
    assert hermes.hold_back("Sure, <b>") == len("Sure, <b>")
    llama = T.SYNTAXES["llama3_json"]
    assert llama.hold_back('  {"name"') == 0 and llama.hold_back("Plain text") == len("Plain text")


# --- the forcing grammar on the engine, each syntax ------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return day0jax.load(write_tiny_chat_checkpoint(tmp_path_factory.mktemp("tools"), name="tiny"), dtype="float32",
                        engine=EngineConfig(max_num_seqs=4, chunk_buckets=(128,), max_model_len=256, min_width=256))


@pytest.mark.parametrize("syntax", ["hermes", "mistral", "llama3_json", "deepseek_v3", "deepseek_v31", "kimi_k2"])
@pytest.mark.parametrize("only", [None, "get_time"])
def test_forced_calls_parse_and_validate_in_every_syntax(tiny, syntax, only):
    s = T.SYNTAXES[syntax]
    # One call: a random model given the choice of another call or the end might go on until max_tokens.
    grammar = tiny.grammars.lark(s.grammar(TOOLS, only, {}, parallel=False), "tool_choice")
    prompt = tiny.tokenizer.encode("Call a tool.")
    params = SamplingParams(max_tokens=160, temperature=1.0, seed=11, n=4, grammar=grammar)
    engine, texts = tiny.engine, {}
    engine.add_request("call", prompt, params)
    ids: dict[int, list[int]] = {}
    finish = {}
    while engine.has_work():
        for ev in engine.step():
            if ev.token is not None and not ev.stop_token:
                ids.setdefault(ev.index, []).append(ev.token)
            if ev.finish_reason:
                finish[ev.index] = ev.finish_reason
    texts = {i: tiny.tokenizer.decode(t) for i, t in ids.items()}
    assert set(finish.values()) == {"stop"}, (finish, texts)
    for text in texts.values():
        content, calls = s.parse(text, set(PARAMETERS))
        assert calls and not content.strip(), text
        assert len(calls) == 1
        for call in calls:
            check_call(call.name, call.arguments)
            assert only is None or call.name == only


def test_parallel_calls_grammar_allows_several():
    hermes, mistral = T.SYNTAXES["hermes"], T.SYNTAXES["mistral"]
    assert hermes.grammar(TOOLS, None, {}).startswith("start: call+")
    assert hermes.grammar(TOOLS, None, {}, parallel=False).startswith("start: call\n")
    assert '(", " body)*' in mistral.grammar(TOOLS, None, {}) and "*" not in mistral.grammar(TOOLS, None, {}, False)
    assert mistral.grammar(TOOLS, None, {"[TOOL_CALLS]": 9}).startswith("start: <[9]>")  # the special token


# --- the server ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Room for the tool descriptions in the prompt.
    ckpt = write_tiny_chat_checkpoint(tmp_path_factory.mktemp("tools-serve"), dict(CONFIG, max_position_embeddings=512),
                                      chat_template=HERMES)
    with serving(["--model", str(ckpt), "--max-num-seqs", "4", "--chunk-sizes", "128",
                 "--max-model-len", "512", "--min-width", "512"]) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


def test_required_tool_call_plain_and_streamed(client):
    for seed in range(3):
        r = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=120, temperature=1.0, seed=seed, parallel_tool_calls=False)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            check_call(call.function.name, call.function.arguments)
        stream = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, tools=TOOLS,
                                                tool_choice="required", max_tokens=120, temperature=1.0, seed=seed,
                                                parallel_tool_calls=False, stream=True)
        assembled: dict[int, dict] = {}
        finish = None
        for chunk in stream:
            delta = chunk.choices[0].delta
            assert not delta.content  # the call is never streamed as text
            for d in delta.tool_calls or []:
                entry = assembled.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in assembled.values()] == \
            [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]


def test_named_tool_choice_and_tool_history(client):
    r = client.chat.completions.create(
        model="tiny-chat", messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=1.0, seed=4,
        parallel_tool_calls=False, tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = r.choices[0].message.tool_calls
    assert calls and {c.function.name for c in calls} == {"get_time"}
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "12:00"}]
    follow = client.chat.completions.create(model="tiny-chat", messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=8, temperature=0)
    assert follow.choices[0].finish_reason in ("stop", "length") and follow.choices[0].message.tool_calls is None


def test_history_renders_arguments_as_objects(server):
    from day0jax.serve import protocol as P
    from day0jax.serve.constraints import template_message

    m = P.ChatMessage(role="assistant", tool_calls=[P.ToolCall(id="call_1", function=P.FunctionCall(
        name="get_time", arguments='{"zone": "UTC+1"}'))])
    assert template_message(m)["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC+1"}


@pytest.mark.parametrize("body,param,message", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters", "'uniqueItems' at #/properties/a"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "at most one of"),
])
def test_bad_tool_requests_are_400s(server, body, param, message):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny-chat", "messages": MESSAGES, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_tools_for_a_template_without_tool_support_are_a_400(tmp_path):
    ckpt = write_tiny_chat_checkpoint(tmp_path)  # SmolLM2's template never reads `tools`
    with serving(["--model", str(ckpt), "--max-num-seqs", "2", "--chunk-sizes", "128", "--max-model-len", "256",
                  "--min-width", "256", "--warmup", "none"], timeout=600) as proc:
        r = httpx.post(proc.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny-chat", "messages": MESSAGES, "max_tokens": 4, "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
        assert "no tool support" in r.json()["error"]["message"]


def test_without_a_key_only_loopback_and_bound_host_names_are_served(server):
    """DNS rebinding: a page whose name resolves to 127.0.0.1 sends its own name as Host."""
    for host in ("localhost", "127.0.0.1", f"127.0.0.1:{server.port}", "[::1]:80", "LOCALHOST:1"):
        assert httpx.get(server.url + "/v1/models", headers={"Host": host}).status_code == 200, host
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", ""):
        r = httpx.get(server.url + "/v1/models", headers={"Host": host})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", host
