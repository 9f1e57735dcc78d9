"""The server's life: /health is 503 until the model is loaded and compiled; a full queue answers 429 with
Retry-After (before tokenizing); SIGTERM stops admitting (503), lets the requests in flight finish, never waits for
those whose clients left, exits 0.

Every step waits for what it depends on to be observed (a stream's first chunk, a response's headers, /health
turning 503) rather than for time to pass, so the test means the same on a loaded machine. The one assumption
left is that a stream of LONG tokens does not end while the client sends a few requests, which has a margin of
thousands of engine steps.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serve_tiny import CONFIG, write_tiny_chat_checkpoint  # noqa: E402

from launch import ServerProcess  # noqa: E402

MODEL = "tiny-chat"
LONG = 2000  # tokens each streamed request asks for (EOS ignored)
CONTEXT = 2048


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_chat_checkpoint(tmp_path_factory.mktemp("life"),
                                      dict(CONFIG, max_position_embeddings=CONTEXT))


def body(i: int, max_tokens: int = LONG, stream: bool = True) -> dict:
    return {"model": MODEL, "prompt": f"request {i}", "max_tokens": max_tokens, "stream": stream,
            "ignore_eos": True, **({"stream_options": {"include_usage": True}} if stream else {})}


def waiting(metrics: httpx.Response) -> float:
    """The queue depth /metrics reports."""
    return float(re.search(r"^day0jax_num_requests_waiting (\S+)$", metrics.text, re.M)[1])


class Stream:
    """A streaming completion whose headers have arrived; `first` is set at its first data chunk."""

    def __init__(self, response: httpx.Response):
        self.response, self.first = response, asyncio.Event()
        self.done = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, http: httpx.AsyncClient, url: str, i: int) -> "Stream":
        response = await http.send(http.build_request("POST", url + "/v1/completions", json=body(i)), stream=True)
        assert response.status_code == 200, (await response.aread()).decode()
        return cls(response)

    async def _read(self) -> tuple[int, list[str]]:
        """(completion tokens from the usage chunk, finish reasons seen)."""
        tokens, reasons = 0, []
        try:
            async for line in self.response.aiter_lines():
                if line.startswith("data: {"):
                    self.first.set()
                    chunk = json.loads(line[6:])
                    reasons += [c["finish_reason"] for c in chunk["choices"] if c.get("finish_reason")]
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
        finally:
            await self.response.aclose()
        return tokens, reasons


def test_health_503_then_429_then_graceful_sigterm(ckpt):
    # One running sequence and four waiting at most: a sixth request gets 429.
    proc = ServerProcess(["--model", str(ckpt), "--max-num-seqs", "1", "--max-waiting", "4", "--chunk-sizes", "32",
                          "--max-model-len", str(CONTEXT), "--min-width", str(CONTEXT), "--shutdown-grace", "300"])
    try:
        statuses = set()
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            code = proc.health()
            if code is not None:
                statuses.add(code)
                if code == 200 or proc.proc.poll() is not None:
                    break
                models = httpx.get(proc.url + "/v1/models").status_code
                # Not ready: /v1 answers 503 too (unless it became ready between the two calls).
                assert models == 503 or (models == 200 and proc.health() == 200)
            time.sleep(0.05)
        assert statuses == {503, 200}, (statuses, proc.log_text()[-3000:])

        async def life():
            async with httpx.AsyncClient(timeout=600) as http:
                # A runs (it has streamed), then B and C are accepted one after the other: they wait behind A. D
                # (streamed) and E (whole) wait behind C; their clients will leave.
                a = await Stream.open(http, proc.url, 0)
                await a.first.wait()
                streams = [a, await Stream.open(http, proc.url, 1), await Stream.open(http, proc.url, 2)]
                d = await Stream.open(http, proc.url, 5)
                e = asyncio.create_task(http.post(proc.url + "/v1/completions", json=body(6, stream=False)))
                while waiting(await http.get(proc.url + "/metrics")) < 4:  # E is queued
                    await asyncio.sleep(0.01)
                full = await http.post(proc.url + "/v1/completions", json=body(3, stream=False))
                assert full.status_code == 429, full.text
                assert full.headers.get("retry-after") and full.json()["error"]["type"] == "rate_limit_error"

                proc.proc.send_signal(signal.SIGTERM)
                while (await http.get(proc.url + "/health")).status_code != 503:  # the signal has been handled
                    await asyncio.sleep(0.01)
                during = await http.post(proc.url + "/v1/completions", json=body(4, 4, stream=False))
                assert during.status_code == 503 and during.json()["error"]["message"], during.text
                # D's and E's clients leave while they wait: the drain must not run them.
                d.done.cancel()
                e.cancel()
                return await asyncio.gather(*(s.done for s in streams))

        finished = asyncio.run(life())
        # The three requests in flight at SIGTERM whose clients stayed all run to their length; the two abandoned
        # ones, queued behind them, never generate a token: the drain ends with exactly their tokens.
        assert finished == [(LONG, ["length"])] * 3, finished
        assert proc.proc.wait(300) == 0, proc.log_text()[-3000:]
        drained = re.search(r"drained in [\d.]+s: (\d+) tokens generated", proc.log_text())
        assert drained and int(drained[1]) == 3 * LONG, proc.log_text()[-3000:]
    finally:
        proc.kill()
