"""Operators of the runtime: per op a pure-jnp reference and the candidates an api picks from (Pallas kernels, C++
kernels for the CPU, cuDNN and XLA programs), and the spec that says what the op is.

Layout and contracts: docs/adding_a_kernel.md; the op table: `ops.py`. The lowest layer: imports neither `day0jax`
nor `sharding`.
"""
