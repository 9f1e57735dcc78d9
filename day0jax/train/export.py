"""Full fine-tuning's output: the trained model written as a day0jax checkpoint beside its source's config and
tokenizer, loadable by `day0jax.load` like any converted one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
from flax import nnx

from day0jax.core.errors import TrainingError
from day0jax.weights.checkpoint import read_manifest

# What the new manifest keeps of its source's (the writer adds the parameters, groups and file hashes).
KEPT = ("converter_version", "source", "model_type", "tokenizer_files")


def save_checkpoint(module: nnx.Module, source: str | Path, dst: str | Path,
                    extra: Callable[[Path], None] | None = None, manifest_extra: dict | None = None,
                    dtype: str = "float32") -> Path:
    """Writes every parameter of `module` in `dtype` (rounded to nearest from float32 masters) as a checkpoint at
    `dst`, with the config.json, generation config and tokenizer files of the checkpoint `source` it was loaded from.
    An existing `dst` is replaced only if it is a day0jax checkpoint or an empty folder. `extra(hidden folder)`
    writes more files into it before the manifest lists them and the folder is renamed into place (the training
    state of --resume); `manifest_extra`: more manifest fields.

    Raises:
        TrainingError: a parameter that is not float (a quantized base: full fine-tuning needs float weights), or a
            `dtype` the loader does not take.
        CheckpointError: `dst` cannot be written.
    """
    from convert.writer import CheckpointWriter
    from day0jax.loader import DTYPES

    if dtype not in DTYPES:
        raise TrainingError(f"checkpoint dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    out_dtype = np.dtype(DTYPES[dtype])
    source = Path(source)
    manifest = read_manifest(source)
    with CheckpointWriter(Path(dst), force=True) as writer:
        for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
            array = np.asarray(var.get_value())
            name = ".".join(map(str, path))
            if not np.issubdtype(array.dtype, np.floating):
                raise TrainingError(f"{name} is {array.dtype}: full fine-tuning of a quantized model is not "
                                    "implemented; convert it in float (--dequantize)")
            writer.add(name, array.astype(out_dtype, copy=False))
        writer.flush()
        for name in ["generation_config.json", *manifest.get("tokenizer_files", [])]:
            if (source / name).is_file():
                shutil.copy(source / name, writer.tmp / name)
        writer.write_json("config.json", dict(json.loads((source / "config.json").read_text()), dtype=dtype))
        if extra is not None:
            extra(writer.tmp)
        out = {k: manifest[k] for k in KEPT if k in manifest}
        fields = manifest_extra or {"fine_tuned_from": str(source.absolute())}
        return writer.commit(dict(out, dtype=dtype, **fields))
