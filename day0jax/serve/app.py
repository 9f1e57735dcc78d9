"""The OpenAI-compatible HTTP API over the engine: routes, validation, streaming, errors, auth and limits.

Everything text lives here (the engine speaks token ids): chat templates, tokenization, incremental
detokenization, stop strings and the OpenAI response shapes. Errors always have the OpenAI body
`{"error": {"message", "type", "param", "code"}}`: 400 for what the client sent, 401 without the API key, 413 for
an oversized body, 429 (with Retry-After) when the queue is full, 503 while loading, warming up or draining, 500
only for real faults. A failing request never touches the others: each one is its own engine request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from day0jax.engine.async_engine import AsyncEngine, EngineDead
from day0jax.engine.engine import ABORT, InvalidRequest, QueueFull, SamplingParams, TokenEvent
from day0jax.serve import protocol as P
from day0jax.serve.metrics import Metrics
from day0jax.weights.tokenizer import ChatTemplateError

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    """What the routes need; `engine` and `tokenizer` appear once loading is done.

    Attributes:
        model_name: the id clients must send as `model`.
        status: "loading", "warming up", "ready", "draining" or "failed".
        api_key: when set, every /v1 route needs `Authorization: Bearer <key>`.
        max_body_bytes: larger request bodies get 413.
        max_prompt_chars: longer prompt texts get 400 before tokenization.
        timeline: the startup timeline, exported on /metrics.
    """

    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    max_prompt_chars: int | None = None
    status: str = "loading"
    detail: str = ""
    engine: AsyncEngine | None = None
    tokenizer: Any = None
    max_model_len: int = 0
    metrics: Metrics | None = None
    in_flight: int = 0
    timeline: Any = None  # day0jax.startup.timeline.Timeline of this start (phases and compiled programs)
    compiles_at_ready: dict[str, int] | None = None  # day0jax.startup.warmup.compile_totals() when it became ready

    def __post_init__(self):
        self.metrics = Metrics(self)


class APIError(Exception):
    """An error answered in the OpenAI shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def error_body(message: str, type_: str, param: str | None = None, code: Any = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable"}


# --- ASGI middleware: body size and API key, before any parsing ---------------------------------------------

class GuardMiddleware:
    """Refuses oversized bodies (413) and, when an API key is set, /v1 requests without it (401)."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = self.state
        if state.api_key and scope["path"].startswith("/v1"):
            headers = dict(scope.get("headers") or [])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            token = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), state.api_key.encode()):
                state.metrics.requests.labels(scope["path"], "401").inc()
                resp = JSONResponse(error_body("invalid or missing API key (send 'Authorization: Bearer KEY')",
                                               "authentication_error", None, "invalid_api_key"), status_code=401)
                return await resp(scope, receive, send)
        limit = state.max_body_bytes
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        too_big = JSONResponse(error_body(f"the request body exceeds {limit} bytes", "invalid_request_error",
                                          None, "request_too_large"), status_code=413)
        if length is not None and length.isdigit() and int(length) > limit:
            return await too_big(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge()
            return message

        async def counting_send(message):
            if message["type"] == "http.response.start" and scope["path"].startswith("/v1"):
                state.metrics.requests.labels(scope["path"], str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, limited_receive, counting_send)
        except _BodyTooLarge:
            await too_big(scope, receive, counting_send)


class _BodyTooLarge(Exception):
    pass


# --- per-choice output state ---------------------------------------------------------------------------------

@dataclass
class _Choice:
    index: int
    stops: list[str]
    ids: list[int] = field(default_factory=list)
    text: str = ""  # text so far (stop strings cut away)
    sent: int = 0  # characters of `text` already streamed
    finish_reason: str | None = None
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    sent_logprobs: int = 0
    generated: int = 0  # tokens generated (stop tokens included), for usage
    first_token_at: float | None = None
    last_token_at: float | None = None


class _Detokenizer:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._cache: dict[int, str] = {}

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def token(self, token_id: int) -> str:
        if token_id not in self._cache:
            self._cache[token_id] = self.tok.decode([token_id], skip_special_tokens=False)
        return self._cache[token_id]


def _update_choice(choice: _Choice, event: TokenEvent, detok: _Detokenizer) -> bool:
    """Adds one engine event to a choice. Returns True when a stop string ended it."""
    if event.token is not None and not event.stop_token:
        choice.ids.append(event.token)
    if event.token is not None and event.logprob is not None:
        choice.logprobs.append((event.token, event.logprob, event.top_logprobs or []))
    full = detok.text(choice.ids)
    stopped = False
    for stop in choice.stops:
        # Search only where a new match can be: the previous text's tail plus the new characters.
        pos = full.find(stop, max(0, len(choice.text) - len(stop) + 1))
        if pos != -1:
            full, stopped = full[:pos], True
    choice.text = full
    return stopped


def _sendable(choice: _Choice) -> str:
    """New text that is safe to stream: hold back an unfinished UTF-8 character and a possible stop prefix."""
    text = choice.text
    end = len(text)
    if choice.finish_reason is None:
        while end > choice.sent and text[end - 1] == "\ufffd":
            end -= 1
        hold = max((len(s) - 1 for s in choice.stops), default=0)
        end = max(choice.sent, end - hold)
    new = text[choice.sent:end]
    choice.sent = end
    return new


# --- the app ---------------------------------------------------------------------------------------------------

def build_app(state: ServerState, lifespan=None) -> FastAPI:
    """The FastAPI app serving `state` (routes answer 503 until `state.status` is "ready")."""
    app = FastAPI(title="day0jax", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API over the day0jax engine.")
    app.add_middleware(GuardMiddleware, state=state)
    metrics = state.metrics

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        kind = first.get("type", "")
        if kind == "json_invalid":
            message = f"the body is not valid JSON: {first.get('msg')}"
        elif not loc and kind in ("model_attributes_type", "dict_type", "model_type"):
            message = "the body must be a JSON object"
        else:
            message = f"{param or 'body'}: {first.get('msg')}"
        return JSONResponse(error_body(message, "invalid_request_error", param, kind or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(error_body(str(e.detail), _TYPES.get(e.status_code, "invalid_request_error")),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _server_error(request: Request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(f"internal server error: {type(e).__name__}", "server_error"),
                            status_code=500)

    @app.get("/health", responses={503: {"model": P.ErrorResponse}})
    async def health():
        if state.status == "ready":
            return {"status": "ok"}
        return JSONResponse({"status": state.status, "detail": state.detail}, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def ready() -> AsyncEngine:
        if state.status != "ready" or state.engine is None:
            what = {"draining": "the server is shutting down"}.get(state.status, f"the model is {state.status}")
            raise APIError(503, f"{what}; retry later", "service_unavailable", headers={"Retry-After": "5"})
        return state.engine

    def check_queue(engine: AsyncEngine) -> None:
        e = engine.engine
        if e.num_waiting >= e.config.max_waiting:
            raise APIError(429, f"the server is at capacity ({e.num_waiting} requests queued); retry later",
                           "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})

    def check_model(name: str) -> None:
        if name != state.model_name:
            raise APIError(400, f"the model {name!r} does not exist; this server serves {state.model_name!r}",
                           param="model", code="model_not_found")

    def check_chars(n: int, param: str) -> None:
        limit = state.max_prompt_chars or state.max_model_len * 64
        if n > limit:
            raise APIError(400, f"the {param} has {n} characters, more than this server accepts ({limit}; "
                           f"the model's context is {state.max_model_len} tokens)", param=param,
                           code="context_length_exceeded")

    error_responses = {400: {"model": P.ErrorResponse}, 401: {"model": P.ErrorResponse},
                       429: {"model": P.ErrorResponse}, 503: {"model": P.ErrorResponse}}

    @app.get("/v1/models", response_model=P.ModelList, responses=error_responses)
    async def list_models():
        ready()
        return P.ModelList(data=[P.ModelCard(id=state.model_name, max_model_len=state.max_model_len)])

    @app.post("/v1/chat/completions", response_model=P.ChatCompletionResponse, responses=error_responses)
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        arrival = time.monotonic()
        engine = ready()
        check_queue(engine)
        check_model(body.model)
        check_chars(sum(len(m.text()) for m in body.messages), "messages")
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in body.messages]
        try:
            prompt = state.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from None
        except Exception as e:  # noqa: BLE001 - a template choking on odd messages is the request's problem
            raise APIError(400, f"the chat template could not render these messages: {e}", param="messages") from None
        max_tokens = body.max_completion_tokens or body.max_tokens
        top = body.top_logprobs if body.top_logprobs is not None else 0
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        params = _sampling(body, max_tokens, len(prompt), top if body.logprobs else None)
        rid = P.new_id("chatcmpl")
        return await _serve(request, engine, rid, [prompt], params, _stops(body.stop), body, True, arrival)

    @app.post("/v1/completions", response_model=P.CompletionResponse, responses=error_responses)
    async def completions(body: P.CompletionRequest, request: Request):
        arrival = time.monotonic()
        engine = ready()
        check_queue(engine)
        check_model(body.model)
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if len(prompts) > 32:
            raise APIError(400, f"at most 32 prompts per request, got {len(prompts)}", param="prompt")
        token_prompts = []
        for p in prompts:
            if isinstance(p, str):
                check_chars(len(p), "prompt")
                token_prompts.append(state.tokenizer.encode(p))
            else:
                token_prompts.append(list(p))
        if any(not p for p in token_prompts):
            raise APIError(400, "prompt must not be empty", param="prompt")
        params = _sampling(body, body.max_tokens or 16, max(map(len, token_prompts)), body.logprobs)
        rid = P.new_id("cmpl")
        return await _serve(request, engine, rid, token_prompts, params, _stops(body.stop), body, False, arrival)

    def _sampling(body, max_tokens, prompt_len, logprobs) -> SamplingParams:
        if max_tokens is None:  # as vLLM: whatever the context leaves
            max_tokens = max(1, state.max_model_len - prompt_len)
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k, min_p=body.min_p,
            seed=None if body.seed is None else body.seed & 0xFFFFFFFF, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos, logprobs=logprobs,
            n=body.n)

    def _stops(stop) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop")
        if len(stops) > 16:
            raise APIError(400, "at most 16 stop strings", param="stop")
        return stops

    async def _serve(request: Request, engine: AsyncEngine, rid: str, prompts: list[list[int]],
                     params: SamplingParams, stops: list[str], body, chat: bool, t0: float):
        # One engine request per prompt; choices are numbered prompt-major, as OpenAI numbers them.
        subs = []
        try:
            for i, prompt in enumerate(prompts):
                sub_id = f"{rid}-{i}"
                subs.append((sub_id, engine.submit(sub_id, prompt, params), len(prompt)))
        except InvalidRequest as e:
            for sub_id, _, _ in subs:
                engine.release(sub_id, finished=False)
            raise APIError(400, str(e), param=e.param,
                           code="context_length_exceeded" if "context length" in str(e) else None) from None
        except QueueFull as e:
            for sub_id, _, _ in subs:
                engine.release(sub_id, finished=False)
            raise APIError(429, str(e), "rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from None
        metrics.prompt_tokens.inc(sum(n for _, _, n in subs))
        n = params.n
        choices = [_Choice(i * n + j, stops) for i in range(len(prompts)) for j in range(n)]
        detok = _Detokenizer(state.tokenizer)
        state.in_flight += 1
        usage_prompt = sum(n_tokens for _, _, n_tokens in subs)
        cached = [0]

        async def events() -> AsyncIterator[list[_Choice]]:
            """Merges the sub-requests' events; yields the choices that changed."""
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(k, stream):
                try:
                    async for ev in stream:
                        await queue.put((k, ev))
                except BaseException as e:  # noqa: BLE001 - handed to the consumer
                    await queue.put((k, e))
                finally:
                    await queue.put((k, None))

            tasks = [asyncio.create_task(pump(k, s)) for k, (_, s, _) in enumerate(subs)]
            live = len(tasks)
            try:
                while live:
                    k, ev = await queue.get()
                    if ev is None:
                        live -= 1
                        continue
                    if isinstance(ev, BaseException):
                        raise ev
                    choice = choices[k * n + ev.index]
                    if choice.finish_reason is not None:
                        continue  # a stop string already ended it; this is the engine's abort echo
                    now = time.monotonic()
                    if ev.token is not None:
                        choice.generated += 1
                        metrics.generation_tokens.inc()
                        if choice.first_token_at is None:
                            choice.first_token_at = now
                            metrics.ttft.observe(now - t0)
                            cached[0] += ev.num_cached_tokens
                        else:
                            metrics.itl.observe(now - choice.last_token_at)
                        choice.last_token_at = now
                    stopped = _update_choice(choice, ev, detok)
                    if stopped:
                        choice.finish_reason = "stop"
                        engine.abort(subs[k][0], ev.index)
                    elif ev.finish_reason is not None:
                        choice.finish_reason = ev.finish_reason
                    if choice.finish_reason is not None:
                        metrics.finished.labels(choice.finish_reason).inc()
                        metrics.e2e.observe(now - t0)
                    yield [choice]
            finally:
                for t in tasks:
                    t.cancel()

        def finish_all(completed: bool) -> None:
            state.in_flight -= 1
            for sub_id, _, _ in subs:
                engine.release(sub_id, finished=completed)

        def usage() -> P.Usage:
            gen = sum(c.generated for c in choices)
            return P.Usage(prompt_tokens=usage_prompt, completion_tokens=gen, total_tokens=usage_prompt + gen,
                           prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached[0]))

        if not body.stream:
            completed = False

            async def watch_disconnect():
                # A non-streaming client that hangs up should not keep its sequences running.
                while not await request.is_disconnected():
                    await asyncio.sleep(0.5)
                for sub_id, _, _ in subs:
                    engine.abort(sub_id)

            watcher = asyncio.create_task(watch_disconnect())
            try:
                async for _ in events():
                    pass
                completed = True
            except EngineDead as e:
                raise APIError(500, f"the engine failed: {e}", "server_error") from None
            finally:
                watcher.cancel()
                finish_all(completed)
            return _final_response(rid, choices, usage(), detok, chat)

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def sse():
            completed = False
            try:
                if chat:
                    for c in choices:  # the role comes first, as OpenAI streams it
                        yield _sse(P.ChatCompletionChunk(id=rid, model=state.model_name, choices=[
                            P.ChatChunkChoice(index=c.index, delta=P.ChatDelta(role="assistant", content=""))]))
                async for changed in events():
                    for c in changed:
                        chunk = _chunk(rid, c, detok, chat)
                        if chunk is not None:
                            yield _sse(chunk)
                if include_usage:
                    cls = P.ChatCompletionChunk if chat else P.CompletionResponse
                    yield _sse(cls(id=rid, model=state.model_name, choices=[], usage=usage()))
                completed = True
            except EngineDead as e:
                yield "data: " + json.dumps(error_body(f"the engine failed: {e}", "server_error")) + "\n\n"
            finally:
                finish_all(completed)
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _chunk(rid: str, c: _Choice, detok: _Detokenizer, chat: bool):
        text = _sendable(c)
        new_lp = c.logprobs[c.sent_logprobs:]
        if not text and c.finish_reason is None:
            return None  # nothing to say yet (held back); logprobs go out with the text they belong to
        c.sent_logprobs = len(c.logprobs)
        if chat:
            lp = P.ChatLogprobs(content=_chat_logprobs(new_lp, detok)) if new_lp else None
            return P.ChatCompletionChunk(id=rid, model=state.model_name, choices=[P.ChatChunkChoice(
                index=c.index, delta=P.ChatDelta(content=text or None), logprobs=lp,
                finish_reason=_reason(c.finish_reason))])
        lp = _completion_logprobs(new_lp, detok, 0) if new_lp else None
        return P.CompletionResponse(id=rid, model=state.model_name, choices=[P.CompletionChoice(
            index=c.index, text=text, logprobs=lp, finish_reason=_reason(c.finish_reason))])

    def _final_response(rid, choices, usage, detok, chat):
        if chat:
            out = [P.ChatChoice(index=c.index, message=P.ChatResponseMessage(content=c.text),
                                logprobs=P.ChatLogprobs(content=_chat_logprobs(c.logprobs, detok))
                                if c.logprobs else None, finish_reason=_reason(c.finish_reason)) for c in choices]
            return P.ChatCompletionResponse(id=rid, model=state.model_name, choices=out, usage=usage)
        out = [P.CompletionChoice(index=c.index, text=c.text, finish_reason=_reason(c.finish_reason),
                                  logprobs=_completion_logprobs(c.logprobs, detok, 0) if c.logprobs else None)
               for c in choices]
        return P.CompletionResponse(id=rid, model=state.model_name, choices=out, usage=usage)

    return app


def _reason(reason: str | None) -> str | None:
    return "stop" if reason == ABORT else reason


def _sse(model) -> str:
    return "data: " + model.model_dump_json() + "\n\n"


def _chat_logprobs(entries, detok: _Detokenizer) -> list[P.TokenLogprob]:
    out = []
    for token, lp, top in entries:
        text = detok.token(token)
        out.append(P.TokenLogprob(token=text, logprob=lp, bytes=list(text.encode()), top_logprobs=[
            P.TopLogprob(token=detok.token(t), logprob=v, bytes=list(detok.token(t).encode())) for t, v in top]))
    return out


def _completion_logprobs(entries, detok: _Detokenizer, offset: int) -> P.CompletionLogprobs:
    out = P.CompletionLogprobs()
    for token, lp, top in entries:
        text = detok.token(token)
        out.text_offset.append(offset)
        offset += len(text)
        out.tokens.append(text)
        out.token_logprobs.append(lp)
        out.top_logprobs.append({detok.token(t): v for t, v in top})
    return out
