"""ASGI middleware run before any parsing: API key (401), body size (413); counts /v1 responses, refusals included."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from day0jax.serve.errors import error_body
from day0jax.serve.state import ServerState


class _BodyTooLarge(Exception):
    pass


class GuardMiddleware:
    """Refuses oversized bodies (413) and, when an API key is set, /v1 requests without it (401).

    Args:
        app: the ASGI app it wraps.
        state: the server state (API key, body limit, metrics).
    """

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state, path = self.state, scope["path"]
        headers = dict(scope.get("headers") or [])

        async def counting_send(message):
            if message["type"] == "http.response.start" and path.startswith("/v1"):
                state.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        if state.api_key and path.startswith("/v1"):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            token = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), state.api_key.encode()):
                resp = JSONResponse(error_body("invalid or missing API key (send 'Authorization: Bearer KEY')",
                                               "authentication_error", None, "invalid_api_key"), status_code=401)
                return await resp(scope, receive, counting_send)
        limit = state.max_body_bytes
        length = headers.get(b"content-length")
        too_big = JSONResponse(error_body(f"the request body exceeds {limit} bytes", "invalid_request_error",
                                          None, "request_too_large"), status_code=413)
        if length is not None and length.isdigit() and int(length) > limit:
            return await too_big(scope, receive, send)
        received = 0

        async def limited_receive():
            # A body sent without Content-Length (chunked) is counted as it arrives.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, limited_receive, counting_send)
        except _BodyTooLarge:
            await too_big(scope, receive, counting_send)
