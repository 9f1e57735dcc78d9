"""Fast restarts: the compile cache's key and folders, checked entries, `python -m day0jax.compile`, the program
store, warm-up of every program before /health is 200, the startup timeline on /metrics, and the server's
default log (short: one line per phase, a compile bar, the URL; no library INFO lines).

One tiny model and one set of engine flags (11 programs: 3 forward shapes, 8 samplers), compiled once
by the first `day0jax.compile` run; the other processes start from that cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serve_tiny import write_tiny_chat_checkpoint  # noqa: E402

from day0jax.startup import compile_cache, timeline as tl  # noqa: E402
from day0jax.startup.warmup import compile_totals, watch_compiles  # noqa: E402
from launch import ServerProcess  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-chat"
ENGINE_FLAGS = ["--max-num-seqs", "2", "--chunk-sizes", "32", "--max-model-len", "256", "--min-width", "256"]
FORWARD_SHAPES = ["1x1x16", "2x1x16", "1x32x16"]  # decode rows 1 and 2 over 16 pages, one 32-token prefill chunk
PROGRAMS = len(FORWARD_SHAPES) + 2 * 2 * 2  # sampler: rows {1, 2} x with or without penalties, guidance
SUMMARY = re.compile(r"^(\d+) programs: (\d+) program-store, (\d+) xla-cache, (\d+) compiled;", re.M)


def run_cli(module: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
    assert proc.returncode == 0, f"{module} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def compile_run(ckpt: Path, cache_root: Path) -> tuple[subprocess.CompletedProcess, dict[str, int]]:
    """`python -m day0jax.compile` on the tiny model; returns the process and its programs per source."""
    proc = run_cli("day0jax.compile", "--model", str(ckpt), "--compile-cache", str(cache_root), *ENGINE_FLAGS)
    m = SUMMARY.search(proc.stdout)
    assert m, proc.stdout[-3000:]
    total, store, xla, compiled = map(int, m.groups())
    assert total == PROGRAMS, proc.stdout[-3000:]
    return proc, {"program-store": store, "xla-cache": xla, "compiled": compiled}


def key_folder(cache_root: Path) -> Path:
    folders = [d for d in cache_root.iterdir() if (d / "key.json").is_file()]
    assert len(folders) == 1, folders
    return folders[0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_chat_checkpoint(tmp_path_factory.mktemp("startup"))


@pytest.fixture(scope="module")
def filled(ckpt, tmp_path_factory):
    """A cache root filled by one cold `day0jax.compile` run, and that run."""
    root = tmp_path_factory.mktemp("compile-cache")
    proc, counts = compile_run(ckpt, root)
    return root, proc, counts


# --- the key and the entries (in this process, nothing compiled) -------------------------------------------------

def test_cache_key_separates_jax_versions_meshes_and_models(ckpt, tmp_path):
    fp = compile_cache.model_fingerprint(ckpt, "float32")
    key = compile_cache.current_key(None, fp)
    here = jax.devices()[0]
    assert key.jax == jax.__version__ and key.devices == jax.device_count()
    assert (key.platform, key.device_kind) == (here.platform, here.device_kind)
    assert compile_cache.current_key("dp=1", fp) == key  # the same mesh spelled another way
    # Another device than this machine's: an H200, or an H100 where this is an H200.
    other = "NVIDIA H100 80GB HBM3" if (key.platform, key.device_kind) == ("gpu", "NVIDIA H200") else "NVIDIA H200"
    others = [dataclasses.replace(key, jax="0.10.0"), dataclasses.replace(key, jaxlib="0.10.0"),
              compile_cache.current_key("tp=2", fp), compile_cache.current_key("auto", fp),
              dataclasses.replace(key, processes=2),
              dataclasses.replace(key, platform="gpu", device_kind=other),
              dataclasses.replace(key, host="another-cpu"),
              compile_cache.current_key(None, compile_cache.model_fingerprint(ckpt, "bfloat16"))]
    names = {key.folder_name()} | {k.folder_name() for k in others}
    assert len(names) == 1 + len(others)
    assert "tp=2" in compile_cache.current_key("tp=2", fp).folder_name()

    # The fingerprint follows the architecture, not the weights: new source hashes keep it, a config change moves it.
    same_arch = tmp_path / "same-arch"
    shutil.copytree(ckpt, same_arch)
    manifest = json.loads((same_arch / "day0jax.json").read_text())
    manifest["source"]["blake3"] = {k: "0" * 64 for k in manifest["source"]["blake3"]}
    (same_arch / "day0jax.json").write_text(json.dumps(manifest))
    assert compile_cache.model_fingerprint(same_arch, "float32") == fp
    config = json.loads((same_arch / "config.json").read_text())
    config["rms_norm_eps"] = 1e-6
    (same_arch / "config.json").write_text(json.dumps(config))
    assert compile_cache.model_fingerprint(same_arch, "float32") != fp


def test_verified_files_detect_damage_and_replace_atomically(tmp_path, caplog):
    files = compile_cache.VerifiedFiles(tmp_path)
    payload = bytes(range(256)) * 40
    files.write("entry", payload)
    assert files.read("entry") == payload and files.read("missing") is None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]  # nothing left half-written
    raw = (tmp_path / "entry").read_bytes()
    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 0x01
    damages = {"truncated": raw[:len(raw) // 2], "garbage": os.urandom(len(raw)), "flipped": bytes(flipped),
               "empty": b"", "jax's own format": b"\x78\x9c" + raw[2:]}
    for what, data in damages.items():
        (tmp_path / "entry").write_bytes(data)
        with caplog.at_level(logging.WARNING, logger="day0jax.startup.compile_cache"):
            caplog.clear()
            assert files.read("entry") is None, what
        assert "is damaged" in caplog.text and str(tmp_path / "entry") in caplog.text, what
        assert not (tmp_path / "entry").exists(), what  # removed, so the rebuilt entry replaces it
    assert files.corrupt == ["entry"] * len(damages)


def test_unusable_cache_folder_is_reported_and_a_read_only_one_is_used_read_only(tmp_path, caplog, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    key = compile_cache.current_key(None, "model")
    with caplog.at_level(logging.WARNING, logger="day0jax.startup.compile_cache"):
        assert compile_cache.enable(blocker / "cache", key) is None
    assert f"cannot use {blocker / 'cache'}" in caplog.text and "without a compilation cache" in caplog.text

    # An existing cache on a read-only file system (tests run as root, so the failure is simulated).
    folder = tmp_path / "ro" / key.folder_name()
    folder.mkdir(parents=True)
    compile_cache.VerifiedFiles(folder).write("entry-cache", b"an executable")

    def read_only(path):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(compile_cache, "_probe_write", read_only)
    caplog.clear()
    try:
        with caplog.at_level(logging.WARNING, logger="day0jax.startup.compile_cache"):
            cache = compile_cache.enable(tmp_path / "ro", key)
        assert cache is not None and not cache.writable and "not writable" in caplog.text
        assert cache.files.read("entry-cache") == b"an executable"
        cache.files.write("new-cache", b"x")
        assert not (folder / "new-cache").exists()
    finally:
        compile_cache.disable()


def test_a_cache_folder_another_user_could_write_is_not_used(tmp_path, caplog, monkeypatch):
    """Programs are loaded (unpickled, executed) from the cache: it must be this user's alone, created 0700."""
    import stat

    from day0jax.startup.program_store import ProgramStore

    key = compile_cache.current_key(None, "model")
    root = tmp_path / "cache"
    try:
        cache = compile_cache.enable(root, key)
        assert cache is not None
        assert [stat.S_IMODE(p.stat().st_mode) for p in (root, cache.folder)] == [0o700, 0o700]
        store = ProgramStore(cache)
        assert store.trusted and stat.S_IMODE((cache.folder / "programs").stat().st_mode) == 0o700
        (cache.folder / "programs").chmod(0o777)
        with caplog.at_level(logging.WARNING):
            store = ProgramStore(cache)
        assert not store.trusted and store.load("anything") is None and "other users may write" in caplog.text
    finally:
        compile_cache.disable()
    for path, harm in ((root, lambda: root.chmod(0o775)), (cache.folder, lambda: cache.folder.chmod(0o757)),
                       (root, lambda: monkeypatch.setattr(compile_cache.os, "getuid", lambda: 4242))):
        harm()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="day0jax.startup.compile_cache"):
            assert compile_cache.enable(root, key) is None
        assert f"not using {path}" in caplog.text and "as trusted as code" in caplog.text
        root.chmod(0o700)
        cache.folder.chmod(0o700)
        monkeypatch.undo()


