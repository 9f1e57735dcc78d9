"""Compiling every program before serving: the program store first, then trace and compile, in parallel.

A thread pool loads programs from the store; one not found there is traced and lowered in the main thread (Python,
holding the GIL) and compiled in the pool (XLA releases the GIL), so lowering overlaps compiling. A per-thread JAX
monitoring listener tells JAX cache hits from compiles (JAX 0.11.2 records the hit in the thread that asked).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Protocol, Sequence

import jax

from day0jax.startup import compile_cache
from day0jax.startup.program_store import ProgramStore
from day0jax.startup.timeline import CompileRecord, Timeline

log = logging.getLogger(__name__)

_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


class ProgramOwner(Protocol):
    """What `compile_programs` needs from the owner of the programs (the engine's `ModelRunner`)."""

    def lower(self, program: Any) -> jax.stages.Lowered: ...
    def compile(self, lowered: jax.stages.Lowered) -> jax.stages.Compiled: ...
    def install(self, program: Any, compiled: jax.stages.Compiled) -> None: ...
    def signature(self, program: Any) -> str: ...


def default_workers() -> int:
    """Compile threads: one per core (the main thread's lowering shares them), at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


_local = threading.local()
_registered = False
_register_lock = threading.Lock()
_totals = {"traces": 0, "compiles": 0}
_background = {"traces": 0, "compiles": 0}  # the part of _totals done by `BackgroundCompiler`'s thread


def _on_event(event: str, **kwargs) -> None:
    seen = getattr(_local, "events", None)
    if seen is not None:
        seen.append(event)


def _on_duration(event: str, duration: float, **kwargs) -> None:
    kind = "traces" if event == _TRACE else "compiles" if event == _BACKEND_COMPILE else None
    if kind is not None:
        _totals[kind] += 1
        if getattr(_local, "background", False):
            _background[kind] += 1


def watch_compiles() -> None:
    """Registers the JAX monitoring listeners (once per process)."""
    global _registered
    with _register_lock:
        if not _registered:
            jax.monitoring.register_event_listener(_on_event)
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _registered = True


def compile_totals(path: str = "all") -> dict[str, int]:
    """Counts since `watch_compiles`: functions traced ("traces") and XLA compilations ("compiles"), all of them
    (`path="all"`), those of `BackgroundCompiler`'s thread ("background") or the rest ("request": on the path of
    whatever asked for the program)."""
    if path == "background":
        return dict(_background)
    if path == "request":
        return {k: _totals[k] - _background[k] for k in _totals}
    return dict(_totals)


def compile_programs(owner: ProgramOwner, programs: Sequence[Any], *, store: ProgramStore | None = None,
                     workers: int | None = None, timeline: Timeline | None = None,
                     progress: Callable[[int, int], None] | None = None) -> list[CompileRecord]:
    """Makes every program ready (from the store, JAX's cache, or compiled) and installs it in `owner`.

    Args:
        owner: lowers, compiles and installs programs, and names their store signatures.
        programs: what to compile; each has `.name` and `.label` (for the records).
        store: the program store (None: always trace).
        workers: compile threads (default `default_workers()`).
        timeline: receives a `CompileRecord` per program.
        progress: called with (done, total) as programs become ready.
    Returns:
        The records, in `programs` order.
    Raises:
        Whatever lowering or compiling a program raises (a program that cannot compile is fatal).
    """
    watch_compiles()
    total = len(programs)
    records: list[CompileRecord | None] = [None] * total
    done = 0

    def from_store(i: int):
        t0 = time.perf_counter()
        return store.load(owner.signature(programs[i])), time.perf_counter() - t0

    def compile_one(i: int, lowered, lower_seconds: float):
        _local.events = []
        compile_cache.reset_last_key()
        try:
            t0 = time.perf_counter()
            compiled = owner.compile(lowered)
            seconds = time.perf_counter() - t0
            hit = _CACHE_HIT in _local.events
        finally:
            _local.events = None
        if store is not None:  # next start: no tracing either
            store.save(owner.signature(programs[i]), compiled, compile_cache.last_key())
        p = programs[i]
        return compiled, CompileRecord(p.name, p.label, lower_seconds, seconds, "xla-cache" if hit else "compiled")

    def finish(i: int, compiled, record: CompileRecord) -> None:
        nonlocal done
        owner.install(programs[i], compiled)
        records[i] = record
        if timeline is not None:
            timeline.add_compile(record)
        done += 1
        if progress:
            progress(done, total)

    with ThreadPoolExecutor(workers or default_workers(), thread_name_prefix="day0jax-compile") as pool:
        looked_up: list[Future | None] = [pool.submit(from_store, i) if store else None for i in range(total)]
        compiling: list[tuple[int, Future]] = []
        for i, p in enumerate(programs):
            if looked_up[i] is not None:
                compiled, seconds = looked_up[i].result()
                if compiled is not None:
                    finish(i, compiled, CompileRecord(p.name, p.label, 0.0, seconds, "program-store"))
                    continue
            t0 = time.perf_counter()
            lowered = owner.lower(p)
            compiling.append((i, pool.submit(compile_one, i, lowered, time.perf_counter() - t0)))
            _collect(compiling, finish, block=False)
        _collect(compiling, finish, block=True)
    return [r for r in records if r is not None]


def _collect(compiling: list[tuple[int, Future]], finish, block: bool) -> None:
    for item in list(compiling):
        i, future = item
        if block or future.done():
            finish(i, *future.result())
            compiling.remove(item)


class BackgroundCompiler:
    """Makes the programs left out of the ready set ready after the server is, one at a time on a daemon thread, in
    the order given (most likely needed first). A step that needs one of them first calls `ensure`, which compiles
    it on the step's path, or waits for it if the thread is on it; the thread skips what is already installed.

    Args:
        owner: as `compile_programs`' (the engine's `ModelRunner`), with `installed(program)`.
        programs: the programs to make ready, in order.
        store: the program store (None: always trace).
        busy: whether requests are being served; the thread starts its next program only when not, so that on a
            machine with few cores the background work does not slow the traffic it prepares for (a step that
            needs a program still makes it ready at once, through `ensure`).
    """

    def __init__(self, owner: Any, programs: Sequence[Any], *, store: ProgramStore | None = None,
                 busy: Callable[[], bool] = lambda: False):
        self.owner, self.store, self.busy = owner, store, busy
        self.order = list(programs)
        self._lock = threading.Lock()
        self._in_progress: dict[Any, threading.Event] = {}
        self.made = {"background": 0, "request": 0}  # programs made ready, by whose path
        self.seconds = 0.0  # from `start` until the last program is ready
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.done = threading.Event()

    @property
    def pending(self) -> int:
        """Programs not ready yet."""
        return sum(not self.owner.installed(p) for p in self.order)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="day0jax-background-compile", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Stops after the program being compiled (an exit during an XLA compile on another thread can crash the
        interpreter's shutdown), waiting at most `timeout` seconds."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        _local.background = True
        t0 = time.perf_counter()
        try:
            for program in self.order:
                while self.busy() and not self._stop.is_set():
                    self._stop.wait(0.05)
                if self._stop.is_set():
                    break
                try:
                    self._make(program, "background")
                except Exception:  # noqa: BLE001 - a step that needs it compiles it again, and fails visibly
                    log.exception("background compile of %s %s failed", program.name, program.label)
        finally:
            self.seconds = time.perf_counter() - t0
            self.done.set()

    def ensure(self, program: Any) -> None:
        """Makes `program` ready before returning: compiled here, or waited for if the background thread has it."""
        self._make(program, "request")

    def _make(self, program: Any, path: str) -> None:
        while True:  # again after waiting: the other thread's compile may have failed
            with self._lock:
                if self.owner.installed(program):
                    return
                waiting = self._in_progress.get(program)
                if waiting is None:
                    self._in_progress[program] = threading.Event()
                    break
            waiting.wait()
        try:
            compiled = self.store.load(self.owner.signature(program)) if self.store is not None else None
            if compiled is None:
                lowered = self.owner.lower(program)
                compile_cache.reset_last_key()
                compiled = self.owner.compile(lowered)
                if self.store is not None:
                    self.store.save(self.owner.signature(program), compiled, compile_cache.last_key())
            self.owner.install(program, compiled)
            self.made[path] += 1
        finally:
            with self._lock:
                self._in_progress.pop(program).set()
