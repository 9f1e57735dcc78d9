"""Checks a checkpoint folder against its manifest: files present, digests unchanged, parameter shapes."""

from __future__ import annotations

from pathlib import Path

from convert.writer import HASHES, file_digest
from day0jax.core.errors import CheckpointError
from day0jax.weights import checkpoint
from day0jax.weights.stream import StoredArray


def verify_checkpoint(path: Path) -> list[str]:
    """Returns a list of problems (empty when the checkpoint is intact).

    Raises:
        CheckpointError: `path` is not a checkpoint at all (no or malformed manifest).
    """
    path = Path(path)
    manifest = checkpoint.read_manifest(path)
    listed = manifest.get("files", {})
    algorithm = manifest.get("file_hash", "sha256")  # manifests written before it was named list sha256 digests
    if algorithm not in HASHES:
        raise CheckpointError(f"{path / checkpoint.MANIFEST}: file_hash {algorithm!r} is not one this version "
                              f"checks ({', '.join(HASHES)}); upgrade day0jax")
    problems = []
    for rel, digest in sorted(listed.items()):
        f = path / rel
        if not f.is_file():
            problems.append(f"{f}: missing")
        elif file_digest(f, algorithm) != digest:
            problems.append(f"{f}: {algorithm} digest differs from the manifest (modified or corrupt)")
    written = {str(f.relative_to(path)) for f in path.rglob("*") if f.is_file()} - {checkpoint.MANIFEST}
    problems += [f"{path / extra}: not in the manifest" for extra in sorted(written - set(listed))]
    return problems or _check_shapes(path, manifest)


def _check_shapes(path: Path, manifest: dict) -> list[str]:
    """Compares each stored array's header with the manifest's shape and dtype."""
    problems = []
    for name, p in manifest["params"].items():
        try:
            stored = StoredArray.open(path / checkpoint.group_dir(p["group"]) / name)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if list(stored.shape) != p["shape"] or str(stored.dtype) != p["dtype"]:
            problems.append(f"parameter {name}: stored {stored.shape} {stored.dtype}, manifest says "
                            f"{tuple(p['shape'])} {p['dtype']}")
    return problems