def test_compile_watch_counts_traces_and_compiles():
    watch_compiles()
    before = compile_totals()
    jax.jit(lambda x: x * 3 + 1)(np.arange(7.0)).block_until_ready()
    after = compile_totals()
    assert after["traces"] > before["traces"] and after["compiles"] > before["compiles"]


def test_timeline_table_and_phase_seconds():
    t = tl.Timeline(origin=0.0)
    with t.phase("restore parameters") as info:
        info["bytes"] = 2_000_000_000
    t.add_compile(tl.CompileRecord("forward", "1x1x16", 0.5, 2.0, "compiled"))
    t.add_compile(tl.CompileRecord("sample", "1", 0.0, 0.1, "program-store"))
    t.mark_ready()
    seconds = t.phase_seconds()
    assert {"python start", "restore parameters", "ready"} <= set(seconds)
    text = t.table()
    assert "GB/s" in text and "2.000 GB" in text
    assert re.search(r"forward\s+1x1x16\s+0\.50\s+2\.00\s+miss\s+compiled", text)
    assert "2 programs: 1 program-store, 0 xla-cache, 1 compiled" in text
    assert t.compile_counts() == {"program-store": 1, "xla-cache": 0, "compiled": 1}


def test_serve_and_compile_share_the_engine_flags_and_take_kernels_and_multihost_flags(capsys):
    from day0jax import compile as compile_cli
    from day0jax.cli import engine_config_from_args
    from day0jax.serve.__main__ import parse_args

    argv = [*ENGINE_FLAGS, "--kernels", "reference", "--compile-cache", "/somewhere", "--coordinator", "h:1",
            "--num-processes", "2", "--process-id", "1", "--mesh", "tp=2"]
    served, compiled = parse_args(argv), compile_cli.build_parser().parse_args(argv)
    assert engine_config_from_args(served) == engine_config_from_args(compiled)  # the same programs
    for args in (served, compiled):
        assert (args.kernels, args.compile_cache, args.no_compile_cache) == ("reference", "/somewhere", False)
        assert (args.coordinator, args.num_processes, args.process_id, args.mesh) == ("h:1", 2, 1, "tp=2")
        assert args.warmup_max_len == 0  # default: every program before ready
    # The multi-host runtime starts first: a bad address is refused before anything is loaded.
    assert compile_cli.main(["--coordinator", "nohost"]) == 2
    assert "--coordinator 'nohost' is not HOST:PORT" in capsys.readouterr().err


