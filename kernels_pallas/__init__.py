"""Operators of the runtime: per op a pure-jnp reference, Pallas kernels and an api that picks one.

Layout and contracts: docs/adding_a_kernel.md. The lowest layer: imports neither `day0jax` nor `sharding`.
"""
