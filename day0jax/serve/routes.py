"""The HTTP routes: /health, /metrics, /v1/models, /v1/chat/completions and /v1/completions."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from day0jax.engine.async_engine import AsyncEngine
from day0jax.engine.requests import SamplingParams
from day0jax.serve import protocol as P
from day0jax.serve.chat_prompt import chat_prompt
from day0jax.serve.constraints import guidance, logit_bias, offered_tools
from day0jax.serve.errors import APIError
from day0jax.serve.serving import serve_request
from day0jax.serve.state import ServerState

MAX_PROMPTS = 32  # prompts in one /v1/completions request
MAX_STOPS = 16

router = APIRouter()


async def server_state(request: Request) -> ServerState:
    """The server state `build_app` stored on the app (async, so FastAPI does not run it in a thread)."""
    return request.app.state.server


State = Annotated[ServerState, Depends(server_state)]

_ERRORS = {code: {"model": P.ErrorResponse} for code in (400, 401, 429, 503)}


@router.get("/health", responses={503: {"model": P.ErrorResponse}})
async def health(state: State):
    _note_dead_engine(state)
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
    check_request(body)
    engine = admit(state, body.model)
    check_chars(state, sum(len(m.text()) for m in body.messages), "messages")
    fits_queue(engine, body.n)
    tools, syntax = offered_tools(state, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    prompt, images = await chat_prompt(state, body, tools)
    params = sampling_params(state, body, body.max_completion_tokens or body.max_tokens, len(prompt),
                             (body.top_logprobs or 0) if body.logprobs else None,
                             await guidance(state, body, tools, syntax))
    return await serve_request(request, state, engine, [prompt], params, stop_strings(body.stop), body, True, arrival,
                               (syntax, {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools})
                               if tools else None, images=[images] if images is not None else None)


@router.post("/v1/completions", response_model=P.CompletionResponse, responses=_ERRORS)
async def completions(body: P.CompletionRequest, request: Request, state: State):
    arrival = time.monotonic()
    check_request(body)
    engine = admit(state, body.model)
    prompts = body.prompt
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if len(prompts) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt")
    for p in prompts:
        if isinstance(p, str):
            check_chars(state, len(p), "prompt")

    def tokenize():
        return [state.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    token_prompts = await asyncio.to_thread(tokenize)  # off the event loop, as the chat template
    if not token_prompts or any(not p for p in token_prompts):
        raise APIError(400, "prompt must not be empty", param="prompt")
    fits_queue(engine, len(token_prompts) * body.n)
    params = sampling_params(state, body, body.max_tokens or 16, max(map(len, token_prompts)), body.logprobs,
                             await guidance(state, body))
    return await serve_request(request, state, engine, token_prompts, params, stop_strings(body.stop), body, False,
                               arrival)


# --- checks before any tokenizing ------------------------------------------------------------------------------

def check_request(body) -> None:
    """Refuses what the server cannot serve as asked: an OpenAI field it does not implement, unless it carries its
    neutral value (`protocol.UNIMPLEMENTED`), and text that is not valid Unicode (JSON lets a string hold a lone
    surrogate, which no tokenizer can encode).

    Raises:
        APIError: 400 naming the field.
    """
    for name, neutral in P.UNIMPLEMENTED.get(type(body).__name__, {}).items():
        value = (body.model_extra or {}).get(name)
        if value is not None and not neutral(value, body):
            raise APIError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")
    _check_text(body, "")


def _check_text(value, path: str) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, f"{path} is not valid Unicode text (it holds a lone surrogate)", param=path) from None
    elif isinstance(value, P.BaseModel):
        for name in type(value).model_fields:
            _check_text(getattr(value, name), f"{path}.{name}" if path else name)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_text(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, path)
            _check_text(item, f"{path}.{key}")


def ready(state: ServerState) -> AsyncEngine:
    """The engine, once the server is ready.

    Raises:
        APIError: 503 with Retry-After while loading, warming up, draining or failed.
    """
    _note_dead_engine(state)
    if state.status != "ready" or state.engine is None:
        what = {"draining": "the server is shutting down"}.get(state.status, f"the model is {state.status}")
        raise APIError(503, f"{what}; retry later", "service_unavailable", headers={"Retry-After": "5"})
    return state.engine


def _note_dead_engine(state: ServerState) -> None:
    """A ready server whose engine stopped serving (it could not recover from failed steps) is "failed"."""
    if state.status == "ready" and state.engine is not None and state.engine.dead is not None:
        state.status, state.detail = "failed", f"the engine stopped serving: {state.engine.dead}"


def admit(state: ServerState, model: str) -> AsyncEngine:
    """The engine, for a generation request it may take: the server is ready, its queue has room, `model` is served.

    Raises:
        APIError: 503 as `ready` does, 429 (with Retry-After) when the waiting queue is full, 400 for another model.
    """
    engine = ready(state)
    e = engine.engine
    if e.num_waiting >= e.config.max_waiting:
        raise APIError(429, f"the server is at capacity ({e.num_waiting} requests queued); retry later",
                       "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    if model != state.model_name:
        raise APIError(400, f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")
    return engine


def fits_queue(engine: AsyncEngine, sequences: int) -> None:
    """Raises APIError 400 for a request of more sequences (prompts x n) than the waiting queue can ever hold: a
    429 would tell its client to retry something that can never be served."""
    limit = engine.engine.config.max_waiting
    if sequences > limit:
        raise APIError(400, f"the request asks for {sequences} sequences (prompts x n); this server queues at most "
                       f"{limit}", param="n")


def check_chars(state: ServerState, n: int, param: str) -> None:
    """Raises APIError 400 for a text over 64 characters per context token: far too long to be worth tokenizing."""
    limit = state.max_model_len * 64
    if n > limit:
        raise APIError(400, f"the {param} has {n} characters, more than this server accepts ({limit}; "
                       f"the model's context is {state.max_model_len} tokens)", param=param,
                       code="context_length_exceeded")


# --- request fields to engine inputs ---------------------------------------------------------------------------

def sampling_params(state: ServerState, body, max_tokens: int | None, prompt_len: int,
                    logprobs: int | None, grammar=None) -> SamplingParams:
    """Returns the engine's `SamplingParams` for a request body (the engine validates their ranges on submit).

    Args:
        state: the server state (the context length).
        body: a chat or completion request.
        max_tokens: the tokens asked for; None: whatever the context leaves after the prompt (as vLLM does).
        prompt_len: tokens of the longest prompt.
        logprobs: top log-probabilities per token, or None for none.
        grammar: the `Grammar` the output must follow (`guidance`), or None.
    Raises:
        APIError: 400 for a logit_bias key that is not a token id.
    """
    if max_tokens is None:
        max_tokens = max(1, state.max_model_len - prompt_len)
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k, min_p=body.min_p,
        seed=None if body.seed is None else body.seed & 0xFFFFFFFF, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
        stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos, logprobs=logprobs,
        n=body.n, grammar=grammar, logit_bias=logit_bias(body.logit_bias))


def stop_strings(stop) -> list[str]:
    """The request's `stop` as a list.

    Raises:
        APIError: 400 for an empty stop string or more than MAX_STOPS.
    """
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise APIError(400, "stop strings must not be empty", param="stop")
    if len(stops) > MAX_STOPS:
        raise APIError(400, f"at most {MAX_STOPS} stop strings", param="stop")
    return stops
