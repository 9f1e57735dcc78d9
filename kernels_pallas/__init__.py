"""Operators of the runtime: a pure-jnp reference per op, Pallas kernels beside it, and an api that picks one.

Each op is a folder (`attention`, `paged_attention`, `moe`, `rms_norm`) with `reference.py` (the definition of
correct and the fallback everywhere), `pallas_mgpu.py` (a Mosaic GPU kernel for Hopper) and `api.py` (the op as
callers see it). `registry.py` holds the candidate pool and the process-wide policy; `selftest.py` checks the
chosen kernels on a model's shapes when it loads; `selfcheck.py` is the command-line check of every candidate
(`python -m kernels_pallas.selfcheck [--interpret] [--lower cuda] [--json]`); `cases.py` builds the shapes both
use from model configs; `platform.py` and `tuning.py` hold the target checks and the block-size tables.

This package imports neither `day0jax` nor `sharding`: it is the lowest layer.
"""
