"""The OpenAI-compatible server, live on loopback, driven by the official `openai` client, raw HTTP and
schemathesis: chat and completions (plain and streamed), the Responses API, /tokenize and /detokenize, concurrency,
clients that disconnect, the bad-input matrix, the API key, metrics.

One server per module (a tiny random Llama with SmolLM2's tokenizer and chat template; a few compiled shapes).
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serve_tiny import write_tiny_adapter, write_tiny_chat_checkpoint  # noqa: E402

from launch import ServerProcess  # noqa: E402

KEY = "test-key-123"
OTHER_KEY = "test-key-456"  # a second tenant's, from --api-key-file
MAX_CONNECTIONS = 128  # above the 40 concurrent streams a test opens, with the other tests' keep-alive connections
MODEL = "tiny-chat"
ADAPTER = "tiny-lora"  # a LoRA adapter served beside it


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = write_tiny_chat_checkpoint(tmp_path_factory.mktemp("serve"))
    adapter = write_tiny_adapter(ckpt.parent / "adapter")
    # One key comes from the environment, as a deployment would pass it, a second tenant's from a file.
    # Few compiled shapes (batch 1/2/4/8, one attention span, chunks 32/128) keep the warm-up short.
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"\n{OTHER_KEY}\n")
    proc = ServerProcess(["--model", str(ckpt), "--max-num-seqs", "8", "--chunk-sizes", "32,128",
                          "--max-model-len", "256", "--min-width", "256", "--api-key-file", str(keys),
                          "--max-connections", str(MAX_CONNECTIONS), "--lora-modules", f"{ADAPTER}={adapter}"],
                         env={"DAY0JAX_API_KEY": KEY})
    try:
        yield proc.wait_ready(900)
    finally:
        code = proc.terminate()
        assert code == 0, proc.log_text()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def headers():
    return {"Authorization": f"Bearer {KEY}"}


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", headers=headers()).text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_models_and_health(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL, ADAPTER]
    assert models[1].parent == MODEL and models[1].root.endswith("adapter")


def test_lora_adapter_is_chosen_by_model_and_shares_batches(server, client):
    """A request's `model` picks the adapter; base and adapter requests in flight together each give what they give
    alone, the adapter something else than the base; its responses name it; an unknown model is a 400."""
    def complete(model):
        r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0)
        assert r.model == model
        return r.choices[0].text

    alone = {m: complete(m) for m in (MODEL, ADAPTER)}
    assert alone[MODEL] != alone[ADAPTER]
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(complete, [MODEL, ADAPTER] * 3))
    assert together == [alone[MODEL], alone[ADAPTER]] * 3
    r = httpx.post(server.url + "/v1/chat/completions", headers=headers(), timeout=60,
                   json={"model": "tiny-lora-2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "model" and error["code"] == "model_not_found"
    assert f"{MODEL!r}, {ADAPTER!r}" in error["message"]


def test_chat_plain_and_streamed_give_the_same_text(client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    text = plain.choices[0].message.content
    assert plain.choices[0].finish_reason in ("stop", "length") and plain.usage.completion_tokens >= 1
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text and text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [plain.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    # The second call reused the first one's prompt pages.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"],
         "additionalProperties": False}


def test_responses_text_whole_and_streamed(client):
    """The Responses API on a model without reasoning: the greedy text chat completions give, as one message item
    whole and as its events streamed (created first, the deltas spelling the text, incomplete last when
    max_output_tokens cut it)."""
    question = "Name a color."
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                          max_tokens=12, temperature=0)
    r = client.responses.create(model=MODEL, input=question, max_output_tokens=12, temperature=0)
    assert r.output_text == chat.choices[0].message.content and [i.type for i in r.output] == ["message"]
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    with client.responses.stream(model=MODEL, input=question, max_output_tokens=12, temperature=0) as stream:
        events = list(stream)
    assert events[0].type == "response.created" and events[-1].type == f"response.{r.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output[0].content[0].text == r.output_text


def test_responses_json_schema(client):
    """text.format as a JSON schema, whole, streamed and through the client's parse helper."""
    from typing import Literal

    from pydantic import BaseModel

    fmt = {"format": {"type": "json_schema", "name": "color", "schema": COLOR, "strict": True}}
    r = client.responses.create(model=MODEL, input="Pick a color.", text=fmt, max_output_tokens=32, temperature=0)
    assert r.status == "completed" and json.loads(r.output_text)["color"] in ("red", "blue")
    with client.responses.stream(model=MODEL, input="Pick a color.", text=fmt, max_output_tokens=32,
                                 temperature=0) as stream:
        assert stream.get_final_response().output_text == r.output_text

    class Color(BaseModel):
        color: Literal["red", "blue"]

    parsed = client.responses.parse(model=MODEL, input="Pick a color.", text_format=Color, max_output_tokens=32,
                                    temperature=0)
    assert isinstance(parsed.output_parsed, Color)


