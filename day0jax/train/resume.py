"""Resuming an interrupted run: the training state every save writes, and `--resume` reads back.

Each save (every `--save-every` steps and the last) writes `training_state/` inside the output folder, in the same
hidden folder that is then renamed into place, so the adapter (or checkpoint) and the state beside it are always
from one step:
- `state.json`: the step, the data position (batches taken from the stream, whose order is numpy's
  `default_rng(seed)` permutations: the seed and that count are the shuffle's whole state; LoRA dropout's masks
  come from the seed and the step number), and the run's settings that the trajectory depends on;
- `tensors.safetensors`: the trainable parameters (`param/<path>`) and the optimizer state (`opt/<path>`), as
  trained (float32), so a resumed run continues bit for bit.
Safetensors and JSON rather than Orbax: the state is one small set of host arrays on one device, which the
project's own atomic folder writes already cover; Orbax would add a dependency and its own folder layout for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from day0jax.core.errors import TrainingError

STATE_DIR = "training_state"
STATE_FILE = "state.json"
TENSORS_FILE = "tensors.safetensors"
FORMAT, VERSION = "day0jax-training-state", 1


@dataclass(frozen=True)
class SavedState:
    """What `read_state` found: the step reached, the batches taken from the data stream, and the tensors."""

    step: int
    batches_taken: int
    tensors: dict[str, np.ndarray]
    where: Path  # the tensors' file, for errors

    def restore(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """`params` and `opt_state` (templates: a fresh run's) with the saved values.

        Raises:
            TrainingError: a tensor missing, of another shape or dtype, or saved for nothing in the templates
                (another model, rank or optimizer), naming it and the file.
        """
        out = (_restore(params, self.tensors, "param", self.where),
               _restore(opt_state, self.tensors, "opt", self.where))
        names = {_name(prefix, path) for prefix, tree in (("param", params), ("opt", opt_state))
                 for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}
        extra = sorted(set(self.tensors) - names)
        if extra:
            raise TrainingError(f"{self.where}: tensor {extra[0]!r} matches nothing this run trains (a save of "
                                "another model, --lora-targets or --optimizer?)")
        return out


def _name(prefix: str, path) -> str:
    return prefix + jax.tree_util.keystr(path)


def _flat(tree: Any, prefix: str) -> dict[str, np.ndarray]:
    return {_name(prefix, path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _restore(template: Any, tensors: dict[str, np.ndarray], prefix: str, where: Path) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    out = []
    for path, leaf in leaves:
        name = _name(prefix, path)
        if name not in tensors:
            raise TrainingError(f"{where}: tensor {name!r} is missing (a save of another model, --lora-targets or "
                                "--optimizer?)")
        saved, want = tensors[name], (tuple(np.shape(leaf)), np.dtype(leaf.dtype))
        if (saved.shape, saved.dtype) != want:
            raise TrainingError(f"{where}: tensor {name!r} is {saved.dtype}{list(saved.shape)}, this run has "
                                f"{want[1]}{list(want[0])} (a save of another model or --lora-rank?)")
        out.append(saved)
    return jax.tree_util.tree_unflatten(treedef, out)


def write_state(folder: Path, *, step: int, batches_taken: int, settings: dict, params: Any, opt_state: Any) -> None:
    """Writes `folder/training_state/` (`folder`: the hidden folder of a save, before its rename); fsyncs it."""
    from safetensors.numpy import save_file

    from convert.writer import fsync_path

    out = Path(folder) / STATE_DIR
    out.mkdir()
    save_file({**_flat(params, "param"), **_flat(opt_state, "opt")}, str(out / TENSORS_FILE))
    state = {"format": FORMAT, "version": VERSION, "step": step, "batches_taken": batches_taken,
             "settings": settings}
    (out / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
    for f in (out / TENSORS_FILE, out / STATE_FILE, out):
        fsync_path(f)


def read_state(folder: str | Path, settings: dict) -> SavedState:
    """The state the last save under `folder` (the --adapter-path) wrote.

    Args:
        settings: this run's settings (`write_state`'s): each must equal the saved one.
    Raises:
        TrainingError: no save there, a file unreadable or of another format, or a setting that differs (naming the
            file and the setting).
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    folder = Path(folder)
    path = folder / STATE_DIR / STATE_FILE
    if not path.is_file():
        raise TrainingError(f"--resume: {path} does not exist; nothing to resume under {folder} (saves are written "
                            "every --save-every steps)")
    try:
        state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TrainingError(f"--resume: {path}: unreadable ({e})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("version") != VERSION:
        raise TrainingError(f"--resume: {path}: not a {FORMAT} file of version {VERSION}")
    saved = state.get("settings", {})
    for key, value in settings.items():
        if saved.get(key) != value:
            raise TrainingError(f"--resume: {path}: field settings.{key} is {saved.get(key)!r} in the save, "
                                f"{value!r} in this run; resume with the run's own flags")
    tensors_path = folder / STATE_DIR / TENSORS_FILE
    try:
        tensors = load_file(str(tensors_path))
    except (OSError, SafetensorError) as e:
        raise TrainingError(f"--resume: {tensors_path}: unreadable ({e})") from None
    for key in ("step", "batches_taken"):
        if not isinstance(state.get(key), int) or state[key] < 0:
            raise TrainingError(f"--resume: {path}: field {key} is {state.get(key)!r}, not a count")
    return SavedState(state["step"], state["batches_taken"], tensors, tensors_path)
