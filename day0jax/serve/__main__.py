"""`python -m day0jax.serve`: load a checkpoint (the embedded default without --model), warm up, serve.

The HTTP socket opens at once; /health answers 503 while the model loads and its programs compile, 200 when
ready. SIGTERM (or Ctrl-C) stops admitting (503), lets the requests in flight finish within `--shutdown-grace`
seconds, aborts what is left, and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("day0jax.serve")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m day0jax.serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="day0jax checkpoint folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", help="the model id clients send (default: the folder's name)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--mesh", help="device mesh SPEC, e.g. 'tp=2' (default: one device)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: per backend")
    p.add_argument("--compile-cache", help="persistent XLA compilation cache folder")
    p.add_argument("--api-key", default=os.environ.get("DAY0JAX_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $DAY0JAX_API_KEY)")
    p.add_argument("--max-model-len", type=int, help="longest prompt + output (default: the model's context)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="most sequences decoded together")
    p.add_argument("--kv-cache-tokens", type=int, help="KV pool capacity in tokens")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunk-sizes", default="32,256", help="prefill chunk lengths compiled, comma separated")
    p.add_argument("--min-width", type=int, default=128,
                   help="smallest attention span (tokens) compiled for decode; spans double up to 1024, then 4x")
    p.add_argument("--max-waiting", type=int, default=256, help="queued sequences before answering 429")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-warmup", action="store_true", help="compile programs on first use instead of at start")
    p.add_argument("--warmup-max-len", type=int, default=2048,
                   help="compile at start the programs for spans up to this many tokens (0: all); longer spans "
                        "compile on first use")
    p.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds to finish requests on SIGTERM")
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def load_engine(args, state) -> None:
    """Loads the model and builds, warms up and starts the engine; updates `state.status` as it goes."""
    import jax

    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    import day0jax
    from day0jax.engine.async_engine import AsyncEngine
    from day0jax.engine.engine import Engine, EngineConfig

    path = Path(args.model) if args.model else None
    if path is None:
        from day0jax.default_model import default_checkpoint

        state.detail = "converting the default model (first use only)"
        path = default_checkpoint()
    state.detail = f"loading {path}"
    model = day0jax.load(path, dtype=args.dtype, mesh=args.mesh)
    if model.tokenizer is None:
        raise SystemExit(f"{path} has no tokenizer.json: the server needs one to read text")
    config = EngineConfig(page_size=args.page_size, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                          kv_cache_tokens=args.kv_cache_tokens, max_waiting=args.max_waiting,
                          chunk_buckets=tuple(int(x) for x in args.chunk_sizes.split(",")),
                          min_width=args.min_width, prefix_caching=not args.no_prefix_caching)
    engine = Engine.from_model(model, config)
    state.tokenizer, state.max_model_len = model.tokenizer, engine.max_model_len
    if not args.no_warmup:
        state.status = "warming up"
        shapes = engine.warmup_shapes(args.warmup_max_len or None)

        def progress(done, total):
            state.detail = f"compiled {done}/{total} programs"

        seconds = engine.warm_up(progress, args.warmup_max_len or None)
        log.info("warm-up: %d of %d programs in %.1fs", len(shapes), len(engine.program_shapes()), seconds)
    state.engine = AsyncEngine(engine)
    return model


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from day0jax.serve.app import ServerState, build_app

    name = args.served_model_name
    if not name:
        from day0jax.default_model import NAME

        name = Path(args.model).resolve().name if args.model else NAME
    state = ServerState(model_name=name, api_key=args.api_key or None, max_body_bytes=args.max_body_bytes)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not state.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use the model",
                    args.host)
    exit_code = [0]
    server_box: list[uvicorn.Server] = []

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop = asyncio.get_running_loop()

        def load():
            try:
                load_engine(args, state)
                state.engine.start(loop)
                state.status, state.detail = "ready", ""
                log.info("ready: serving %s on http://%s:%d", state.model_name, args.host, args.port)
            except BaseException as e:  # noqa: BLE001 - reported, then the server exits non-zero
                log.exception("loading failed")
                state.status, state.detail = "failed", str(e)
                exit_code[0] = 1
                server_box[0].should_exit = True

        threading.Thread(target=load, name="day0jax-load", daemon=True).start()
        yield
        if state.engine is not None:
            state.engine.stop()

    app = build_app(state, lifespan=lifespan)

    class Server(uvicorn.Server):
        draining_since: float | None = None

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
                    self.should_exit = True
            return await super().on_tick(counter)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            timeout_graceful_shutdown=5, access_log=False)
    server = Server(config)
    server_box.append(server)
    server.run()
    return exit_code[0]


if __name__ == "__main__":
    sys.exit(main())
