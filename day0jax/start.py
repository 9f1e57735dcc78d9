"""From command-line arguments to a warmed-up engine: the start sequence `serve` and `compile` share."""

from __future__ import annotations

import argparse
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from day0jax.core import logs
from day0jax.core.errors import CheckpointError
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


def find_model(args: argparse.Namespace, dtype: str, timeline: Timeline):
    """The checkpoint `--model` names (or the embedded default's), its config.json, its compile-cache fingerprint,
    and on the default model's first use the conversion still to run (else None). The config and fingerprint of a
    checkpoint still to be converted come from the converter's plan, from the GGUF header alone, so the programs
    compile while it converts.

    Raises:
        CheckpointError, ConfigError: not a readable checkpoint.
    """
    from day0jax.startup import compile_cache
    from day0jax import default_model
    from day0jax import loader

    if args.model or default_model.is_converted():
        path, hf = loader.read_checkpoint_config(args.model or default_model.checkpoint_dir(), timeline)
        return path, hf, compile_cache.model_fingerprint(path, dtype), None
    hf, manifest = default_model.planned_output()
    return (default_model.checkpoint_dir().absolute(), hf, compile_cache.fingerprint(hf, manifest, dtype),
            default_model.default_checkpoint)


def enable_cache(args: argparse.Namespace, fingerprint: str, timeline: Timeline):
    """Enables the flags' compile cache (call it before anything compiles) for the model `fingerprint` names
    (`compile_cache.model_fingerprint`); returns it, or None (off or unusable)."""
    if getattr(args, "no_compile_cache", False):
        return None
    from day0jax.startup import compile_cache

    with timeline.phase("compile cache") as info:
        cache = compile_cache.enable(args.compile_cache, compile_cache.current_key(args.mesh, fingerprint))
        info["folder"] = str(cache.folder) if cache else "none"
    return cache


def start_engine(args: argparse.Namespace, timeline: Timeline, status: Callable[[str], None] = lambda s: None,
                 warmup: str = "all") -> Started:
    """Loads the model and builds the engine the flags describe, and compiles its programs: all of them, the ready
    set or none (`warmup`, as `Engine.programs`). Programs depend on shapes only, so they compile (or load from the
    program store) on a side thread while the weights are read.

    Args:
        args: parsed flags of `cli.add_model_arguments`, `add_compile_cache_arguments`, `add_engine_arguments`,
            `add_warmup_arguments` and `sharding.distributed.add_arguments`.
        timeline: receives the phases and one record per program.
        status: called with a short description as the start proceeds (the server's /health detail).
        warmup: "all", "ready" or "none".
    Raises:
        Day0Error subclasses from loading (CheckpointError, MeshError, OutOfMemoryPlan, ...).
    """
    with timeline.phase("imports", what="jax, flax, day0jax"):
        import jax

        from day0jax.cli import engine_config_from_args
        from day0jax import loader
        from sharding import distributed

    distributed.initialize_from_args(args)  # before anything touches a device
    dtype = args.dtype or loader.default_dtype()
    path, hf, fingerprint, conversion = find_model(args, dtype, timeline)
    cache = enable_cache(args, fingerprint, timeline)
    prepared = loader.prepare(hf, dtype=dtype, mesh=args.mesh, engine=engine_config_from_args(args),
                              kernels=args.kernels, timeline=timeline, folder=path)
    with timeline.phase("build engine", what="KV page pool"):
        engine = prepared.engine()
    store = None
    if cache is not None and jax.process_count() == 1:
        from day0jax.startup.program_store import ProgramStore

        store = ProgramStore(cache)
    programs = engine.programs(args.warmup_max_len or None, warmup)
    if conversion is None:
        prepared.check_checkpoint(path)  # a checkpoint that cannot load fails now, not after the compile
    with ThreadPoolExecutor(1, thread_name_prefix="day0jax-warm-up") as side:
        # A conversion shows its own progress bar meanwhile: the compile's then only logs.
        compiling = side.submit(_compile, engine, programs, args, timeline, status, store, warmup,
                                show_bar=conversion is None)
        if conversion is not None:
            status("converting the default model (first use only)")
            with timeline.phase("default model"):
                conversion()
            if loader.read_checkpoint_config(path)[1] != hf:
                raise CheckpointError(f"{path}: the converter wrote another config.json than it planned")
        status(f"loading {path}")
        model = loader.restore(prepared, path, timeline=timeline, load_concurrency=args.load_concurrency)
        records = compiling.result()
    started = Started(model, engine, cache, records, store)
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


def _compile(engine, programs: list, args: argparse.Namespace, timeline: Timeline, status: Callable[[str], None],
             store, warmup: str, show_bar: bool = True) -> list[CompileRecord]:
    """`engine.warm_up` as the "compile" phase, with status lines and a progress bar (or a log line)."""
    if not programs:
        return []
    what = f"compiling {len(programs)} programs"
    status(what)
    if not show_bar:
        log.info("%s meanwhile", what)
    with timeline.phase("compile") as info, logs.progress_bar(len(programs), what, shown=show_bar) as bar:
        def progress(done: int, total: int) -> None:
            bar.update(done - bar.n)
            status(f"compiled {done}/{total} programs")

        records = engine.warm_up(progress, args.warmup_max_len or None, store=store, workers=args.compile_workers,
                                 timeline=timeline, warmup=warmup)
        info["programs"] = len(records)
        info.update(count_sources(records))
    return records
