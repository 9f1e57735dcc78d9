"""ASGI middleware run before any parsing: Host header (403), API key (401), body size (413), body read time (408);
counts /v1 responses, refusals included.

Without an API key the server trusts whoever can reach it, so it accepts only requests addressed to a loopback
name or to the address it is bound to: a web page on another site whose name an attacker points at 127.0.0.1 (DNS
rebinding) sends its own name as Host and is refused. With a key, every route but /health needs it (/metrics too,
unless --public-metrics). With several keys, each is a tenant whose prefix-cache hits stay its own.
"""

from __future__ import annotations

import asyncio
import hmac
import time

from fastapi.responses import JSONResponse

from day0jax.serve.errors import error_body
from day0jax.serve.state import ServerState


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})

# The /v1 routes the metrics name; any other path counts as "other", so probing unknown paths cannot grow the
# metrics without bound.
ROUTES = frozenset({"/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/responses"})


class GuardMiddleware:
    """Refuses oversized bodies (413), bodies not sent within `state.body_timeout` seconds (408) and, when an API key
    is set, /v1 requests without it (401).

    Args:
        app: the ASGI app it wraps.
        state: the server state (API key, body limits, metrics).
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, app, state: ServerState, clock=time.monotonic):
        self.app, self.state, self.clock = app, state, clock

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state, path = self.state, scope["path"]
        headers = dict(scope.get("headers") or [])

        async def counting_send(message):
            if message["type"] == "http.response.start" and path.startswith("/v1"):
                state.metrics.requests.labels(path if path in ROUTES else "other", str(message["status"])).inc()
            await send(message)

        if not state.api_keys and _host_name(headers.get(b"host", b"")) not in LOOPBACK_NAMES | {state.bound_host}:
            resp = JSONResponse(error_body("this server answers only requests addressed to it by a loopback name or "
                                           f"its address ({state.bound_host}); serve with an API key to accept "
                                           "others", "invalid_request_error", None, "host_not_allowed"),
                                status_code=403)
            return await resp(scope, receive, counting_send)
        public = path == "/health" or (path == "/metrics" and state.public_metrics)
        if state.api_keys and not public:
            auth = headers.get(b"authorization", b"").decode("latin-1")
            key = matching_key(state.api_keys, auth[7:] if auth.lower().startswith("bearer ") else "")
            if key is None:
                resp = JSONResponse(error_body("invalid or missing API key (send 'Authorization: Bearer KEY')",
                                               "authentication_error", None, "invalid_api_key"), status_code=401)
                return await resp(scope, receive, counting_send)
            if len(state.api_keys) > 1:  # the routes read it as `request.state.tenant`
                scope.setdefault("state", {})["tenant"] = f"api-key-{key}"
        limit = state.max_body_bytes
        length = headers.get(b"content-length")
        too_big = JSONResponse(error_body(f"the request body exceeds {limit} bytes", "invalid_request_error",
                                          None, "request_too_large"), status_code=413)
        if length is not None and length.isdigit() and int(length) > limit:
            return await too_big(scope, receive, counting_send)
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            # Read the body here, up to the limit and within the time allowed (uvicorn's timeouts do not cover a
            # body: a client sending one byte at a time would hold its connection forever; and the app's body
            # parser would turn an error raised from inside its reads into a 400), then hand the app the whole
            # body, joined once (appending each chunk to one bytes object would copy the body so far per chunk:
            # quadratic in many small chunks).
            chunks, size, more = [], 0, True
            deadline = self.clock() + state.body_timeout
            while more:
                try:
                    async with asyncio.timeout(deadline - self.clock()):
                        message = await receive()
                except TimeoutError:
                    message = None
                if message is None or self.clock() > deadline:
                    slow = JSONResponse(error_body(f"the request body was not sent within {state.body_timeout:g} "
                                                   "seconds", "invalid_request_error", None, "request_timeout"),
                                        status_code=408, headers={"Connection": "close"})
                    return await slow(scope, receive, counting_send)
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                chunks.append(chunk)
                size += len(chunk)
                more = message.get("more_body", False)
                if size > limit:
                    return await too_big(scope, receive, counting_send)
            replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

            async def replayed():
                return replay.pop() if replay else await receive()
            return await self.app(scope, replayed, counting_send)
        await self.app(scope, receive, counting_send)


def matching_key(keys: tuple[str, ...], token: str) -> int | None:
    """The index of the key `token` is, or None; every key is compared in full (constant time, no early exit), so
    timing does not tell how many keys there are before the match or how much of a guess is right."""
    match = None
    for i, key in enumerate(keys):
        if hmac.compare_digest(token.encode(), key.encode()):
            match = i
    return match


def _host_name(host: bytes) -> str:
    """The name in a Host header, without the port ("[::1]:8000" -> "::1")."""
    text = host.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text