# --- processes ----------------------------------------------------------------------------------------------------

def test_compile_command_fills_the_cache_and_prints_every_program(filled):
    root, proc, counts = filled
    assert counts == {"program-store": 0, "xla-cache": 0, "compiled": PROGRAMS}
    for shape in FORWARD_SHAPES:
        assert re.search(rf"^forward\s+{shape}\s+[\d.]+\s+[\d.]+\s+miss\s+compiled$", proc.stdout, re.M), shape
    assert re.search(r"^sample\s+2\+penalties\+guidance\s", proc.stdout, re.M)
    for phase in ("read config", "build model", "restore parameters", "compile", "warm-up", "ready"):
        assert re.search(rf"^{phase}\s+[\d.]+", proc.stdout, re.M), phase
    folder = key_folder(root)
    key = json.loads((folder / "key.json").read_text())
    assert key["jax"] == jax.__version__ and key["mesh"] == "dp=1,ep=1,tp=1"
    assert len(list(folder.glob("jit__stage_fn-*-cache"))) == len(FORWARD_SHAPES)
    assert len(list((folder / "programs").glob("*.program"))) == PROGRAMS


def test_second_process_loads_every_program_and_ignores_other_versions(ckpt, filled):
    root, _, _ = filled
    folder = key_folder(root)
    # A folder written by another jax version, full of entries under this version's names: never opened.
    decoy = root / folder.name.replace(f"jax-{jax.__version__}", "jax-0.10.0")
    (decoy / "programs").mkdir(parents=True)
    (decoy / "key.json").write_text(json.dumps({"jax": "0.10.0"}))
    for entry in [*folder.glob("*-cache"), *(folder / "programs").iterdir()]:
        (decoy / entry.relative_to(folder)).write_bytes(b"garbage from another version")
    proc, counts = compile_run(ckpt, root)
    assert counts == {"program-store": PROGRAMS, "xla-cache": 0, "compiled": 0}, proc.stdout[-3000:]
    assert "1 other key folder(s)" in proc.stderr and " is damaged" not in proc.stderr
    assert all(p.read_bytes() == b"garbage from another version" for p in decoy.rglob("*") if p.is_file()
               and p.name != "key.json")

    # Without the program store, JAX's persistent cache alone still spares every compile (tracing remains).
    shutil.rmtree(folder / "programs")
    proc, counts = compile_run(ckpt, root)
    assert counts == {"program-store": 0, "xla-cache": PROGRAMS, "compiled": 0}, proc.stdout[-3000:]
    assert len(list((folder / "programs").glob("*.program"))) == PROGRAMS  # written again from the cache hits
    shutil.rmtree(decoy)


