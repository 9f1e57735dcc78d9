"""The streaming checkpoint reader (day0jax/weights/stream.py): any region of any stored array, the same parameters
whatever the concurrency, host memory within its bound, and damaged files named."""

import itertools
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

from day0jax.core.errors import CheckpointError
from day0jax.weights import checkpoint, stream

ROOT = Path(__file__).resolve().parents[1]


def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "split.last": rng.standard_normal((37, 50), np.float32),          # chunks cut the last axis
        "split.both": rng.standard_normal((64, 48), np.float32),          # chunks cut both axes
        "split.first": rng.standard_normal((500, 4), np.float32),         # chunks cut the first axis only
        "three.axes": rng.standard_normal((16, 9, 20), np.float32).astype(ml_dtypes.bfloat16),
        "codes": rng.integers(-128, 128, 3000, dtype=np.int8),
        "scalar": np.float32(3.5).reshape(()),
    }


# Chunks cut along inner axes, with partial edge chunks stored padded (zarr v2), as tensorstore lays out arrays
# that other writers (Orbax among them) chunk: the reader takes any such layout, not only the converter's own.
INNER_CHUNKS = {"split.last": (37, 16), "split.both": (24, 20), "three.axes": (16, 4, 7)}


def rechunk(folder: Path, array: np.ndarray, chunks: tuple[int, ...]) -> None:
    for f in folder.iterdir():
        if f.name != ".zarray":
            f.unlink()
    header = json.loads((folder / ".zarray").read_text())
    (folder / ".zarray").write_text(json.dumps(dict(header, chunks=list(chunks))))
    for index in itertools.product(*(range(-(-n // c)) for n, c in zip(array.shape, chunks))):
        part = array[tuple(slice(i * c, (i + 1) * c) for i, c in zip(index, chunks))]
        block = np.zeros(chunks, array.dtype)
        block[tuple(slice(0, n) for n in part.shape)] = part
        (folder / ".".join(map(str, index))).write_bytes(block.tobytes())


@pytest.fixture(scope="module")
def small_chunks(tmp_path_factory):
    """A checkpoint whose arrays are stored in chunks of 4 KiB (the converter's cuts, along the first axes), some
    re-chunked along inner axes (`INNER_CHUNKS`), so regions cross chunk borders on every axis."""
    import convert.writer as writer

    old, writer.CHUNK_BYTES = writer.CHUNK_BYTES, 4096
    try:
        with writer.CheckpointWriter(tmp_path_factory.mktemp("stream") / "ck") as w:
            for name, a in arrays().items():
                w.add(name, a)
            ck = w.commit({})
    finally:
        writer.CHUNK_BYTES = old
    for name, chunks in INNER_CHUNKS.items():
        rechunk(stored(ck, name).folder, arrays()[name], chunks)
    return ck


def stored(ck: Path, name: str) -> stream.StoredArray:
    group = checkpoint.read_manifest(ck)["params"][name]["group"]
    return stream.StoredArray.open(ck / checkpoint.group_dir(group) / name)


def test_any_region_reads_what_was_written(small_chunks):
    rng = np.random.default_rng(1)
    chunked = {name: stored(small_chunks, name).chunks for name in arrays()}
    # the converter's layout: first axis only, whole rows straight into place (a partial last chunk: 500 = 256 +
    # 244)
    assert chunked["split.first"] == (256, 4) and chunked["codes"] == (3000,) and chunked["scalar"] == ()
    assert all(chunked[name] == chunks for name, chunks in INNER_CHUNKS.items())
    for name, want in arrays().items():
        s = stored(small_chunks, name)
        assert s.shape == want.shape and s.dtype == want.dtype
        np.testing.assert_array_equal(s.read(), want)
        for _ in range(25 if want.ndim else 0):
            lo = [int(rng.integers(0, n)) for n in want.shape]
            region = tuple(slice(a, int(rng.integers(a + 1, n + 1))) for a, n in zip(lo, want.shape))
            np.testing.assert_array_equal(s.read(region), want[region], err_msg=f"{name}{region}")


@pytest.mark.parametrize("name, axis", [("split.both", 1), ("split.both", 0), ("three.axes", 2), ("codes", 0)])
def test_device_slices_read_each_chunk_file_once(small_chunks, monkeypatch, name, axis):
    """A parameter split four ways (as over tp=4) along any axis: every slice right, every chunk file opened once."""
    want = arrays()[name]
    s = stored(small_chunks, name)
    opened = []
    original = stream.StoredArray._open
    monkeypatch.setattr(stream.StoredArray, "_open", lambda self, index: opened.append(index) or original(self, index))
    step = want.shape[axis] // 4
    regions = [tuple(slice(i * step, (i + 1) * step) if a == axis else slice(0, n) for a, n in enumerate(want.shape))
               for i in range(4)]
    outs = [np.empty(tuple(r.stop - r.start for r in region), want.dtype) for region in regions]
    s.read_many(list(zip(regions, outs)))
    for region, out in zip(regions, outs):
        np.testing.assert_array_equal(out, want[region])
    assert sorted(opened) == sorted(set(opened)) and len(opened) == math.prod(
        -(-n // c) for n, c in zip(s.shape, s.chunks))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_the_same_parameters_with_any_concurrency(small_chunks, dtype):
    """One byte of concurrency (one slice at a time, on one thread) gives bit-identical arrays to the default; a
    parameter stored in another dtype is cast as numpy casts it."""
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    want = {n: a for n, a in arrays().items() if a.dtype.kind == "f"}

    def read(**kw):
        timings = stream.Timings()
        targets = [stream.Target(n, stored(small_chunks, n), np.dtype(dtype), sharding) for n in want]
        return stream.read_sharded(targets, timings=timings, **kw), timings

    default, _ = read()
    one, timings = read(concurrency=1, workers=1)
    assert timings.peak_in_flight == max(a.size * (a.dtype.itemsize + (np.dtype(dtype).itemsize
                                                                       if a.dtype != dtype else 0))
                                         for a in want.values())  # one slice at a time, however large
    assert timings.bytes_read == sum(a.nbytes for a in want.values())
    for name, a in want.items():
        for got in (default[name], one[name]):
            assert got.dtype == dtype and got.sharding == sharding
            np.testing.assert_array_equal(np.asarray(got), a.astype(dtype))


def damage(ck: Path, name: str, how: str) -> Path:
    s = stored(ck, name)
    chunk = sorted(p for p in s.folder.iterdir() if not p.name.startswith("."))[0]
    if how == "truncated":
        chunk.write_bytes(chunk.read_bytes()[:-4])
    elif how == "longer":
        chunk.write_bytes(chunk.read_bytes() + b"\0")
    elif how == "missing":
        chunk.unlink()
    elif how == "header":
        chunk = s.folder / ".zarray"
        chunk.write_text("{not json")
    elif how == "compressed":
        chunk = s.folder / ".zarray"
        chunk.write_text(json.dumps(dict(json.loads(chunk.read_text()), compressor={"id": "zstd"})))
    return chunk


@pytest.mark.parametrize("how, message", [("truncated", "bytes, its array's header says"),
                                          ("longer", "truncated or corrupt"), ("missing", "missing"),
                                          ("header", "unreadable"), ("compressed", "uncompressed C-order zarr v2")])
def test_a_damaged_data_file_is_named(small_chunks, tmp_path, how, message):
    ck = Path(shutil.copytree(small_chunks, tmp_path / "ck"))
    path = damage(ck, "split.both", how)
    with pytest.raises(CheckpointError, match=message) as e:
        checkpoint.read_params(ck, ["split.both"])
    assert str(path) in str(e.value)


def test_loading_names_a_truncated_file(tiny_llama, tmp_path):
    import day0jax

    ck = Path(shutil.copytree(tiny_llama, tmp_path / "ck"))
    path = damage(ck, "model.layers.1.mlp.down_proj.kernel", "truncated")
    with pytest.raises(CheckpointError, match="truncated or corrupt") as e:
        day0jax.load(ck, dtype="float32")
    assert str(path) in str(e.value)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from test_sharding import synthetic_checkpoint

    hf = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
    return synthetic_checkpoint(hf, tmp_path_factory.mktemp("llama") / "ck")


# Host memory while reading: the process's peak resident set (reset just before) grows by the parameters' bytes plus
# the bytes in flight, within 10%. A checkpoint of 96 MB read with 8 MB in flight.
PEAK = """
import json, sys
from pathlib import Path
import jax, ml_dtypes, numpy as np
from day0jax.weights import checkpoint, stream

ck, dtype, limit = Path(sys.argv[1]), np.dtype(getattr(ml_dtypes, sys.argv[2], sys.argv[2])), int(sys.argv[3])
manifest = checkpoint.read_manifest(ck)
sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
targets = [stream.Target(n, stream.StoredArray.open(ck / checkpoint.group_dir(p["group"]) / n), dtype, sharding)
           for n, p in manifest["params"].items()]

def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) << 10

open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from the current resident set
before = status("VmRSS")
timings = stream.Timings()
out = stream.read_sharded(targets, concurrency=limit, timings=timings)
jax.block_until_ready(list(out.values()))
print(json.dumps({"growth": status("VmHWM") - before, "params": sum(a.nbytes for a in out.values()),
                  "peak_in_flight": timings.peak_in_flight}))
"""


@pytest.fixture(scope="module")
def big_bf16(tmp_path_factory):
    """24 parameters of 2 MB in bfloat16 (48 MB stored), far more than the 8 MB in flight."""
    from convert.writer import CheckpointWriter

    rng = np.random.default_rng(0)
    with CheckpointWriter(tmp_path_factory.mktemp("big") / "ck") as w:
        for i in range(24):
            w.add(f"layers.{i}.kernel", rng.standard_normal((1024, 1024), np.float32).astype(ml_dtypes.bfloat16))
        return w.commit({})


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_host_memory_stays_within_parameters_plus_bytes_in_flight(big_bf16, dtype):
    limit = 8 << 20
    run = subprocess.run([sys.executable, "-c", PEAK, str(big_bf16), dtype, str(limit)], capture_output=True,
                         text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["params"] == 24 * 1024 * 1024 * np.dtype(getattr(ml_dtypes, dtype, dtype)).itemsize
    assert got["peak_in_flight"] <= limit
    assert got["growth"] <= 1.1 * (got["params"] + limit), got
