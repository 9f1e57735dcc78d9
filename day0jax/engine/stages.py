"""Pipeline stages in the runner (a mesh with a `pp` axis; see sharding/pipeline.py): which layers each stage runs,
read from where the loader placed their parameters, and how a decode batch's micro-batches find their input tokens.

Each stage is its own program on its own (dp, ep, tp) mesh, holding its layers' parameters and KV pools; the
residual stream of a micro-batch moves to the next stage's devices between programs. A decode batch is cut into
micro-batches (as many as there are stages, when its rows allow), dispatched stage after stage without waiting:
each device runs its queue in order, so while stage 1 works on micro-batch 0, stage 0 works on micro-batch 1.
Tokens go back to the first stage per micro-batch (greedy ones straight from the last stage, sampled ones from one
sampler call per micro-batch), so the next step's micro-batch 0 starts as soon as its own tokens exist, not when
the whole batch has left the last stage: in steady state no stage waits. Prefill chunks of a prompt pipeline the
same way across steps (a chunk needs only its predecessor's KV on each stage). A model that is not split is the
one-stage case: one program, no micro-batches, nothing moved.
"""

from __future__ import annotations

import time
from dataclasses import replace

import jax
import numpy as np
from flax import nnx

from day0jax.core.errors import MeshError
from day0jax.engine.input_batch import Batch
from sharding.pipeline import Links, Stages, layer_index


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


class MicroBatches:
    """How a pipelined decode batch is cut, and where each micro-batch reads its input tokens.

    Args:
        links: the moves between stages (`sharding.pipeline.Links`).
        most: the most micro-batches a batch is cut into (the number of stages).
    """

    def __init__(self, links: Links, most: int):
        self.links, self.most = links, most
        self._routes: list[tuple[jax.Array, int, list[jax.Array]]] = []

    def count(self, rows: int) -> int:
        """Micro-batches a batch of `rows` is cut into: the most, up to `most`, that divide it evenly."""
        return max(m for m in range(1, min(rows, self.most) + 1) if rows % m == 0)

    def remember(self, tokens: jax.Array, rows: int, greedy: list[jax.Array]) -> None:
        """Keeps each micro-batch's tokens (greedy or sampled), on the first stage, for the next step's same
        micro-batch; `tokens` is what the engine will hand back as `previous`."""
        self._routes = [(tokens, rows, [self.links.restrict(g, 0) for g in greedy])] + self._routes[:1]

    def forget(self) -> None:
        self._routes = []

    def sources(self, previous, parts: list[Batch], rows: int) -> list[tuple[jax.Array | None, Batch]]:
        """Each micro-batch's input-token source on the first stage: the same micro-batch's tokens of the step that
        made `previous` when its rows read only those (no wait for the other micro-batches), else all of `previous`
        moved there."""
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


def stage_seconds(runner, shape: tuple[int, int, int], repeats: int = 5) -> tuple[list[float], list[float]]:
    """Each stage's program on one micro-batch of a padding batch of `shape` (rows, tokens, pages), run alone and
    waited for, and each move of its output to the next stage: the fastest of `repeats` runs after one warm-up
    (which compiles), the least disturbed by other work. For schedules (bench/pipeline.py); one process only.

    Args:
        runner: a `ModelRunner` over a mesh with pipeline stages.
    Returns:
        (seconds per stage, seconds per move between stages s and s + 1).
    """
    B, T, W = shape
    part = runner.inputs.empty(B // runner.micro.count(B), T, W)
    stages, moves, x = [], [], None

    def timed(fn):
        runs = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn())
            runs.append(time.perf_counter() - t0)
        return out, min(runs[1:])

    for s in range(runner.stages.count):
        if s > 0:
            y = x
            x, seconds = timed(lambda: runner.send_hidden(y, s))
            moves.append(seconds)
        out, seconds = timed(lambda s=s, x=x: runner.run_stage(s, None, part, None, x))
        stages.append(seconds)
        x = out[0]
    return stages, moves
