"""The day0jax checkpoint format, written by the converter and read by the loader. A checkpoint is a folder:

    config.json          the model's HF-style config (what the runtime builds the model from)
    tokenizer.json, ...  tokenizer, chat template and generation config, as HF names them
    day0jax.json         the manifest: format version, source, digests of source and written files, every
                         parameter's name, shape, dtype and group; written last: without it, not a checkpoint
    params/NNNN/<name>/  each parameter, in the runtime's names and layout, as an uncompressed zarr (v2) array
                         (`.zarray` and C-order chunk files cut along the first axes: `weights/stream.py` reads
                         them, `convert/writer.py` writes them), in groups NNNN of about 128 MB
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from day0jax.core.errors import CheckpointError
from day0jax.weights.stream import StoredArray

# 2: Linear kernels in HF's [out, in] order (1 had them transposed).
FORMAT_VERSION = 2
MANIFEST = "day0jax.json"
PARAMS_DIR = "params"


def group_dir(index: int) -> str:
    return f"{PARAMS_DIR}/{index:04d}"


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint folder `path`.

    Raises:
        CheckpointError: not a day0jax checkpoint, a malformed manifest, or a newer format version.
    """
    path = Path(path)
    manifest_path = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a folder (a day0jax checkpoint is a folder made by `python -m convert`)")
    if not manifest_path.is_file():
        hint = " (it looks like a Hugging Face folder: convert it first with `python -m convert`)" \
            if (path / "config.json").is_file() else ""
        raise CheckpointError(f"{path}: not a day0jax checkpoint, {MANIFEST} is missing{hint}")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{manifest_path}: malformed manifest ({e})") from None
    version = manifest.get("format_version")
    if not isinstance(version, int):
        raise CheckpointError(f"{manifest_path}: no format_version")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{manifest_path}: format version {version} is newer than this day0jax understands "
                              f"({FORMAT_VERSION}); upgrade day0jax or re-convert with this version")
    if version < FORMAT_VERSION:
        raise CheckpointError(f"{manifest_path}: format version {version} is older than this day0jax's "
                              f"({FORMAT_VERSION}); re-convert the source with `python -m convert SRC DST --force`")
    return manifest


def read_params(path: Path, names: list[str] | None = None) -> dict[str, Any]:
    """Returns a checkpoint's parameters as name -> host numpy array in its stored dtype (for inspection and tests).

    Args:
        path: checkpoint folder.
        names: dotted parameter names to read (default: all).
    Raises:
        CheckpointError: not a checkpoint, an unknown name, or a stored array missing, truncated or malformed.
    """
    manifest = read_manifest(path)
    missing = [n for n in names or [] if n not in manifest["params"]]
    if missing:
        raise CheckpointError(f"{path}: no parameter {missing[0]}")
    wanted = manifest["params"] if names is None else names
    return {name: StoredArray.open(Path(path) / group_dir(manifest["params"][name]["group"]) / name).read()
            for name in wanted}
