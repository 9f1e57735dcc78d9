"""Batched generation with a contiguous KV cache: one jitted prefill, one jitted decode step.

Shapes are bucketed so that request lengths do not cause recompilation: the batch to a power of two (a
multiple of the data-parallel size), the prompt to a power of two of at least 16, the cache to a power of two
covering prompt + new tokens, and the attention span of each decode step to a power of two of at least 64.
Sequences are right-padded; each row carries its own positions, so prompts of different lengths share a batch.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from day0jax.engine.kv_cache import DenseKVCache
from day0jax.engine.sampling import mode_for, sample
from day0jax.errors import GenerationError
from sharding.rules import constrain, named_sharding

log = logging.getLogger(__name__)


def bucket(n: int, minimum: int) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return 1 << (max(n, minimum) - 1).bit_length()


class Generator:
    """Runs a model's forward pass, prefill and decode steps under `jax.jit` (the only jit sites of the path).

    Args:
        module: the nnx model with its (sharded) parameters.
        mesh: the mesh the parameters live on.
        dtype: KV cache dtype (the compute dtype).
        max_positions: the model's context length.
    """

    def __init__(self, module: nnx.Module, mesh: Mesh, dtype, max_positions: int):
        self.graphdef, self.params = nnx.split(module)
        self.mesh, self.dtype, self.max_positions = mesh, dtype, max_positions
        self.cache_layout = module.cache_layout()
        # Batches are split over dp and ep (sharding/rules.py): buckets are multiples of both.
        self.dp = mesh.shape.get("dp", 1) * mesh.shape.get("ep", 1)
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._forward = jax.jit(self._forward_fn)
        self._prefill = jax.jit(self._prefill_fn, donate_argnames=("caches",), static_argnames=("mode",))
        self._decode = jax.jit(self._decode_fn, donate_argnames=("caches",), static_argnames=("mode",))

    # --- jitted bodies ---------------------------------------------------------------------------------------
    def _forward_fn(self, params, tokens, seq_len):
        model = nnx.merge(self.graphdef, params)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        hidden, _ = model(tokens, positions, seq_len=seq_len)
        return self._to_host(model.logits(constrain(hidden)))

    def _prefill_fn(self, params, caches, tokens, lengths, key, temperature, top_k, top_p, mode):
        model = nnx.merge(self.graphdef, params)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        hidden, caches = model(tokens, positions, caches, seq_len=jnp.max(lengths))
        last = constrain(hidden)[jnp.arange(tokens.shape[0]), lengths - 1]  # only the last token needs logits
        return self._to_host(sample(model.logits(last), key, temperature, top_k, top_p, mode)), caches

    def _decode_fn(self, params, caches, tokens, positions, key, temperature, top_k, top_p, mode):
        model = nnx.merge(self.graphdef, params)
        hidden, caches = model(tokens[:, None], positions[:, None], caches)
        next_tokens = sample(model.logits(constrain(hidden)[:, 0]), key, temperature, top_k, top_p, mode)
        return self._to_host(next_tokens), caches

    # --- sharding of inputs and outputs (issue 6) --------------------------------------------------------------
    def _to_host(self, x: jax.Array) -> jax.Array:
        # What the host reads back is replicated: every process of a multi-host mesh can then read all of it.
        return jax.lax.with_sharding_constraint(x, self._replicated)

    def _put(self, x, logical: tuple | None = None) -> jax.Array:
        """A host array onto the mesh, split by `logical` names (None: replicated).

        Built from each device's slice (`make_array_from_callback`), so it also works when the mesh spans
        several processes, each holding the same host value, without a cross-process equality check.
        """
        x = np.asarray(x)
        sharding = self._replicated if logical is None else named_sharding(logical, x.shape, self.mesh)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    def _call(self, fn, *args, **kwargs):
        # The mesh is the context while tracing so `sharding.rules.constrain` at block boundaries can see it.
        with jax.set_mesh(self.mesh):
            return fn(*args, **kwargs)

    # --- host side -------------------------------------------------------------------------------------------

    def logits(self, token_ids) -> np.ndarray:
        """Full forward pass without a cache: int [B, T] -> float32 numpy [B, T, V]."""
        tokens = np.asarray(token_ids, dtype=np.int32)
        if tokens.ndim != 2 or tokens.shape[1] < 1:
            raise GenerationError(f"logits expects int token ids of shape [B, T] with T >= 1, got {tokens.shape}")
        B, T = tokens.shape
        if T > self.max_positions:
            raise GenerationError(f"{T} tokens exceed the model's context of {self.max_positions}")
        padded = np.zeros((bucket(B, self.dp), bucket(T, 16)), np.int32)
        padded[:B, :T] = tokens
        return np.asarray(self._call(self._forward, self.params, self._put(padded, ("batch", None)),
                                     self._put(np.int32(T))))[:B, :T]

    def _new_caches(self, batch: int, length: int) -> list[DenseKVCache]:
        caches = []
        for kv_heads, k_dim, v_dim in self.cache_layout:
            # Split like the kv heads (and the batch over dp); the head dims are never split.
            sharding = named_sharding(("batch", None, "kv_heads", None), (batch, length, kv_heads, 1), self.mesh)
            caches.append(DenseKVCache.zeros(batch, length, kv_heads, k_dim, v_dim, self.dtype, sharding))
        return caches

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop_token_ids: Sequence[int] = ()) -> list[list[int]]:
        """New tokens for each prompt; a row ends after a stop token (kept, as transformers does) or the limit.

        Raises:
            GenerationError: empty prompts, max_new_tokens < 1, bad sampling values, or a prompt that does not
                fit the context with max_new_tokens.
        """
        self._validate(prompts, max_new_tokens, temperature, top_p, top_k)
        B = len(prompts)
        lengths = np.array([len(p) for p in prompts], np.int32)
        Bb, Tb = bucket(B, self.dp), bucket(int(lengths.max()), 16)
        tokens = np.zeros((Bb, Tb), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
        all_lengths = np.ones(Bb, np.int32)
        all_lengths[:B] = lengths
        S = bucket(max(int(lengths.max()) + max_new_tokens, Tb), 64)
        caches = [c.with_attend_len(Tb) for c in self._new_caches(Bb, S)]

        seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
        key = jax.random.key(seed)
        sampling = (self._put(np.full(Bb, temperature, np.float32), ("batch",)),
                    self._put(np.full(Bb, top_k, np.int32), ("batch",)),
                    self._put(np.full(Bb, top_p, np.float32), ("batch",)))
        mode = mode_for([temperature], [top_k], [top_p])
        stops = set(stop_token_ids)
        out: list[list[int]] = [[] for _ in range(B)]
        done = np.zeros(B, bool)
        positions = all_lengths.copy()  # where each row's next token goes

        t0 = time.perf_counter()
        next_tokens, caches = self._call(self._prefill, self.params, caches, self._put(tokens, ("batch", None)),
                                         self._put(all_lengths, ("batch",)), jax.random.fold_in(key, 0),
                                         *sampling, mode=mode)
        for step in range(max_new_tokens):
            pending = next_tokens
            if step + 1 < max_new_tokens:
                # Dispatch the next step before reading this one back, so the host's bookkeeping overlaps it.
                span = bucket(int(positions.max()) + 1, 64)
                caches = [c.with_attend_len(span) for c in caches]
                next_tokens, caches = self._call(self._decode, self.params, caches, next_tokens,
                                                 self._put(positions, ("batch",)),
                                                 jax.random.fold_in(key, step + 1), *sampling, mode=mode)
                positions = positions + 1
            host = np.asarray(pending)
            for i in np.flatnonzero(~done):
                out[i].append(int(host[i]))
                if host[i] in stops:
                    done[i] = True
            if done.all():
                break
        log.debug("generated %d tokens for %d prompts in %.2fs", sum(map(len, out)), B, time.perf_counter() - t0)
        return out

    def _validate(self, prompts, max_new_tokens, temperature, top_p, top_k):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise GenerationError("prompts must be a non-empty list of non-empty token-id lists")
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if temperature < 0:
            raise GenerationError(f"temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise GenerationError(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 0:
            raise GenerationError(f"top_k must be >= 0, got {top_k}")
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > self.max_positions:
            raise GenerationError(f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the "
                                  f"model's context of {self.max_positions} tokens")
