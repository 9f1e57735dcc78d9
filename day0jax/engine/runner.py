"""The device side of the engine: the parameters, the paged KV pools and the two jitted programs (forward, sample).

One forward program serves decode steps (tokens [B, 1]) and prefill chunks ([1, C]) and also returns each row's greedy
token, so a greedy batch needs no second program; sampling is a separate small program, so the model programs do not
multiply by sampling modes. Buckets that warm-up did not `install` go through `jax.jit`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from day0jax.engine.config import EngineLayout
from day0jax.engine.paged_cache import TRASH_PAGE, layer_caches, new_pools
from day0jax.engine.sampling import MAX_LOGIT_BIAS, sample
from day0jax.engine.state_cache import TRASH_SLOT
from day0jax.layers.linear import exact_float32
from kernels_pallas import registry as kernel_registry
from day0jax.core.cache_layout import KVLayer, StateLayer
from sharding.rules import put

log = logging.getLogger(__name__)

ROW_ARRAYS = ("seeds", "counters", "temperature", "top_k", "top_p", "min_p")


@dataclass(frozen=True)
class Program:
    """One compiled program of the runner, for one bucket."""

    # "forward" (shape: rows, tokens, width in pages), "sample" (shape: rows) or "encode" (a vision tower's call on
    # one image: shape () for towers of one image size, (patches,) padded for those of any size)
    name: str
    shape: tuple[int, ...]
    # Samplers only (mode and logprobs are run-time choices): taking the [B, V] penalty arrays, taking the grammar
    # masks and logit biases.
    penalized: bool = False
    guided: bool = False
    # Forward programs of a pipelined model (engine/pipeline.py): the pipeline stage this program runs, on the
    # micro-batches of a batch of `shape`.
    stage: int | None = None

    @property
    def label(self) -> str:
        if self.name == "forward":
            return "x".join(map(str, self.shape)) + ("" if self.stage is None else f" stage {self.stage}")
        if self.name == "encode":
            return "image" + "".join(f" {n} patches" for n in self.shape)
        extras = "".join(f"+{x}" for x, on in (("penalties", self.penalized), ("guidance", self.guided)) if on)
        return f"{self.shape[0]}{extras}"


@dataclass
class Batch:
    """One forward call, host side: [B, T] token ids and positions, [B, W] block tables, [B] lengths and state
    slots."""

    tokens: np.ndarray
    positions: np.ndarray
    block_tables: np.ndarray
    kv_lengths: np.ndarray
    last_index: np.ndarray  # [B] which of the T positions to return logits for
    token_source: np.ndarray  # [B] row of `previous` holding the row's input token, -1: `tokens` holds it
    state_slots: np.ndarray  # [B] each row's slot in the linear-attention state pools (TRASH_SLOT: padding)
    # Vision-language models only: [B, T, D] image features, put in place of the embeddings where [B, T] is set;
    # [B, T, 3] multimodal RoPE positions and [k, B, T, D] DeepStack features where the model has them.
    image_features: np.ndarray | None = None
    image_mask: np.ndarray | None = None
    rope_positions: np.ndarray | None = None
    deepstack: np.ndarray | None = None

    def arrays(self) -> tuple[np.ndarray, ...]:
        image = tuple(x for x in (self.image_features, self.image_mask, self.rope_positions, self.deepstack)
                      if x is not None)
        return (self.tokens, self.positions, self.block_tables, self.kv_lengths, self.last_index, self.token_source,
                self.state_slots) + image


def layer_rings(cache_layout: list, layout: EngineLayout) -> list[int]:
    """Per layer, the pages per sequence of its ring (a sliding-window layer that keeps only its window), else 0."""
    return [layout.ring_pages(x.window) if isinstance(x, KVLayer) else 0 for x in cache_layout]


class ModelRunner:
    """Holds the parameters, the KV page pools and the compiled programs.

    Args:
        module, mesh, dtype: the nnx model (any family with the cache protocol and `cache_layout()`), the mesh its
            parameters live on, the KV cache dtype.
        layout: the engine's pool size and shape buckets.
    """

    def __init__(self, module: nnx.Module, mesh: Mesh, dtype, layout: EngineLayout):
        self._graphdef, params = nnx.split(module)
        # Flat leaves: unflattening nnx Variables on every call costs about a millisecond of host time a step.
        self.params, self._params_def = jax.tree.flatten(params)
        self.mesh, self.layout, self.dtype = mesh, layout, dtype
        self.vocab_size = int(module.config.vocab_size)
        self._sample_mesh = mesh  # where the sampler runs (a pipeline's last stage)
        self._replicated = NamedSharding(mesh, PartitionSpec())
        cache_layout = module.cache_layout()
        self.stateful = [isinstance(x, StateLayer) for x in cache_layout]
        self.rings = layer_rings(cache_layout, layout)
        self.pools = new_pools(cache_layout, layout.num_pages, layout.page_size, layout.state_slots, dtype, mesh,
                               layout.ring_pages)
        self._no_previous = self._put(np.zeros(layout.max_rows, np.int32))
        # A vision-language model's: its programs take image features, and it encodes images (one program per
        # image count).
        self.vision = getattr(module, "vision_spec", None)
        self._encode = jax.jit(self._encode_fn)
        self._forward = jax.jit(self._forward_fn, donate_argnames=("pools",))
        self._sample = jax.jit(self._sample_fn)
        self.compiled: set[tuple] = set()  # shapes traced by jit (not installed): logged once each
        self.programs: dict[Program, jax.stages.Compiled] = {}  # installed by warm-up
        # Set while programs are still compiling in the background (`startup.warmup.BackgroundCompiler.ensure`):
        # a step whose program is not installed then runs on an installed larger one, or makes its own ready
        # through this, instead of tracing it inline.
        self.ensure: Callable[[Program], None] | None = None
        self._context: str | None = None  # see `signature`

    def attach(self, module: nnx.Module) -> None:
        """Replaces the parameters by `module`'s: the restored weights of the abstract model this runner was built
        on, with the same shapes, dtypes and shardings (so every compiled program takes them).

        Raises:
            ValueError: a parameter differs in structure, shape, dtype or sharding.
        """
        params, treedef = jax.tree.flatten(nnx.split(module)[1])
        if treedef != self._params_def:
            raise ValueError("the restored model's parameters are not the ones the engine was built for")
        for old, new in zip(self.params, params):
            if (old.shape, old.dtype, old.sharding) != (new.shape, new.dtype, new.sharding):
                raise ValueError(f"a restored parameter is {new.shape} {new.dtype} {new.sharding}; the engine's "
                                 f"programs take {old.shape} {old.dtype} {old.sharding}")
        self.params = params

    @property
    def has_state(self) -> bool:
        """Whether some layer keeps per-sequence state (linear attention) besides the paged KV cache."""
        return any(self.stateful)

    @property
    def pool_bytes(self) -> int:
        """Bytes of the KV page pools."""
        return sum(x.nbytes for pools, state in zip(self.pools, self.stateful) if not state for x in pools)

    @property
    def state_bytes(self) -> int:
        """Bytes of the linear-attention state pools."""
        return sum(x.nbytes for pools, state in zip(self.pools, self.stateful) if state for x in pools)

    @property
    def param_bytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in self.params)  # also before `attach` (shapes only)

    def _encode_fn(self, params, *inputs):
        model = nnx.merge(self._graphdef, jax.tree.unflatten(self._params_def, params))
        with exact_float32(self.dtype):
            return model.encode_images(*inputs)

    def encode_images(self, images) -> tuple[np.ndarray, np.ndarray | None]:
        """A request's `ImageInputs` -> (features [n, D], DeepStack features [k, n, D] or None), float32 on the
        host: one tower call per image, on the program of its shape bucket (installed by warm-up)."""
        from day0jax.models.vision_language import encode_host

        def run(key, arrays):
            program = self.programs.get(Program("encode", key))
            if program is None and ("encode", key) not in self.compiled:
                log.info("compiling the vision tower for %s", Program("encode", key).label)
                self.compiled.add(("encode", key))
            with jax.set_mesh(self.mesh):
                return (program or self._encode)(self.params, *[self._put(a) for a in arrays])
        return encode_host(self.vision, images.pixels, images.grids, run)

    def _forward_fn(self, params, pools, previous, tokens, positions, block_tables, kv_lengths, last_index,
                    token_source, state_slots, *image):
        model = nnx.merge(self._graphdef, jax.tree.unflatten(self._params_def, params))
        tokens = jnp.where(token_source[:, None] >= 0, previous[token_source][:, None], tokens)
        # A layer sharing another's KV has no pools and gets no cache, or one of its indexer's pages only: the model
        # hands it its source's.
        caches = layer_caches(pools, self.stateful, self.rings, block_tables, kv_lengths, positions, state_slots)
        # seq_len: the real longest length (padding positions are huge), for RoPE variants that depend on it.
        with exact_float32(self.dtype):
            image_inputs = self._image_inputs(image)
            hidden, caches = model(tokens, positions, caches, seq_len=jnp.max(kv_lengths), **image_inputs)
            logits = model.logits(hidden[jnp.arange(tokens.shape[0]), last_index])
        # Replicated logits: the sampler's programs are compiled ahead of time for exactly this input sharding.
        logits = jax.lax.with_sharding_constraint(logits, self._replicated)
        pools = [() if c is None else c.pools for c in caches]
        with jax.named_scope("sampling"):
            greedy = self._padded(jnp.argmax(logits, axis=-1))
        return logits, greedy, pools

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

    def forward(self, batch: Batch, previous: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Runs one forward call, writing its keys/values into the pools; `previous` is a `sample` output's "tokens"
        that `batch.token_source` points into (None: no row does). Returns, on device, the logits [B, V] and each
        row's greedy token (padded to max_rows, as `sample`'s "tokens")."""
        key = batch.tokens.shape + (batch.block_tables.shape[1],)
        program = self.programs.get(Program("forward", key))
        if program is None and self.ensure is not None:
            cover = self.covering(key)
            if cover is None:
                self.ensure(Program("forward", key))
            else:
                batch, key = self.padded(batch, cover), cover
            program = self.programs[Program("forward", key)]
        if program is None and key not in self.compiled:
            log.info("compiling the forward program for batch %d x %d tokens, %d pages", *key)
            self.compiled.add(key)
        inputs = [self._put(x) for x in batch.arrays()]
        previous = self._no_previous if previous is None else previous
        # The mesh is the context while tracing, for `sharding.rules.constrain` inside the model.
        with jax.set_mesh(self.mesh):
            logits, greedy, self.pools = (program or self._forward)(self.params, self.pools, previous, *inputs)
        return logits, greedy

    def sample(self, logits: jax.Array, rows: dict[str, np.ndarray], penalties: tuple | None,
               logprobs: bool, guidance: tuple | None = None) -> dict[str, jax.Array]:
        """Samples one token per row of `logits` without waiting for it: `rows` holds the per-row arrays of
        `sampling.sample`, `penalties` and `guidance` its optional host arrays. Returns device arrays ("tokens"
        padded to max_rows, and the logprob outputs, zeros unless `logprobs`); `read` brings them to the host."""
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

    def empty_batch(self, rows: int, tokens: int, width: int) -> Batch:
        """A batch of padding only: every token goes to the trash page."""
        pad = width * self.layout.page_size  # beyond every block table: the trash page
        v = self.vision
        image = {} if v is None else dict(
            image_features=np.zeros((rows, tokens, v.dim), np.float32), image_mask=np.zeros((rows, tokens), bool),
            rope_positions=np.full((rows, tokens, 3), pad, np.int32) if v.mrope is not None else None,
            deepstack=np.zeros((v.deepstack, rows, tokens, v.dim), np.float32) if v.deepstack else None)
        return Batch(tokens=np.zeros((rows, tokens), np.int32), positions=np.full((rows, tokens), pad, np.int32),
                     block_tables=np.full((rows, width), TRASH_PAGE, np.int32),
                     kv_lengths=np.zeros(rows, np.int32), last_index=np.zeros(rows, np.int32),
                     token_source=np.full(rows, -1, np.int32), state_slots=np.full(rows, TRASH_SLOT, np.int32),
                     **image)

    def installed(self, program: Program) -> bool:
        return program in self.programs

    def forward_programs(self, shape: tuple[int, int, int]) -> list[Program]:
        """The programs a forward call of `shape` (rows, tokens, width in pages) runs: one here, one per stage in a
        pipeline."""
        return [Program("forward", shape)]

    def covering(self, key: tuple[int, int, int]) -> tuple[int, int, int] | None:
        """The smallest installed forward shape with at least `key`'s rows, tokens and pages, or None."""
        # list(): one call under the GIL, while the background thread may be installing programs
        shapes = [p.shape for p in list(self.programs)
                  if p.name == "forward" and all(a >= b for a, b in zip(p.shape, key))]
        return min(shapes, key=lambda s: (s[0] * s[1] * s[2], s), default=None)

    def padded(self, batch: Batch, shape: tuple[int, int, int]) -> Batch:
        """`batch` grown to `shape` with padding: rows and tokens that write to the trash page, and block-table
        columns holding it (a running row's positions never reach them)."""
        out = self.empty_batch(*shape)
        B, T = batch.tokens.shape
        out.tokens[:B, :T], out.positions[:B, :T] = batch.tokens, batch.positions
        out.block_tables[:B, :batch.block_tables.shape[1]] = batch.block_tables
        for name in ("kv_lengths", "last_index", "token_source", "state_slots"):
            getattr(out, name)[:B] = getattr(batch, name)
        if batch.image_features is not None:
            out.image_features[:B, :T], out.image_mask[:B, :T] = batch.image_features, batch.image_mask
        if batch.rope_positions is not None:
            out.rope_positions[:B, :T] = batch.rope_positions
        if batch.deepstack is not None:
            out.deepstack[:, :B, :T] = batch.deepstack
        return out

    def ready_programs(self) -> list[Program]:
        """What a server compiles before it is ready (`--warmup ready`): decode at the smallest span for one row and
        for the most rows (which covers every decode batch at that span, padded), each prefill chunk at the
        smallest span, and the plain sampler (no penalties, no grammar) for those row counts."""
        L = self.layout
        rows = sorted({L.batch_buckets[0], L.batch_buckets[-1]})
        shapes = [(r, 1, L.decode_widths[0]) for r in rows] + [(1, c, L.prefill_widths[0]) for c in L.chunk_buckets]
        forward = [p for shape in shapes for p in self.forward_programs(shape)]
        sampler_rows = sorted(set(rows) | {1})
        return forward + [Program("sample", (r,)) for r in sampler_rows] + self.encode_programs()

    def encode_programs(self) -> list[Program]:
        """A vision-language model's tower programs: one per image shape bucket (none for text models)."""
        return [] if self.vision is None else [Program("encode", k) for k in self.vision.encoder.keys()]

    def background_programs(self, ready: list[Program], max_len: int | None = None) -> list[Program]:
        """`all_programs(max_len)` not in `ready`, most likely needed first: plain samplers, then forward programs by
        span (the short spans every request starts with), the most rows first, then the samplers with penalties or
        guidance."""
        def rank(p: Program):
            if p.name == "encode":
                return (0, p.shape)
            if p.name == "sample":
                return (2 if p.penalized or p.guided else 0, p.shape[0], p.penalized, p.guided)
            rows, tokens, width = p.shape
            return (1, width, -rows, tokens)  # the most rows first: padded, they serve every smaller batch
        return sorted((p for p in self.all_programs(max_len) if p not in ready), key=rank)

    def all_programs(self, max_len: int | None = None) -> list[Program]:
        """The forward programs of `layout.forward_shapes(max_len)`, then the samplers (with and without penalties,
        with and without guidance) per row count."""
        return ([p for s in self.layout.forward_shapes(max_len) for p in self.forward_programs(s)] +
                [Program("sample", (r,), penalized, guided) for r in self.layout.sampler_batches()
                 for penalized in (False, True) for guided in (False, True)] + self.encode_programs())

    def lower(self, program: Program) -> jax.stages.Lowered:
        """Traces and lowers `program` on padding inputs of its shape (nothing runs)."""
        if program.name == "sample":
            return self._lower_sample(program)
        with jax.set_mesh(self.mesh):
            if program.name == "forward":
                inputs = [self._put(x) for x in self.empty_batch(*program.shape).arrays()]
                # The pools as shapes: while serving, the step running meanwhile may have donated these arrays.
                pools = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                     self.pools)
                return self._forward.lower(self.params, pools, self._no_previous, *inputs)
            example = self.vision.encoder.example(program.shape)  # "encode"
            return self._encode.lower(self.params, *[self._put(a) for a in example])

    def _lower_sample(self, program: Program) -> jax.stages.Lowered:
        m = self._sample_mesh
        with jax.set_mesh(m):
            rows, V = program.shape[0], self.vocab_size
            logits = jax.ShapeDtypeStruct((rows, V), jnp.float32, sharding=self._replicated)
            neutral = self.neutral_rows(rows)
            args = [self._put(neutral[k], m) for k in ROW_ARRAYS]
            pen = tuple(self._put(x, m) for x in (np.zeros((rows, V), np.float32), np.zeros((rows, V), bool),
                                                  np.zeros(rows, np.float32), np.zeros(rows, np.float32),
                                                  np.ones(rows, np.float32))) if program.penalized else None
            guide = tuple(self._put(x, m) for x in self.neutral_guidance(rows)) if program.guided else None
            return self._sample.lower(logits, *args, pen, guide, self._put(np.bool_(False), m))

    def compile(self, lowered: jax.stages.Lowered) -> jax.stages.Compiled:
        """Compiles (or loads from JAX's persistent cache) a lowered program; safe to call from several threads."""
        with jax.set_mesh(self.mesh):
            return lowered.compile()

    def install(self, program: Program, compiled: jax.stages.Compiled) -> None:
        """From now on `forward`/`sample` run `compiled` for `program`'s bucket."""
        self.programs[program] = compiled

    def signature(self, program: Program) -> str:
        """What the program store keys `program` on, beyond the code and the environment: the program, then
        the shapes, dtypes and shardings of every argument, and the kernel choices (read when tracing)."""
        if self._context is None:
            leaves = self.params + jax.tree.leaves(self.pools)
            self._context = "\n".join([
                str(self._params_def), str(jax.tree.structure(self.pools)),
                *(f"{x.shape} {x.dtype} {x.sharding}" for x in leaves),
                f"layout={self.layout} vocab={self.vocab_size}",
                f"mesh={self.mesh}", f"kernels={kernel_registry.get_policy()}"])
        return f"{program.name} {program.label}\n{program}\n{self._context}"

    def smoke_run(self) -> float:
        """Runs the smallest decode step and the greedy sampler once on padding (a program that loads but cannot
        run fails here, at start, not on the first request); returns the seconds it took."""
        t0 = time.perf_counter()
        rows = self.layout.batch_buckets[0]
        logits, _ = self.forward(self.empty_batch(rows, 1, self.layout.decode_widths[0]))
        self.read(self.sample(logits, self.neutral_rows(rows), None, False))
        return time.perf_counter() - t0

    def neutral_guidance(self, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`sampling.apply_guidance`'s arrays allowing every token and biasing none."""
        return (np.full((rows, -(-self.vocab_size // 32)), -1, np.int32), np.zeros((rows, MAX_LOGIT_BIAS), np.int32),
                np.zeros((rows, MAX_LOGIT_BIAS), np.float32))

    @staticmethod
    def neutral_rows(rows: int) -> dict[str, np.ndarray]:
        return dict(seeds=np.zeros(rows, np.uint32), counters=np.zeros(rows, np.int32),
                    temperature=np.zeros(rows, np.float32), top_k=np.zeros(rows, np.int32),
                    top_p=np.ones(rows, np.float32), min_p=np.zeros(rows, np.float32))
