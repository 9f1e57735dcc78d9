"""`python -m day0jax.serve` as a subprocess on a free loopback port, for tests and benchmarks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess; `terminate` sends SIGTERM, which drains it.

    Args:
        args: extra command-line arguments for `python -m day0jax.serve`.
        env: extra environment variables.
        python: the interpreter (default: this one).
        cwd: the folder to run in, whose `day0jax` is the one served (default: this checkout).
    """

    def __init__(self, args: list[str], env: dict | None = None, python: str | None = None, cwd: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="day0jax-serve-", suffix=".log", delete=False)
        cmd = [python or sys.executable, "-m", "day0jax.serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, cwd=cwd or Path(__file__).resolve().parents[2])

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def health(self) -> int | None:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    def wait_ready(self, timeout: float = 600) -> "ServerProcess":
        """Blocks until /health is 200.

        Raises:
            RuntimeError: the process exited or the timeout passed (the server's log is in the message).
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_text()[-5000:]}")
            if self.health() == 200:
                return self
            time.sleep(0.25)
        self.kill()
        raise RuntimeError(f"the server was not ready after {timeout}s:\n{self.log_text()[-5000:]}")

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM, then the exit code (killing it if it does not exit within `timeout`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def serving(args: list[str], timeout: float = 900, **kwargs) -> Iterator[ServerProcess]:
    """A ready server for the `with` block (arguments as `ServerProcess`'s); on leaving it, SIGTERM, and an
    AssertionError carrying the log's end if the drain's exit code was not 0."""
    proc = ServerProcess(args, **kwargs)
    try:
        yield proc.wait_ready(timeout)
    finally:
        code = proc.terminate()
        assert code == 0, f"the server exited with {code}:\n{proc.log_text()[-3000:]}"
