"""The startup timeline: where the seconds between process start and "ready" went.

Phases (with details such as the bytes restored) and one `CompileRecord` per program; the server logs `table()` at
debug level and exports the same figures on /metrics, `compile` prints it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

# "program-store": loaded without tracing; "xla-cache": traced, then found in JAX's persistent cache; "compiled": built.
SOURCES = ("program-store", "xla-cache", "compiled")


@dataclass(frozen=True)
class CompileRecord:
    """One program made ready before serving."""

    program: str  # "forward" or "sample"
    shape: str  # its bucket, e.g. "16x1x64" (rows x tokens x pages)
    lower_seconds: float  # tracing and lowering (0 when loaded from the program store)
    compile_seconds: float  # compiling, or loading from a cache
    source: str  # one of SOURCES

    @property
    def seconds(self) -> float:
        return self.lower_seconds + self.compile_seconds

    @property
    def cache(self) -> str:
        return "miss" if self.source == "compiled" else "hit"


@dataclass
class Phase:
    name: str
    start: float  # seconds since the timeline's origin
    seconds: float
    detail: dict[str, Any] = field(default_factory=dict)


def process_start_time() -> float | None:
    """Epoch seconds at which this process started (field 22 of /proc/self/stat: ticks since boot), or None."""
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
        origin: epoch seconds counted from (default: process start; then a "python start" phase covers the time before).
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
        """Logs each phase at INFO as it ends (`phase_line`), the phases recorded so far first.

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
            lines += ["", program_table(self.compiles)]
        return "\n".join(lines)


def program_table(records: list[CompileRecord]) -> str:
    """One line per program, then totals."""
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
    """One phase as a log line, e.g. "compile 5.73s (programs=27, ...)"."""
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
