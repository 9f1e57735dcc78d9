"""The HTTP routes: /health, /metrics, /v1/models, /v1/chat/completions and /v1/completions.

A generation route composes the request path's steps, each in its own module, in order: parse (FastAPI, with the
`protocol` schemas) -> `validate` -> `render` -> `constrain` -> `submit` -> `stream` -> `format`.
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from day0jax.serve import constrain, format, protocol as P, render, stream, submit, validate
from day0jax.serve.state import ServerState, note_dead_engine
from day0jax.serve.validate import ready

router = APIRouter()


async def server_state(request: Request) -> ServerState:
    """The server state `build_app` stored on the app (async, so FastAPI does not run it in a thread)."""
    return request.app.state.server


State = Annotated[ServerState, Depends(server_state)]

_ERRORS = {code: {"model": P.ErrorResponse} for code in (400, 401, 429, 503)}


@router.get("/health", responses={503: {"model": P.ErrorResponse}})
async def health(state: State):
    note_dead_engine(state)
    if state.status == "ready":
        return {"status": "ok"}
    return JSONResponse({"status": state.status, "detail": state.detail}, status_code=503)


@router.get("/metrics")
async def prometheus_metrics(state: State):
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models", response_model=P.ModelList, responses=_ERRORS)
async def list_models(state: State):
    ready(state)
    return P.ModelList(data=[P.ModelCard(id=state.model_name, max_model_len=state.max_model_len)])


@router.post("/v1/chat/completions", response_model=P.ChatCompletionResponse, responses=_ERRORS)
async def chat_completions(body: P.ChatCompletionRequest, request: Request, state: State):
    arrival = time.monotonic()
    checked = validate.chat(state, body)
    prompt, images = await render.chat(state, body, checked.tools.specs if checked.tools else None)
    constraints = await constrain.constraints(state, body, checked.tools)
    run = submit.submit(state, checked.engine, P.new_id("chatcmpl"), body, [prompt], constraints,
                        [images] if images is not None else None)
    outputs = stream.Outputs(state, run, checked.stops, checked.tools, arrival)
    return await format.respond(request, outputs, format.Chat(state.model_name), body)


@router.post("/v1/completions", response_model=P.CompletionResponse, responses=_ERRORS)
async def completions(body: P.CompletionRequest, request: Request, state: State):
    arrival = time.monotonic()
    checked = validate.completion(state, body)
    prompts = await render.completion(state, body.prompts())
    constraints = await constrain.constraints(state, body)
    run = submit.submit(state, checked.engine, P.new_id("cmpl"), body, prompts, constraints)
    outputs = stream.Outputs(state, run, checked.stops, None, arrival)
    return await format.respond(request, outputs, format.Completion(state.model_name), body)
