"""The command-line programs' log set-up: short at "info" (no library INFO lines), everything at "debug"; the
compile progress bar; the startup timeline's one line per phase. In-process and fast.
"""

from __future__ import annotations

import io
import logging
import re

import pytest

from day0jax.core import logs
from day0jax.startup.timeline import Timeline

LIBRARIES = ["absl", "orbax.checkpoint", "jax._src.xla_bridge", "uvicorn.error"]


@pytest.fixture
def root_logger():
    """The root logger, restored after the test (level and handlers)."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield root
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)


def emit_everything() -> None:
    """One record per (library or project logger, level)."""
    for name in [*LIBRARIES, "day0jax.serve", "kernels_pallas.selftest"]:
        for level in (logging.DEBUG, logging.INFO, logging.WARNING):
            logging.getLogger(name).log(level, "%s says %s", name, logging.getLevelName(level))


def test_info_level_shows_the_project_and_library_warnings_only(root_logger):
    out = io.StringIO()
    logs.setup("info", out)
    emit_everything()
    text = out.getvalue()
    for name in LIBRARIES:
        assert f"{name} says INFO" not in text and f"{name} says DEBUG" not in text, text
        assert re.search(rf"^\d\d:\d\d:\d\d WARNING {re.escape(name)}: {re.escape(name)} says WARNING$", text, re.M)
    # The project's INFO lines are short: time and message.
    assert re.search(r"^\d\d:\d\d:\d\d day0jax.serve says INFO$", text, re.M), text
    assert "kernels_pallas.selftest says INFO" in text and "day0jax.serve says DEBUG" not in text


def test_debug_level_brings_back_every_library_line_with_its_logger(root_logger):
    out = io.StringIO()
    logs.setup("DEBUG", out)
    emit_everything()
    text = out.getvalue()
    for name in [*LIBRARIES, "day0jax.serve"]:
        for level in ("DEBUG", "INFO", "WARNING"):
            assert re.search(rf" {level} {re.escape(name)}: {re.escape(name)} says {level}$", text, re.M), (name, text)


def test_setup_again_replaces_its_handler_and_refuses_unknown_levels(root_logger):
    first, second = io.StringIO(), io.StringIO()
    logs.setup("info", first)
    logs.setup("warning", second)
    logging.getLogger("day0jax.serve").warning("once")
    logging.getLogger("day0jax.serve").info("not at warning level")
    assert first.getvalue() == "" and second.getvalue().count("once") == 1
    assert "not at warning level" not in second.getvalue()
    with pytest.raises(ValueError, match="unknown log level 'loud'; use one of debug, info"):
        logs.setup("loud")


def test_progress_bar_only_while_the_project_logs_at_info(root_logger):
    logs.setup("warning", io.StringIO())
    assert logs.progress_bar(3, "compiling 3 programs").disable
    logs.setup("info", io.StringIO())
    bar = logs.progress_bar(3, "compiling 3 programs")
    assert not bar.disable
    bar.close()


def test_timeline_logs_one_line_per_phase_including_those_before_logging_started(caplog):
    t = Timeline(origin=None)
    with t.phase("server imports", what="flags"):
        pass
    with caplog.at_level(logging.INFO, logger="day0jax.test"):
        t.log_phases(logging.getLogger("day0jax.test"))
        with t.phase("restore parameters") as info:
            info["bytes"] = 2_000_000_000
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" ")[0] for line in lines][-2:] == ["server", "restore"]
    assert re.fullmatch(r"server imports \d+\.\d\ds \(flags\)", lines[-2])
    assert re.fullmatch(r"restore parameters \d+\.\d\ds \(2\.000 GB at [\d.]+ GB/s\)", lines[-1])


def test_a_line_logged_while_a_bar_is_drawn_starts_its_own_line(root_logger, monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    logs.setup("info")
    with logs.progress_bar(3, "compiling 3 programs") as bar:
        bar.update(1)
        logging.getLogger("day0jax.test").info("restore parameters 0.25s")
        bar.update(2)
    lines = re.split(r"[\r\n]", stream.getvalue())
    assert any(re.fullmatch(r"\d\d:\d\d:\d\d restore parameters 0\.25s", line) for line in lines), lines
    assert any("compiling 3 programs |" in line and "3/3" in line for line in lines), lines  # drawn again after
