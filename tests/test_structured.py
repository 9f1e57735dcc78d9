"""Structured output on the real default model (SmolLM2-135M-Instruct): JSON schemas, any JSON object, regexes,
choices and logit biases through `Model.generate` and through the server with the official `openai` client; the
grammar's mask applied on the device inside the sampler, constrained and free requests sharing decode steps.

Sampled outputs (temperature 1, 20 seeds per schema, through the server) must each parse and validate: a grammar
that leaked one token would fail some seed. Bad schemas, regexes and combinations are 400s naming the field and
keyword.
"""

from __future__ import annotations

import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jax.numpy as jnp
import jsonschema_rs
import numpy as np
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import day0jax  # noqa: E402
from day0jax.engine import sampling  # noqa: E402
from day0jax.engine.config import EngineConfig  # noqa: E402
from day0jax.engine.grammar import (  # noqa: E402
    GrammarError, malformed_schema_keywords, unsupported_schema_keywords)
from day0jax.engine.requests import SamplingParams  # noqa: E402
from launch import serving  # noqa: E402

ENGINE = EngineConfig(max_num_seqs=16, chunk_buckets=(32, 128), max_model_len=512, min_width=512)
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]}}, "required": ["name", "age", "role"],
    "additionalProperties": False}
INVENTORY = {"type": "object", "properties": {
    "items": {"type": "array", "minItems": 1, "maxItems": 3,
              "items": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                                                         "count": {"type": "integer", "minimum": 1, "maximum": 99}},
                        "required": ["sku", "count"], "additionalProperties": False}},
    "in_stock": {"type": "boolean"}}, "required": ["items", "in_stock"], "additionalProperties": False}
ANSWER = {"type": "object", "properties": {
    "kind": {"const": "answer"},
    "value": {"anyOf": [{"type": "number"}, {"type": "string", "maxLength": 8}, {"type": "null"}]}},
    "required": ["kind", "value"], "additionalProperties": False}
SCHEMAS = {"person": PERSON, "inventory": INVENTORY, "answer": ANSWER}
SEEDS = 20


@pytest.fixture(scope="module")
def model(smollm2):
    return day0jax.load(smollm2["ckpt_gguf"], dtype="float32", engine=ENGINE)


def chat(model, text: str) -> list[int]:
    return model.tokenizer.apply_chat_template([{"role": "user", "content": text}])


# --- the pieces -------------------------------------------------------------------------------------------------

def test_guidance_masks_and_biases_on_the_device():
    logits = jnp.zeros((2, 70), jnp.float32)
    allowed = np.zeros((2, 3), np.int32)
    allowed[0, 0] = 1 << 5  # row 0: token 5 only
    allowed[1, 2] = np.int32(-(1 << 31))  # row 1: token 2 * 32 + 31 = 95 is past the vocabulary: nothing allowed
    allowed[1, 1] = np.int32(-(1 << 31) | 1 << 2)  # and tokens 34, 63 (bit 31: the sign bit)
    ids, bias = np.zeros((2, sampling.MAX_LOGIT_BIAS), np.int32), np.zeros((2, sampling.MAX_LOGIT_BIAS), np.float32)
    ids[1, :2], bias[1, :2] = [63, 7], [5.0, 50.0]
    out = np.asarray(sampling.apply_guidance(logits, jnp.asarray(allowed), jnp.asarray(ids), jnp.asarray(bias)))
    assert np.isfinite(out[0]).nonzero()[0].tolist() == [5]
    assert np.isfinite(out[1]).nonzero()[0].tolist() == [34, 63] and out[1, 63] == 5.0 and out[1, 34] == 0.0


def test_unsupported_schema_keywords_are_named_with_their_place():
    schema = {"type": "object", "title": "t", "properties": {
        "if": {"type": "string", "contentEncoding": "base64"},  # a property named like a keyword is a name
        "x": {"anyOf": [{"type": "integer"}, {"not": {"type": "null"}}]}},
        "dependentRequired": {"x": ["if"]}}
    assert unsupported_schema_keywords(schema) == [
        "'dependentRequired' at #", "'contentEncoding' at #/properties/if", "'not' at #/properties/x/anyOf/1"]
    assert unsupported_schema_keywords(PERSON) == unsupported_schema_keywords(INVENTORY) == []



