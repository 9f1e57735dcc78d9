"""The runner of a model split into pipeline stages (a mesh with a `pp` axis; see sharding/pipeline.py).

Each stage is its own program on its own (dp, ep, tp) mesh, holding its layers' parameters and KV pools; the
residual stream of a micro-batch moves to the next stage's devices between programs. A decode batch is cut into
micro-batches (as many as there are stages, when its rows allow), dispatched stage after stage without waiting:
each device runs its queue in order, so while stage 1 works on micro-batch 0, stage 0 works on micro-batch 1.
Tokens go back to the first stage per micro-batch (greedy ones straight from the last stage, sampled ones from one
sampler call per micro-batch), so the next step's micro-batch 0 starts as soon as its own tokens exist, not when
the whole batch has left the last stage: in steady state no stage waits. Prefill
chunks of a prompt pipeline the same way across steps (a chunk needs only its predecessor's KV on each stage).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from day0jax.engine.config import EngineLayout
from day0jax.engine.paged_cache import layer_caches, new_pools
from day0jax.engine.runner import Batch, ModelRunner, Program, layer_rings
from day0jax.core.errors import MeshError
from day0jax.layers.linear import exact_float32
from sharding.pipeline import Links, Stages, layer_index
from day0jax.core.cache_layout import StateLayer

log = logging.getLogger(__name__)


def leaf_paths(params) -> list[str]:
    """Dotted paths (`model.layers.0.mlp.gate_proj.kernel`) of `jax.tree.flatten(params)`'s leaves, in order."""
    out = []
    for keys, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        parts = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in keys]
        out.append(".".join(str(p) for p in parts if p != "value"))
    return out


def pipeline_refusal(module: nnx.Module) -> str | None:
    """Why `module` cannot run in pipeline stages (None: it can)."""
    if not hasattr(module, "stage"):
        return (f"pipeline stages (pp > 1) are not implemented for {module.config.model_type}, a vision-language "
                "model; use tp, ep and dp")
    return module.pipeline_refusal()


def placed_stages(paths: list[str], leaves: list, meshes: list) -> Stages:
    """The stages the loader placed the parameters on, read from each layer's parameter shardings.

    Raises:
        MeshError: a layer's parameters on several stages, or stages that are not contiguous ranges of layers.
    """
    where = [frozenset(m.devices.flat) for m in meshes]
    stage_of: dict[int, int] = {}
    for path, leaf in zip(paths, leaves):
        layer = layer_index(path)
        if layer is None:
            continue
        s = where.index(frozenset(leaf.sharding.device_set))
        if stage_of.setdefault(layer, s) != s:
            raise MeshError(f"layer {layer}'s parameters lie on several pipeline stages")
    order = [stage_of[i] for i in range(len(stage_of))]
    if order != sorted(order) or set(order) != set(range(len(meshes))):
        raise MeshError(f"pipeline stages must hold contiguous, non-empty ranges of layers; got {order}")
    ranges = tuple(range(order.index(s), len(order) - order[::-1].index(s)) for s in range(len(meshes)))
    return Stages(ranges, tied=not any(p.startswith("lm_head.") for p in paths))


