"""The OpenAI-compatible HTTP API over the engine: middleware, error handlers and routes, assembled.

Every error has the OpenAI body (see `errors`): 400 for what the client sent, 401 without the API key, 413 for an
oversized body, 429 (with Retry-After) when the queue is full, 503 while loading, warming up or draining, 500 only
for real faults.
"""

from __future__ import annotations

from fastapi import FastAPI

from day0jax.serve.errors import add_error_handlers
from day0jax.serve.middleware import GuardMiddleware
from day0jax.serve.routes import router
from day0jax.serve.state import ServerState


def build_app(state: ServerState, lifespan=None) -> FastAPI:
    """Returns the FastAPI app serving `state`.

    Args:
        state: the server state; routes answer 503 until `state.status` is "ready".
        lifespan: FastAPI's lifespan context (the server loads the model in it).
    """
    app = FastAPI(title="day0jax", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API over the day0jax engine.")
    app.state.server = state
    app.add_middleware(GuardMiddleware, state=state)
    add_error_handlers(app)
    app.include_router(router)
    return app
