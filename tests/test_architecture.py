"""The layers hold: no import in `day0jax`, `kernels_pallas`, `sharding` or `convert` runs upward or across a row
of the allowed-imports table in docs/architecture.md (module level or inside a function), and the top-level
modules of `day0jax` import each other without a cycle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("day0jax", "kernels_pallas", "sharding", "convert")


def allowed_ranks() -> dict[str, int]:
    """unit -> rank, from the table under '## Allowed imports' in docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Allowed imports", 1)[1].split("\n## ", 1)[0]
    ranks = {}
    for line in section.splitlines():
        m = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if m:
            for unit in re.findall(r"`([\w.]+)`", m[2]):
                ranks[unit] = int(m[1])
    return ranks


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str, ranks: dict[str, int]) -> str:
    """The table's unit of a module: its longest listed prefix (`day0jax.engine.runner` -> `day0jax.engine`)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in ranks:
            return ".".join(parts[:n])
    raise KeyError(module)


def imports(path: Path, package: str | None = None) -> list[tuple[str, int]]:
    """Every module of this repository `path` imports, anywhere in the file, with its line; relative imports are
    resolved from `package` (default: the file's own)."""
    tree = ast.parse(path.read_text())
    if package is None:
        package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            # `from a import b`: b may be a module (a sub-package) or a name; a module counts as its own import.
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return [(m, line) for m, line in out if m.split(".")[0] in PACKAGES]


def sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_the_table_covers_every_package():
    ranks = allowed_ranks()
    assert {"day0jax", "day0jax.core", "kernels_pallas", "sharding", "convert"} <= set(ranks)
    sub_packages = {f"day0jax.{p.name}" for p in (ROOT / "day0jax").iterdir() if (p / "__init__.py").is_file()}
    assert sub_packages <= set(ranks), f"sub-packages missing from the table: {sorted(sub_packages - set(ranks))}"


def test_no_import_runs_upward_or_across():
    ranks = allowed_ranks()
    bad = []
    for path in sources():
        here = unit_of(module_name(path), ranks)
        for target, line in imports(path):
            there = unit_of(target, ranks)
            if there != here and ranks[there] >= ranks[here]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {here} (rank {ranks[here]}) imports {target} "
                           f"({there}, rank {ranks[there]})")
    assert not bad, "imports against docs/architecture.md's table:\n" + "\n".join(bad)


def test_top_level_modules_form_no_cycle():
    top = {p.stem for p in (ROOT / "day0jax").glob("*.py") if p.stem != "__init__"}
    graph = {m: set() for m in top}
    for m in top:
        for target, _ in imports(ROOT / "day0jax" / f"{m}.py"):
            parts = target.split(".")
            if parts[0] == "day0jax" and len(parts) > 1 and parts[1] in top and parts[1] != m:
                graph[m].add(parts[1])
    done, path = set(), []

    def visit(m):
        if m in path:
            pytest.fail("day0jax's top-level modules import each other in a cycle: "
                        + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        path.append(m)
        for n in sorted(graph[m]):
            visit(n)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


def test_the_checker_sees_an_upward_import(tmp_path):
    """The walk finds imports inside functions and relative ones, which a module-level scan would miss."""
    f = tmp_path / "sample.py"
    f.write_text("import numpy\n\ndef f():\n    from day0jax.engine import engine\n    import sharding.plan\n"
                 "    from ..models import base\n")
    found = [m for m, _ in imports(f, package="day0jax.layers")]
    assert found == ["day0jax.engine.engine", "sharding.plan", "day0jax.models.base"]
    ranks = allowed_ranks()
    assert all(ranks[unit_of(m, ranks)] >= ranks["day0jax.layers"] for m in found[:1] + found[2:])
