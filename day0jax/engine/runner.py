"""The device side of the engine: the parameters, the paged KV pools and the jitted programs, one per purpose: the
forward step over the cache (per pipeline stage), the cache-less forward of `Model.logits`, the vision tower, and
the sampler.

A model that is not split into pipeline stages is the one-stage case (engine/stages.py): one forward program, its
parameters and pools on the whole mesh, no micro-batches. The forward program serves decode steps (tokens [B, 1])
and prefill chunks ([1, C]) and also returns each row's greedy token, so a greedy batch needs no second program;
sampling is a separate small program, so the model programs do not multiply by sampling modes. Buckets that
warm-up did not `install` go through `jax.jit`.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from day0jax.core.cache_layout import StateLayer, kv_part
from day0jax.core.errors import MeshError
from day0jax.engine.config import EngineLayout
from day0jax.engine.input_batch import ROW_ARRAYS, Batch, InputBatch, SamplingMetadata
from day0jax.engine.paged_cache import layer_caches, new_pools
from day0jax.engine.programs import Program, ProgramCatalog
from day0jax.engine.sampling import accept_drafts, sample
from day0jax.engine.stages import MicroBatches, leaf_paths, pipeline_refusal, placed_stages
from day0jax.layers.linear import exact_float32
from day0jax.layers.lora import adapter_rows
from day0jax.vision.spec import FeatureCache, encode_host
from kernels_pallas import registry as kernel_registry
from sharding.pipeline import Links, Stages
from sharding.rules import ACTIVATION, constrain, named_sharding, put

log = logging.getLogger(__name__)


# The acceptance closes over nothing of a runner: one jit for the process, so engines share its compiled shapes.
_ACCEPT = jax.jit(accept_drafts)


def layer_rings(cache_layout: list, layout: EngineLayout) -> list[int]:
    """Per layer, the pages per sequence of its ring (a sliding-window layer that keeps only its window), else 0."""
    return [layout.ring_pages(kv.window) if kv is not None else 0 for kv in map(kv_part, cache_layout)]


class ModelRunner:
    """Holds the parameters, the KV page pools and the compiled programs.

    Args:
        module, mesh, dtype: the nnx model (any family with the cache protocol and `cache_layout()`), the mesh its
            parameters live on (with a `pp` axis: split into pipeline stages as `sharding.pipeline.param_sharding`
            placed them), the KV cache dtype.
        layout: the engine's pool size and shape buckets.
        micro_batches: most micro-batches a pipelined decode batch is cut into (default: the number of stages).
    Raises:
        MeshError: pipeline stages for a model that cannot be split.
    """

    def __init__(self, module: nnx.Module, mesh: Mesh, dtype, layout: EngineLayout, micro_batches: int | None = None):
        self._graphdef, params = nnx.split(module)
        # Flat leaves: unflattening nnx Variables on every call costs about a millisecond of host time a step.
        leaves, self._params_def = jax.tree.flatten(params)
        self._paths = leaf_paths(params)
        self.mesh, self.layout, self.dtype = mesh, layout, dtype
        self.vocab_size = int(module.config.vocab_size)
        self.links = Links(mesh)
        self.meshes = self.links.meshes
        cache_layout = module.cache_layout()
        if len(self.meshes) > 1:
            refusal = pipeline_refusal(module)
            if refusal:
                raise MeshError(refusal)
            self.stages = placed_stages(self._paths, leaves, self.meshes)
            self.micro = MicroBatches(self.links, micro_batches or self.stages.count)
            log.info("pipeline: %d stages, layers %s, up to %d micro-batches per decode step", self.stages.count,
                     self.stages.describe(), self.micro.most)
        else:
            self.stages = Stages((range(len(cache_layout)),), tied=not any(p.startswith("lm_head.") for p in self._paths))
            self.micro = None
        self.local = [s for s in range(self.stages.count) if self.links.local[s]]
        # Which flat parameters each stage's program takes (its layers, and the embeddings, norm and head it uses).
        self._needs = [list(range(len(leaves)))] if self.stages.count == 1 else \
            [[i for i, p in enumerate(self._paths) if s in self.stages.holders(p)] for s in range(self.stages.count)]
        self._place(leaves)
        # Per layer, how many of its pools are per-sequence state (the first ones; 0 for KV layers).
        self.stateful = [len(x.arrays) if isinstance(x, StateLayer) else 0 for x in cache_layout]
        self.rings = layer_rings(cache_layout, layout)
        self.compressed = [x.compressed if isinstance(x, StateLayer) else None for x in cache_layout]
        self._cache_layout = cache_layout
        self._mtp_layout = module.mtp_cache_layout() if getattr(module, "mtp", None) is not None else []
        self._mtp_hidden_size = module.mtp_hidden_size if self._mtp_layout else 0
        # With the MTP proposer, the forward and verify programs also return what the MTP layers read of the last
        # layer's output, [B, T, mtp_hidden_size] (`hidden`, the last call's: `CausalLM.mtp_hidden`).
        self.keep_hidden = False
        self.hidden: jax.Array | None = None
        self.mtp_pools: list | None = None
        self.mtp_carry: tuple = ()
        self._stage_pools: list | None = None  # allocated by the engine (`allocate_pools`), not by `full_logits`
        self._stage_replicated = [NamedSharding(m, PartitionSpec()) for m in self.meshes]
        self._sample_mesh = self.links.sample_mesh
        self._replicated = NamedSharding(self._sample_mesh, PartitionSpec())
        self._no_previous = self._put(np.zeros(layout.max_rows, np.int32), self.meshes[0]) \
            if self.links.local[0] else None
        # A vision-language model's (never split into stages): its programs take image features, and it encodes
        # images (one program per image shape bucket).
        self.vision = getattr(module, "vision_spec", None)
        self.feature_cache = FeatureCache(layout.image_cache_bytes) if self.vision is not None else None
        self.inputs = InputBatch(layout, self.vision, self.vocab_size, self.encode_images)
        self.catalog = ProgramCatalog(layout, None if self.micro is None else self.local,
                                      self.vision.encoder.keys() if self.vision is not None else ())
        self._stage_jits = [jax.jit(functools.partial(self._stage_fn, s, False), donate_argnames=("pools",))
                            for s in range(self.stages.count)]
        # Verify programs: decode rows with their drafts, the logits of every position.
        self._verify_jits = [jax.jit(jax.named_scope("verify")(functools.partial(self._stage_fn, s, True)),
                                     donate_argnames=("pools",)) for s in range(self.stages.count)]
        self._whole_jits = [jax.jit(functools.partial(self._whole_fn, s)) for s in range(self.stages.count)]
        self._encode = jax.jit(self._encode_fn)
        self._sample = jax.jit(self._sample_fn)
        self._accept = _ACCEPT
        self.compiled: set[tuple] = set()  # shapes traced by jit (not installed): logged once each
        self.programs: dict[Program, jax.stages.Compiled] = {}  # installed by warm-up
        # Set while programs are still compiling in the background (`startup.warmup.BackgroundCompiler.ensure`):
        # a step whose program is not installed then runs on an installed larger one, or makes its own ready
        # through this, instead of tracing it inline.
        self.ensure: Callable[[Program], None] | None = None
        self._context: str | None = None  # see `signature`
        self._split = None  # the last forward's logits, rows per micro-batch and each micro-batch's: see `sample`
        # Speculative decoding's device proposers: a draft model's runner (`attach_draft`), whose programs this
        # runner runs and compiles ("draft": its prefill chunks, "propose": its drafting after each verify).
        self.draft: ModelRunner | None = None
        self._propose_jit = None

    # --- parameters and pools ------------------------------------------------------------------------------------

    def _place(self, leaves: list) -> None:
        """Each local stage's parameters on its mesh: the loaded arrays, and for those loaded on several stages'
        devices (`sharding.pipeline.holders_mesh`) the shards on this stage's (no copy)."""
        self.stage_params = []
        for s, needs in enumerate(self._needs):
            if not self.links.local[s]:
                self.stage_params.append(None)
                continue
            if self.stages.count == 1:
                self.stage_params.append(list(leaves))
                continue
            mine = []
            for i in needs:
                leaf = leaves[i]
                if frozenset(leaf.sharding.device_set) != frozenset(self.meshes[s].devices.flat):
                    sharding = NamedSharding(self.meshes[s], leaf.sharding.spec)
                    if isinstance(leaf, jax.ShapeDtypeStruct):
                        leaf = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
                    else:
                        shards = {x.device: x.data for x in leaf.addressable_shards}
                        leaf = jax.make_array_from_single_device_arrays(
                            leaf.shape, sharding, [shards[d] for d in sharding.addressable_devices])
                mine.append(leaf)
            self.stage_params.append(mine)
        self._leaves = leaves

    def attach(self, module: nnx.Module) -> None:
        """Replaces the parameters by `module`'s: the restored weights of the abstract model this runner was built
        on, with the same shapes, dtypes and shardings (so every compiled program takes them).

        Raises:
            ValueError: a parameter differs in structure, shape, dtype or sharding.
        """
        params, treedef = jax.tree.flatten(nnx.split(module)[1])
        if treedef != self._params_def:
            raise ValueError("the restored model's parameters are not the ones the engine was built for")
        for old, new in zip(self._leaves, params):
            if (old.shape, old.dtype, old.sharding) != (new.shape, new.dtype, new.sharding):
                raise ValueError(f"a restored parameter is {new.shape} {new.dtype} {new.sharding}; the engine's "
                                 f"programs take {old.shape} {old.dtype} {old.sharding}")
        self._place(params)

    @property
    def params(self) -> list:
        """The loaded parameters (each stage's arrays are these or views of their shards)."""
        return list(self._leaves)

    @property
    def stage_pools(self) -> list[list]:
        """Each local stage's layers' KV and state pools (allocated on first use)."""
        if self._stage_pools is None:
            L = self.layout
            self._stage_pools = [new_pools([self._cache_layout[i] for i in r], L.num_pages, L.page_size,
                                           L.state_slots, self.dtype, m, L.ring_pages, L.kv_cache_dtype,
                                           L.ring_slots)
                                 if local else []
                                 for r, m, local in zip(self.stages.ranges, self.meshes, self.links.local)]
        return self._stage_pools

    def allocate_pools(self) -> None:
        """Allocates the KV page and state pools now (the engine does, when it is made)."""
        self.stage_pools  # noqa: B018 - the property allocates

    @property
    def pools(self) -> list:
        """Every layer's pools, in layer order."""
        return [p for pools in self.stage_pools for p in pools]

    @property
    def has_state(self) -> bool:
        """Whether some layer keeps per-sequence state (linear attention) besides the paged KV cache."""
        return any(self.stateful)

    @property
    def pool_bytes(self) -> int:
        """Bytes of the KV page pools."""
        return sum(x.nbytes for pools, n in zip(self.pools, self.stateful) for x in pools[n:])

    @property
    def state_bytes(self) -> int:
        """Bytes of the linear-attention state pools."""
        return sum(x.nbytes for pools, n in zip(self.pools, self.stateful) for x in pools[:n])

    @property
    def param_bytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in self._leaves)  # also before `attach` (shapes only)

    @functools.cached_property
    def hidden_size(self) -> int:
        embed = next(a for p, a in zip(self._paths, self._leaves) if p.startswith("model.embed_tokens."))
        return int(embed.shape[-1])

    # --- the programs' functions ---------------------------------------------------------------------------------

    def _model(self, s: int, params: list):
        if self.stages.count == 1:
            return nnx.merge(self._graphdef, jax.tree.unflatten(self._params_def, params))
        leaves = [None] * len(self._paths)  # other stages' parameters: absent here
        for i, value in zip(self._needs[s], params):
            leaves[i] = value
        return nnx.merge(self._graphdef, jax.tree.unflatten(self._params_def, leaves))

    def _stage_fn(self, s: int, every_position: bool, params, pools, x, previous, tokens, positions, block_tables,
                  kv_lengths, last_index, token_source, state_slots, state_targets, adapters, *image):
        model = self._model(s, params)
        layers = self.stages.ranges[s]
        # A layer sharing another's KV has no pools and gets no cache, or one of its indexer's pages only: the model
        # hands it its source's.
        caches = layer_caches(pools, self.stateful[layers.start:layers.stop], self.rings[layers.start:layers.stop],
                              block_tables, kv_lengths, positions, state_slots, state_targets,
                              self.compressed[layers.start:layers.stop], self.layout.page_size,
                              self.layout.state_copies)
        first, last = s == 0, s == self.stages.last
        if first:
            # A row's token still on the device is its first one (a verify row's drafts follow it from the host).
            from_previous = (token_source[:, None] >= 0) & (jnp.arange(tokens.shape[1])[None, :] == 0)
            x = jnp.where(from_previous, previous[token_source][:, None], tokens)
        # seq_len: the real longest length (padding positions are huge), for RoPE variants that depend on it.
        seq_len = jnp.max(kv_lengths)
        with exact_float32(self.dtype), adapter_rows(adapters):
            kept = ()
            if first and last and self.keep_hidden:  # the MTP layers read the last layer's output (`mtp_hidden`)
                out, caches = model(x, positions, caches, seq_len=seq_len, raw=True, **self._image_inputs(image))
                hidden, kept = model.final_norm(out), (model.mtp_hidden(out),)
            elif first and last:
                hidden, caches = model(x, positions, caches, seq_len=seq_len, **self._image_inputs(image))
            else:
                hidden, caches = model.stage(x, positions, caches, seq_len, layers)
            pools = [() if c is None else c.pools for c in caches]
            if not last:
                return hidden, pools
            if every_position:
                logits = model.logits(hidden)
                logits = jax.lax.with_sharding_constraint(logits, self._stage_replicated[s])
                return (logits, *kept, pools)
            logits = model.logits(hidden[jnp.arange(hidden.shape[0]), last_index])
        # Replicated logits: the sampler's programs are compiled ahead of time for exactly this input sharding.
        logits = jax.lax.with_sharding_constraint(logits, self._stage_replicated[s])
        with jax.named_scope("sampling"):
            greedy = self._padded(jnp.argmax(logits, axis=-1))
        return (logits, greedy, *kept, pools)

    def _whole_fn(self, s: int, params, x, seq_len, image, adapters=None):
        """Stage `s` of `Model.logits`' full forward pass (no cache); `adapters`: each row's adapter slot, or None
        for a model without served adapters."""
        model = self._model(s, params)
        B, T = x.shape[:2]
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        first, last = s == 0, s == self.stages.last
        with exact_float32(self.dtype), adapter_rows(adapters):
            if first and last:
                hidden, _ = model(x, positions, seq_len=seq_len, **(image or {}))
            else:
                hidden, _ = model.stage(x, positions, None, seq_len, self.stages.ranges[s])
            if not last:
                return hidden
            logits = model.logits(constrain(hidden))
        # Replicated: every process of a multi-host mesh can read all of it.
        return jax.lax.with_sharding_constraint(logits, self._stage_replicated[s])

    def _encode_fn(self, params, *inputs):
        model = self._model(0, params)
        with exact_float32(self.dtype):
            return model.encode_images(*inputs)

    def _image_inputs(self, image: tuple) -> dict:
        """The model's image arguments from the forward's trailing inputs (see `Batch.arrays`)."""
        if not image:
            return {}
        names = ["image_features", "image_mask"] + ["rope_positions"] * (self.vision.mrope is not None) + \
            ["deepstack"] * bool(self.vision.deepstack)
        return dict(zip(names, image))

    def _padded(self, tokens: jax.Array) -> jax.Array:
        # To max_rows: the next forward reads its input tokens from here, whatever this batch's size.
        return jnp.zeros(self.layout.max_rows, jnp.int32).at[:tokens.shape[0]].set(tokens.astype(jnp.int32))

    def _sample_fn(self, logits, *rows):
        *arrays, penalties, guidance, logprobs = rows
        out = sample(logits, *arrays, penalties, guidance, logprobs)
        out["tokens"] = self._padded(out["tokens"])
        return out

    def _put(self, x, mesh=None):
        # On one device, jit's own transfer of host arrays is the cheapest path (it runs every step).
        mesh = self.mesh if mesh is None else mesh
        return np.asarray(x) if mesh.size == 1 else put(x, mesh)

    def _propose_fn(self, k: int, params, pools, tokens, last_token, override, accepted, base, block_tables,
                    state_slots):
        """A draft model's drafting after a verify step (or a prompt's last chunk), all on the device.

        Catch-up: the row's tokens the target just kept (`tokens` [B, T], the kept drafts and the next token, columns
        0..accepted; with `override`, column `accepted` replaced by `last_token`, the token a prompt's sampler drew)
        at positions base + 1 + column, writing the draft model's keys; its greedy token after the last is draft 1.
        Then k - 1 one-token steps, each drafting from the last. Returns (drafts [B, k] int32, pools).
        """
        model = self._model(0, params)
        B, T = tokens.shape
        pad = block_tables.shape[1] * self.layout.page_size  # beyond the table: the trash page
        col = jnp.arange(T, dtype=jnp.int32)[None, :]
        tokens = jnp.where(override[:, None] & (col == accepted[:, None]), last_token[:B, None], tokens)
        first = base + 1
        positions = jnp.where(col <= accepted[:, None], first[:, None] + col, pad).astype(jnp.int32)
        kv = (first + accepted + 1).astype(jnp.int32)
        rows = jnp.arange(B)
        with exact_float32(self.dtype):
            caches = layer_caches(pools, self.stateful, self.rings, block_tables, kv, positions, state_slots,
                                  compressed=self.compressed, page_size=self.layout.page_size,
                                  state_copies=self.layout.state_copies)
            hidden, caches = model(tokens, positions, caches, seq_len=jnp.max(kv))
            pools = [() if c is None else c.pools for c in caches]
            draft = jnp.argmax(model.logits(hidden[rows, accepted]), axis=-1).astype(jnp.int32)
            drafts, pos = [draft], kv
            for _ in range(k - 1):
                caches = layer_caches(pools, self.stateful, self.rings, block_tables, pos + 1, pos[:, None],
                                      state_slots, compressed=self.compressed, page_size=self.layout.page_size,
                                      state_copies=self.layout.state_copies)
                hidden, caches = model(draft[:, None], pos[:, None], caches, seq_len=jnp.max(pos + 1))
                pools = [() if c is None else c.pools for c in caches]
                draft = jnp.argmax(model.logits(hidden[:, 0]), axis=-1).astype(jnp.int32)
                drafts.append(draft)
                pos = pos + 1
        return jnp.stack(drafts, axis=1), pools

    def _mtp_fn(self, k: int, params, pools, carry, hidden, prefix, tokens, last_token, override, accepted, base,
                block_tables, slots, fresh):
        """The model's multi-token-prediction layers over a verify step's or a prefill chunk's positions, then
        drafting, all on the device (`layers/mtp.py`). Returns (drafts [B, k] int32, pools, carry).

        The layers are chained over a window of columns, as transformers' `MtpModel` runs them: column c is the
        main-model position a chain starts from. Layer 0 at c takes the target's final hidden state there and token
        t(c + 1); layer i takes layer i - 1's (chained) output at the same column and token t(c + 1 + i), and its
        keys sit at column c of its own pages. The window is the call's columns `base` .. `base + accepted`
        (`hidden` [B, T, mtp_hidden_size], `tokens` t(base + 1) ...; with `override`, column `accepted`'s token
        replaced by `last_token`, the one a prompt's sampler drew) and, with n > 1 layers, the n - 1 columns before
        them (`carry`: their hidden states, kept per sequence slot `slots`; `prefix`: the tokens after them), so that
        the entries a layer wrote last time from drafted tokens are rewritten from the kept ones. Where a layer's
        token lies past the last kept one, it is a draft: layer i's output at the last column drafts token i + 1.
        Drafts k > n chain through layer j mod n, each layer at the columns after its window's.
        """
        from day0jax.engine.paged_cache import PagedKVCache

        model = self._model(0, params)
        B, T = tokens.shape
        n = min(len(pools), k)  # the layers the drafts go through
        E = n - 1  # window columns before `base`
        pad = block_tables.shape[1] * self.layout.page_size
        rows = jnp.arange(B)
        col = jnp.arange(T, dtype=jnp.int32)[None, :]
        tokens = jnp.where(override[:, None] & (col == accepted[:, None]), last_token[:B, None], tokens)
        kept = col <= accepted[:, None]
        states, stream = hidden, tokens
        if E:  # a fresh sequence's carry is another's, and nothing lies before column 0
            carried, carried_ok = carry
            kept = jnp.concatenate([carried_ok[slots] & ~fresh[:, None], kept], axis=1)
            states = jnp.concatenate([carried[slots].astype(hidden.dtype), hidden], axis=1)
            stream = jnp.concatenate([prefix, tokens], axis=1)
        columns = base[:, None] - E + jnp.arange(E + T, dtype=jnp.int32)[None, :]
        kept = kept & (columns >= 0)
        positions = jnp.where(kept, columns, pad).astype(jnp.int32)
        stream = jnp.concatenate([stream, jnp.zeros((B, n), jnp.int32)], axis=1)  # room for the drafts
        last = E + accepted  # the window index of the last kept column
        kv = (base + accepted + 1).astype(jnp.int32)
        caches = [PagedKVCache.from_pools(p, block_tables, kv) for p in pools]
        drafts, chain = [], states
        with exact_float32(self.dtype):
            for i in range(n):
                h, caches[i] = model.mtp_step(i, stream[:, i:i + E + T], chain, positions, caches[i],
                                              seq_len=jnp.max(kv))
                out = h[rows, last]
                draft = jnp.argmax(model.mtp_logits(i, out), axis=-1).astype(jnp.int32)
                drafts.append(draft)
                stream = jnp.where(jnp.arange(stream.shape[1])[None, :] == (last + i + 1)[:, None], draft[:, None],
                                   stream)
                chain = model.mtp_chained(i, h)
            chain = chain[rows, last]
            for j in range(n, k):
                i, at = j % n, base + accepted + j // n
                cache = PagedKVCache.from_pools(caches[i].pools, block_tables, at + 1)
                h, caches[i] = model.mtp_step(i, draft[:, None], chain[:, None], at[:, None], cache,
                                              seq_len=jnp.max(at + 1))
                draft = jnp.argmax(model.mtp_logits(i, h[:, 0]), axis=-1).astype(jnp.int32)
                chain = model.mtp_chained(i, h[:, 0])
                drafts.append(draft)
        if E:  # the next call's window starts after this one's last kept column
            take = accepted[:, None] + 1 + jnp.arange(E)[None, :]
            carry = (carried.at[slots].set(jnp.take_along_axis(states, take[..., None], axis=1).astype(carried.dtype)),
                     carried_ok.at[slots].set(jnp.take_along_axis(kept, take, axis=1)))
        return jnp.stack(drafts, axis=1), [c.pools for c in caches], carry

    def attach_mtp(self) -> None:
        """Makes the model's multi-token-prediction layers speculative decoding's proposer: their KV pools (in this
        layout, under the same block tables), and the forward programs keep the final hidden states.

        Raises:
            GenerationError: a model built without them (`day0jax.load` builds them for speculative method
                "mtp"), or split into pipeline stages.
        """
        from day0jax.core.errors import GenerationError

        if not self._mtp_layout:
            raise GenerationError("this model was built without its multi-token-prediction layers (day0jax.load "
                                  "builds them when EngineConfig.speculative is 'mtp')")
        if self.micro is not None:
            raise GenerationError("speculative method 'mtp' with pipeline stages (pp > 1) is not implemented")
        L = self.layout
        if self.mtp_pools is None:
            self.mtp_pools = new_pools(self._mtp_layout, L.num_pages, L.page_size, L.state_slots, self.dtype,
                                       self.mesh, kv_cache_dtype=L.kv_cache_dtype)
            E = min(len(self._mtp_layout), L.spec_tokens) - 1
            # Per sequence slot, the hidden states of the last E kept columns and whether they are this
            # sequence's (`_mtp_fn`): tiny next to the pages.
            self.mtp_carry = (self._put(np.zeros((L.state_slots, E, self._mtp_hidden_size), self.dtype)),
                              self._put(np.zeros((L.state_slots, E), bool))) if E > 0 else ()
        self.keep_hidden = True
        self._propose_jit = jax.jit(jax.named_scope("propose")(functools.partial(self._mtp_fn, L.spec_tokens)),
                                    donate_argnames=("pools", "carry"))

    def attach_draft(self, module: nnx.Module) -> None:
        """Makes `module` (a smaller model with the same vocabulary, on this runner's mesh) the draft model of
        speculative decoding: its own KV pools, in this layout (the same pages and block tables as the target's).

        Raises:
            GenerationError: a draft model it cannot run (another vocabulary, state layers, a split mesh).
        """
        from day0jax.core.errors import GenerationError

        if int(module.config.vocab_size) != self.vocab_size:
            raise GenerationError(f"the draft model's vocabulary ({module.config.vocab_size} tokens) is not the "
                                  f"target's ({self.vocab_size}); a draft model must share the tokenizer")
        if self.micro is not None:
            raise GenerationError("a draft model with pipeline stages (pp > 1) is not implemented")
        draft = ModelRunner(module, self.mesh, self.dtype, self.layout)
        if draft.has_state:
            raise GenerationError("a draft model with linear-attention layers is not implemented (its state would "
                                  "have to follow every rejected draft back)")
        if draft.vision is not None:
            raise GenerationError("a vision-language draft model is not implemented")
        draft.allocate_pools()
        self.draft = draft
        self._propose_jit = jax.jit(jax.named_scope("propose")(functools.partial(draft._propose_fn,
                                                                                 self.layout.spec_tokens)),
                                    donate_argnames=("pools",))

    def draft_prefill(self, batch: Batch) -> None:
        """The draft model's forward over a prefill chunk of the target's (the same batch), writing its keys."""
        key = batch.tokens.shape + (batch.block_tables.shape[1],)
        program = self.programs.get(Program("draft", key))
        if program is None and self.ensure is not None:
            self.ensure(Program("draft", key))
            program = self.programs.get(Program("draft", key))
        self.draft.run_stage(0, program, batch, None, None)

    @property
    def mtp_carried(self) -> int:
        """The columns before its own that each MTP call recomputes: n - 1 for n chained layers (`_mtp_fn`)."""
        return self.mtp_carry[1].shape[1] if self.mtp_carry else 0

    def _program(self, key: tuple):
        """The compiled propose program for `key` (rows, tokens, table width), compiling it on demand."""
        wanted = Program("propose", key)
        if wanted not in self.programs and self.ensure is not None:
            self.ensure(wanted)
        return self.programs.get(wanted, self._propose_jit)

    def _device(self, arrays) -> list:
        return [self._put(x) if isinstance(x, np.ndarray) else x for x in arrays]

    def propose(self, tokens, last_token, override: np.ndarray, accepted, base: np.ndarray, block_tables: np.ndarray,
                state_slots: np.ndarray) -> jax.Array:
        """The draft model's drafts [B, k] (`_propose_fn`) after a verify step or a prompt's last chunk, without
        waiting for them. `tokens`, `last_token` and `accepted` may be device arrays (the acceptance's or the
        sampler's outputs)."""
        run = self._program(tokens.shape + (block_tables.shape[1],))
        args = self._device((tokens, last_token, override, accepted, base, block_tables, state_slots))
        draft = self.draft
        with jax.set_mesh(self.mesh):
            drafts, draft.stage_pools[0] = self.links.settle(run(draft.stage_params[0], draft.stage_pools[0], *args))
        return drafts

    def mtp_propose(self, prefix: np.ndarray, tokens, last_token, override: np.ndarray, accepted, base: np.ndarray,
                    block_tables: np.ndarray, slots: np.ndarray, fresh: np.ndarray) -> jax.Array:
        """The MTP layers over the last forward's positions (`hidden`) and their drafts [B, k] (`_mtp_fn`), without
        waiting for them; arguments as `propose`'s, plus the tokens after the carried columns (`prefix` [B, n - 1]),
        each row's carry slot (`slots`) and whether its carry is another sequence's (`fresh`)."""
        run = self._program(tokens.shape + (block_tables.shape[1],))
        args = self._device((prefix, tokens, last_token, override, accepted, base, block_tables, slots, fresh))
        with jax.set_mesh(self.mesh):
            drafts, self.mtp_pools, self.mtp_carry = self.links.settle(
                run(self.stage_params[0], self.mtp_pools, self.mtp_carry, self.hidden, *args))
        return drafts

    # --- running -------------------------------------------------------------------------------------------------

    def forward(self, batch: Batch, previous: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Runs one forward call, writing its keys/values into the pools; `previous` is a `sample` output's "tokens"
        that `batch.token_source` points into (None: no row does). Returns, on device, the logits [B, V] and each
        row's greedy token (padded to max_rows, as `sample`'s "tokens")."""
        key = batch.tokens.shape + (batch.block_tables.shape[1],)
        wanted = self.catalog.forward(key)
        if not all(p in self.programs for p in wanted) and self.ensure is not None:
            cover = self.covering(key)
            if cover is None:
                for p in wanted:
                    self.ensure(p)
            else:
                batch, key = self.inputs.padded(batch, cover), cover
                wanted = self.catalog.forward(key)
        programs = {s: self.programs.get(p) for s, p in zip(self.local, wanted)}
        if None in programs.values() and key not in self.compiled:
            log.info("compiling the forward program for batch %d x %d tokens, %d pages%s", *key,
                     f" ({self.stages.count} stages)" if self.micro else "")
            self.compiled.add(key)
        M = self.micro.count(key[0]) if self.micro else 1
        rows = key[0] // M
        parts = [batch] if M == 1 else [batch.rows(j * rows, (j + 1) * rows) for j in range(M)]
        routed = self.micro.sources(previous, parts, rows) if self.micro else [(previous, batch)]
        logits, greedy = [], []
        for before, part in routed:
            out = self._through_stages(part, before, programs)
            if self.keep_hidden:
                self.hidden = out[2]
            logits.append(self.links.to_sampler(None if out is None else out[0], (rows, self.vocab_size),
                                                jnp.float32, PartitionSpec()))
            greedy.append(self.links.to_sampler(None if out is None else out[1], (self.layout.max_rows,),
                                                jnp.int32, PartitionSpec()))
        if M == 1:
            all_logits, tokens = logits[0], greedy[0]
        else:
            with jax.set_mesh(self._sample_mesh):
                all_logits = jnp.concatenate(logits)
                tokens = self._padded(jnp.concatenate([g[:rows] for g in greedy]))
        if self.micro:
            self.micro.remember(tokens, rows, greedy)
        self._split = (all_logits, rows, logits) if M > 1 else None
        return all_logits, tokens

    def verify(self, batch: Batch, previous: jax.Array | None = None) -> jax.Array:
        """Runs one verify call (decode rows, each its input token then its drafts; `previous` as in `forward`),
        writing their keys and values; returns, on device, the logits of every position [B, T, V]. Rows of a model
        with state layers leave the state after each of their tokens in `batch.state_targets` (see
        `state_cache.StateCache`)."""
        key = batch.tokens.shape + (batch.block_tables.shape[1],)
        wanted = self.catalog.verify(key)
        if self.ensure is not None:
            for p in wanted:
                if p not in self.programs:
                    self.ensure(p)
        programs = {s: self.programs.get(p) for s, p in zip(self.local, wanted)}
        if None in programs.values() and ("verify",) + key not in self.compiled:
            log.info("compiling the verify program for batch %d x %d tokens, %d pages", *key)
            self.compiled.add(("verify",) + key)
        M = self.micro.count(key[0]) if self.micro else 1
        rows = key[0] // M
        parts = [batch] if M == 1 else [batch.rows(j * rows, (j + 1) * rows) for j in range(M)]
        routed = self.micro.sources(previous, parts, rows) if self.micro else [(previous, batch)]
        logits = []
        for before, part in routed:
            out = self._through_stages(part, before, programs, verify=True)
            if self.keep_hidden:
                self.hidden = out[1]
            logits.append(self.links.to_sampler(None if out is None else out[0], (rows, key[1], self.vocab_size),
                                                jnp.float32, PartitionSpec()))
        if M == 1:
            return logits[0]
        with jax.set_mesh(self._sample_mesh):
            return jnp.concatenate(logits)

    def accept(self, logits: jax.Array, meta: SamplingMetadata, drafts: np.ndarray, num_drafts: np.ndarray,
               force: np.ndarray | None = None) -> dict[str, jax.Array]:
        """The target's verdict on each row's drafts (`sampling.accept_drafts`) without waiting for it: device
        arrays "tokens" [B, T], "accepted" [B] and the logprob outputs (zeros unless `meta.logprobs`). `force`: the
        test hook that keeps every draft of those rows (runs through jit)."""
        B, T = logits.shape[:2]
        m = self._sample_mesh
        pen, guide = (None if x is None else tuple(self._put(a, m) for a in x) for x in (meta.penalties, meta.guidance))
        args = [self._put(drafts, m), self._put(num_drafts, m)] + [self._put(meta.rows[k], m) for k in ROW_ARRAYS]
        wanted = Program("accept", (B, T), meta.penalties is not None, meta.guidance is not None)
        if wanted not in self.programs and self.ensure is not None:
            self.ensure(wanted)
        with jax.set_mesh(m):
            if force is not None:
                return self.links.settle(self._accept(logits, *args, pen, guide, self._put(np.bool_(meta.logprobs), m),
                                                      self._put(force, m)))
            return self.links.settle(self.programs.get(wanted, self._accept)(
                logits, *args, pen, guide, self._put(np.bool_(meta.logprobs), m)))

    def _through_stages(self, part: Batch, previous, programs: dict, verify: bool = False):
        """Dispatches one micro-batch through every stage (this process's programs, and every move between
        stages); returns the last stage's (logits, greedy tokens), or None where that stage is not local."""
        x = None
        for s in range(self.stages.count):
            if s > 0:
                x = self.send_hidden(x, s, part.tokens.shape)
            if not self.links.local[s]:
                x = None
                continue
            x = self.run_stage(s, programs.get(s), part, previous, x, verify=verify)
            x = x[0] if s < self.stages.last else x
        return x

    def run_stage(self, s: int, program, part: Batch, previous, x, verify: bool = False):
        """Stage `s`'s forward program (`program`, else its jit; `verify`: the verify program) on one micro-batch;
        returns its outputs before the pools (the residual stream, or the logits and greedy tokens on the last
        stage)."""
        # Only the first stage reads input tokens from a sampler output; the others take the residual stream.
        previous = (self._no_previous if previous is None else previous) if s == 0 else None
        inputs = [None if a is None else self._put(a, self.meshes[s]) for a in part.arrays()]
        jitted = (self._verify_jits if verify else self._stage_jits)[s]
        # The mesh is the context while tracing, for `sharding.rules.constrain` inside the model.
        with jax.set_mesh(self.meshes[s]):
            *out, self.stage_pools[s] = self.links.settle(
                (program or jitted)(self.stage_params[s], self.stage_pools[s], x, previous, *inputs))
        return out

    def send_hidden(self, x, s: int, rows_tokens: tuple[int, int]):
        """The residual stream [B, T, D] of stage s - 1 onto stage `s`'s mesh."""
        hidden = tuple(rows_tokens) + (self.hidden_size,)
        return self.links.send(x, s - 1, s, hidden, jnp.dtype(self.dtype), self._hidden_sharding(s, hidden).spec)

    def _hidden_sharding(self, s: int, shape) -> NamedSharding:
        return named_sharding(ACTIVATION, shape, self.meshes[s])

    def full_logits(self, tokens: np.ndarray, seq_len: int, image: dict | None = None,
                    adapter: str | None = None) -> jax.Array:
        """`Model.logits`' forward pass without a cache: token ids [B, T] -> float32 logits [B, T, V] (replicated on
        the sample mesh); `image`: a vision-language model's image arrays, on the mesh; `adapter`: the served LoRA
        adapter every row takes (None: the base model)."""
        B, T = tokens.shape
        slot = self.inputs.adapter_slot(adapter)
        rows = [put(np.full(B, slot, np.int32), m) if self.layout.adapters and local else None
                for m, local in zip(self.meshes, self.links.local)]
        x = put(tokens, self.meshes[0], ("batch", None)) if self.links.local[0] else None
        for s in range(self.stages.count):
            if s > 0:
                x = self.send_hidden(x, s, (B, T))
            if self.links.local[s]:
                with jax.set_mesh(self.meshes[s]):
                    x = self.links.settle(self._whole_jits[s](self.stage_params[s], x,
                                                              put(np.int32(seq_len), self.meshes[s]),
                                                              image if s == 0 else None, rows[s]))
        return self.links.to_sampler(x if self.links.local[-1] else None, (B, T, self.vocab_size), jnp.float32,
                                     PartitionSpec())

    def encode_images(self, images) -> tuple[np.ndarray, np.ndarray | None]:
        """A request's `ImageInputs` -> (features [n, D], DeepStack features [k, n, D] or None), float32 on the
        host: one tower call per image, on the program of its shape bucket (installed by warm-up), except for images
        whose features `feature_cache` holds (the same pixels encoded before).

        Raises:
            MeshError: a model split into pipeline stages (they run no vision tower).
        """
        if self.stages.count > 1:
            raise MeshError("pipeline stages do not run vision towers")

        def run(key, arrays):
            program = self.programs.get(Program("encode", key))
            if program is None and ("encode", key) not in self.compiled:
                log.info("compiling the vision tower for %s", Program("encode", key).label)
                self.compiled.add(("encode", key))
            with jax.set_mesh(self.mesh):
                return (program or self._encode)(self.stage_params[0], *[self._put(a) for a in arrays])
        return encode_host(self.vision, images.pixels, images.grids, run, self.feature_cache)

    def sample(self, logits: jax.Array, meta: SamplingMetadata) -> dict[str, jax.Array]:
        """Samples one token per row of `logits` without waiting for it (`meta`: the rows' settings, from
        `inputs.sampling`). Returns device arrays ("tokens" padded to max_rows, and the logprob outputs, zeros
        unless `meta.logprobs`); `read` brings them to the host. The logits of a micro-batched forward take one
        sampler call per micro-batch (a row's draws depend only on its seed and position, so the tokens are the
        same), whose tokens go back to the first stage on their own: the next step's micro-batch waits for its own
        rows only."""
        split = self._split
        if split is None or split[0] is not logits or split[1] not in self.layout.sampler_batches():
            return self.links.settle(self._sample_rows(logits, meta.rows, meta.penalties, meta.logprobs,
                                                       meta.guidance))
        _, r, parts = split
        outs = []
        for j, part in enumerate(parts):
            sl = slice(j * r, (j + 1) * r)
            cut = lambda arrays: None if arrays is None else tuple(a[sl] for a in arrays)  # noqa: E731
            outs.append(self.links.settle(self._sample_rows(part, {k: v[sl] for k, v in meta.rows.items()},
                                                            cut(meta.penalties), meta.logprobs, cut(meta.guidance))))
        with jax.set_mesh(self._sample_mesh):
            out = {k: jnp.concatenate([o[k][:r] for o in outs]) for k in outs[0]}
            out["tokens"] = self._padded(out["tokens"])
        self.micro.remember(out["tokens"], r, [o["tokens"] for o in outs])
        return out

    def _sample_rows(self, logits, rows: dict[str, np.ndarray], penalties: tuple | None, logprobs: bool,
                     guidance: tuple | None) -> dict[str, jax.Array]:
        m = self._sample_mesh
        pen, guide = (None if x is None else tuple(self._put(a, m) for a in x) for x in (penalties, guidance))
        args = [self._put(rows[k], m) for k in ROW_ARRAYS] + [pen, guide, self._put(np.bool_(logprobs), m)]
        wanted = Program("sample", (logits.shape[0],), penalties is not None, guidance is not None)
        if wanted not in self.programs and self.ensure is not None:
            self.ensure(wanted)
        with jax.set_mesh(m):
            return self.programs.get(wanted, self._sample)(logits, *args)

    @staticmethod
    def read(out: dict[str, jax.Array]) -> dict[str, np.ndarray]:
        """A `sample` output on the host (waits for it)."""
        return {k: np.asarray(v) for k, v in out.items()}

    def smoke_run(self) -> float:
        """Runs the smallest decode step and the greedy sampler once on padding (a program that loads but cannot
        run fails here, at start, not on the first request); returns the seconds it took."""
        t0 = time.perf_counter()
        rows = self.layout.batch_buckets[0]
        logits, _ = self.forward(self.inputs.empty(rows, 1, self.layout.decode_widths[0]))
        neutral = SamplingMetadata(self.inputs.neutral_rows(rows), None, None, sampled=True, logprobs=False)
        self.read(self.sample(logits, neutral))
        if self.micro:
            self.micro.forget()
        return time.perf_counter() - t0

    # --- compiling -----------------------------------------------------------------------------------------------

    def installed(self, program: Program) -> bool:
        return program in self.programs

    def covering(self, key: tuple[int, int, int]) -> tuple[int, int, int] | None:
        """The smallest forward shape with at least `key`'s rows, tokens and pages installed for every local stage,
        or None."""
        counts: dict[tuple, int] = {}
        # list(): one call under the GIL, while the background thread may be installing programs
        for p in list(self.programs):
            if p.name == "forward" and all(a >= b for a, b in zip(p.shape, key)):
                counts[p.shape] = counts.get(p.shape, 0) + 1
        full = [shape for shape, n in counts.items() if n == len(self.local)]
        return min(full, key=lambda s: (s[0] * s[1] * s[2], s), default=None)

    def lower(self, program: Program) -> jax.stages.Lowered:
        """Traces and lowers `program` on padding inputs of its shape (nothing runs)."""
        if program.name == "sample":
            return self._lower_sample(program)
        if program.name == "accept":
            return self._lower_accept(program)
        if program.name == "draft":
            return self.draft.lower(Program("forward", program.shape))
        if program.name == "propose":
            return self._lower_propose(program)
        if program.name == "encode":
            with jax.set_mesh(self.mesh):
                example = self.vision.encoder.example(program.shape)
                return self._encode.lower(self.stage_params[0], *[self._put(a) for a in example])
        s, (B, T, W) = program.stage or 0, program.shape
        rows = B // (self.micro.count(B) if self.micro else 1)
        x = None
        if s > 0:
            hidden = (rows, T, self.hidden_size)
            x = jax.ShapeDtypeStruct(hidden, jnp.dtype(self.dtype), sharding=self._hidden_sharding(s, hidden))
        # The pools as shapes: while serving, the step running meanwhile may have donated these arrays.
        pools = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                             self.stage_pools[s])
        verify = program.name == "verify"
        empty = self.inputs.empty(rows, T, W, verify=verify)
        inputs = [None if a is None else self._put(a, self.meshes[s]) for a in empty.arrays()]
        previous = self._no_previous if s == 0 else None
        with jax.set_mesh(self.meshes[s]):
            return (self._verify_jits if verify else self._stage_jits)[s].lower(self.stage_params[s], pools, x,
                                                                                previous, *inputs)

    def _lower_sample(self, program: Program) -> jax.stages.Lowered:
        m = self._sample_mesh
        with jax.set_mesh(m):
            rows, V = program.shape[0], self.vocab_size
            logits = jax.ShapeDtypeStruct((rows, V), jnp.float32, sharding=self._replicated)
            neutral = self.inputs.neutral_rows(rows)
            args = [self._put(neutral[k], m) for k in ROW_ARRAYS]
            pen = tuple(self._put(x, m) for x in (np.zeros((rows, V), np.float32), np.zeros((rows, V), bool),
                                                  np.zeros(rows, np.float32), np.zeros(rows, np.float32),
                                                  np.ones(rows, np.float32))) if program.penalized else None
            guide = tuple(self._put(x, m) for x in self.inputs.neutral_guidance(rows)) if program.guided else None
            return self._sample.lower(logits, *args, pen, guide, self._put(np.bool_(False), m))

    def _lower_propose(self, program: Program) -> jax.stages.Lowered:
        B, T, W = program.shape
        shapes = lambda tree: jax.tree.map(  # noqa: E731
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)
        zeros = np.zeros(B, np.int32)
        args = [np.zeros((B, T), np.int32), np.zeros(self.layout.max_rows, np.int32), np.zeros(B, bool), zeros, zeros,
                np.full((B, W), 0, np.int32), zeros]
        with jax.set_mesh(self.mesh):
            if self.draft is None:  # the MTP layers, on the target's hidden states
                shape = (B, T, self._mtp_hidden_size)
                hidden = jax.ShapeDtypeStruct(shape, jnp.dtype(self.dtype), sharding=self._hidden_sharding(0, shape))
                prefix = np.zeros((B, self.mtp_carried), np.int32)
                return self._propose_jit.lower(self.stage_params[0], shapes(self.mtp_pools), shapes(self.mtp_carry),
                                               hidden, *[self._put(a) for a in [prefix, *args, np.zeros(B, bool)]])
            return self._propose_jit.lower(self.draft.stage_params[0], shapes(self.draft.stage_pools[0]),
                                           *[self._put(a) for a in args])

    def _lower_accept(self, program: Program) -> jax.stages.Lowered:
        m = self._sample_mesh
        with jax.set_mesh(m):
            (rows, T), V = program.shape, self.vocab_size
            logits = jax.ShapeDtypeStruct((rows, T, V), jnp.float32, sharding=self._replicated)
            neutral = self.inputs.neutral_rows(rows)
            args = [self._put(np.zeros((rows, T - 1), np.int32), m), self._put(np.zeros(rows, np.int32), m)]
            args += [self._put(neutral[k], m) for k in ROW_ARRAYS]
            pen = tuple(self._put(x, m) for x in (np.zeros((rows, V), np.float32), np.zeros((rows, V), bool),
                                                  np.zeros(rows, np.float32), np.zeros(rows, np.float32),
                                                  np.ones(rows, np.float32))) if program.penalized else None
            guide = None
            if program.guided:
                allowed, ids, bias = self.inputs.neutral_guidance(rows)
                guide = tuple(self._put(x, m) for x in (np.repeat(allowed[:, None], T, axis=1), ids, bias))
            return self._accept.lower(logits, *args, pen, guide, self._put(np.bool_(False), m))

    def compile(self, lowered: jax.stages.Lowered) -> jax.stages.Compiled:
        """Compiles (or loads from JAX's persistent cache) a lowered program; safe to call from several threads."""
        if self.micro:
            return lowered.compile()
        with jax.set_mesh(self.mesh):
            return lowered.compile()

    def install(self, program: Program, compiled: jax.stages.Compiled) -> None:
        """From now on `forward`/`sample` run `compiled` for `program`'s bucket."""
        self.programs[program] = compiled

    def signature(self, program: Program) -> str:
        """What the program store keys `program` on, beyond the code and the environment: the program, then
        the shapes, dtypes and shardings of every argument, and the kernel choices (read when tracing)."""
        if self._context is None:
            leaves = self._leaves + jax.tree.leaves(self.pools)
            self._context = "\n".join([
                str(self._params_def), str(jax.tree.structure(self.pools)),
                *(f"{x.shape} {x.dtype} {x.sharding}" for x in leaves),
                f"layout={self.layout} vocab={self.vocab_size}",
                f"mesh={self.mesh}", f"kernels={kernel_registry.get_policy()}"])
        return f"{program.name} {program.label}\n{program}\n{self._context}"
