"""ASGI middleware run before any parsing: API key (401), body size (413); counts /v1 responses, refusals included."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from day0jax.serve.errors import error_body
from day0jax.serve.state import ServerState


# The /v1 routes the metrics name; any other path counts as "other", so probing unknown paths cannot grow the
# metrics without bound.
ROUTES = frozenset({"/v1/models", "/v1/chat/completions", "/v1/completions"})


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
                state.metrics.requests.labels(path if path in ROUTES else "other", str(message["status"])).inc()
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
            return await too_big(scope, receive, counting_send)
        if length is None and scope.get("method") in ("POST", "PUT", "PATCH"):
            # Chunked: read it here, up to the limit (the app's body parser would turn an error raised from
            # inside its reads into a 400), then hand the app the whole body.
            body, more = b"", True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > limit:
                    return await too_big(scope, receive, counting_send)
            replay = [{"type": "http.request", "body": body, "more_body": False}]

            async def replayed():
                return replay.pop() if replay else await receive()
            return await self.app(scope, replayed, counting_send)
        await self.app(scope, receive, counting_send)
