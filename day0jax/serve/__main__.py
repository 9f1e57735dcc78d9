"""`python -m day0jax.serve`: load a checkpoint (the embedded default without --model), warm up, serve.

The socket opens at once: /health answers 503 while the model loads and the programs the first requests need compile
(or load from the compile cache), 200 when ready; the other programs then compile in the background (`--warmup`).
SIGTERM (or Ctrl-C) stops admitting (503), lets the requests in flight finish within `--shutdown-grace` seconds,
aborts the rest and exits 0. `--log-level debug` adds the libraries' messages and the startup timeline (also on
/metrics).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("day0jax.serve")


def parse_args(argv=None) -> argparse.Namespace:
    from day0jax import cli
    from day0jax.core import logs
    from sharding import distributed

    p = argparse.ArgumentParser(prog="python -m day0jax.serve", description=__doc__.splitlines()[0])
    cli.add_model_arguments(p)
    p.add_argument("--served-model-name", help="the model id clients send (default: the folder's name)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("DAY0JAX_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                        "$DAY0JAX_API_KEY; prefer it or --api-key-file: a command line is visible to other users)")
    p.add_argument("--api-key-file", type=Path,
                   help="read API keys from this file, one a line (with --api-key too, both are accepted); with "
                        "several keys each is a tenant whose prefix-cache hits stay among its own requests")
    p.add_argument("--public-metrics", action="store_true", help="with an API key, serve /metrics without it")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="the longest a client may take to send a request's body, from its first byte read to its last "
                        "(a client trickling a body byte by byte would otherwise hold its connection forever); "
                        "slower ones get 408 (default 30)")
    p.add_argument("--max-prompt-chars", type=int, default=0, metavar="N",
                   help="the most characters a request's prompt may render from (messages, names, tool calls and "
                        "offered tools' JSON, template variables, all counted), checked before anything is "
                        "tokenized (default 0: 64 per token of the model's context)")
    p.add_argument("--max-response-entries", type=int, default=1 << 22, metavar="N",
                   help="the most entries a whole (not streamed) response with logprobs may carry: prompts x n "
                        "x max_tokens x (top_logprobs + 1), known before the request runs; larger requests get 400 "
                        "(default 4194304)")
    p.add_argument("--grammar-cache-mb", type=int, default=64, metavar="MB",
                   help="the memory compiled grammars (structured output, tools) are kept in, by their estimated "
                        "size, least recently used dropped first (default 64)")
    p.add_argument("--max-connections", type=int, default=1024, metavar="N",
                   help="open connections (idle keep-alive ones included) beyond which new requests get 503 at once, "
                        "so that many slow or idle clients cannot exhaust the server's sockets and memory "
                        "(default 1024)")
    p.add_argument("--allowed-media-dir", type=Path, metavar="DIR",
                   help="vision-language models: the one folder whose files `file://` image URLs may name (default: "
                        "none, file:// URLs are refused); images otherwise come inline as data:image/...;base64 "
                        "URLs, and http(s) URLs are always refused (the server never fetches)")
    p.add_argument("--max-images-per-request", type=int, default=8, metavar="N",
                   help="vision-language models: the most images (and videos) one chat request may hold "
                        "(default 8)")
    p.add_argument("--max-image-bytes", type=int, default=20 << 20, metavar="N",
                   help="vision-language models: the largest encoded image, in bytes (a data URL's payload after "
                        "base64 decoding, or a file), checked before it is decoded (default 20 MiB); data URLs are "
                        "also bounded by --max-body-bytes")
    p.add_argument("--max-image-pixels", type=int, default=40_000_000, metavar="N",
                   help="vision-language models: the most pixels (width * height) of one image, read from its "
                        "header before any pixel is decoded, so that a small file declaring a huge canvas "
                        "(a decompression bomb) is refused (default 40000000; Pillow's own ceiling of about 179 "
                        "million pixels applies above it); a video_url's (animated GIF, WebP, PNG) over all its "
                        "frames, which are at most 1024")
    p.add_argument("--max-image-memory-mb", type=int, default=1024, metavar="MB",
                   help="vision-language models: the memory all requests' images may hold together, decoded while "
                        "a request renders and preprocessed until it ends (default 1024); a request whose images do "
                        "not fit while others hold theirs gets 429, one that never could 400")
    p.add_argument("--warmup", choices=("ready", "all", "none"), default="ready",
                   help="what to compile before /health turns 200: the few programs the first requests need "
                        "('ready', the default), every program ('all': no compile after ready) or nothing; the "
                        "rest compile in the background once serving")
    p.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds to finish requests on SIGTERM")
    p.add_argument("--reasoning-parser", metavar="NAME|none",
                   help="how a reasoning model's output splits into its reasoning and its answer: think (<think>...), "
                        "seed_oss, hunyuan, mistral ([THINK]...), gemma4, harmony (gpt-oss), or vLLM's names for "
                        "them (deepseek_r1, qwen3, glm45, minimax_m2, kimi_k2, gpt_oss, ...); 'none' leaves the "
                        "reasoning in the content (default: read from the chat template)")
    logs.add_argument(p)
    cli.add_compile_cache_arguments(p)
    cli.add_engine_arguments(p)
    cli.add_warmup_arguments(p)
    distributed.add_arguments(p)
    return p.parse_args(argv)


def load_engine(args, state, loop: asyncio.AbstractEventLoop) -> None:
    """Loads and warms up the engine, starts it on `loop` and marks the server ready, updating `state.status`,
    `state.detail` and `state.timeline` as it goes."""
    from day0jax.engine.async_engine import AsyncEngine
    from day0jax.serve import reasoning
    from day0jax.start import start_engine
    from day0jax.startup.warmup import compile_totals

    def status(detail: str) -> None:
        if detail.startswith("compil"):
            state.status = "warming up"
        state.detail = detail

    started = start_engine(args, state.timeline, status, warmup=args.warmup)
    model = started.model
    if model.tokenizer is None:
        raise SystemExit(f"{model.path} has no tokenizer.json: the server needs one to read text")
    state.tokenizer, state.max_model_len, state.model = model.tokenizer, started.engine.max_model_len, model
    model.grammar_cache_bytes = args.grammar_cache_mb << 20
    state.reasoning = reasoning.choose(args.reasoning_parser, model.tokenizer)
    state.engine = AsyncEngine(started.engine)
    state.engine.start(loop)
    state.timeline.mark_ready()
    state.compiles_at_ready = {path: compile_totals(path) for path in ("background", "request")}
    state.status, state.detail = "ready", ""
    log.debug("startup timeline:\n%s", state.timeline.table())
    log.info("ready in %.1fs: serving %s on http://%s:%d", state.timeline.ready_at, state.model_name, args.host,
             args.port)
    state.background = compiler = started.engine.compile_in_background(started.store)
    if compiler.pending:
        log.info("compiling %d more programs in the background", compiler.pending)

        def report():
            compiler.done.wait()
            log.info("background compile done: %d programs in %.1fs (%d made ready on a request's path)",
                     compiler.made["background"] + compiler.made["request"], compiler.seconds,
                     compiler.made["request"])
        threading.Thread(target=report, name="day0jax-background-report", daemon=True).start()


def main(argv=None) -> int:
    from day0jax.startup.timeline import Timeline

    timeline = Timeline()  # counts from the process's start
    with timeline.phase("server imports", what="flags, uvicorn, FastAPI, jax"):
        args = parse_args(argv)
        import uvicorn

        from day0jax.core import logs
        from day0jax.serve.app import build_app
        from day0jax.serve.state import ServerState
        from day0jax.startup.warmup import watch_compiles
    logs.setup(args.log_level)
    timeline.log_phases(log)

    watch_compiles()  # counts traces and compiles, so /metrics shows any that happen after ready

    name = args.served_model_name
    if not name:
        from day0jax.default_model import NAME

        name = Path(args.model).resolve().name if args.model else NAME
    api_keys = [args.api_key] if args.api_key else []
    if args.api_key_file is not None:
        try:
            from_file = [line.strip() for line in args.api_key_file.read_text().splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            log.error("--api-key-file %s: cannot read it (%s)", args.api_key_file, e)
            return 2
        if not from_file:
            log.error("--api-key-file %s: no key in it", args.api_key_file)
            return 2
        api_keys += [k for k in from_file if k not in api_keys]
    media_dir = None
    if args.allowed_media_dir is not None:
        if not args.allowed_media_dir.is_dir():
            log.error("--allowed-media-dir %s: not a folder", args.allowed_media_dir)
            return 2
        media_dir = str(args.allowed_media_dir.resolve())
    if args.reasoning_parser is not None:
        from day0jax.serve import reasoning

        try:
            reasoning.by_name(args.reasoning_parser)
        except ValueError as e:
            log.error("--reasoning-parser: %s", e)
            return 2
    from day0jax.cli import lora_modules_from_args

    adapters = lora_modules_from_args(args)
    if name in dict(adapters):
        log.error("--lora-modules: the adapter name %r is the base model's served name; give it another", name)
        return 2
    if args.max_images_per_request < 0:
        log.error("--max-images-per-request must be >= 0, got %d", args.max_images_per_request)
        return 2
    for flag, value in (("--max-image-bytes", args.max_image_bytes), ("--max-image-pixels", args.max_image_pixels),
                        ("--max-image-memory-mb", args.max_image_memory_mb),
                        ("--max-connections", args.max_connections),
                        ("--max-response-entries", args.max_response_entries),
                        ("--grammar-cache-mb", args.grammar_cache_mb)):
        if value < 1:
            log.error("%s must be >= 1, got %d", flag, value)
            return 2
    if args.max_prompt_chars < 0 or not args.body_timeout > 0:
        log.error("--max-prompt-chars must be >= 0 and --body-timeout > 0")
        return 2
    state = ServerState(model_name=name, api_keys=tuple(api_keys), max_body_bytes=args.max_body_bytes,
                        timeline=timeline, public_metrics=args.public_metrics, bound_host=args.host.strip("[]").lower(),
                        allowed_media_dir=media_dir, max_images_per_request=args.max_images_per_request,
                        max_image_bytes=args.max_image_bytes, max_image_pixels=args.max_image_pixels,
                        max_image_memory=args.max_image_memory_mb << 20, body_timeout=args.body_timeout,
                        max_prompt_chars=args.max_prompt_chars, max_response_entries=args.max_response_entries,
                        adapters=dict(adapters))
    if args.host not in ("127.0.0.1", "localhost", "::1") and not state.api_keys:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use the model", args.host)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop = asyncio.get_running_loop()

        def load():
            try:
                load_engine(args, state, loop)
            except BaseException as e:  # noqa: BLE001 - reported, then the server exits non-zero
                from day0jax.core.errors import Day0Error

                if isinstance(e, Day0Error):  # a refusal that names its cause: no traceback
                    log.error("loading failed: %s", e)
                else:
                    log.exception("loading failed")
                state.status, state.detail = "failed", str(e)
                server.exit_code = 1  # `server` is made below, before the lifespan runs
                server.should_exit = True

        threading.Thread(target=load, name="day0jax-load", daemon=True).start()
        yield
        if state.background is not None:
            state.background.stop()
        if state.engine is not None:
            state.engine.stop()

    app = build_app(state, lifespan=lifespan)

    class Server(uvicorn.Server):
        draining_since: float | None = None
        exit_code = 0

        def handle_exit(self, sig, frame):
            # First signal: drain (new requests get 503) instead of uvicorn's immediate close; a second one
            # forces the exit. No re-raise of the signal afterwards, so the process exits 0.
            if self.draining_since is not None or state.status != "ready":
                self.should_exit = True
                if self.draining_since is not None:
                    self.force_exit = True
                return
            log.info("signal %s: draining (grace %.0fs)", sig, args.shutdown_grace)
            self.draining_since = time.monotonic()
            state.status = "draining"

        async def on_tick(self, counter: int) -> bool:
            if self.draining_since is not None and not self.should_exit:
                engine = state.engine
                busy = state.in_flight or (engine is not None and engine.engine.has_work())
                if not busy or time.monotonic() - self.draining_since > args.shutdown_grace:
                    if busy:
                        log.warning("grace period over: aborting %d requests", state.in_flight)
                    log.info("drained in %.1fs: %d tokens generated since the start",
                             time.monotonic() - self.draining_since, engine.engine.generated_tokens if engine else 0)
                    self.should_exit = True
            return await super().on_tick(counter)

    # log_config=None: uvicorn's records go through logs.setup's handler (its INFO lines only at debug level).
    # limit_concurrency: uvicorn answers 503 itself, before the app, once this many connections are open.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, log_config=None,
                            timeout_graceful_shutdown=5, access_log=False, limit_concurrency=args.max_connections)
    server = Server(config)
    server.run()
    return server.exit_code


if __name__ == "__main__":
    sys.exit(main())
