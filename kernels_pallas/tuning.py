"""Block-size tables: one per kernel, keyed by (device kind, shape class), with a heuristic for the rest.

Entries record their `source`: 'seed' (a starting point not measured yet) or a figure measured on that device by
`bench/kernels.py --tune`, which prints entries in this form to paste after a run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Mapping, TypeVar

C = TypeVar("C")


@dataclass(frozen=True)
class Entry(Generic[C]):
    """One configuration and its source: 'seed', or 'measured <date> <figure>'."""

    config: C
    source: str


@dataclass(frozen=True)
class BlockTable(Generic[C]):
    """Tuned configurations of one kernel."""

    kernel: str  # the kernel's name, for messages
    heuristic: Callable[..., C]  # (shape_class, **shape) -> config, used when the table has no entry
    entries: Mapping[tuple[str, str], Entry[C]] = field(default_factory=dict)  # (device kind, shape class) -> Entry

    def lookup(self, kind: str, shape_class: str, **shape: Any) -> C:
        """The configuration for `shape_class` on device `kind`: the table's entry, else the heuristic."""
        entry = self.entries.get((kind, shape_class))
        if entry is not None:
            return entry.config
        return self.heuristic(shape_class, **shape)
