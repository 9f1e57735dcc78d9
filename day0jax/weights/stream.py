"""Reading a checkpoint's parameters at storage speed, straight into their shardings.

The converter writes each parameter as an uncompressed zarr (v2) array: a `.zarray` header and raw C-order chunk
files of at most 16 MB, cut along the first axes (`convert/writer.py`; arrays chunked along other axes, as other zarr
writers lay them out, read as well). This module reads the chunk files itself:

- a pool of reader threads takes one parameter each: every chunk file it needs is read once, with one large
  sequential read, straight into the slice's buffer where the chunk's bytes are contiguous there (a slice along the
  first axis, or a whole parameter), otherwise once into a scratch buffer and copied into every device slice it
  overlaps (a parameter split along an inner axis over tp); a slice several devices hold is read once;
- at most `concurrency` bytes sit in host buffers waiting for their devices at any time (a parameter larger than
  that waits until nothing else is in flight, then goes alone);
- on the CPU backend a 64-byte aligned buffer becomes the device array without a copy (XLA aliases it), so
  parameters stored in the load dtype are read once into their final memory; elsewhere the buffer is copied to the
  device and dropped;
- a chunk file that is missing, shorter or longer than its header says, or a header that disagrees with the
  manifest, is a `CheckpointError` naming the file.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Iterator

import jax
import ml_dtypes
import numpy as np

from day0jax.core.errors import CheckpointError

ALIGN = 64  # XLA's CPU client aliases host buffers aligned to this instead of copying them


def default_concurrency() -> int:
    """Bytes in flight by default: a sixteenth of the memory available now, between 64 MiB and 2 GiB."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        available = 8 << 30
    return int(min(2 << 30, max(64 << 20, available // 16)))


def default_workers() -> int:
    """Reader threads: reads and copies release the GIL, and a few more threads than cores keep a disk queue full."""
    return min(8, 2 * (os.cpu_count() or 1))


def _dtype(name: str, where: Path) -> np.dtype:
    if name == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(name)
    except TypeError:
        try:
            return np.dtype(getattr(ml_dtypes, name))
        except (AttributeError, TypeError):
            raise CheckpointError(f"{where}: unknown dtype {name!r}") from None


@dataclasses.dataclass(frozen=True)
class StoredArray:
    """One parameter as the converter stored it: its folder, shape, chunk shape and dtype."""

    folder: Path
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: np.dtype

    @classmethod
    def open(cls, folder: Path) -> "StoredArray":
        """Reads `folder/.zarray`.

        Raises:
            CheckpointError: missing or malformed, or a layout this reader does not take (compressed, filtered,
                Fortran order, another zarr version).
        """
        header = folder / ".zarray"
        try:
            meta = json.loads(header.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{header}: missing; run `python -m convert --verify` on the checkpoint") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{header}: unreadable ({e}); run `python -m convert --verify` on the checkpoint"
                                  ) from None
        layout = (meta.get("zarr_format"), meta.get("compressor"), meta.get("filters"), meta.get("order"),
                  meta.get("dimension_separator", "."))
        if layout != (2, None, None, "C", "."):
            raise CheckpointError(f"{header}: zarr format {layout[0]}, compressor {layout[1]}, filters {layout[2]}, "
                                  f"order {layout[3]}: day0jax reads uncompressed C-order zarr v2 arrays, as its "
                                  "converter writes them; re-convert the source")
        try:
            shape, chunks = tuple(int(n) for n in meta["shape"]), tuple(int(n) for n in meta["chunks"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{header}: no valid shape and chunks") from None
        if len(shape) != len(chunks) or any(c < 1 for c in chunks):
            raise CheckpointError(f"{header}: chunks {list(chunks)} do not fit shape {list(shape)}")
        return cls(folder, shape, chunks, _dtype(str(meta.get("dtype")), header))

    def _chunk_file(self, index: tuple[int, ...]) -> Path:
        return self.folder / (".".join(map(str, index)) if index else "0")

    def _chunk_bytes(self) -> int:
        return math.prod(self.chunks) * self.dtype.itemsize

    def read(self, region: tuple[slice, ...] | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """The stored values in `region` (whole-array by default), in the stored dtype, written into `out` (a
        C-contiguous array of the region's shape) when given.

        Raises:
            CheckpointError: a chunk file missing, truncated or too long.
        """
        region = tuple(slice(0, n) for n in self.shape) if region is None else region
        if out is None:
            out = np.empty(tuple(r.stop - r.start for r in region), self.dtype)
        self.read_many([(region, out)])
        return out

    def read_many(self, parts: list[tuple[tuple[slice, ...], np.ndarray]]) -> None:
        """Fills each `out` (C-contiguous, its region's shape) with the stored values of its region, reading every
        chunk file once however many regions it overlaps (the slices of a parameter split over devices).

        Raises:
            CheckpointError: a chunk file missing, truncated or too long.
        """
        parts = [(r, out) for r, out in parts if out.size]
        if not self.shape:
            if parts:
                with self._open(()) as f:
                    _read_into(f, 0, parts[0][1].reshape(-1).view(np.uint8), f.name)
                for _, out in parts[1:]:
                    out[...] = parts[0][1]
            return
        chunks = set()
        for region, _ in parts:
            ranges = (range(r.start // c, (r.stop - 1) // c + 1) for r, c in zip(region, self.chunks))
            chunks.update(itertools.product(*ranges))
        for index in sorted(chunks):
            self._read_chunk(index, parts)

    def _open(self, index: tuple[int, ...]):
        path = self._chunk_file(index)
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing; run `python -m convert --verify` on the checkpoint") from None
        size = os.fstat(f.fileno()).st_size
        if size != self._chunk_bytes():
            f.close()
            raise CheckpointError(f"{path}: {size} bytes, its array's header says {self._chunk_bytes()} "
                                  "(truncated or corrupt); run `python -m convert --verify` on the checkpoint")
        return f

    def _read_chunk(self, index: tuple[int, ...], parts) -> None:
        c0 = [i * c for i, c in zip(index, self.chunks)]
        users = []  # (overlap in the chunk's coordinates, where it lands in out, out)
        for region, out in parts:
            lo = [max(r.start, c) - c for r, c in zip(region, c0)]
            hi = [min(r.stop, c + n) - c for r, c, n in zip(region, c0, self.chunks)]
            if all(a < b for a, b in zip(lo, hi)):
                dst = tuple(slice(c + a - r.start, c + b - r.start) for c, a, b, r in zip(c0, lo, hi, region))
                users.append((lo, hi, dst, out))
        row = math.prod(self.chunks[1:]) * self.dtype.itemsize  # bytes per index of the first axis
        with self._open(index) as f:
            if len(users) == 1:
                lo, hi, dst, out = users[0]
                # Rows lo[0]..hi[0] of the chunk are one contiguous read; they land in `out` contiguously when both
                # the chunk and `out` are covered whole along every later axis.
                if all(a == 0 and b == n == m for a, b, n, m in zip(lo[1:], hi[1:], self.chunks[1:], out.shape[1:])):
                    _read_into(f, lo[0] * row, out[dst].reshape(-1).view(np.uint8), f.name)
                    return
            first, last = min(u[0][0] for u in users), max(u[1][0] for u in users)
            rows = np.empty((last - first,) + self.chunks[1:], self.dtype)
            _read_into(f, first * row, rows.reshape(-1).view(np.uint8), f.name)
        for lo, hi, dst, out in users:
            out[dst] = rows[(slice(lo[0] - first, hi[0] - first),) + tuple(slice(a, b) for a, b in zip(lo[1:], hi[1:]))]


def _read_into(f, offset: int, buf: np.ndarray, path) -> None:
    view = memoryview(buf)
    done = 0
    while done < len(view):
        n = os.preadv(f.fileno(), [view[done:]], offset + done)
        if n == 0:
            raise CheckpointError(f"{path}: ended early (truncated?); run `python -m convert --verify` on it")
        done += n


def time_storage(files: list[Path], sample_bytes: int = 64 << 20) -> tuple[int, float]:
    """(bytes, seconds) of reading up to `sample_bytes` of `files` from storage: the sample is dropped from the page
    cache first (posix_fadvise DONTNEED, which needs no privileges) so the figure is the storage's, not memory's."""
    picked, total = [], 0
    for f in files:
        if total >= sample_bytes:
            break
        picked.append(f)
        total += f.stat().st_size
    buf = memoryview(bytearray(8 << 20))
    done, t0 = 0, 0.0
    for i, f in enumerate(picked):
        with open(f, "rb", buffering=0) as fh:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            if i == 0:
                t0 = time.perf_counter()
            while n := fh.readinto(buf):
                done += n
    return done, time.perf_counter() - t0 if picked else 0.0


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on an `ALIGN`-byte boundary."""
    dtype = np.dtype(dtype)
    n = math.prod(shape) * dtype.itemsize
    raw = np.empty(n + ALIGN, np.uint8)
    offset = (-raw.ctypes.data) % ALIGN
    return raw[offset:offset + n].view(dtype).reshape(shape)


def _cast(host: np.ndarray, dtype: np.dtype) -> np.ndarray:
    wide = aligned_empty(host.shape, dtype)
    np.copyto(wide, host, casting="unsafe")
    return wide


@dataclasses.dataclass
class Timings:
    """Seconds the reader threads spent (summed over threads) and what they moved."""

    read: float = 0.0
    convert: float = 0.0
    place: float = 0.0
    bytes_read: int = 0
    peak_in_flight: int = 0

    def add(self, other: "Timings") -> None:
        self.read += other.read
        self.convert += other.convert
        self.place += other.place
        self.bytes_read += other.bytes_read


class _Budget:
    """Bytes in flight, bounded: `take(n)` waits until n more fit (or, for n over the bound, until none are)."""

    def __init__(self, limit: int):
        self.limit, self.used, self.peak = limit, 0, 0
        self._cond = threading.Condition()

    def take(self, n: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n
            self.peak = max(self.peak, self.used)

    def give(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()


@dataclasses.dataclass(frozen=True)
class Target:
    """What to make of one parameter: its stored array, the dtype to load it as, and where it goes."""

    name: str
    stored: StoredArray
    dtype: np.dtype
    sharding: jax.sharding.Sharding


def _slices(target: Target) -> Iterator[tuple[tuple[slice, ...], list]]:
    """Each distinct slice of the parameter this process's devices hold, with the devices holding it."""
    by_region: dict[tuple, list] = {}
    for device, index in target.sharding.addressable_devices_indices_map(target.stored.shape).items():
        region = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, target.stored.shape))
        by_region.setdefault(tuple((s.start, s.stop) for s in region), []).append(device)
    for key, devices in by_region.items():
        yield tuple(slice(a, b) for a, b in key), devices


def read_sharded(targets: list[Target], *, concurrency: int | None = None, workers: int | None = None,
                 timings: Timings | None = None) -> dict[str, jax.Array]:
    """Every target read and placed as its sharding says, `workers` threads reading with at most `concurrency`
    bytes of host buffers not yet on their devices.

    Returns:
        name -> jax.Array (global shape, the target's sharding).
    Raises:
        CheckpointError: a missing, truncated or malformed stored array.
    """
    concurrency = default_concurrency() if concurrency is None else int(concurrency)
    if concurrency < 1:
        raise CheckpointError(f"load concurrency must be a positive number of bytes, got {concurrency}")
    budget = _Budget(concurrency)
    timings = timings if timings is not None else Timings()
    lock = threading.Lock()
    cpu = all(d.platform == "cpu" for t in targets for d in t.sharding.addressable_devices)

    def place(target: Target) -> list[jax.Array]:
        """Reads the parameter's distinct slices (each chunk file once), casts them, puts them on their devices."""
        slices = list(_slices(target))
        stored, want = target.stored.dtype, target.dtype
        elements = sum(math.prod(s.stop - s.start for s in region) for region, _ in slices)
        nbytes = elements * (stored.itemsize + (want.itemsize if want != stored else 0))
        mine = Timings(bytes_read=elements * stored.itemsize)
        budget.take(nbytes)
        try:
            t0 = time.perf_counter()
            hosts = [aligned_empty(tuple(s.stop - s.start for s in region), stored) for region, _ in slices]
            target.stored.read_many([(region, host) for (region, _), host in zip(slices, hosts)])
            t1 = time.perf_counter()
            if want != stored:
                hosts = [_cast(host, want) for host in hosts]
            t2 = time.perf_counter()
            arrays = [jax.device_put(host, d, may_alias=cpu) for host, (_, devices) in zip(hosts, slices)
                      for d in devices]
            if not cpu:
                jax.block_until_ready(arrays)  # the host buffers are free once copied
            t3 = time.perf_counter()
        finally:
            budget.give(nbytes)
        mine.read, mine.convert, mine.place = t1 - t0, t2 - t1, t3 - t2
        with lock:
            timings.add(mine)
        return arrays

    jobs: dict[str, concurrent.futures.Future] = {}
    with concurrent.futures.ThreadPoolExecutor(workers or default_workers(), thread_name_prefix="day0jax-load") as pool:
        for target in targets:
            jobs[target.name] = pool.submit(place, target)
        out = {}
        try:
            for target in targets:
                arrays = jobs[target.name].result()
                out[target.name] = jax.make_array_from_single_device_arrays(target.stored.shape, target.sharding,
                                                                            arrays)
        except BaseException:
            pool.shutdown(cancel_futures=True)  # the first error is the one reported; the rest need not run
            raise
    timings.peak_in_flight = budget.peak
    return out
