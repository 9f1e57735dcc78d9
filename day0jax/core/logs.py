"""What the command-line programs (serve, compile, generate) print while they work: the log and progress bars.

At "info" (the default) the log shows this project's messages and every library's warnings, not the libraries' INFO
lines (absl, XLA and uvicorn write dozens at start); "debug" shows all, each line with its logger's name.
"""

from __future__ import annotations

import logging
import sys
from typing import IO

LEVELS = ("debug", "info", "warning", "error", "critical")
OWN_PACKAGES = ("day0jax", "kernels_pallas", "sharding", "convert")  # this repository's top-level packages
_HANDLER_NAME = "day0jax-console"
_DETAILED = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_argument(parser, default: str = "info") -> None:
    """Adds `--log-level` (one of LEVELS) to a command's argument parser.

    Args:
        parser: an `argparse.ArgumentParser`.
        default: the level without the flag.
    """
    parser.add_argument("--log-level", default=default, type=str.lower, choices=LEVELS,
                        help=f"{default} by default; info: a short log, one line per start-up step; debug: "
                             "everything, the libraries' messages included")


def setup(level: str = "info", stream: IO[str] | None = None) -> logging.Handler:
    """Sends log records to `stream` at `level`, libraries' records below WARNING only at "debug"; replaces the
    handler an earlier call installed (other handlers are left alone).

    Args:
        level: one of LEVELS, any case.
        stream: where the log goes (default: standard error).
    Returns:
        The handler installed on the root logger.
    Raises:
        ValueError: `level` is not one of LEVELS.
    """
    name = level.lower()
    if name not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; use one of {', '.join(LEVELS)}")
    numeric = logging.getLevelNamesMapping()[name.upper()]
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
    handler = _ConsoleHandler(stream if stream is not None else sys.stderr)
    handler.set_name(_HANDLER_NAME)
    if numeric <= logging.DEBUG:
        handler.setFormatter(logging.Formatter(_DETAILED))
    else:
        handler.setFormatter(_ShortFormatter())
        handler.addFilter(_quiet_libraries)
    root.addHandler(handler)
    root.setLevel(numeric)
    return handler


class _ConsoleHandler(logging.StreamHandler):
    """A stream handler that takes a progress bar drawn on its stream off the line before writing a record, and
    draws it again after: a line logged by another thread mid-bar (parameters restored while programs compile)
    starts on its own line instead of after the bar's text."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        with tqdm.external_write_mode(file=self.stream):
            super().emit(record)


def is_own(logger_name: str) -> bool:
    """Whether a logger belongs to this repository's packages (not to a library)."""
    return logger_name.split(".", 1)[0] in OWN_PACKAGES


def _quiet_libraries(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or is_own(record.name)


class _ShortFormatter(logging.Formatter):
    """`12:00:01 message` for this project's INFO lines; level and logger name for anything else."""

    def __init__(self):
        super().__init__("%(asctime)s %(message)s", datefmt="%H:%M:%S")
        self._detailed = logging.Formatter(_DETAILED, datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno == logging.INFO and is_own(record.name):
            return super().format(record)
        return self._detailed.format(record)


def progress_bar(total: int, description: str, shown: bool = True):
    """A progress bar on standard error, shown while this project logs at INFO (a silent stand-in otherwise).

    Args:
        total: the number of steps.
        description: what is being done, e.g. "compiling 24 programs".
        shown: False for a silent stand-in anyway (another bar is on the terminal meanwhile).
    Returns:
        A tqdm bar: use it as a context manager and call `update(n)`.
    """
    from tqdm import tqdm

    shown = shown and logging.getLogger(OWN_PACKAGES[0]).isEnabledFor(logging.INFO)
    return tqdm(total=total, desc=description, file=sys.stderr, disable=not shown, mininterval=0.5,
                bar_format="{desc} |{bar:24}| {n_fmt}/{total_fmt} [{elapsed}]")
