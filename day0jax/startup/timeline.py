"""The startup timeline: where the seconds between process start and "ready" went.

Phases (reading the config, building the model, restoring parameters, the kernel self-test, building the
engine, compiling, warm-up) are recorded as they happen, with details such as the bytes restored; every
compiled program gets a `CompileRecord` (seconds, and whether it came from a cache). `log_phases` logs one short
line per phase as it ends; `table()` is the full readable form (the server logs it at debug level, `compile`
prints it); the server exports the same figures on /metrics.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

# Where a compiled program came from. "program-store": a serialized executable of this exact program, loaded
# without tracing; "xla-cache": traced, then found in JAX's persistent compilation cache; "compiled": built now.
SOURCES = ("program-store", "xla-cache", "compiled")


@dataclass(frozen=True)
class CompileRecord:
    """One program made ready before serving.

    Attributes:
        program: the program's name ("forward", "sample").
        shape: its bucket, e.g. "16x1x64" (rows x tokens x pages) or "4 filtered+logprobs".
        lower_seconds: tracing and lowering (0 when loaded from the program store).
        compile_seconds: compiling, or loading from a cache.
        source: one of SOURCES.
    """

    program: str
    shape: str
    lower_seconds: float
    compile_seconds: float
    source: str

    @property
    def seconds(self) -> float:
        return self.lower_seconds + self.compile_seconds

    @property
    def cache(self) -> str:
        """"hit" when a cache supplied the executable, else "miss"."""
        return "miss" if self.source == "compiled" else "hit"


@dataclass
class Phase:
    name: str
    start: float  # seconds since the timeline's origin
    seconds: float
    detail: dict[str, Any] = field(default_factory=dict)


def process_start_time() -> float | None:
    """Wall-clock time (epoch seconds) at which this process started, or None where it cannot be read.

    Linux only (/proc): the 22nd field of /proc/self/stat is the start in clock ticks since boot.
    """
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - uptime + started_after_boot
    except (OSError, ValueError, IndexError):
        return None


class Timeline:
    """Phases and compiled programs of one start.

    Args:
        origin: wall-clock time (epoch seconds) the timeline counts from; default: the process's start, so the
            first phase ("python start") covers the interpreter and imports before the timeline existed.
    """

    def __init__(self, origin: float | None = None):
        now = time.time()
        self.origin = origin if origin is not None else (process_start_time() or now)
        self.phases: list[Phase] = []
        self.compiles: list[CompileRecord] = []
        self.ready_at: float | None = None  # seconds since origin
        self._logger: logging.Logger | None = None  # see log_phases
        if now - self.origin > 1e-3:
            self.phases.append(Phase("python start", 0.0, now - self.origin, {"what": "interpreter and imports"}))

    def now(self) -> float:
        """Seconds since the origin."""
        return time.time() - self.origin

    @contextlib.contextmanager
    def phase(self, name: str, **detail: Any) -> Iterator[dict[str, Any]]:
        """Times a block as phase `name`; the yielded dict takes details (e.g. `bytes`) while it runs."""
        start = self.now()
        info = dict(detail)
        try:
            yield info
        finally:
            phase = Phase(name, start, self.now() - start, info)
            self.phases.append(phase)
            if self._logger is not None:
                self._logger.info("%s", phase_line(phase))

    def log_phases(self, logger: logging.Logger) -> None:
        """Logs each phase at INFO as it ends, one line (`phase_line`); the phases recorded so far first.

        Args:
            logger: where the lines go.
        """
        for phase in self.phases:
            logger.info("%s", phase_line(phase))
        self._logger = logger

    def add_compile(self, record: CompileRecord) -> None:
        self.compiles.append(record)

    def mark_ready(self) -> None:
        self.ready_at = self.now()

    def phase_seconds(self) -> dict[str, float]:
        """Seconds per phase name (summed if a phase ran more than once), plus "ready" (origin to ready)."""
        out: dict[str, float] = {}
        for p in self.phases:
            out[p.name] = out.get(p.name, 0.0) + p.seconds
        if self.ready_at is not None:
            out["ready"] = self.ready_at
        return out

    def compile_counts(self) -> dict[str, int]:
        return count_sources(self.compiles)

    def table(self, programs: bool = True) -> str:
        """The timeline as aligned text: phases, then (with `programs`) one line per compiled program."""
        lines = [f"{'phase':<20} {'start s':>8} {'seconds':>8}  detail"]
        for p in self.phases:
            lines.append(f"{p.name:<20} {p.start:8.2f} {p.seconds:8.2f}  {_detail(p)}")
        if self.ready_at is not None:
            lines.append(f"{'ready':<20} {self.ready_at:8.2f} {'':>8}  since process start")
        if programs and self.compiles:
            lines.append("")
            lines.append(program_table(self.compiles))
        return "\n".join(lines)


def program_table(records: list[CompileRecord]) -> str:
    """One line per program (program, shape, lower/compile seconds, cache hit or miss, source), then totals."""
    lines = [f"{'program':<8} {'shape':<30} {'lower s':>8} {'compile s':>9}  {'cache':<5} source"]
    for r in records:
        lines.append(f"{r.program:<8} {r.shape:<30} {r.lower_seconds:8.2f} {r.compile_seconds:9.2f}  "
                     f"{r.cache:<5} {r.source}")
    lines.append(f"{len(records)} programs: " + ", ".join(f"{n} {s}" for s, n in count_sources(records).items()) +
                 f"; {sum(r.lower_seconds for r in records):.1f}s lowering, "
                 f"{sum(r.compile_seconds for r in records):.1f}s compiling or loading (summed over threads)")
    return "\n".join(lines)


def count_sources(records: list[CompileRecord]) -> dict[str, int]:
    """Programs per source, in SOURCES order."""
    return {s: sum(1 for r in records if r.source == s) for s in SOURCES}


def phase_line(p: Phase) -> str:
    """One phase as a short log line: its name, seconds and details, e.g. "compile 5.73s (programs=27, ...)"."""
    detail = _detail(p)
    return f"{p.name} {p.seconds:.2f}s" + (f" ({detail})" if detail else "")


def _detail(p: Phase) -> str:
    d = dict(p.detail)
    parts = []
    if "bytes" in d:
        n = d.pop("bytes")
        parts.append(f"{n / 1e9:.3f} GB at {n / max(p.seconds, 1e-9) / 1e9:.2f} GB/s")
    parts += [f"{k}={v}" if k != "what" else str(v) for k, v in d.items()]
    return ", ".join(parts)


class _NullTimeline(Timeline):
    """Records nothing (for callers that do not keep a timeline)."""

    def __init__(self):
        super().__init__(origin=time.time())

    @contextlib.contextmanager
    def phase(self, name: str, **detail: Any) -> Iterator[dict[str, Any]]:
        yield dict(detail)

    def add_compile(self, record: CompileRecord) -> None:
        pass


def null() -> Timeline:
    """A timeline that records nothing."""
    return _NullTimeline()