def test_malformed_schema_keywords_are_named_with_what_they_must_be():
    schema = {"type": "object", "required": "a", "properties": {
        "a": {"type": "text", "minLength": -1, "maxLength": True, "pattern": 5},
        "b": {"enum": [], "items": 3, "multipleOf": 0}, "c": 7}, "anyOf": []}
    assert malformed_schema_keywords(schema) == [
        "'required' at # must be a list of strings", "'anyOf' at # must be a non-empty list of schemas",
        "'type' at #/properties/a must be one of string, number, integer, boolean, object, array, null or a "
        "non-empty list of them", "'minLength' at #/properties/a must be a non-negative integer",
        "'maxLength' at #/properties/a must be a non-negative integer",
        "'pattern' at #/properties/a must be a string (a regular expression)",
        "'enum' at #/properties/b must be a non-empty list", "'items' at #/properties/b must be a schema (an object "
        "or a boolean)", "'multipleOf' at #/properties/b must be a number above 0",
        "the schema at #/properties/c must be an object or a boolean, not int"]
    assert malformed_schema_keywords(PERSON) == malformed_schema_keywords(INVENTORY) == []


def test_schema_checks_walk_any_depth_without_recursion():
    schema: dict = {"type": "string"}
    for _ in range(5000):  # far past Python's recursion limit
        schema = {"type": "array", "items": schema}
    assert unsupported_schema_keywords(schema) == malformed_schema_keywords(schema) == []


# --- Model.generate ------------------------------------------------------------------------------------------------

def test_generate_takes_a_json_schema(model):
    prompts = [chat(model, f"Reply with JSON person record number {i}.") for i in range(4)]
    for out in model.generate(prompts, 96, temperature=1.0, seed=7, json_schema=PERSON):
        jsonschema_rs.validate(PERSON, json.loads(model.tokenizer.decode(out, skip_special_tokens=True)))


def test_any_json_object_regex_and_choice(model):
    ask = chat(model, "Give a JSON object with a name and an age.")
    obj = json.loads(model.tokenizer.decode(model.generate([ask], 64, json_schema={"type": "object"})[0],
                                            skip_special_tokens=True))
    assert isinstance(obj, dict)
    phone = model.generate([chat(model, "Give me a phone number.")] * 4, 16, temperature=1.0, seed=3,
                           regex=r"\(\d{3}\) \d{3}-\d{4}")
    for out in phone:
        assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", model.tokenizer.decode(out, skip_special_tokens=True))
    options = ["red", "green", "blue", "ultraviolet"]
    picks = model.generate([chat(model, "Pick a color.")] * 6, 8, temperature=1.5, seed=5, choice=options)
    assert {model.tokenizer.decode(p, skip_special_tokens=True) for p in picks} <= set(options)


