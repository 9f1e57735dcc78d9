"""`OpCall`: one kind of call a model makes to an operator, with the static facts that fix its shapes.

Layers report them in `op_calls()` (docs/adding_a_kernel.md). Each op's spec (`ops.spec(op)`, in its folder's
`spec.py`) lists the parameters its calls carry and says how a call reads in words.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kernels_pallas import ops


@dataclass(frozen=True)
class OpCall:
    """An op name and its parameters (sorted (name, value) pairs, so calls compare and hash by value)."""

    op: str
    params: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, op: str, **params: Any) -> "OpCall":
        return cls(op, tuple(sorted(params.items())))

    def __getitem__(self, name: str) -> Any:
        return dict(self.params)[name]

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.params).get(name, default)

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, **dict(self.params)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "OpCall":
        d = dict(d)
        return cls.of(d.pop("op"), **d)

    def describe(self) -> str:
        """The variant in words, e.g. 'GQA 32q/8kv heads x 128, sliding window 4096'.

        Raises:
            KeyError: the op has no spec.
        """
        return ops.spec(self.op).describe(dict(self.params))
