"""Where the CPU kernels' shared objects come from: only a folder this user owns and no one else can write, and a
library that does not load is built again. A stand-in compiler (a shell script) keeps these tests free of C++ builds.
"""

from __future__ import annotations

import os

import pytest

from kernels_pallas import cpu_build

TARGET = "day0jax_paged_decode"


@pytest.fixture
def builds(tmp_path, monkeypatch):
    """A fresh kernels folder and a stand-in compiler that writes a corrupt library; returns the log of its runs."""
    log = tmp_path / "compiler-runs"
    compiler = tmp_path / "fake-c++"
    # The output path follows -o; each run appends a line to the log.
    compiler.write_text(f'#!/bin/sh\necho run >> {log}\nwhile [ "$1" != -o ]; do shift; done\n'
                        'printf "not an ELF file" > "$2"\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("DAY0JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(compiler))
    for cached in (cpu_build.library_path, cpu_build._library_file):
        cached.cache_clear()
    yield lambda: len(log.read_text().splitlines()) if log.exists() else 0
    for cached in (cpu_build.library_path, cpu_build._library_file):
        cached.cache_clear()


def library(target: str = TARGET):
    source, _ = cpu_build._source(target)
    return cpu_build._library_file(source, os.environ["CXX"])


def test_a_library_that_does_not_load_is_built_again_once_then_declined(builds):
    out = library()
    out.parent.mkdir(mode=0o700, parents=True)
    out.write_bytes(b"\x7fELF truncated by a full disk")
    # Uncached (`__wrapped__`): the process's own registration of the kernel stays as it is.
    assert cpu_build.register.__wrapped__(TARGET) is False  # no exception: the reference runs
    assert builds() == 1  # built again once; that build did not load either, so the kernel is declined
    assert not out.exists()


def test_a_folder_or_library_others_can_write_is_never_loaded(builds):
    out = library()
    out.parent.mkdir(mode=0o700, parents=True)
    out.write_bytes(b"planted")
    out.chmod(0o666)
    assert cpu_build.library_path(cpu_build._source(TARGET)[0]) is None
    out.unlink()
    out.parent.chmod(0o777)
    assert cpu_build.library_path(cpu_build._source(TARGET)[0]) is None
    assert builds() == 0  # nothing built into a folder others could swap files in
