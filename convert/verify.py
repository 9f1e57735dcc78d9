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
    listed = manifest.get("files", {})
    problems = []
    for rel, digest in sorted(listed.items()):
        f = path / rel
        if not f.is_file():
            problems.append(f"{f}: missing")
        elif sha256_file(f) != digest:
            problems.append(f"{f}: sha256 differs from the manifest (modified or corrupt)")
    written = {str(f.relative_to(path)) for f in path.rglob("*") if f.is_file()} - {checkpoint.MANIFEST}
    problems += [f"{path / extra}: not in the manifest" for extra in sorted(written - set(listed))]
    return problems or _check_shapes(path, manifest)


def _check_shapes(path: Path, manifest: dict) -> list[str]:
    """Compares each group's Orbax metadata with the manifest's shapes and dtypes."""
    import orbax.checkpoint as ocp

    problems = []
    for group, names in checkpoint.groups(manifest).items():
        folder = checkpoint.group_dir(group)
        try:
            meta = ocp.PyTreeCheckpointer().metadata(path / folder)
        except Exception as e:  # orbax raises many types for unreadable metadata
            problems.append(f"{path / folder}: unreadable Orbax metadata ({e})")
            continue
        stored = checkpoint.flatten(meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta)
        for name in names:
            m, p = stored.get(name), manifest["params"][name]
            if m is None:
                problems.append(f"parameter {name}: missing from {folder}")
            elif list(m.shape) != p["shape"] or str(m.dtype) != p["dtype"]:
                problems.append(f"parameter {name}: stored {tuple(m.shape)} {m.dtype}, manifest says "
                                f"{tuple(p['shape'])} {p['dtype']}")
    return problems
