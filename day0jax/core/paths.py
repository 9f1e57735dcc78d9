"""Where day0jax keeps what it makes on this machine (converted models, compiled programs, built kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$DAY0JAX_CACHE` if set, else `$XDG_CACHE_HOME/day0jax`, else `~/.cache/day0jax`."""
    if os.environ.get("DAY0JAX_CACHE"):
        return Path(os.environ["DAY0JAX_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "day0jax"