def test_model_is_optional_and_tokenize_round_trips(server):
    """Without `model` every route serves the one model (as vLLM and llama.cpp do); /tokenize and /detokenize."""
    for route, body in [("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
                        ("completions", {"prompt": "hi", "max_tokens": 2}),
                        ("responses", {"input": "hi", "max_output_tokens": 2})]:
        r = httpx.post(f"{server.url}/v1/{route}", json=body, headers=headers(), timeout=60)
        assert r.status_code == 200 and r.json()["model"] == MODEL, r.text
    prompt = "Once upon a time, naïve 🤗"
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, headers=headers()).json()
    assert tokens["count"] == len(tokens["tokens"]) > 3 and tokens["max_model_len"] == 256
    back = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}, headers=headers())
    assert back.json() == {"prompt": prompt}
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": prompt}]},
                      headers=headers()).json()
    assert chat["count"] > tokens["count"]  # the template's turn markers around it
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401


def test_completions_with_logprobs_n_and_stop(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == r.usage.completion_tokens and all(len(t) == 3 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    # A stop string cuts the text before it and ends the choice with "stop".
    text = r.choices[0].text
    cut = text[3:6]
    if cut:
        s = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, stop=[cut])
        assert s.choices[0].text == text[:text.index(cut)] and s.choices[0].finish_reason == "stop"
    many = client.completions.create(model=MODEL, prompt=["a b c", "d e f"], max_tokens=5, n=2, temperature=1.0,
                                     seed=3)
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          logprobs=True, top_logprobs=2, temperature=0,
                                          extra_body={"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.2})
    assert all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)


def test_32_concurrent_requests(client):
    def one(i):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Count to {i}"}],
                                           max_tokens=8 + i % 8, temperature=0.7, seed=i)
        return r.choices[0].finish_reason, r.usage.completion_tokens

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert all(reason in ("stop", "length") and n >= 1 for reason, n in results)


def chat_body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def called_with(arguments: str) -> list[dict]:
    """A conversation whose assistant turn called a tool with `arguments`."""
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": arguments}}]}, {"role": "tool", "tool_call_id": "c1", "content": "x"}]


def tool_with(parameters) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


# One request of each kind of hostile input, by route: malformed JSON, values out of range, lone surrogates,
# unimplemented fields, too many sequences, token ids and biases out of range, a bad regex; deep nesting in a
# body, in tool-call arguments and in a schema; malformed and oversized schemas; grammars the offered tools forbid;
# a NUL in a media URL; images sent to a text model; echo; a body over the size limit; a wrong API key.
HOSTILE = [
    ("/v1/completions", b'{"model": "tiny-chat", "prompt": '),
    ("/v1/completions", b'{"model": "tiny-chat", "prompt": "x", "top_p": 7}'),
    ("/v1/completions", b'{"model": "tiny-chat", "prompt": "x\\ud800"}'),
    ("/v1/completions", b'{"model": "tiny-chat", "prompt": "x", "best_of": 4}'),
    ("/v1/completions", b'{"model": "tiny-chat", "prompt": ["x", "y"], "n": 200}'),
    ("/v1/completions", b'{"model": "tiny-chat", "prompt": [999999]}'),
    ("/v1/completions", b'{"model": "tiny-chat", "prompt": "x", "logit_bias": {"-3": 1}}'),
    ("/v1/completions", b'{"model": "tiny-chat", "prompt": "x", "guided_regex": "("}'),
    ("/v1/completions", b'{"model": "tiny-chat", "prompt": "x", "echo": true}'),
    ("/v1/chat/completions", chat_body(chat_template_kwargs={"x": json.loads("[" * 500 + "]" * 500)})),
    ("/v1/chat/completions", chat_body(messages=called_with("[" * 20000))),
    ("/v1/chat/completions", chat_body(guided_json=json.loads('{"items": ' * 300 + "{}" + "}" * 300))),
    ("/v1/chat/completions", chat_body(tools=tool_with({"type": "object", "properties": 5}))),
    ("/v1/chat/completions", chat_body(guided_json={"type": "object", "properties": {
        f"p{i}": {"type": "string"} for i in range(400)}})),
    ("/v1/chat/completions", chat_body(guided_choice=[str(i) for i in range(5000)])),
    ("/v1/chat/completions", chat_body(tools=tool_with({"type": "object"}), guided_regex="a+")),
    ("/v1/chat/completions", chat_body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///tmp/a\u0000.png"}}]}])),
    ("/v1/chat/completions", chat_body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}])),
    ("/v1/completions", b'{"model": "tiny-chat", "prompt": "' + b"x" * (5 << 20) + b'"}'),
    ("/v1/completions", b"wrong key"),
]


