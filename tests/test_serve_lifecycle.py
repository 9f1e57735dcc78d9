"""The server's life: /health is 503 until the model is loaded and compiled; a full queue answers 429 with
Retry-After (before tokenizing); SIGTERM stops admitting (503), lets the requests in flight finish, exits 0.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serve_tiny import write_tiny_chat_checkpoint  # noqa: E402

from day0jax.serve.launch import ServerProcess  # noqa: E402

MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_chat_checkpoint(tmp_path_factory.mktemp("life"))


async def stream(url: str, i: int, max_tokens: int, started: asyncio.Event | None = None):
    body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    async with httpx.AsyncClient(timeout=300) as http:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, r.headers.get("retry-after"), r.json()
            chunks, reasons = 0, []
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if started is not None:
                        started.set()
                    if '"finish_reason":"' in line:
                        reasons.append(line.split('"finish_reason":"')[1].split('"')[0])
            return 200, chunks, reasons


def test_health_503_then_429_then_graceful_sigterm(ckpt):
    # One running sequence and two waiting at most: the fourth concurrent request gets 429.
    proc = ServerProcess(["--model", str(ckpt), "--max-num-seqs", "1", "--max-waiting", "2", "--chunk-sizes", "32",
                          "--max-model-len", "256", "--min-width", "256", "--shutdown-grace", "120"])
    try:
        statuses = set()
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            code = proc.health()
            if code is not None:
                statuses.add(code)
                if code == 200:
                    break
                if proc.proc.poll() is not None:
                    break
                models = httpx.get(proc.url + "/v1/models").status_code
                # Not ready: /v1 answers 503 too (unless it became ready between the two calls).
                assert models == 503 or (models == 200 and proc.health() == 200)
            time.sleep(0.05)
        assert statuses == {503, 200}, (statuses, proc.log_text()[-3000:])

        async def burst():
            return await asyncio.gather(*(stream(proc.url, i, 40) for i in range(8)))

        results = asyncio.run(burst())
        limited = [r for r in results if r[0] == 429]
        served = [r for r in results if r[0] == 200]
        assert limited and served, results
        for _, retry_after, body in limited:
            assert retry_after and body["error"]["type"] == "rate_limit_error"
        assert all(chunks >= 40 and reasons == ["length"] for _, chunks, reasons in served)

        async def drain():
            # Three long requests (one running, two queued); SIGTERM as soon as the first one streams.
            started = asyncio.Event()
            running = [asyncio.create_task(stream(proc.url, i, 240, started)) for i in range(3)]
            await started.wait()
            proc.proc.send_signal(__import__("signal").SIGTERM)
            await asyncio.sleep(0.05)
            async with httpx.AsyncClient(timeout=30) as http:
                during = await http.post(proc.url + "/v1/completions", json={"model": MODEL, "prompt": "late"})
                health = await http.get(proc.url + "/health")
            return await asyncio.gather(*running), during, health

        finished, during, health = asyncio.run(drain())
        assert during.status_code == 503 and during.json()["error"]["message"]
        assert health.status_code == 503
        assert all(r[0] == 200 and r[2] == ["length"] and r[1] >= 240 for r in finished), finished
        assert proc.proc.wait(120) == 0, proc.log_text()[-3000:]
    finally:
        proc.kill()
