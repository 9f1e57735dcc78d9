"""The device side of the serving engine: the paged KV pools and the two jitted programs (forward, sample).

One forward program serves decode steps (tokens [B, 1]) and prefill chunks (tokens [1, C]); it returns the
logits of one chosen position per row. Sampling is a separate small program, so the model programs do not
multiply by sampling modes. Shapes come from a few buckets (batch sizes, chunk lengths, block-table widths),
each compiled once, during `warm_up` when asked; padding tokens and rows are routed to the trash page.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from day0jax.engine.paged_cache import TRASH_PAGE, PagedKVCache, new_pools
from day0jax.engine.sampling import sample_rows
from sharding.rules import named_sharding

log = logging.getLogger(__name__)


def pick(buckets: Sequence[int], n: int) -> int:
    """The smallest bucket >= n (the largest if none is)."""
    for b in buckets:
        if b >= n:
            return b
    return buckets[-1]


@dataclass
class Batch:
    """One forward call, host side: [B, T] token ids and positions, [B, W] block tables, [B] lengths."""

    tokens: np.ndarray
    positions: np.ndarray
    block_tables: np.ndarray
    kv_lengths: np.ndarray
    last_index: np.ndarray  # [B] which of the T positions to return logits for


class ModelRunner:
    """Holds the parameters, the KV page pools and the compiled programs.

    Args:
        module: the nnx model (any family implementing the cache protocol and `cache_layout()`).
        mesh: the mesh its parameters live on.
        dtype: KV cache dtype.
        num_pages: pages per layer, trash page included.
        page_size: tokens per page.
        batch_buckets, chunk_buckets: allowed decode batch sizes and prefill chunk lengths, ascending.
        decode_widths, prefill_widths: allowed block-table widths in pages for decode steps and prefill chunks,
            ascending (the last covers the longest sequence).
    """

    def __init__(self, module: nnx.Module, mesh: Mesh, dtype, *, num_pages: int, page_size: int,
                 batch_buckets: Sequence[int], chunk_buckets: Sequence[int], decode_widths: Sequence[int],
                 prefill_widths: Sequence[int]):
        self.graphdef, self.params = nnx.split(module)
        self.mesh, self.page_size, self.num_pages = mesh, page_size, num_pages
        self.batch_buckets, self.chunk_buckets = tuple(batch_buckets), tuple(chunk_buckets)
        self.decode_widths, self.prefill_widths = tuple(decode_widths), tuple(prefill_widths)
        self.vocab_size = int(module.config.vocab_size)
        self._replicated = NamedSharding(mesh, PartitionSpec())
        # Pools split like the model's kv heads; pages, slots and head dims are never split.
        self.pools = new_pools(module.cache_layout(), num_pages, page_size, dtype,
                               lambda shape: named_sharding((None, None, "kv_heads", None), shape, mesh))
        self._forward = jax.jit(self._forward_fn, donate_argnames=("pools",))
        self._sample = jax.jit(sample_rows, static_argnames=("mode", "logprobs"))
        self.compiled: set[tuple[int, int, int]] = set()

    @property
    def pool_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.pools)

    def _forward_fn(self, params, pools, tokens, positions, block_tables, kv_lengths, last_index):
        model = nnx.merge(self.graphdef, params)
        caches = [PagedKVCache(k, v, block_tables, kv_lengths) for k, v in pools]
        # seq_len: the real longest length (padding positions are huge), for RoPE variants that depend on it.
        hidden, caches = model(tokens, positions, caches, seq_len=jnp.max(kv_lengths))
        last = hidden[jnp.arange(tokens.shape[0]), last_index]
        return model.logits(last), [(c.k_pages, c.v_pages) for c in caches]

    def _put(self, x):
        x = np.asarray(x)
        if self.mesh.size == 1:
            return x  # jit's own transfer of host arrays is the cheapest path (it runs every step)
        # Built from each device's slice, so a mesh spanning several processes works too (as the generator does).
        return jax.make_array_from_callback(x.shape, self._replicated, lambda index: x[index])

    def forward(self, batch: Batch) -> jax.Array:
        """Runs one forward call (writing its keys/values into the pools); returns logits [B, V] on device."""
        key = batch.tokens.shape + (batch.block_tables.shape[1],)
        if key not in self.compiled:
            log.info("compiling the forward program for batch %d x %d tokens, %d pages", *key)
            self.compiled.add(key)
        inputs = [self._put(x) for x in (batch.tokens, batch.positions, batch.block_tables, batch.kv_lengths,
                                         batch.last_index)]
        # The mesh is the context while tracing, for `sharding.rules.constrain` inside the model.
        with jax.set_mesh(self.mesh):
            logits, self.pools = self._forward(self.params, self.pools, *inputs)
        return logits

    def sample(self, logits: jax.Array, rows: dict[str, np.ndarray], penalties: tuple | None, mode: str,
               logprobs: bool) -> dict[str, np.ndarray]:
        """Samples one token per row of `logits`; `rows` holds the per-row arrays of `sample_rows`."""
        pen = None if penalties is None else tuple(self._put(x) for x in penalties)
        args = [self._put(rows[k]) for k in ("seeds", "counters", "temperature", "top_k", "top_p", "min_p")]
        with jax.set_mesh(self.mesh):
            out = self._sample(logits, *args, pen, mode=mode, logprobs=logprobs)
        return {k: np.asarray(v) for k, v in out.items()}

    def empty_batch(self, rows: int, tokens: int, width: int) -> Batch:
        """A batch of padding only: every token goes to the trash page."""
        pad = width * self.page_size  # beyond every block table: the trash page
        return Batch(tokens=np.zeros((rows, tokens), np.int32), positions=np.full((rows, tokens), pad, np.int32),
                     block_tables=np.full((rows, width), TRASH_PAGE, np.int32),
                     kv_lengths=np.zeros(rows, np.int32), last_index=np.zeros(rows, np.int32))

    def warm_up(self, shapes: Sequence[tuple[int, int, int]],
                sample_modes: Sequence[str] = ("greedy", "random", "filtered"), progress=None) -> float:
        """Compiles (by running on padding) the forward program for each (rows, tokens, width) and the sampler
        for each row count and mode. Returns the seconds it took."""
        t0 = time.perf_counter()
        rows_seen = set()
        for i, (rows, tokens, width) in enumerate(shapes):
            logits = self.forward(self.empty_batch(rows, tokens, width))
            if rows not in rows_seen:
                rows_seen.add(rows)
                for mode in sample_modes:
                    self.sample(logits, self.neutral_rows(rows), None, mode, False)
            else:
                logits.block_until_ready()
            if progress:
                progress(i + 1, len(shapes))
        return time.perf_counter() - t0

    @staticmethod
    def neutral_rows(rows: int) -> dict[str, np.ndarray]:
        return dict(seeds=np.zeros(rows, np.uint32), counters=np.zeros(rows, np.int32),
                    temperature=np.zeros(rows, np.float32), top_k=np.zeros(rows, np.int32),
                    top_p=np.ones(rows, np.float32), min_p=np.zeros(rows, np.float32))