def test_a_storm_of_bad_requests_leaves_good_streams_untouched(server, client):
    """Greedy streams running while hostile requests (`HOSTILE`: one of each kind) keep arriving: every good stream
    gets exactly the text it gets alone, every bad request a 4xx in OpenAI's shape, and nothing is a 5xx."""
    prompts = [f"Tell me about item {i}" for i in range(4)]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0, extra_body={
        "ignore_eos": True}).choices[0].text for p in prompts]

    async def good(http, p):
        body = {"model": MODEL, "prompt": p, "max_tokens": 24, "temperature": 0, "stream": True, "ignore_eos": True}
        text = ""
        async with http.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def storm(http):
        codes = []
        for round_ in range(3):
            for route, body in HOSTILE:
                wrong_key = body == b"wrong key"
                r = await http.post(server.url + route, content=b'{"prompt": "x"}' if wrong_key else body,
                                    headers={"Content-Type": "application/json",
                                             **({"Authorization": "Bearer wrong"} if wrong_key else {})})
                codes.append(r.status_code)
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
        return codes

    async def main():
        async with httpx.AsyncClient(timeout=120, headers=headers()) as http:
            return await asyncio.gather(*(good(http, p) for p in prompts), storm(http))

    *texts, codes = asyncio.run(main())
    assert texts == alone
    assert all(400 <= c < 500 for c in codes), codes


