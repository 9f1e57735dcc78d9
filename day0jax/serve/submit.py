"""Submit: a validated, rendered and constrained request becomes the engine's `SamplingParams` and one engine request
per prompt (each with the request's `n` sequences), queued on the engine thread.

The engine checks the parameters against the model when a request is queued (a prompt longer than the context,
token ids outside the vocabulary, logit biases out of range): its refusals become 400s naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

from day0jax.engine.async_engine import AsyncEngine, EngineDead
from day0jax.engine.requests import InvalidRequest, QueueFull, SamplingParams, TokenEvent
from day0jax.serve.constrain import Constraints
from day0jax.serve.errors import APIError
from day0jax.serve.state import ServerState, tenant_salt
from day0jax.serve.validate import adapter_of
from day0jax.vision.inputs import ImageInputs


def sampling_params(state: ServerState, body, prompt_len: int, constraints: Constraints,
                    tenant: str | None = None) -> SamplingParams:
    """The engine's `SamplingParams` for a chat or completion request (the engine checks their ranges).

    Args:
        state: the server state (the context length).
        body: the request.
        prompt_len: tokens of its longest prompt (a request without a token limit gets what the context leaves).
        constraints: its grammar and logit biases.
        tenant: the API key's tenant, when the server has several keys (its prefix-cache hits stay its own).
    """
    max_tokens = body.max_new_tokens()
    if max_tokens is None:
        max_tokens = max(1, state.max_model_len - prompt_len)
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k, min_p=body.min_p,
        seed=None if body.seed is None else body.seed & 0xFFFFFFFF, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
        stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos, logprobs=body.logprob_count(),
        n=body.n, grammar=constraints.grammar, logit_bias=constraints.logit_bias,
        cache_salt=tenant_salt(tenant, body.cache_salt), adapter=adapter_of(state, body))


@dataclass
class Run:
    """A submitted request: one engine request per prompt, counted in `state.in_flight` until `release`.

    Attributes:
        id: the request's id (the response's `id`; engine request k is `{id}-{k}`).
        engine: the engine it runs on.
        streams: each engine request's event stream, in prompt order.
        n: sequences per prompt.
        prompt_tokens: the prompts' tokens, all together.
    """

    id: str
    engine: AsyncEngine
    state: ServerState
    streams: list[AsyncIterator[TokenEvent]]
    n: int
    prompt_tokens: int
    image_bytes: int = 0  # the server's image memory its images hold until it ends (`render.chat` took it)
    released: bool = False

    def abort(self, prompt: int | None = None, index: int | None = None) -> None:
        """Stops sequence `index` of prompt `prompt` (every sequence of every prompt by default)."""
        for k in range(len(self.streams)) if prompt is None else [prompt]:
            self.engine.abort(f"{self.id}-{k}", index)

    def release(self, completed: bool) -> None:
        """Forgets the engine requests, aborting them unless `completed`; the request is no longer in flight. Only the
        first call counts: every way a response can end calls it."""
        if self.released:
            return
        self.released = True
        self.state.in_flight -= 1
        self.state.image_memory.give_back(self.image_bytes)
        for k in range(len(self.streams)):
            self.engine.release(f"{self.id}-{k}", finished=completed)


def submit(state: ServerState, engine: AsyncEngine, rid: str, body, prompts: list[list[int]],
           constraints: Constraints, images: list[ImageInputs | None] | None = None, tenant: str | None = None
           ) -> Run:
    """Queues one engine request per prompt, all or none.

    Args:
        state: the server state (context length, metrics, in-flight count).
        engine: the engine that admitted the request (`validate`).
        rid: the request's id.
        body: the request (its sampling fields).
        prompts: token ids of each prompt (`render`).
        constraints: its grammar and logit biases (`constrain`).
        images: per prompt, its preprocessed images (shared by the prompt's `n` sequences), or None.
        tenant: the API key's tenant (`sampling_params`).
    Returns:
        The `Run`, in flight.
    Raises:
        APIError: 400 for parameters the engine refuses (naming the field), 429 when its queue is full, 503 when it
            stopped serving.
    """
    params = sampling_params(state, body, max(map(len, prompts)), constraints, tenant)
    streams = []
    try:
        for k, prompt in enumerate(prompts):
            streams.append(engine.submit(f"{rid}-{k}", prompt, params, images[k] if images else None))
    except (InvalidRequest, QueueFull, EngineDead) as e:
        for k in range(len(streams)):
            engine.release(f"{rid}-{k}", finished=False)
        if isinstance(e, EngineDead):
            raise APIError(503, str(e), "service_unavailable") from None
        if isinstance(e, QueueFull):
            raise APIError(429, str(e), "rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from None
        raise APIError(400, str(e), param=e.param,
                       code="context_length_exceeded" if "context length" in str(e) else None) from None
    run = Run(rid, engine, state, streams, params.n, sum(map(len, prompts)),
              sum(x.pixels.nbytes for x in images or () if x is not None))
    state.metrics.prompt_tokens.inc(run.prompt_tokens)
    state.in_flight += 1
    return run
