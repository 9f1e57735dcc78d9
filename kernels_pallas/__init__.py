"""Operators of the runtime: a pure-jnp reference per op, Pallas kernels beside it, and an api that picks one.

This package imports neither `day0jax` nor `sharding`: it is the lowest layer.
"""