def test_disconnecting_streams_free_their_blocks(server):
    baseline = metric(server, "day0jax_kv_blocks_used")

    async def client(i, drop: bool):
        body = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 60, "stream": True,
                "ignore_eos": True, "temperature": 0.8, "seed": i}
        async with httpx.AsyncClient(timeout=120, headers=headers()) as http:
            async with http.stream("POST", server.url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                chunks = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks += 1
                        if drop and chunks == 3:
                            return "dropped"  # closing the stream mid-way is the disconnect
                    if line == "data: [DONE]":
                        return chunks

    async def main():
        return await asyncio.gather(*(client(i, i % 5 == 0) for i in range(40)))

    results = asyncio.run(main())
    assert results.count("dropped") == 8
    assert all(r == "dropped" or r >= 60 for r in results), results  # the others got every token
    deadline = time.time() + 30
    while time.time() < deadline and metric(server, "day0jax_kv_blocks_used") != baseline:
        time.sleep(0.2)
    assert metric(server, "day0jax_kv_blocks_used") == baseline
    assert metric(server, "day0jax_num_requests_running") == 0


BAD = [
    ("malformed JSON", b'{"model": "tiny-chat", "messages": [', 400),
    ("a JSON array body", b'[{"role": "user", "content": "hi"}]', 400),
    ("missing messages", json.dumps({"model": MODEL}).encode(), 400),
    ("empty messages", json.dumps({"model": MODEL, "messages": []}).encode(), 400),
    ("negative max_tokens", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                        "max_tokens": -5}).encode(), 400),
    ("temperature as a string", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                            "temperature": "0.5"}).encode(), 400),
    ("top_p out of range", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                       "top_p": 1.5}).encode(), 400),
    ("unknown model", json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}).encode(), 400),
    ("a prompt far beyond the context", json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": "word " * 5000}]}).encode(), 400),
    # Nesting that parses but would exhaust the stack of a recursive step after parsing.
    ("template variables nested 980 deep", ('{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": '
                                            '{"x": ' + '{"a": ' * 980 + '1' + '}' * 980 + '}}').encode(), 400),
    ("tool-call arguments nested 100000 deep", json.dumps({"messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}]}]}).encode(), 400),
]


@pytest.mark.parametrize("name,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_matrix(server, name, body, status):
    r = httpx.post(server.url + "/v1/chat/completions", content=body,
                   headers={**headers(), "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("route,body,param", [
    ("chat/completions", '{"model": "tiny-chat", "messages": [{"role": "user", "content": "hi \\ud800"}]}',
     "messages[0].content"),
    ("chat/completions", '{"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], '
                         '"stop": ["a", "\\udfff"]}', "stop[1]"),
    ("completions", '{"model": "tiny-chat", "prompt": "x\\udc00y"}', "prompt"),
])
def test_lone_surrogates_are_400s_naming_the_field(server, route, body, param):
    r = httpx.post(f"{server.url}/v1/{route}", content=body.encode(), timeout=60,
                   headers={**headers(), "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "lone surrogate" in r.json()["error"]["message"]


@pytest.mark.parametrize("route,extra,status", [
    ("chat/completions", {"functions": [{"name": "f", "parameters": {}}]}, 400),
    ("chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, 400),
    ("chat/completions", {"store": True}, 400),
    ("chat/completions", {"store": False, "service_tier": "auto", "modalities": ["text"]}, 200),  # neutral values
    ("completions", {"best_of": 3}, 400),
    ("completions", {"suffix": " the end"}, 400),
    ("completions", {"echo": True}, 400),
    ("completions", {"best_of": 1, "suffix": None, "echo": False, "some_vendor_field": 1}, 200),
])
def test_unimplemented_openai_fields_are_refused_unless_neutral(server, route, extra, status):
    base = {"model": MODEL, "max_tokens": 2, **({"prompt": "x"} if route == "completions" else
                                                 {"messages": [{"role": "user", "content": "x"}]})}
    r = httpx.post(f"{server.url}/v1/{route}", json={**base, **extra}, headers=headers(), timeout=120)
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == next(k for k in extra if k != "store" or extra[k])


def test_more_sequences_than_the_queue_holds_is_a_400_not_a_429(server):
    r = httpx.post(server.url + "/v1/completions", headers=headers(), timeout=60,
                   json={"model": MODEL, "prompt": ["x"] * 32, "n": 16, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert "512 sequences" in r.json()["error"]["message"]


def test_metrics_labels_stay_bounded(server):
    for i in range(5):
        assert httpx.get(f"{server.url}/v1/probe-{i}", headers=headers()).status_code == 404
    text = httpx.get(server.url + "/metrics", headers=headers()).text
    assert "probe-" not in text
    assert re.search(r'day0jax_requests_total\{endpoint="other",status="404"\} [5-9]', text), text


def test_context_overflow_names_both_numbers(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hello " * 100, max_tokens=200)
    message = e.value.body["message"] if isinstance(e.value.body, dict) else str(e.value)
    assert "256" in message and "200" in message and re.search(r"\b10[0-9]\b", message), message


def test_bad_params_name_the_parameter(server):
    for field, value in [("max_tokens", -1), ("temperature", "hot"), ("top_p", 0), ("n", 100), ("top_k", 10 ** 12),
                         ("stop_token_ids", [2 ** 40])]:
        r = httpx.post(server.url + "/v1/completions", headers=headers(),
                       json={"model": MODEL, "prompt": "x", field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_with_a_key_every_route_but_health_needs_it(server):
    for path in ("/metrics", "/openapi.json", "/docs", "/v1/models"):
        r = httpx.get(server.url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        assert httpx.get(server.url + path, headers=headers()).status_code == 200, path
    assert httpx.get(server.url + "/health").status_code == 200
    # With a key, the Host header is not checked: the key is the protection.
    assert httpx.get(server.url + "/v1/models", headers={**headers(), "Host": "example.com"}).status_code == 200


def test_api_key_required(server):
    assert httpx.get(server.url + "/v1/models").status_code == 401
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key


def test_each_api_key_is_a_tenant_of_its_own_prefix_cache(server, client):
    """Two keys, two tenants: a prompt one key's request cached is a prefix hit for that key's next request and
    not for the other key's, whose own repeat then hits its own pages."""
    other = openai.OpenAI(base_url=server.url + "/v1", api_key=OTHER_KEY, max_retries=0, timeout=120)
    # A system message of its own: no page of this prompt is one another test's requests cached.
    messages = [{"role": "system", "content": "Tenants share no pages."},
                {"role": "user", "content": "one two three four " * 12}]

    def cached(c) -> int:
        r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
        return r.usage.prompt_tokens_details.cached_tokens
    assert cached(client) == 0
    assert cached(client) > 0
    assert cached(other) == 0
    assert cached(other) > 0


def test_idle_connections_past_the_limit_get_503_and_free_it_when_closed(server):
    """--max-connections open sockets (idle: no request sent) leave no room: the next request is a 503 answered
    before the app; once they close, requests are served again."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    idle = [socket.create_connection((host, int(port))) for _ in range(MAX_CONNECTIONS)]
    try:
        deadline = time.monotonic() + 30
        while True:  # (the server accepts the idle sockets asynchronously)
            r = httpx.get(server.url + "/health")
            if r.status_code == 503 or time.monotonic() > deadline:
                break
        assert r.status_code == 503
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 30
    while httpx.get(server.url + "/health").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(server.url + "/v1/models", headers=headers()).status_code == 200


def test_oversized_body_is_refused(server):
    r = httpx.post(server.url + "/v1/completions", headers=headers(), content=b"x" * (5 << 20))
    assert r.status_code == 413 and "error" in r.json()


def test_metrics(server, client):
    client.completions.create(model=MODEL, prompt="metrics please", max_tokens=3)
    text = httpx.get(server.url + "/metrics", headers=headers()).text
    for name in ["day0jax_requests_total", "day0jax_prompt_tokens_total", "day0jax_generation_tokens_total",
                 "day0jax_time_to_first_token_seconds_bucket", "day0jax_inter_token_latency_seconds_bucket",
                 "day0jax_num_requests_waiting", "day0jax_num_requests_running", "day0jax_kv_blocks_used",
                 "day0jax_kv_blocks_free", "day0jax_prefix_cache_hits_total"]:
        assert name in text, name
    assert metric(server, "day0jax_generation_tokens_total") > 0
    assert metric(server, "day0jax_prefix_cache_hits_total") > 0  # the chat test reused its prompt


@pytest.mark.parametrize("mode,with_key", [("positive", True), ("negative", True), ("positive", False)])
def test_schemathesis_finds_no_server_error(server, mode, with_key):
    """Fuzzing every route from the OpenAPI schema, with valid and with invalid data, with and without the key:
    no 5xx, every error in OpenAI's shape. Seeded and bounded, so it is the same run every time."""
    import schemathesis
    from hypothesis import HealthCheck, seed, settings

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", headers=headers())
    failures = []
    for op in schema.get_all_operations():
        operation = op.ok()
        if mode == "negative" and operation.method.upper() != "POST":
            continue  # a GET route without parameters has no invalid input to generate
        strategy = operation.as_strategy(schemathesis.GenerationMode(mode))

        @seed(1234)
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                  derandomize=True)
        @__import__("hypothesis").given(case=strategy)
        def check(case):
            if isinstance(case.body, dict):  # keep generated requests short: this is about validation
                for k in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                    if isinstance(case.body.get(k), int) and case.body[k] > 8:
                        case.body[k] = 8
                if isinstance(case.body.get("n"), int) and case.body["n"] > 2:
                    case.body["n"] = 2
                case.body["stream"] = False
            response = case.call(headers=headers() if with_key else {}, timeout=120)
            if response.status_code >= 500:
                failures.append((operation.label, case.body, response.status_code, response.text[:300]))
            elif response.status_code >= 400:
                error = response.json().get("error")
                if not (isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)):
                    failures.append((operation.label, case.body, response.status_code, "not OpenAI's error shape"))
            if not with_key and response.status_code != 401 and operation.path != "/health":
                failures.append((operation.label, case.body, response.status_code, "answered without the key"))

        check()
    assert not failures, failures[:5]
    assert httpx.get(server.url + "/health").status_code == 200


def test_invalid_utf8_in_a_body_is_a_400(server):
    r = httpx.post(server.url + "/v1/completions", content=b'{"model": "tiny-chat", "prompt": "x\xff\xfey"}',
                   headers={**headers(), "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text


def test_oversized_chunked_body_is_a_413(server):
    def chunks():  # no Content-Length: sent with chunked transfer encoding
        for _ in range(6):
            yield b"x" * (1 << 20)
    r = httpx.post(server.url + "/v1/completions", headers={**headers(), "Content-Type": "application/json"},
                   content=chunks(), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert httpx.get(server.url + "/health").status_code == 200
