"""Grouped matmul for mixture-of-experts layers (the `jax.lax.ragged_dot` contract)."""
