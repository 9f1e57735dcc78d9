"""The guard middleware alone, as an ASGI app over fake receive and send: a body must arrive whole within the time
allowed (408 otherwise), whether it stalls or trickles; within it the app gets the body once, joined."""

from __future__ import annotations

import asyncio
import json

from day0jax.serve.middleware import GuardMiddleware
from day0jax.serve.state import ServerState


class FakeClock:
    """Seconds that pass only when the test says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scope(length: int | None = None) -> dict:
    headers = [(b"host", b"127.0.0.1")] + ([(b"content-length", str(length).encode())] if length is not None else [])
    return {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}


def run(receive, state: ServerState, clock=None, length: int | None = None) -> tuple[list[bytes], list[dict]]:
    """(the bodies the wrapped app read, the messages sent) for one request."""
    bodies, sent = [], []

    async def app(scope, receive, send):
        message = await receive()
        bodies.append(message["body"])

    async def send(message):
        sent.append(message)

    guard = GuardMiddleware(app, state, **({"clock": clock} if clock else {}))
    # The outer timeout only keeps a guard that waits forever from hanging the suite; the guard's own is far shorter.
    asyncio.run(asyncio.wait_for(guard(scope(length), receive, send), 60))
    return bodies, sent


def status(sent: list[dict]) -> int:
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def test_a_body_that_never_arrives_is_a_408():
    async def stalled():
        await asyncio.Event().wait()  # a client that sent its headers and nothing more
    bodies, sent = run(stalled, ServerState(model_name="m", body_timeout=0.01), length=10)
    assert bodies == [] and status(sent) == 408
    error = json.loads(b"".join(m.get("body", b"") for m in sent))["error"]
    assert error["code"] == "request_timeout" and "0.01 seconds" in error["message"]


def test_a_body_trickled_byte_by_byte_is_cut_off_at_the_timeout():
    """Each byte arrives at once, one second apart: the whole body's time counts, not each read's."""
    clock, reads = FakeClock(), []

    async def trickle():
        clock.now += 1.0
        reads.append(clock.now)
        return {"type": "http.request", "body": b"x", "more_body": True}
    for length in (None, 1000):  # chunked, and with a Content-Length
        reads.clear()
        bodies, sent = run(trickle, ServerState(model_name="m", body_timeout=30), clock, length)
        assert bodies == [] and status(sent) == 408 and len(reads) == 31


def test_a_body_within_the_timeout_reaches_the_app_whole():
    clock, parts = FakeClock(), [b'{"prompt": ', b'"hi"', b"}"]

    async def receive():
        clock.now += 9.0
        part = parts.pop(0)
        return {"type": "http.request", "body": part, "more_body": bool(parts)}
    bodies, sent = run(receive, ServerState(model_name="m", body_timeout=30), clock, 16)
    assert bodies == [b'{"prompt": "hi"}'] and sent == []
