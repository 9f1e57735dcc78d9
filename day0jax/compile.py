"""`python -m day0jax.compile`: fill the compilation cache ahead of time, then exit (a build step, a container image).

It builds the engine exactly as `python -m day0jax.serve` given the same flags, compiles (or finds cached) every
program the server would run and prints them and the startup timeline: a server started later with the same model,
mesh, flags and cache folder compiles nothing.
"""

from __future__ import annotations

import argparse
import logging
import sys

from day0jax import cli
from day0jax.core import logs
from day0jax.core.errors import Day0Error
from sharding import distributed


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m day0jax.compile", description=__doc__.splitlines()[0])
    cli.add_model_arguments(p)
    cli.add_compile_cache_arguments(p)
    cli.add_engine_arguments(p)
    cli.add_warmup_arguments(p)
    distributed.add_arguments(p)
    logs.add_argument(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup(args.log_level)
    from day0jax.start import start_engine
    from day0jax.startup.timeline import Timeline, program_table

    timeline = Timeline()
    timeline.log_phases(logging.getLogger("day0jax.compile"))
    try:
        started = start_engine(args, timeline)
    except Day0Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    timeline.mark_ready()
    print(program_table(started.records))
    print()
    print(timeline.table(programs=False))
    cache = started.cache
    if cache is None:
        print("no compilation cache was used (--no-compile-cache, or the folder was unusable: see the warning)")
    else:
        print(f"cache: {cache.folder}{'' if cache.writable else ' (read-only: nothing was saved)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