def test_damaged_entries_are_reported_rebuilt_and_startup_goes_on(ckpt, filled, tmp_path):
    root = tmp_path / "cache"
    shutil.copytree(key_folder(filled[0]), root / key_folder(filled[0]).name)
    folder = key_folder(root)
    forward = sorted(folder.glob("jit__stage_fn-*-cache"))
    programs = sorted((folder / "programs").glob("*.program"))
    raw = forward[0].read_bytes()
    forward[0].write_bytes(raw[:len(raw) // 3])  # a write cut short
    flipped = bytearray(forward[1].read_bytes())
    flipped[-100] ^= 0x10  # one bit flipped inside the executable
    forward[1].write_bytes(bytes(flipped))
    programs[0].write_bytes(os.urandom(500))
    proc, counts = compile_run(ckpt, root)
    log = proc.stderr
    for damaged in (forward[0], forward[1], programs[0]):
        assert f"{damaged} is damaged" in log, log[-4000:]
    assert "damaged entries were removed and rebuilt" in log
    # The two forward programs whose executables were damaged are compiled again, nothing else is.
    assert counts["compiled"] == 2 and counts["program-store"] + counts["xla-cache"] == PROGRAMS - 2, counts
    proc, counts = compile_run(ckpt, root)
    assert counts == {"program-store": PROGRAMS, "xla-cache": 0, "compiled": 0} and " is damaged" not in proc.stderr


def test_generate_cli_with_a_warm_cache_traces_nothing(ckpt, tmp_path):
    """`day0jax.generate` makes its programs ready before the first token; a second process with the same cache
    takes every one from the program store (no tracing, no compiling) and gives the same text."""
    args = ("--model", str(ckpt), "--prompt", "Hello", "--max-tokens", "5", "--compile-cache", str(tmp_path),
            "--log-level", "info", *ENGINE_FLAGS)
    ready = re.compile(r"(\d+) programs ready before the first token in [0-9.]+s \((.*)\)")
    cold, warm = run_cli("day0jax.generate", *args), run_cli("day0jax.generate", *args)
    (n, sources), = ready.findall(cold.stderr)
    assert int(n) >= 2 and "program-store" not in sources, cold.stderr[-3000:]
    assert ready.findall(warm.stderr) == [(n, f"{n} program-store")], warm.stderr[-3000:]
    assert warm.stdout == cold.stdout


def test_unwritable_cache_folder_is_reported_and_generation_goes_on(ckpt, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("a file where the cache folder's parent should be")
    proc = run_cli("day0jax.generate", "--model", str(ckpt), "--prompt", "Hello", "--max-tokens", "3",
                   "--compile-cache", str(blocker / "cache"))
    assert f"cannot use {blocker / 'cache'}" in proc.stderr and "without a compilation cache" in proc.stderr
    assert "prompt tokens" in proc.stderr and proc.stdout.strip()


async def _requests(url: str) -> list[httpx.Response]:
    """Requests that use every sampler mode, logprobs, penalties, logit biases, a grammar and a two-row decode
    batch."""
    bodies = [
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0},
        {"prompt": "Once upon", "max_tokens": 6, "temperature": 0.8, "top_p": 0.9, "logprobs": 2, "seed": 1},
        {"prompt": "The sky", "max_tokens": 6, "temperature": 1.0, "presence_penalty": 0.5, "seed": 2},
        {"prompt": "One two", "max_tokens": 6, "temperature": 0.7, "seed": 3, "stream": True},
        {"prompt": "Red or", "max_tokens": 6, "temperature": 0, "logit_bias": {"5": -100, "17": 3}},
        {"messages": [{"role": "user", "content": "Pick"}], "max_tokens": 6, "temperature": 0,
         "guided_choice": ["yes", "no"]},
    ]
    async with httpx.AsyncClient(timeout=120) as http:
        calls = [http.post(url + ("/v1/chat/completions" if "messages" in b else "/v1/completions"),
                           json={"model": MODEL, **b}) for b in bodies]
        return await asyncio.gather(*calls)


def test_server_warms_up_every_program_and_exports_the_timeline(ckpt, filled):
    root, _, _ = filled
    proc = ServerProcess(["--model", str(ckpt), "--compile-cache", str(root), "--warmup", "all", *ENGINE_FLAGS])
    try:
        proc.wait_ready(600)
        responses = asyncio.run(_requests(proc.url))
        assert [r.status_code for r in responses] == [200] * len(responses), [r.text for r in responses]
        metrics = httpx.get(proc.url + "/metrics").text

        def value(name: str, **labels) -> float:
            sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
            m = re.search(rf"^{name}{{{sel}}} ([0-9.e+-]+)$" if labels else rf"^{name} ([0-9.e+-]+)$", metrics, re.M)
            assert m, f"{name}{{{sel}}} not in /metrics"
            return float(m.group(1))

        for phase in ("python start", "imports", "read config", "build model", "restore parameters", "compile",
                      "warm-up", "ready"):
            assert value("day0jax_startup_phase_seconds", phase=phase) >= 0
        assert value("day0jax_startup_phase_seconds", phase="ready") >= value("day0jax_startup_phase_seconds",
                                                                              phase="compile")
        assert value("day0jax_startup_restore_bytes") > 1e6
        assert value("day0jax_startup_programs_total", cache="hit", source="program-store") == PROGRAMS
        assert value("day0jax_startup_programs_total", cache="miss", source="compiled") == 0
        assert re.search(r'^day0jax_startup_compile_seconds\{cache="hit",program="forward",shape="2x1x16",'
                         r'source="program-store"\} ', metrics, re.M)  # labels in alphabetical order
        # Every request ran on warmed-up programs: nothing was traced or compiled after ready.
        for path in ("request", "background"):
            assert value("day0jax_compiles_after_ready_total", kind="trace", path=path) == 0
            assert value("day0jax_compiles_after_ready_total", kind="compile", path=path) == 0
        assert value("day0jax_programs_pending") == 0
        check_short_startup_log(proc.log_text(), proc.url)
    finally:
        assert proc.terminate() == 0, proc.log_text()[-3000:]


SERVER_PHASES = ("python start", "server imports", "imports", "compile cache", "read config", "build model",
                 "restore parameters", "kernel self-test", "build engine", "compile", "warm-up")
MAX_STARTUP_LINES = 25  # about 17 today: the phases, a few notes (memory plan, kernels, cache folder), ready


def check_short_startup_log(text: str, url: str) -> None:
    """The default-level server log: no library INFO lines, one line per phase, the compile bar, the ready URL."""
    # Reading the log as text turned the progress bar's carriage returns into newlines: one line per update.
    bar = [line for line in text.split("\n") if f"compiling {PROGRAMS} programs |" in line]
    assert bar and f"| {PROGRAMS}/{PROGRAMS} [" in bar[-1], text
    # A log line written while the bar (on the compile thread) is drawn takes the bar off the line first.
    assert not re.search(r"\| *\d+/\d+ \[[^\]]*\] *\d\d:\d\d:\d\d ", text), text
    lines = text.split("\n")
    lines = [line for line in lines if line.strip() and f"compiling {PROGRAMS} programs |" not in line]
    for library in ("absl", "orbax", "jax", "uvicorn"):
        assert not [line for line in lines if re.search(rf" INFO {library}\b", line)], (library, text)
    assert "if no error is raised then it is a bug" not in text  # one of Orbax's INFO lines
    assert "startup timeline:" not in text  # the full table is for --log-level debug (and /metrics)
    for phase in SERVER_PHASES:
        found = [line for line in lines if re.match(rf"\d\d:\d\d:\d\d {re.escape(phase)} \d+\.\d\ds\b", line)]
        assert len(found) == 1, (phase, text)
    assert [line for line in lines if re.match(r"\d\d:\d\d:\d\d restore parameters .* GB/s", line)], text
    ready = [i for i, line in enumerate(lines) if re.search(rf" ready in \d+\.\ds: serving {MODEL} on {url}$", line)]
    assert len(ready) == 1 and ready[0] < MAX_STARTUP_LINES, text
