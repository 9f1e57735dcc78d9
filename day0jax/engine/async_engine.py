"""The engine on its own thread, with an asyncio face for the server: `submit()` streams a request's `TokenEvent`s.

The step runs on a background thread (XLA releases the GIL while it computes), so the event loop keeps accepting and
streaming; events reach the loop in one thread-safe call per step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import AsyncIterator, Sequence

from day0jax.engine.engine import Engine
from day0jax.engine.requests import SamplingParams, TokenEvent
from day0jax.vision.inputs import ImageInputs

log = logging.getLogger(__name__)


class EngineDead(RuntimeError):
    """A request's steps fail (the server answers 500 for it alone), or the engine could not recover."""


MAX_FAILED_STEPS = 3  # consecutive failed steps (each recovered from) before the engine is declared dead


class AsyncEngine:
    """Runs `engine.step()` in a loop on a daemon thread.

    Args:
        engine: the `Engine`.
        on_step: optional callable(events, seconds) called on the engine thread after each step (metrics).
    """

    def __init__(self, engine: Engine, on_step=None):
        self.engine = engine
        self.on_step = on_step
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.dead: str | None = None  # why the engine stopped serving, once it could not recover
        self._failed_steps = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="day0jax-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def submit(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
               images: ImageInputs | None = None) -> AsyncIterator[TokenEvent]:
        """Queues a request; returns the iterator of its events until each of its `n` sequences finished (it raises
        EngineDead if the engine fails meanwhile). Call `release(request_id)` when done with it, early or not.

        Args:
            request_id: unique among the requests in flight.
            prompt: token ids (a vision-language model's image placeholders expanded).
            params: the sampling parameters.
            images: the prompt's preprocessed images, shared by its `n` sequences (None: no images).
        Returns:
            The async iterator of the request's `TokenEvent`s.
        Raises:
            EngineDead: the engine stopped serving.
            InvalidRequest, QueueFull: from `Engine.add_request`, synchronously.
        """
        if self.dead is not None:
            raise EngineDead(f"the engine stopped serving: {self.dead}")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            self.engine.add_request(request_id, prompt, params, images=images)
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        self._wake.set()
        return self._stream(queue, params.n)

    @staticmethod
    async def _stream(queue: asyncio.Queue, n: int) -> AsyncIterator[TokenEvent]:
        done = 0
        while done < n:
            event = await queue.get()
            if isinstance(event, BaseException):
                raise EngineDead(str(event)) from event
            if event.finish_reason is not None:
                done += 1
            yield event

    def release(self, request_id: str, finished: bool) -> None:
        """Forgets a request's queue; aborts it in the engine unless it `finished`."""
        self._queues.pop(request_id, None)
        if not finished:
            self.abort(request_id)

    def abort(self, request_id: str, index: int | None = None) -> None:
        self.engine.abort(request_id, index)
        self._wake.set()

    def _deliver(self, batches: dict[str, list]) -> None:
        for request_id, items in batches.items():
            queue = self._queues.get(request_id)
            if queue is not None:
                for item in items:
                    queue.put_nowait(item)

    def _run(self) -> None:
        while not self._stop:
            if not self.engine.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            t0 = time.perf_counter()
            try:
                events = self.engine.step()
                self._failed_steps = 0
            except Exception as e:  # a real fault: end only the requests it happens on, keep the others
                log.exception("engine step failed; looking for the request it fails on")
                self._failed_steps += 1
                try:
                    if self._failed_steps > MAX_FAILED_STEPS:
                        raise RuntimeError(f"{self._failed_steps} steps in a row failed, the last with "
                                           f"{type(e).__name__}: {e}") from e
                    events, failed = self.engine.recover()
                except Exception as fatal:  # noqa: BLE001 - nothing left to blame: stop serving, say so
                    log.exception("the engine cannot recover; refusing new requests")
                    self.dead = f"{type(fatal).__name__}: {fatal}"
                    self._loop.call_soon_threadsafe(self._deliver, {rid: [fatal] for rid in list(self._queues)})
                    return
                self._loop.call_soon_threadsafe(self._deliver, {rid: [e] for rid in failed})
            if self.on_step is not None:
                self.on_step(events, time.perf_counter() - t0)
            if events:
                batches: dict[str, list] = {}
                for event in events:
                    batches.setdefault(event.request_id, []).append(event)
                self._loop.call_soon_threadsafe(self._deliver, batches)

