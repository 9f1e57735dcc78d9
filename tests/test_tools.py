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
from day0jax.engine.config import EngineConfig  # noqa: E402
from day0jax.engine.grammar import GrammarError  # noqa: E402
from day0jax.engine.requests import SamplingParams  # noqa: E402
from day0jax.serve import tools as T  # noqa: E402
from launch import serving  # noqa: E402

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
# Typed parameters, optional ones between required ones: what the XML-like, pythonic and Gemma 4 syntaxes write
# differently from JSON.
ALARM = {"type": "function", "function": {"name": "set_alarm", "parameters": {
    "type": "object", "properties": {
        "hour": {"type": "integer", "minimum": 0, "maximum": 23}, "label": {"type": "string", "maxLength": 12},
        "repeat": {"type": "boolean"},
        "days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "minItems": 1, "maxItems": 3}},
    "required": ["hour", "days"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS + [ALARM]}


def check_call(name: str, arguments: str) -> None:
    assert name in PARAMETERS
    jsonschema_rs.validate(PARAMETERS[name], json.loads(arguments))


# --- syntaxes and parsers -----------------------------------------------------------------------------------------

# Qwen3.5's shape: XML-like tags per argument, strings bare.
QWEN35 = """{%- if tools %}<|im_start|>system
<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>
Call functions like this: <tool_call>
<function=f>
<parameter=x>
1
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
<function={{ call.function.name }}>
{% for k, v in call.function.arguments.items() %}<parameter={{ k }}>
{{ v if v is string else v | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
DEEPSEEK_V3 = """{% for m in messages %}{% if m.tool_calls %}<｜tool▁calls▁begin｜>{% for t in m.tool_calls %}\
<｜tool▁call▁begin｜>{{ t.type }}<｜tool▁sep｜>{{ t.function.name }}\n```json\n{{ t.function.arguments | tojson }}\n```\
<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜>{% else %}{{ m.content }}{% endif %}{% endfor %}{{ tools }}"""
DEEPSEEK_V31 = DEEPSEEK_V3.replace("{{ t.type }}<｜tool▁sep｜>{{ t.function.name }}\n```json\n", "{{ t.function.name }}"
                                   "<｜tool▁sep｜>").replace("\n```\\\n", "")
KIMI = """{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}\
<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>"""


def test_syntax_is_read_from_the_template():
    assert T.syntax_of(HERMES).name == "hermes"
    assert T.syntax_of(QWEN35).name == "qwen3_coder"
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
    assert T.syntax_of(glm).name == "glm47"  # contains <tool_call>, but is not Hermes JSON
    assert T.syntax_of(glm.replace("</arg_key><arg_value>", "</arg_key>\n<arg_value>")).name == "glm45"
    for mark, name in [("<function=", "qwen3_coder"), ("<seed:tool_call>", "seed_oss"), ("｜DSML｜", "deepseek_v32"),
                       ("<minimax:tool_call>", "minimax_m2"), ("<|tool_call_start|>", "lfm2"),
                       ("<|tool_call>", "gemma4"), ("[TOOL_CALLS]{{ name }}[ARGS]", "mistral_args")]:
        assert T.syntax_of("{% if tools %}<tool_call>" + mark + "{% endif %}").name == name, mark
    assert T.syntax_of("{% if tools %}<|start|>assistant to=functions.{{ name }}{% endif %}").name == "harmony"


PARSE_CASES = [
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
    ("qwen3_coder", 'Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n'
     '<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=set_alarm>\n'
     '<parameter=hour>\n7\n</parameter>\n<parameter=days>\n["mon", "tue"]\n</parameter>\n<parameter=label>\n42\n'
     '</parameter>\n</function>\n</tool_call>', "Checking.\n",
     [("get_weather", {"city": "Oslo", "unit": "celsius"}),
      ("set_alarm", {"hour": 7, "days": ["mon", "tue"], "label": "42"})]),  # a string parameter stays a string
    ("qwen3_coder", '<tool_call>\n<function=get_time>\nzone=UTC\n</function>\n</tool_call>', None, []),  # no tags
    ("qwen3_coder", '<tool_call>\n<function=rm>\n<parameter=path>\n/\n</parameter>\n</function>\n</tool_call>', None,
     []),
    ("seed_oss", '<seed:tool_call>\n<function=get_time>\n<parameter=zone>UTC-5</parameter>\n</function>\n'
     '</seed:tool_call>', "", [("get_time", {"zone": "UTC-5"})]),
    ("glm45", 'Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n'
     '<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n</tool_call>', "Sure.\n",
     [("get_weather", {"city": "Rome", "unit": "celsius"})]),
    ("glm47", '<tool_call>set_alarm<arg_key>hour</arg_key><arg_value>6</arg_value><arg_key>repeat</arg_key>'
     '<arg_value>true</arg_value><arg_key>days</arg_key><arg_value>["wed"]</arg_value></tool_call>', "",
     [("set_alarm", {"hour": 6, "repeat": True, "days": ["wed"]})]),
    ("minimax_m2", 'Ok<minimax:tool_call>\n<invoke name="get_time">\n<parameter name="zone">UTC+2</parameter>\n'
     '</invoke>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n<parameter name="unit">'
     'celsius</parameter>\n</invoke>\n</minimax:tool_call>', "Ok",
     [("get_time", {"zone": "UTC+2"}), ("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("deepseek_v32", '<｜DSML｜function_calls>\n<｜DSML｜invoke name="set_alarm">\n<｜DSML｜parameter name="hour" '
     'string="false">9</｜DSML｜parameter>\n<｜DSML｜parameter name="label" string="true">true</｜DSML｜parameter>\n'
     '<｜DSML｜parameter name="days" string="false">["mon"]</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
     '</｜DSML｜function_calls>', "", [("set_alarm", {"hour": 9, "label": "true", "days": ["mon"]})]),
    ("lfm2", '<|tool_call_start|>[get_time(zone="UTC+3"), set_alarm(hour=5, repeat=True, days=[\'tue\'])]'
     '<|tool_call_end|>', "", [("get_time", {"zone": "UTC+3"}), ("set_alarm", {"hour": 5, "repeat": True,
                                                                                "days": ["tue"]})]),
    ("lfm2", '<|tool_call_start|>[get_time("UTC")]<|tool_call_end|>', None, []),  # positional: not a call
    ("lfm2", '<|tool_call_start|>[get_time(zone=os.getcwd())]<|tool_call_end|>', None, []),  # not a literal
    ("gemma4", '<|tool_call>call:set_alarm{hour:8,label:<|"|>a, b: {c}<|"|>,days:[<|"|>mon<|"|>]}<tool_call|>'
     '<|tool_call>call:get_time{zone:<|"|>UTC+0<|"|>}<tool_call|>', "",
     [("set_alarm", {"hour": 8, "label": "a, b: {c}", "days": ["mon"]}), ("get_time", {"zone": "UTC+0"})]),
    ("gemma4", '<|tool_call>call:get_time{zone:<|"|>UTC+0}<tool_call|>', None, []),  # unterminated string
    ("mistral_args", '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC-1"}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", '
     '"unit": "celsius"}', "", [("get_time", {"zone": "UTC-1"}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]),
    ("harmony", '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone": "UTC+1"}', "",
     [("get_time", {"zone": "UTC+1"})]),
    # The recipient before the channel, as the template writes earlier calls, after text of the final channel.
    ("harmony", 'Sure.<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "UTC-2"}'
     '<|call|>', "Sure.", [("get_time", {"zone": "UTC-2"})]),
    ("harmony", '<|channel|>commentary to=functions.rm <|constrain|>json<|message|>{}', None, []),
    ("harmony", '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone": ', None, []),
]


@pytest.mark.parametrize("syntax,text,content,calls", PARSE_CASES)
def test_parsers(syntax, text, content, calls):
    got_content, got = T.SYNTAXES[syntax].parse(text, PARAMETERS)
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


_SAMPLED: dict = {}


def sample_calls(tiny, syntax: str, only: str | None) -> list[str]:
    """Four texts sampled (temperature 1) under the grammar forcing one call in `syntax` (of `only`, or any of
    TOOLS and ALARM); each finished with "stop". Kept per (syntax, only): the reference comparison reads them too."""
    if (syntax, only) not in _SAMPLED:
        # One call: a random model given the choice of another call or the end might go on until max_tokens.
        source = T.SYNTAXES[syntax].grammar(TOOLS + [ALARM], only, {}, parallel=False)
        params = SamplingParams(max_tokens=240, temperature=1.0, seed=11, n=4,
                                grammar=tiny.grammars.lark(source, "tool_choice"))
        tiny.engine.add_request("call", tiny.tokenizer.encode("Call a tool."), params)
        ids: dict[int, list[int]] = {}
        finish = {}
        while tiny.engine.has_work():
            for ev in tiny.engine.step():
                if ev.token is not None and not ev.stop_token:
                    ids.setdefault(ev.index, []).append(ev.token)
                if ev.finish_reason:
                    finish[ev.index] = ev.finish_reason
        texts = [tiny.tokenizer.decode(t) for _, t in sorted(ids.items())]
        assert set(finish.values()) == {"stop"}, (finish, texts)
        _SAMPLED[syntax, only] = texts
    return _SAMPLED[syntax, only]


@pytest.mark.parametrize("syntax", list(T.SYNTAXES))
@pytest.mark.parametrize("only", [None, "set_alarm"])
def test_forced_calls_parse_and_validate_in_every_syntax(tiny, syntax, only):
    for text in sample_calls(tiny, syntax, only):
        content, calls = T.SYNTAXES[syntax].parse(text, PARAMETERS)
        assert calls and not content.strip(), text
        assert len(calls) == 1
        for call in calls:
            check_call(call.name, call.arguments)
            assert only is None or call.name == only


def test_parsers_match_transformers_response_parser(tiny, tmp_path):
    """Qwen3.5's <function=...> calls and Gemma 4's calls read as transformers' response parser reads them: the
    well-formed hand-written cases above and the texts sampled under the forcing grammars (transformers raises on
    malformed calls, where day0jax leaves the text as content)."""
    from conftest import run_reference

    cases = [(syntax, text) for syntax, text, _, calls in PARSE_CASES if syntax in ("qwen3_coder", "gemma4") and calls]
    cases += [(syntax, text) for syntax in ("qwen3_coder", "gemma4") for only in (None, "set_alarm")
              for text in sample_calls(tiny, syntax, only)]
    family = {"qwen3_coder": "qwen3_5", "gemma4": "gemma4"}
    tools = [t["function"] for t in TOOLS + [ALARM]]
    out = tmp_path / "parsed.json"
    run_reference([{"op": "parse_tools", "out": str(out), "cases": [
        {"family": family[syntax], "text": text, "tools": [{"type": "function", "function": f} for f in tools]}
        for syntax, text in cases]}], tmp_path)
    for (syntax, text), ref in zip(cases, json.loads(out.read_text())):
        content, calls = T.SYNTAXES[syntax].parse(text, PARAMETERS)
        assert [[c.name, json.loads(c.arguments)] for c in calls] == ref["calls"], text
        assert content.strip() == (ref["content"] or "").strip(), text


def test_parallel_calls_grammar_allows_several():
    hermes, mistral = T.SYNTAXES["hermes"], T.SYNTAXES["mistral"]
    assert hermes.grammar(TOOLS, None, {}).startswith("start: call+")
    assert hermes.grammar(TOOLS, None, {}, parallel=False).startswith("start: call\n")
    assert '(", " body)*' in mistral.grammar(TOOLS, None, {}) and "*" not in mistral.grammar(TOOLS, None, {}, False)
    assert mistral.grammar(TOOLS, None, {"[TOOL_CALLS]": 9}).startswith("start: <[9]>")  # the special token


@pytest.mark.parametrize("syntax", list(T.SYNTAXES))
def test_every_grammar_compiles_parallel_and_with_special_tokens(tiny, syntax):
    s = T.SYNTAXES[syntax]
    tiny.grammars.lark(s.grammar(TOOLS + [ALARM], None, {}, parallel=True), "tool_choice")
    # The syntax's special strings, as a tokenizer holding them as tokens would have them (the tiny one does not:
    # ids of ordinary tokens stand in, so the grammar compiles but is not sampled).
    special = {t: 100 + i for i, t in enumerate(s.specials)}
    source = s.grammar(TOOLS + [ALARM], "set_alarm", special)
    assert not s.marker or source.startswith("start: ") and f"<[{special[s.marker]}]>" in source, source
    tiny.grammars.lark(source, "tool_choice")


def test_grammars_refuse_what_a_syntax_cannot_force():
    dated = {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]}}}
    with pytest.raises(GrammarError, match="book.day: string format 'date'"):
        T.SYNTAXES["qwen3_coder"].grammar([dated], None, {})
    untyped = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {}}, "required": ["x"]}}}
    with pytest.raises(GrammarError, match="f.x: a parameter without a type"):
        T.SYNTAXES["gemma4"].grammar([untyped], None, {})
    assert "%json" in T.SYNTAXES["hermes"].grammar([dated], None, {})  # JSON syntaxes hold formats as JSON does


def test_gemma4_nested_arrays_and_objects(tiny):
    grid = {"name": "grid", "parameters": {"type": "object", "properties": {
        "rows": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 2}},
        "origin": {"type": "object", "properties": {"x": {"type": "number"}, "label": {"type": "string"}},
                   "required": ["x"]}}, "required": ["rows", "origin"]}}
    source = T.SYNTAXES["gemma4"].grammar([{"type": "function", "function": grid}], None, {})
    assert "item0:" in source and "item1:" in source  # one rule per array level
    tiny.grammars.lark(source, "tool_choice")
    text = '<|tool_call>call:grid{rows:[[1,2],[3]],origin:{x:-0.5,label:<|"|>a "b"<|"|>}}<tool_call|>'
    _, calls = T.SYNTAXES["gemma4"].parse(text, {"grid": grid["parameters"]})
    assert json.loads(calls[0].arguments) == {"rows": [[1, 2], [3]], "origin": {"x": -0.5, "label": 'a "b"'}}


def test_optional_parameters_around_required_ones():
    """Lark sequences with optional items: separators only between the items present."""
    from day0jax.serve.tools.base import sequence

    assert sequence(["a", "b", "c"], [False, True, False], ", ") == '(a ", ")? b (", " c)?'
    assert sequence(["a", "b"], [False, False], ",") == '(a ("," b)? | b)?'
    assert sequence([], [], ",") == ""


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
def hermes_client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def qwen35_client(tmp_path_factory):
    ckpt = write_tiny_chat_checkpoint(tmp_path_factory.mktemp("tools-qwen35"),
                                      dict(CONFIG, max_position_embeddings=512), chat_template=QWEN35)
    with serving(["--model", str(ckpt), "--max-num-seqs", "4", "--chunk-sizes", "128",
                 "--max-model-len", "512", "--min-width", "512"]) as proc:
        yield openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(params=["hermes", "qwen35"])
def client(request):
    """The server with a Hermes-style template, and with a Qwen3.5-style one (XML-like tags, not JSON)."""
    return request.getfixturevalue(f"{request.param}_client")


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


def test_responses_function_call_round_trip(hermes_client):
    """The Responses API: a forced call comes back as a function_call item (its arguments streamed in one delta),
    and that item with its output, sent back as input, renders through the template for the next answer."""
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    first = hermes_client.responses.create(model="tiny-chat", input=MESSAGES, tools=tools, tool_choice="required",
                                           parallel_tool_calls=False, max_output_tokens=120, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1, first.output
    check_call(calls[0].name, calls[0].arguments)
    follow = MESSAGES + [item.model_dump(exclude_none=True) for item in first.output] + [
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "12:00"}]
    second = hermes_client.responses.create(model="tiny-chat", input=follow, tools=tools, tool_choice="none",
                                            max_output_tokens=8, temperature=0)
    assert [item.type for item in second.output] == ["message"]
    with hermes_client.responses.stream(model="tiny-chat", input=MESSAGES, tools=tools, tool_choice="required",
                                        parallel_tool_calls=False, max_output_tokens=120, temperature=0) as stream:
        events = list(stream)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [calls[0].arguments]


def test_history_renders_arguments_as_objects(server):
    from day0jax.serve import protocol as P
    from day0jax.serve.render import template_message

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
