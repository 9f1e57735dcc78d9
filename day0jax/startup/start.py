"""From command-line arguments to a warmed-up engine: the start sequence `serve` and `compile` share."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from day0jax import logs
from day0jax.startup.timeline import CompileRecord, Timeline, count_sources

log = logging.getLogger(__name__)


@dataclass
class Started:
    """A started engine and how it got there."""

    model: Any
    engine: Any
    cache: Any  # day0jax.startup.compile_cache.CompileCache or None
    records: list[CompileRecord] = field(default_factory=list)
    store: Any = None  # the ProgramStore used, or None


def resolve_model(args: argparse.Namespace, timeline: Timeline, status: Callable[[str], None]) -> Path:
    """--model, or the embedded default (converted on first use)."""
    if args.model:
        return Path(args.model)
    from day0jax.weights.default_model import default_checkpoint

    status("converting the default model (first use only)")
    with timeline.phase("default model"):
        return default_checkpoint()


def enable_cache(args: argparse.Namespace, path: Path, dtype: str, timeline: Timeline):
    """Enables the flags' compile cache (call it before anything compiles); returns it, or None (off or unusable)."""
    if getattr(args, "no_compile_cache", False):
        return None
    from day0jax.startup import compile_cache

    with timeline.phase("compile cache") as info:
        key = compile_cache.current_key(args.mesh, compile_cache.model_fingerprint(path, dtype))
        cache = compile_cache.enable(args.compile_cache, key)
        info["folder"] = str(cache.folder) if cache else "none"
    return cache


def start_engine(args: argparse.Namespace, timeline: Timeline, status: Callable[[str], None] = lambda s: None,
                 warmup: str = "all") -> Started:
    """Loads the model and builds the engine the flags describe, and compiles its programs: all of them, the ready
    set or none (`warmup`, as `Engine.programs`).

    Args:
        args: parsed flags of `cli.add_model_arguments`, `add_compile_cache_arguments`, `add_engine_arguments`,
            `add_warmup_arguments` and `sharding.distributed.add_arguments`.
        timeline: receives the phases and one record per program.
        status: called with a short description as the start proceeds (the server's /health detail).
        warmup: "all", "ready" or "none".
    Raises:
        Day0Error subclasses from loading (CheckpointError, MeshError, OutOfMemoryPlan, ...).
    """
    with timeline.phase("imports", what="jax, flax, orbax, day0jax"):
        import jax

        import day0jax
        from day0jax.cli import engine_config_from_args
        from day0jax.weights.loader import default_dtype
        from sharding import distributed

    distributed.initialize_from_args(args)  # before anything touches a device
    path = resolve_model(args, timeline, status)
    dtype = args.dtype or default_dtype()
    cache = enable_cache(args, path, dtype, timeline)
    status(f"loading {path}")
    model = day0jax.load(path, dtype=dtype, mesh=args.mesh, engine=engine_config_from_args(args),
                         kernels=args.kernels, timeline=timeline)
    with timeline.phase("build engine", what="KV page pool"):
        engine = model.engine
    started = Started(model, engine, cache)
    if cache is not None and jax.process_count() == 1:
        from day0jax.startup.program_store import ProgramStore

        started.store = ProgramStore(cache)
    store = started.store
    programs = engine.programs(args.warmup_max_len or None, warmup)
    if not programs:
        return started
    what = f"compiling {len(programs)} programs"
    status(what)
    with timeline.phase("compile") as info, logs.progress_bar(len(programs), what) as bar:
        def progress(done: int, total: int) -> None:
            bar.update(done - bar.n)
            status(f"compiled {done}/{total} programs")

        started.records = engine.warm_up(progress, args.warmup_max_len or None, store=store,
                                         workers=args.compile_workers, timeline=timeline, warmup=warmup)
        info["programs"] = len(started.records)
        info.update(count_sources(started.records))
    layout = engine.layout
    skipped = len(layout.forward_shapes()) - len(layout.forward_shapes(args.warmup_max_len or None))
    if skipped and warmup == "all":
        log.info("--warmup-max-len %d: %d forward programs compile later", args.warmup_max_len, skipped)
    damaged = (cache.files.corrupt if cache else []) + (store.files.corrupt if store else [])
    if damaged:
        log.warning("compile cache: %d damaged entries were removed and rebuilt (%s)", len(damaged),
                    ", ".join(damaged[:5]) + (" ..." if len(damaged) > 5 else ""))
    with timeline.phase("warm-up", what="one decode step and sample on padding"):
        engine.runner.smoke_run()
    return started