def test_constrained_and_free_requests_share_steps_and_the_free_ones_are_unchanged(model):
    story = model.tokenizer.encode("Once upon a time,")
    alone = model.generate([story], 12, ignore_eos=True)[0]
    engine = model.engine
    engine.add_request("free", story, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    engine.add_request("guided", chat(model, "Yes or no?"), SamplingParams(
        max_tokens=12, temperature=0.0, grammar=model.grammars.choice(["yes", "no"])))
    out: dict[str, list[int]] = {"free": [], "guided": []}
    batches = []
    while engine.has_work():
        for event in engine.step():
            if event.token is not None:
                out[event.request_id].append(event.token)
        batches.append(len(engine.scheduler.running))
    assert out["free"] == alone
    assert model.tokenizer.decode(out["guided"], skip_special_tokens=True) in ("yes", "no")
    assert max(batches) == 2  # both rows ran in the same steps


def test_logit_bias_steers_and_forbids(model):
    story = model.tokenizer.encode("Once upon a time,")
    first = model.generate([story], 1)[0][0]
    assert model.generate([story], 1, logit_bias={first: -100.0})[0][0] != first
    target = model.tokenizer.encode(" dragon", add_special_tokens=False)[0]
    assert model.generate([story], 1, logit_bias={target: 100.0})[0][0] == target


def test_bad_constraints_are_grammar_errors(model):
    story = model.tokenizer.encode("Hi")
    with pytest.raises(GrammarError, match="'patternProperties'|not supported|'not' at #"):
        model.generate([story], 4, json_schema={"type": "object", "not": {"type": "null"}})
    with pytest.raises(GrammarError, match="at most one of json_schema, regex and choice"):
        model.generate([story], 4, regex="a+", choice=["a"])
    with pytest.raises(GrammarError, match="invalid regex"):
        model.generate([story], 4, regex="(unclosed")


def test_a_grammar_that_compiles_too_long_is_a_400_for_that_request(monkeypatch):
    """The compile runs off the event loop with a deadline; here it is held until the deadline has passed."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from day0jax.serve import protocol as P
    from day0jax.serve import constrain as constraints
    from day0jax.serve.errors import APIError

    release = threading.Event()

    class HeldCompiler:
        def regex(self, pattern, param="guided_regex"):
            release.wait(60)
            raise GrammarError("released", param)

    state = SimpleNamespace(model=SimpleNamespace(grammars=HeldCompiler()))
    body = P.CompletionRequest(model="m", prompt="x", guided_regex="a+")
    monkeypatch.setattr(constraints, "GRAMMAR_SECONDS", 0.05)

    async def request():
        try:
            return await constraints.guidance(state, body)
        finally:
            release.set()  # lets the compile thread end, so the loop can close

    with pytest.raises(APIError) as error:
        asyncio.run(request())
    assert error.value.status == 400 and error.value.param == "guided_regex"
    assert "took longer than 0.05 s to compile" in error.value.message


# --- the server ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(smollm2):
    with serving(["--model", str(smollm2["ckpt_gguf"]), "--dtype", "float32", "--max-num-seqs", "16",
                 "--chunk-sizes", "32,128", "--max-model-len", "512", "--min-width", "512"]) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def model_name(client) -> str:
    return client.models.list().data[0].id


def test_schema_outputs_parse_and_validate_for_every_seed(client):
    """SEEDS sampled completions per schema through the official client, sent at once (they share decode steps):
    every one that stops parses and validates, and sampling really varied them."""
    name = model_name(client)

    def ask(job):
        schema_name, seed = job
        fmt = {"type": "json_schema", "json_schema": {"name": schema_name, "schema": SCHEMAS[schema_name]}}
        r = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": f"Reply with a JSON {schema_name} record."}],
            max_tokens=128, temperature=1.0, seed=seed, response_format=fmt)
        return schema_name, r.choices[0]

    with ThreadPoolExecutor(len(SCHEMAS) * SEEDS) as pool:
        results = list(pool.map(ask, [(n, seed) for n in SCHEMAS for seed in range(SEEDS)]))
    texts = {n: set() for n in SCHEMAS}
    for schema_name, choice in results:
        assert choice.finish_reason == "stop", choice
        jsonschema_rs.validate(SCHEMAS[schema_name], json.loads(choice.message.content))
        texts[schema_name].add(choice.message.content)
    assert all(len(t) > 1 for t in texts.values()), texts


def test_response_format_json_schema_plain_and_streamed(client):
    name = model_name(client)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    messages = [{"role": "user", "content": "Reply with a JSON person record."}]
    plain = client.chat.completions.create(model=name, messages=messages, max_tokens=96, temperature=0,
                                           response_format=fmt)
    assert plain.choices[0].finish_reason == "stop"
    text = plain.choices[0].message.content
    jsonschema_rs.validate(PERSON, json.loads(text))
    chunks = list(client.chat.completions.create(model=name, messages=messages, max_tokens=96, temperature=0,
                                                 response_format=fmt, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    cut = client.chat.completions.create(model=name, messages=messages, max_tokens=3, temperature=0,
                                         response_format=fmt)
    assert cut.choices[0].finish_reason == "length"


def test_json_object_guided_choice_and_regex_on_both_routes(client):
    name = model_name(client)
    obj = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "A cat, as JSON."}],
                                         max_tokens=64, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    pick = client.completions.create(model=name, prompt="The best color is", max_tokens=8, temperature=1.0, n=4,
                                     seed=1, extra_body={"guided_choice": ["red", "green", "blue"]})
    assert {c.text for c in pick.choices} <= {"red", "green", "blue"}
    year = client.completions.create(model=name, prompt="The moon landing was in", max_tokens=8, temperature=0,
                                     extra_body={"guided_regex": r" (19|20)\d\d"})
    assert re.fullmatch(r" (19|20)\d\d", year.choices[0].text)
    record = client.completions.create(model=name, prompt="A person, as JSON:", max_tokens=96, temperature=0,
                                       extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                           "name": "person", "schema": PERSON}}})
    jsonschema_rs.validate(PERSON, json.loads(record.choices[0].text))


@pytest.mark.parametrize("body,param,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "contentEncoding": "base64"}}}}}},
     "response_format.json_schema.schema", "'contentEncoding' at #/properties/a"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema",
     "needs json_schema.schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "invalid regex"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "at most one of"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty strings"),
    ({"logit_bias": {"dragon": 5}}, "logit_bias", "token ids"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias", "outside the vocabulary"),
    ({"logit_bias": {"5": 500}}, "logit_bias", r"\[-100, 100\]"),
])
def test_bad_structured_requests_are_400s_naming_the_field(server, client, body, param, message):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": model_name(client), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and re.search(message, error["message"]), error
