"""What the server knows between requests: the model's name and status, limits, the engine once loaded, metrics."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from day0jax.engine.async_engine import AsyncEngine
from day0jax.serve.metrics import Metrics
from day0jax.serve.reasoning import ReasoningSyntax


@dataclass
class ServerState:
    """What the routes need; `engine` and `tokenizer` appear once loading is done."""

    model_name: str  # the id clients must send as `model`
    # Served LoRA adapters (`--lora-modules`), name -> folder: a request's `model` may name one instead.
    adapters: dict[str, str] = field(default_factory=dict)
    # When set, every route but /health needs `Authorization: Bearer <one of them>`. With several, each key is a
    # tenant: prefix-cache hits (`cached_tokens`) stay among the requests sent with the same key, so one tenant
    # cannot learn from response timing or usage what another has sent.
    api_keys: tuple[str, ...] = ()
    public_metrics: bool = False  # with an API key: /metrics answers without it
    bound_host: str = "127.0.0.1"  # without an API key, only this and loopback names are accepted as Host
    max_body_bytes: int = 4 << 20  # larger request bodies get 413
    body_timeout: float = 30.0  # seconds from a body's first read to its last; slower clients get 408
    # Characters a prompt may render from, counted before tokenizing (0: `validate.CHARS_PER_TOKEN` per context token)
    max_prompt_chars: int = 0
    # Tokens one response may carry, each logprob alternative counted: prompts x n x max_tokens x (top_logprobs + 1)
    max_response_entries: int = 1 << 22
    allowed_media_dir: str | None = None  # the one folder `file://` image URLs may name (None: refused)
    max_images_per_request: int = 8  # each image is decoded, preprocessed and encoded: a bound on one request's work
    max_image_bytes: int = 20 << 20  # one encoded image (a data URL's decoded payload, or a file), checked unread
    # width * height of one image, read from its header before decoding: a tiny file can declare a huge canvas
    max_image_pixels: int = 40_000_000
    # All requests' images together, decoded and preprocessed, until each request ends: beyond it a request with
    # images waits its turn (429) instead of growing the server's memory.
    max_image_memory: int = 1 << 30
    status: str = "loading"  # "loading", "warming up", "ready", "draining" or "failed"
    detail: str = ""
    engine: AsyncEngine | None = None
    tokenizer: Any = None
    model: Any = None  # the loaded `Model` (its grammar compiler, for structured output)
    reasoning: ReasoningSyntax | None = None  # how outputs are split into reasoning and answer (None: not split)
    max_model_len: int = 0
    metrics: Metrics | None = None
    in_flight: int = 0
    timeline: Any = None  # day0jax.startup.timeline.Timeline of this start, exported on /metrics
    # day0jax.startup.warmup.compile_totals() by path ("background", "request") when it became ready
    compiles_at_ready: dict[str, dict[str, int]] | None = None
    background: Any = None  # the engine's BackgroundCompiler once ready
    image_memory: "ImageMemory" = field(init=False)

    def __post_init__(self):
        self.metrics = Metrics(self)
        self.image_memory = ImageMemory(self.max_image_memory)


class ImageMemory:
    """The bytes the requests in flight hold in images (decoded while they render, preprocessed pixels until they end),
    within a server-wide limit. Thread-safe: images are decoded off the event loop, several requests at once."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0
        self._lock = threading.Lock()

    def take(self, nbytes: int, param: str) -> None:
        """Counts `nbytes` more.

        Raises:
            APIError: 400 naming `param` for more than the whole limit (it can never fit); 429 (retry) while the images
                of other requests leave too little.
        """
        from day0jax.serve.errors import APIError

        mb = lambda n: f"{n / 2**20:.0f} MiB"  # noqa: E731
        if nbytes > self.limit:
            raise APIError(400, f"the images take {mb(nbytes)}, more than the server's {mb(self.limit)} for images "
                           "(--max-image-memory-mb); send fewer or smaller images", param=param)
        with self._lock:
            if self.held + nbytes > self.limit:
                raise APIError(429, f"the images of the requests in flight hold {mb(self.held)} of the server's "
                               f"{mb(self.limit)} for images; retry shortly", "rate_limit_error",
                               code="image_memory_full", headers={"Retry-After": "1"})
            self.held += nbytes

    def give_back(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes


def tenant_salt(tenant: str | None, salt: str | None) -> str | None:
    """The cache salt a request's prefix blocks are hashed with: its tenant's (its API key's, when the server has
    several) joined with the request's own `cache_salt`, so that no request can name another tenant's chain."""
    if tenant is None:
        return salt
    return f"{tenant}\x00{salt or ''}"


def note_dead_engine(state: ServerState) -> None:
    """A ready server whose engine stopped serving (it could not recover from failed steps) becomes "failed"."""
    if state.status == "ready" and state.engine is not None and state.engine.dead is not None:
        state.status, state.detail = "failed", f"the engine stopped serving: {state.engine.dead}"