class PipelinedRunner(ModelRunner):
    """A `ModelRunner` whose model runs as one program per pipeline stage (see the module docstring).

    Args:
        module, mesh, dtype, layout: as `ModelRunner`'s; `mesh` has a `pp` axis and the module's parameters lie on
            its stages' meshes as `sharding.pipeline.param_sharding` places them.
        micro_batches: most micro-batches a decode batch is cut into (default: the number of stages).
    Raises:
        MeshError: a model that cannot be split into stages.
    """

    def __init__(self, module: nnx.Module, mesh, dtype, layout: EngineLayout, micro_batches: int | None = None):
        refusal = pipeline_refusal(module)
        if refusal:
            raise MeshError(refusal)
        self._graphdef, params = nnx.split(module)
        leaves, self._params_def = jax.tree.flatten(params)
        self._paths = leaf_paths(params)
        self.mesh, self.layout, self.dtype = mesh, layout, dtype
        self.vocab_size = int(module.config.vocab_size)
        self.links = Links(mesh)
        self.meshes = self.links.meshes
        self.stages = placed_stages(self._paths, leaves, self.meshes)
        self.micro_batches = micro_batches or self.stages.count
        self._stage_replicated = [NamedSharding(m, PartitionSpec()) for m in self.meshes]
        self._sample_mesh = self.links.sample_mesh
        self._replicated = NamedSharding(self._sample_mesh, PartitionSpec())
        # Which flat parameters each stage's program takes (its layers, and the embeddings, norm and head it uses).
        self._needs = [[i for i, p in enumerate(self._paths) if s in self.stages.holders(p)]
                       for s in range(self.stages.count)]
        self._place(leaves)
        cache_layout = module.cache_layout()
        self.stateful = [isinstance(x, StateLayer) for x in cache_layout]
        self.rings = layer_rings(cache_layout, layout)
        # Stages on other processes' devices: no pools, parameters or programs here.
        self.stage_pools = [new_pools([cache_layout[i] for i in r], layout.num_pages, layout.page_size,
                                      layout.state_slots, dtype, m, layout.ring_pages) if local else []
                            for r, m, local in zip(self.stages.ranges, self.meshes, self.links.local)]
        self._no_previous = self._put(np.zeros(layout.max_rows, np.int32), self.meshes[0]) \
            if self.links.local[0] else None
        self.vision = None
        self._stage_jits = [jax.jit(functools.partial(self._stage_fn, s), donate_argnames=("pools",))
                            for s in range(self.stages.count)]
        self._whole_jits = [jax.jit(functools.partial(self._whole_fn, s)) for s in range(self.stages.count)]
        self._sample = jax.jit(self._sample_fn)
        self.compiled: set[tuple] = set()
        self.programs: dict[Program, jax.stages.Compiled] = {}
        self.ensure = None
        self._context = None
        self._routes: list[tuple[jax.Array, int, list[jax.Array]]] = []  # see `_previous_for`
        self._split = None  # the last forward's logits, rows per micro-batch and each micro-batch's: see `sample`
        log.info("pipeline: %d stages, layers %s, up to %d micro-batches per decode step", self.stages.count,
                 self.stages.describe(), self.micro_batches)

    def _place(self, leaves: list) -> None:
        """Each local stage's parameters on its mesh: the loaded arrays, and for those loaded on several stages'
        devices (`sharding.pipeline.holders_mesh`) the shards on this stage's (no copy)."""
        self.stage_params = []
        for s, needs in enumerate(self._needs):
            if not self.links.local[s]:
                self.stage_params.append(None)
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

    @property
    def params(self) -> list:
        """The loaded parameters (each stage's arrays are these or views of their shards), for memory accounting."""
        return list(self._leaves)

    @property
    def pools(self) -> list:
        """Every layer's pools, in layer order."""
        return [p for pools in self.stage_pools for p in pools]

    def attach(self, module: nnx.Module) -> None:
        params, treedef = jax.tree.flatten(nnx.split(module)[1])
        if treedef != self._params_def:
            raise ValueError("the restored model's parameters are not the ones the engine was built for")
        for old, new in zip(self._leaves, params):
            if (old.shape, old.dtype, old.sharding) != (new.shape, new.dtype, new.sharding):
                raise ValueError(f"a restored parameter is {new.shape} {new.dtype} {new.sharding}; the engine's "
                                 f"programs take {old.shape} {old.dtype} {old.sharding}")
        self._place(params)

    def encode_images(self, images):
        raise MeshError("pipeline stages do not run vision towers")

    # --- programs --------------------------------------------------------------------------------------------

    def _stage_fn(self, s: int, params, pools, x, previous, tokens, positions, block_tables, kv_lengths, last_index,
                  token_source, state_slots):
        leaves = [None] * len(self._paths)  # other stages' parameters: absent here
        for i, value in zip(self._needs[s], params):
            leaves[i] = value
        model = nnx.merge(self._graphdef, jax.tree.unflatten(self._params_def, leaves))
        layers = self.stages.ranges[s]
        caches = layer_caches(pools, self.stateful[layers.start:layers.stop], self.rings[layers.start:layers.stop],
                              block_tables, kv_lengths, positions, state_slots)
        if s == 0:
            x = jnp.where(token_source[:, None] >= 0, previous[token_source][:, None], tokens)
        with exact_float32(self.dtype):
            hidden, caches = model.stage(x, positions, caches, jnp.max(kv_lengths), layers)
            pools = [() if c is None else c.pools for c in caches]
            if s < self.stages.last:
                return hidden, pools
            logits = model.logits(hidden[jnp.arange(hidden.shape[0]), last_index])
        # Replicated on the last stage: what `Links.to_sampler` takes.
        logits = jax.lax.with_sharding_constraint(logits, self._stage_replicated[s])
        with jax.named_scope("sampling"):
            greedy = self._padded(jnp.argmax(logits, axis=-1))
        return logits, jax.lax.with_sharding_constraint(greedy, self._stage_replicated[s]), pools

    def _whole_fn(self, s: int, params, x, seq_len):
        """Stage `s` of `Model.logits`' full forward pass (no cache)."""
        leaves = [None] * len(self._paths)
        for i, value in zip(self._needs[s], params):
            leaves[i] = value
        model = nnx.merge(self._graphdef, jax.tree.unflatten(self._params_def, leaves))
        B, T = x.shape[:2]
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        with exact_float32(self.dtype):
            hidden, _ = model.stage(x, positions, None, seq_len, self.stages.ranges[s])
            if s < self.stages.last:
                return hidden
            logits = model.logits(hidden)
        return jax.lax.with_sharding_constraint(logits, self._stage_replicated[s])

    def full_logits(self, tokens: np.ndarray, seq_len: int) -> jax.Array:
        """`Model.logits` through the stages: token ids [B, T] -> float32 logits [B, T, V] (on the sample mesh,
        replicated), no cache."""
        from sharding.rules import put

        B, T = tokens.shape
        hidden = (B, T, self.module_hidden_size)
        x = put(tokens, self.meshes[0], ("batch", None)) if self.links.local[0] else None
        for s, run in enumerate(self._whole_jits):
            if s > 0:
                x = self.links.send(x, s - 1, s, hidden, jnp.dtype(self.dtype), self._hidden_sharding(s, hidden).spec)
            if self.links.local[s]:
                with jax.set_mesh(self.meshes[s]):
                    x = self.links.settle(run(self.stage_params[s], x, put(np.int32(seq_len), self.meshes[s])))
        return self.links.to_sampler(x if self.links.local[-1] else None, (B, T, self.vocab_size), jnp.float32,
                                     PartitionSpec())

    def forward_programs(self, shape: tuple[int, int, int]) -> list[Program]:
        return [Program("forward", shape, stage=s) for s in range(self.stages.count) if self.links.local[s]]

    def micro_count(self, rows: int) -> int:
        """Micro-batches a batch of `rows` is cut into: the most, up to `micro_batches`, that divide it evenly."""
        return max(m for m in range(1, min(rows, self.micro_batches) + 1) if rows % m == 0)

    def _stage_inputs(self, s: int, batch: Batch, previous, x):
        put = functools.partial(self._put, mesh=self.meshes[s])
        if s == 0:
            previous = self._no_previous if previous is None else previous
        else:
            previous = None
        return (x, previous) + tuple(put(a) for a in batch.arrays())

    def _lower_forward(self, program: Program) -> jax.stages.Lowered:
        s, (B, T, W) = program.stage, program.shape
        rows = B // self.micro_count(B)
        batch = self.empty_batch(rows, T, W)
        x = None
        if s > 0:
            D = self.module_hidden_size
            dtype = jnp.dtype(self.dtype)
            x = jax.ShapeDtypeStruct((rows, T, D), dtype, sharding=self._hidden_sharding(s, (rows, T, D)))
        pools = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                             self.stage_pools[s])
        with jax.set_mesh(self.meshes[s]):
            return self._stage_jits[s].lower(self.stage_params[s], pools, *self._stage_inputs(s, batch, None, x))

    @functools.cached_property
    def module_hidden_size(self) -> int:
        embed = next(a for p, a in zip(self._paths, self._leaves) if p.startswith("model.embed_tokens."))
        return int(embed.shape[-1])

    def _hidden_sharding(self, s: int, shape) -> NamedSharding:
        from sharding.rules import ACTIVATION, named_sharding

        return named_sharding(ACTIVATION, shape, self.meshes[s])

    def lower(self, program: Program) -> jax.stages.Lowered:
        if program.name == "forward":
            return self._lower_forward(program)
        if program.name == "sample":
            return self._lower_sample(program)
        raise MeshError("pipeline stages do not run vision towers")

    def compile(self, lowered: jax.stages.Lowered) -> jax.stages.Compiled:
        return lowered.compile()

    def covering(self, key: tuple[int, int, int]) -> tuple[int, int, int] | None:
        count = sum(self.links.local)
        shapes = {}
        for p in list(self.programs):
            if p.name == "forward" and all(a >= b for a, b in zip(p.shape, key)):
                shapes[p.shape] = shapes.get(p.shape, 0) + 1
        full = [shape for shape, n in shapes.items() if n == count]
        return min(full, key=lambda s: (s[0] * s[1] * s[2], s), default=None)

    # --- running ---------------------------------------------------------------------------------------------

    def forward(self, batch: Batch, previous: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        key = batch.tokens.shape + (batch.block_tables.shape[1],)
        wanted = self.forward_programs(key)
        if not all(p in self.programs for p in wanted) and self.ensure is not None:
            cover = self.covering(key)
            if cover is None:
                for p in wanted:
                    self.ensure(p)
            else:
                batch, key = self.padded(batch, cover), cover
                wanted = self.forward_programs(key)
        programs = {p.stage: self.programs.get(p) for p in wanted}
        if None in programs.values() and key not in self.compiled:
            log.info("compiling the forward program for batch %d x %d tokens, %d pages (%d stages)", *key,
                     self.stages.count)
            self.compiled.add(key)
        M = self.micro_count(key[0])
        rows = key[0] // M
        parts = [_rows(batch, j * rows, (j + 1) * rows) for j in range(M)]
        routed = self._previous_for(previous, parts, rows)
        logits, greedy = [], []
        for j, part in enumerate(parts):
            before, part = routed[j]
            out = self._through_stages(part, before, programs)
            logits.append(self.links.to_sampler(None if out is None else out[0], (rows, self.vocab_size),
                                                jnp.float32, PartitionSpec()))
            greedy.append(self.links.to_sampler(None if out is None else out[1], (self.layout.max_rows,),
                                                jnp.int32, PartitionSpec()))
        with jax.set_mesh(self._sample_mesh):
            all_logits = logits[0] if M == 1 else jnp.concatenate(logits)
            tokens = greedy[0] if M == 1 else self._padded(jnp.concatenate([g[:rows] for g in greedy]))
        self._remember(tokens, rows, greedy)
        self._split = (all_logits, rows, logits) if M > 1 else None
        return all_logits, tokens

    def sample(self, logits: jax.Array, rows: dict[str, np.ndarray], penalties: tuple | None,
               logprobs: bool, guidance: tuple | None = None) -> dict[str, jax.Array]:
        """As `ModelRunner.sample`; for the logits of a micro-batched forward, one sampler call per micro-batch
        (a row's draws depend only on its seed and position, so the tokens are the same), whose tokens go back to
        the first stage on their own: the next step's micro-batch waits for its own rows only."""
        split = self._split
        if split is None or split[0] is not logits or split[1] not in self.layout.sampler_batches():
            return self.links.settle(super().sample(logits, rows, penalties, logprobs, guidance))
        _, r, parts = split
        outs = []
        for j, part in enumerate(parts):
            sl = slice(j * r, (j + 1) * r)
            cut = lambda arrays: None if arrays is None else tuple(a[sl] for a in arrays)  # noqa: E731
            outs.append(self.links.settle(super().sample(part, {k: v[sl] for k, v in rows.items()}, cut(penalties),
                                                         logprobs, cut(guidance))))
        with jax.set_mesh(self._sample_mesh):
            out = {k: jnp.concatenate([o[k][:r] for o in outs]) for k in outs[0]}
            out["tokens"] = self._padded(out["tokens"])
        self._remember(out["tokens"], r, [o["tokens"] for o in outs])
        return out

    def _through_stages(self, part: Batch, previous, programs: dict):
        """Dispatches one micro-batch through every stage (this process's programs, and every move between
        stages); returns the last stage's (logits, greedy tokens), or None where that stage is not local."""
        x = None
        rows, T = part.tokens.shape
        hidden = (rows, T, self.module_hidden_size)
        for s in range(self.stages.count):
            if s > 0:
                x = self.links.send(x, s - 1, s, hidden, jnp.dtype(self.dtype), self._hidden_sharding(s, hidden).spec)
            if not self.links.local[s]:
                x = None
                continue
            run = programs.get(s) or self._stage_jits[s]
            with jax.set_mesh(self.meshes[s]):
                *x, self.stage_pools[s] = self.links.settle(run(self.stage_params[s], self.stage_pools[s],
                                                                *self._stage_inputs(s, part, previous, x)))
            x = x[0] if s < self.stages.last else x
        return x

    def _remember(self, tokens: jax.Array, rows: int, greedy: list[jax.Array]) -> None:
        """Keeps each micro-batch's tokens (greedy or sampled), on the first stage, for the next step's same
        micro-batch; `tokens` is what the engine will hand back as `previous`."""
        self._routes = [(tokens, rows, [self.links.restrict(g, 0) for g in greedy])] + self._routes[:1]

    def _previous_for(self, previous, parts: list[Batch], rows: int) -> list[tuple[jax.Array | None, Batch]]:
        """Each micro-batch's input-token source on the first stage: the same micro-batch's greedy tokens of the
        step that made `previous` when its rows read only those (no wait for the other micro-batches), else all of
        `previous` moved there."""
        if previous is None:
            return [(None, p) for p in parts]
        for tokens, old_rows, greedy in self._routes:
            if tokens is previous and old_rows == rows and len(greedy) == len(parts):
                out = []
                for j, part in enumerate(parts):
                    src = part.token_source
                    inside = (src < 0) | ((src >= j * rows) & (src < (j + 1) * rows))
                    if not inside.all():
                        break
                    out.append((greedy[j], replace(part, token_source=np.where(src >= 0, src - j * rows, src))))
                else:
                    return out
        moved = self.links.restrict(previous, 0)
        return [(moved, p) for p in parts]

    def stage_seconds(self, shape: tuple[int, int, int], repeats: int = 5) -> tuple[list[float], list[float]]:
        """Each stage's program on one micro-batch of a padding batch of `shape` (rows, tokens, pages), run alone
        and waited for, and each move of its output to the next stage: the fastest of `repeats` runs after one
        warm-up (which compiles), the least disturbed by other work. For schedules (bench/pipeline.py); one process
        only.

        Returns:
            (seconds per stage, seconds per move between stages s and s + 1).
        """
        import time

        B, T, W = shape
        part = self.empty_batch(B // self.micro_count(B), T, W)
        hidden = part.tokens.shape + (self.module_hidden_size,)
        stages, moves, x = [], [], None

        def timed(fn):
            runs = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                out = jax.block_until_ready(fn())
                runs.append(time.perf_counter() - t0)
            return out, min(runs[1:])

        for s in range(self.stages.count):
            if s > 0:
                y = x
                x, seconds = timed(lambda: self.links.send(y, s - 1, s, hidden, jnp.dtype(self.dtype),
                                                           self._hidden_sharding(s, hidden).spec))
                moves.append(seconds)

            def run(s=s, x=x):
                with jax.set_mesh(self.meshes[s]):
                    *out, self.stage_pools[s] = self._stage_jits[s](self.stage_params[s], self.stage_pools[s],
                                                                    *self._stage_inputs(s, part, None, x))
                return out
            out, seconds = timed(run)
            stages.append(seconds)
            x = out[0]
        return stages, moves

    def smoke_run(self) -> float:
        out = super().smoke_run()
        self._routes = []
        return out


def _rows(batch: Batch, start: int, stop: int) -> Batch:
    """Rows [start, stop) of a batch."""
    fields = {k: (None if v is None else v[start:stop]) for k, v in vars(batch).items()
              if k not in ("deepstack",)}
    return Batch(**fields)
