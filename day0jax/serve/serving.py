"""Serving one chat or completion request: submit it to the engine, follow its tokens, answer whole or streamed.

One engine request per prompt (each with the request's `n` sequences); choices are numbered prompt-major, as
OpenAI numbers them. A failing request never touches the others; a client that hangs up stops its sequences.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from day0jax.engine.async_engine import AsyncEngine, EngineDead
from day0jax.engine.requests import InvalidRequest, QueueFull, SamplingParams
from day0jax.serve import protocol as P
from day0jax.serve.errors import APIError, error_body
from day0jax.serve.outputs import Choice, Detokenizer, chunk, final_response, sse
from day0jax.serve.state import ServerState
from day0jax.vision.inputs import ImageInputs

_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def serve_request(request: Request, state: ServerState, engine: AsyncEngine, prompts: list[list[int]],
                        params: SamplingParams, stops: list[str], body, chat: bool, arrival: float,
                        tools: tuple | None = None, images: list[ImageInputs | None] | None = None):
    """Runs a validated request on the engine and answers it.

    Args:
        request: the HTTP request (to notice a client that disconnects).
        state: the server state (model name, metrics, in-flight count).
        engine: the ready engine.
        prompts: token ids of each prompt.
        params: the sampling parameters, shared by every prompt.
        stops: stop strings.
        body: the request body (`stream`, `stream_options`).
        chat: a chat completion (else a completion).
        arrival: `time.monotonic()` when the request arrived (latency metrics count from there).
        tools: (syntax, function names) when the request offered tools: calls in the output become `tool_calls`.
        images: per prompt, its preprocessed images (each shared by the prompt's `n` sequences), or None.
    Returns:
        The response model, or a `StreamingResponse` of server-sent events when `body.stream`.
    Raises:
        APIError: 400 for parameters the engine refuses, 429 when its queue is full, 500 when it failed.
    """
    rid = P.new_id("chatcmpl" if chat else "cmpl")
    run = _Run(state, engine, rid, _submit(engine, rid, prompts, params, images), params.n, stops, chat, arrival, tools)
    if not body.stream:
        return await run.complete(request)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return StreamingResponse(run.stream(include_usage), media_type="text/event-stream", headers=_STREAM_HEADERS)


def _submit(engine: AsyncEngine, rid: str, prompts: list[list[int]], params: SamplingParams,
            images: list[ImageInputs | None] | None = None) -> list[tuple[str, AsyncIterator, int]]:
    """Submits one engine request per prompt (with its images, if any); returns (id, event stream, prompt tokens)
    of each, or none at all."""
    subs = []
    try:
        for i, prompt in enumerate(prompts):
            sub_id = f"{rid}-{i}"
            subs.append((sub_id, engine.submit(sub_id, prompt, params, images[i] if images else None), len(prompt)))
    except (InvalidRequest, QueueFull, EngineDead) as e:
        for sub_id, _, _ in subs:
            engine.release(sub_id, finished=False)
        if isinstance(e, EngineDead):
            raise APIError(503, str(e), "service_unavailable") from None
        if isinstance(e, QueueFull):
            raise APIError(429, str(e), "rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from None
        raise APIError(400, str(e), param=e.param,
                       code="context_length_exceeded" if "context length" in str(e) else None) from None
    return subs


class _Run:
    """A submitted request: its engine sub-requests, its choices, and the metrics they update."""

    def __init__(self, state: ServerState, engine: AsyncEngine, rid: str, subs: list[tuple[str, Any, int]], n: int,
                 stops: list[str], chat: bool, arrival: float, tools: tuple | None = None):
        self.state, self.engine, self.rid, self.subs, self.n = state, engine, rid, subs, n
        self.chat, self.arrival = chat, arrival
        self.prompt_tokens = sum(n_tokens for _, _, n_tokens in subs)
        state.metrics.prompt_tokens.inc(self.prompt_tokens)
        self.choices = [Choice(i * n + j, stops) for i in range(len(subs)) for j in range(n)]
        if tools is not None:
            for c in self.choices:
                c.tools, c.tool_params = tools
        self.detok = Detokenizer(state.tokenizer, keep_special=tools is not None)
        self.cached_tokens = 0
        state.in_flight += 1

    async def events(self) -> AsyncIterator[Choice]:
        """Merges the sub-requests' events, yielding each choice an event changed; EngineDead if the engine fails."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(k, stream):
            try:
                async for ev in stream:
                    await queue.put((k, ev))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await queue.put((k, e))
            finally:
                await queue.put((k, None))

        tasks = [asyncio.create_task(pump(k, s)) for k, (_, s, _) in enumerate(self.subs)]
        live = len(tasks)
        try:
            while live:
                k, ev = await queue.get()
                if ev is None:
                    live -= 1
                    continue
                if isinstance(ev, BaseException):
                    raise ev
                choice = self.choices[k * self.n + ev.index]
                if choice.finish_reason is not None:
                    continue  # a stop string already ended it; this is the engine's abort echo
                self._apply(k, choice, ev)
                yield choice
        finally:
            for t in tasks:
                t.cancel()

    def _apply(self, k: int, choice: Choice, ev) -> None:
        """Adds an event to its choice: token metrics, text, and the end (a stop string aborts the sequence)."""
        metrics = self.state.metrics
        now = time.monotonic()
        if ev.token is not None:
            choice.generated += 1
            metrics.generation_tokens.inc()
            if choice.first_token_at is None:
                choice.first_token_at = now
                metrics.ttft.observe(now - self.arrival)
                self.cached_tokens += ev.num_cached_tokens
            else:
                metrics.itl.observe(now - choice.last_token_at)
            choice.last_token_at = now
        if choice.add(ev, self.detok):
            choice.finish_reason = "stop"
            self.engine.abort(self.subs[k][0], ev.index)
        elif ev.finish_reason is not None:
            choice.finish_reason = ev.finish_reason
        if choice.finish_reason is not None:
            choice.settle_tools()
            metrics.finished.labels(choice.finish_reason).inc()
            metrics.e2e.observe(now - self.arrival)

    def _release(self, completed: bool) -> None:
        self.state.in_flight -= 1
        for sub_id, _, _ in self.subs:
            self.engine.release(sub_id, finished=completed)

    def usage(self) -> P.Usage:
        gen = sum(c.generated for c in self.choices)
        return P.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=gen, total_tokens=self.prompt_tokens + gen,
                       prompt_tokens_details=P.PromptTokensDetails(cached_tokens=self.cached_tokens))

    async def _abort_on_disconnect(self, request: Request) -> None:
        # A non-streaming client that hangs up should not keep its sequences running.
        while not await request.is_disconnected():
            await asyncio.sleep(0.5)
        for sub_id, _, _ in self.subs:
            self.engine.abort(sub_id)

    async def complete(self, request: Request):
        """Waits for every choice to finish; returns the whole response (APIError 500 when the engine failed)."""
        completed = False
        watcher = asyncio.create_task(self._abort_on_disconnect(request))
        try:
            async for _ in self.events():
                pass
            completed = True
        except EngineDead as e:
            raise APIError(500, f"the engine failed: {e}", "server_error") from None
        finally:
            watcher.cancel()
            self._release(completed)
        return final_response(self.rid, self.state.model_name, self.choices, self.usage(), self.detok, self.chat)

    async def stream(self, include_usage: bool) -> AsyncIterator[str]:
        """The server-sent events: the chat role first, a chunk per change, usage if asked, then [DONE]."""
        completed = False
        name = self.state.model_name
        try:
            if self.chat:
                for c in self.choices:  # the role comes first, as OpenAI streams it
                    yield sse(P.ChatCompletionChunk(id=self.rid, model=name, choices=[
                        P.ChatChunkChoice(index=c.index, delta=P.ChatDelta(role="assistant", content=""))]))
            async for c in self.events():
                out = chunk(self.rid, name, c, self.detok, self.chat)
                if out is not None:
                    yield sse(out)
            if include_usage:
                cls = P.ChatCompletionChunk if self.chat else P.CompletionResponse
                yield sse(cls(id=self.rid, model=name, choices=[], usage=self.usage()))
            completed = True
        except EngineDead as e:
            yield "data: " + json.dumps(error_body(f"the engine failed: {e}", "server_error")) + "\n\n"
        finally:
            self._release(completed)
        yield "data: [DONE]\n\n"
