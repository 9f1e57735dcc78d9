"""Checks a checkpoint folder against its manifest: files present, sha256 unchanged, parameter shapes."""

from __future__ import annotations

from pathlib import Path

from convert.writer import sha256_file
from day0jax.weights import checkpoint


def verify_checkpoint(path: Path) -> list[str]:
    """Returns a list of problems (empty when the checkpoint is intact).

    Raises:
        CheckpointError: `path` is not a checkpoint at all (no or malformed manifest).
    """
    path = Path(path)
    manifest = checkpoint.read_manifest(path)
    problems = []
    for rel, digest in sorted(manifest.get("files", {}).items()):
        f = path / rel
        if not f.is_file():
            problems.append(f"{f}: missing")
        elif sha256_file(f) != digest:
            problems.append(f"{f}: sha256 differs from the manifest (modified or corrupt)")
    written = {str(f.relative_to(path)) for f in path.rglob("*") if f.is_file()} - {checkpoint.MANIFEST}
    for extra in sorted(written - set(manifest.get("files", {}))):
        problems.append(f"{path / extra}: not in the manifest")
    if not problems:
        problems += _check_shapes(path, manifest)
    return problems


def _check_shapes(path: Path, manifest: dict) -> list[str]:
    """Compares each group's Orbax metadata with the manifest's shapes and dtypes."""
    import orbax.checkpoint as ocp

    problems = []
    by_group: dict[int, dict[str, dict]] = {}
    for name, p in manifest["params"].items():
        by_group.setdefault(p["group"], {})[name] = p
    for group, params in sorted(by_group.items()):
        try:
            meta = ocp.PyTreeCheckpointer().metadata(path / checkpoint.group_dir(group))
        except Exception as e:  # orbax raises many types for unreadable metadata
            problems.append(f"{path / checkpoint.group_dir(group)}: unreadable Orbax metadata ({e})")
            continue
        tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta
        flat = _flatten(tree)
        for name, p in params.items():
            m = flat.get(name)
            if m is None:
                problems.append(f"parameter {name}: missing from {checkpoint.group_dir(group)}")
            elif list(m.shape) != p["shape"] or str(m.dtype) != p["dtype"]:
                problems.append(f"parameter {name}: stored {tuple(m.shape)} {m.dtype}, manifest says "
                                f"{tuple(p['shape'])} {p['dtype']}")
    return problems


def _flatten(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
