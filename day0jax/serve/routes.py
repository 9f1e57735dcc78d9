"""The HTTP routes: /health, /metrics, /v1/models, /v1/chat/completions, /v1/completions, /v1/responses, /tokenize and
/detokenize.

A generation route composes the request path's steps, each in its own module, in order: parse (FastAPI, with the
`protocol` schemas) -> `validate` -> `render` -> `constrain` -> `submit` -> `stream` -> `format`. A Responses API
request takes the chat path as the chat request it amounts to, with its own formatter; its errors name its own
fields.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from day0jax.serve import constrain, format, protocol as P, render, stream, submit, validate
from day0jax.serve.errors import APIError
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
    # /health answers anyone (no API key): a failure's exception text (paths, devices, internals) stays in the log.
    detail = "see the server's log" if state.status == "failed" else state.detail
    return JSONResponse({"status": state.status, "detail": detail}, status_code=503)


@router.get("/metrics")
async def prometheus_metrics(state: State):
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models", response_model=P.ModelList, responses=_ERRORS)
async def list_models(state: State):
    ready(state)
    base = P.ModelCard(id=state.model_name, max_model_len=state.max_model_len)
    # Served LoRA adapters, as vLLM lists them: each its own model, `parent` the base, `root` its folder.
    return P.ModelList(data=[base] + [P.ModelCard(id=name, root=path, parent=state.model_name,
                                                  max_model_len=state.max_model_len)
                                      for name, path in state.adapters.items()])


@router.post("/v1/chat/completions", response_model=P.ChatCompletionResponse, responses=_ERRORS)
async def chat_completions(body: P.ChatCompletionRequest, request: Request, state: State):
    return await _chat(state, body, request, format.Chat(validate.model_of(state, body), body.include_reasoning),
                       P.new_id("chatcmpl"))


@router.post("/v1/responses", response_model=P.ResponseObject, responses=_ERRORS)
async def responses(body: P.ResponsesRequest, request: Request, state: State):
    try:
        validate.responses(state, body)
        try:
            chat = body.chat()
        except ValidationError as e:  # what the chat request refuses beyond the Responses schema
            error = e.errors()[0]
            raise APIError(400, f"input: {error['msg']}", param=".".join(map(str, error["loc"]))) from None
        return await _chat(state, chat, request, format.Responses(validate.model_of(state, body), body),
                           P.new_id("resp", "_"))
    except APIError as e:
        e.param = P.responses_param(e.param)
        raise


async def still_connected(request: Request) -> None:
    """Raises APIError 499 (nginx's "client closed request", never sent: no one is listening) when the client hung
    up while its request was rendered, its images decoded or its grammar compiled: it is not queued at all.

    Raises:
        APIError: 499 when the client disconnected.
    """
    if await request.is_disconnected():
        raise APIError(499, "the client closed the connection before its request was queued", "client_closed_request")


def tenant_of(request: Request) -> str | None:
    """The tenant the guard found for the request's API key (set only when the server has several keys)."""
    return getattr(request.state, "tenant", None)


async def _chat(state: ServerState, body: P.ChatCompletionRequest, request: Request, fmt: format.Formatter,
                rid: str):
    """A chat request through every step, answered by `fmt`."""
    arrival = time.monotonic()
    checked = validate.chat(state, body)
    prompt, images = await render.chat(state, body, checked.tools.specs if checked.tools else None)
    try:
        reasoning = render.reasoning(state, prompt)
        constraints = await constrain.constraints(state, body, checked.tools, reasoning)
        await still_connected(request)
        run = submit.submit(state, checked.engine, rid, body, [prompt], constraints,
                            [images] if images is not None else None, tenant_of(request))
    except BaseException:  # not queued: its images' memory is free again (a run gives it back when it ends)
        render.release(state, images)
        raise
    outputs = stream.Outputs(state, run, checked.stops, checked.tools, arrival, reasoning)
    return await format.respond(request, outputs, fmt, body)


@router.post("/v1/completions", response_model=P.CompletionResponse, responses=_ERRORS)
async def completions(body: P.CompletionRequest, request: Request, state: State):
    arrival = time.monotonic()
    checked = validate.completion(state, body)
    prompts = await render.completion(state, body.prompts())
    constraints = await constrain.constraints(state, body)
    await still_connected(request)
    run = submit.submit(state, checked.engine, P.new_id("cmpl"), body, prompts, constraints,
                        tenant=tenant_of(request))
    outputs = stream.Outputs(state, run, checked.stops, None, arrival)
    return await format.respond(request, outputs, format.Completion(validate.model_of(state, body)), body)


@router.post("/tokenize", response_model=P.TokenizeResponse, responses=_ERRORS)
async def tokenize(body: P.TokenizeRequest, state: State):
    validate.tokenize(state, body)
    tokenizer = state.tokenizer
    if body.messages is None:
        ids = await asyncio.to_thread(tokenizer.encode, body.prompt, body.add_special_tokens is not False)
    else:
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        ids, images = await render.chat(state, body.chat(), tools, add_generation_prompt=body.add_generation_prompt)
        render.release(state, images)
        if body.add_special_tokens:  # the tokenizer's own additions (a BOS) before the template's text
            ids = await asyncio.to_thread(lambda: tokenizer.encode(tokenizer.decode(ids, skip_special_tokens=False)))
    # Off the event loop, as all tokenizing: a long prompt's strings take milliseconds other streams would wait.
    strs = await asyncio.to_thread(lambda: [tokenizer.decode([i], skip_special_tokens=False) for i in ids]) \
        if body.return_token_strs else None
    return P.TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize", response_model=P.DetokenizeResponse, responses=_ERRORS)
async def detokenize(body: P.DetokenizeRequest, state: State):
    validate.detokenize(state, body)
    text = await asyncio.to_thread(state.tokenizer.decode, body.tokens, skip_special_tokens=False)
    return P.DetokenizeResponse(prompt=text)
