"""`day0jax.load`: a converted checkpoint -> a `Model`, with every parameter restored straight into its sharding.

The model is built abstractly (shapes and logical axes, no memory), the sharding rules give each parameter a
`NamedSharding`, and `weights/stream.py` reads into those: each device's slice is read once, the host holds no
replicated copy.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from day0jax import models
from day0jax.adapters import ServedAdapters
from day0jax.core.cache_layout import layer_windows
from day0jax.core.errors import CheckpointError, MeshError
from day0jax.core.hf_config import read_config_json
from day0jax.engine.config import EngineConfig, EngineLayout
from day0jax.engine.paged_cache import kv_cache_refusal
from day0jax.layers.quantized import specs_from_config
from day0jax.layers.rope import context_length as model_context_length
from day0jax.model import Model
from day0jax.startup.timeline import Timeline
from day0jax.startup.timeline import null as null_timeline
from day0jax.weights import checkpoint, stream
from day0jax.weights.restore import large_buffers_back_to_the_os, manifest_problems, restore_arrays
from kernels_pallas import selftest as kernel_selftest
from sharding import plan as plan_lib
from sharding.mesh import describe, make_mesh, problems
from sharding.pipeline import Stages, param_sharding
from sharding.rules import put

log = logging.getLogger(__name__)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def default_dtype(backend: str | None = None) -> str:
    """float32 on the CPU (bf16 arithmetic is slow there), bfloat16 on accelerators; `backend`: a JAX backend's name
    ('cpu', 'gpu', 'tpu'; default: the one in use)."""
    return "float32" if (backend or jax.default_backend()) == "cpu" else "bfloat16"


def load(path: str | Path, *, dtype: str | None = None, mesh: Mesh | str | None = None,
         engine: EngineConfig | None = None, memory_budget: int | None = None, kernels: str = "auto",
         timeline: Timeline | None = None, load_concurrency: int | None = None,
         adapters: dict[str, str | Path] | None = None) -> Model:
    """Loads a day0jax checkpoint as a `Model`, after checking (sharding/plan.py, kept in `model.memory_plan`) that
    the parameters, the engine's KV page pool and the activations of its largest program fit on each device.

    Args:
        path: checkpoint folder written by `python -m convert`.
        dtype: compute and parameter dtype ('float32', 'bfloat16', 'float16'); default per backend.
        mesh: a `Mesh`, a SPEC like 'tp=2', 'auto' (the smallest model-parallel group that fits, the rest data
            parallel) or None for one device.
        engine: the `EngineConfig` that `Model.generate` and the server run; default `EngineConfig()`.
        memory_budget: bytes one device may use; default: free device memory (CPU: host memory, shared).
        kernels: 'auto' (kernels checked against their references on the model's shapes; one that disagrees is
            replaced by the next candidate), 'strict' (disagreement is an error) or 'reference' (no kernels).
            The resulting choice holds for the whole process (`kernels_pallas.registry.set_policy`): every program
            traced after this load, another model's included, follows it.
        timeline: a `Timeline` recording the phases (config, build, restore with its bytes, kernel self-test).
        load_concurrency: bytes of checkpoint data read but not yet on their devices, at most (default: a
            sixteenth of the available host memory, between 64 MiB and 2 GiB; `weights/stream.py`).
        adapters: LoRA adapters to serve beside the model, name -> PEFT folder (`EngineConfig.lora_modules`, which
            this extends); `Model.generate(..., adapter=name)` and a server request's `model` pick one.
    Raises:
        CheckpointError: not a checkpoint, newer format, parameters that do not match the model, or a data file
            missing, truncated or malformed (named).
        UnsupportedArchitecture: the model type or a config value is not implemented.
        GenerationError: an engine config that cannot work (a pool smaller than one sequence, ...).
        MeshError: the mesh spec is invalid or does not fit the model (the message lists meshes that would).
        OutOfMemoryPlan: the plan does not fit; the message names a mesh or a context length that would.
        AdapterError: an adapter folder that cannot be served (named, with the file and the key).
        ValueError: `kernels` is not 'auto', 'strict' or 'reference'.
        kernels_pallas.registry.KernelMismatch: kernels='strict' and a kernel disagrees with its reference.
    """
    timeline = timeline or null_timeline()
    path, hf = read_checkpoint_config(path, timeline)
    if adapters:
        engine = engine or EngineConfig()
        engine = dataclasses.replace(engine, lora_modules=engine.lora_modules +
                                     tuple((name, str(folder)) for name, folder in adapters.items()))
    prepared = prepare(hf, dtype=dtype, mesh=mesh, engine=engine, memory_budget=memory_budget, kernels=kernels,
                       timeline=timeline, folder=path)
    return restore(prepared, path, timeline=timeline, load_concurrency=load_concurrency)


def read_checkpoint_config(path: str | Path, timeline: Timeline | None = None) -> tuple[Path, dict]:
    """A checkpoint's absolute path and its config.json.

    Raises:
        CheckpointError: not a day0jax checkpoint (said before any complaint about its config).
        ConfigError: config.json missing or malformed.
    """
    with (timeline or null_timeline()).phase("read config"):
        path = Path(path).absolute()
        checkpoint.read_manifest(path)
        return path, read_config_json(path / "config.json")


@dataclasses.dataclass
class Prepared:
    """A model before its weights: everything `prepare` decides from the config alone. Its `engine()` lowers and
    compiles programs (they depend on shapes and shardings only) while `restore` reads the weights.

    Attributes:
        hf, config, dtype: the config.json it was prepared from, the family's config, the compute dtype name.
        abstract: the model built abstractly (shapes, no memory).
        infos: the model's parameters by path (`models.ParamInfo`).
        layout, memory_plan, mesh: the engine's layout, the memory plan for it, the device mesh.
        engine_config, kernel_report: the engine's runtime choices; the startup kernel self-test's report.
        adapters: the LoRA adapters served (`adapters.ServedAdapters`, attached to `abstract`), or None.
    """

    hf: dict
    config: object
    dtype: str
    abstract: nnx.Module
    infos: dict
    layout: EngineLayout
    memory_plan: plan_lib.Plan
    mesh: Mesh
    engine_config: EngineConfig
    kernel_report: object
    adapters: ServedAdapters | None = None
    _engine: object = None

    def sharded_abstract(self) -> nnx.Module:
        """The abstract model with each parameter a `jax.ShapeDtypeStruct` carrying the sharding it is restored into
        (what programs are lowered against before the weights exist)."""
        graphdef, state = nnx.split(self.abstract)
        names = [(p, ".".join(map(str, p)), var) for p, var in nnx.to_flat_state(state)]
        # Served adapters' stacks are not parameters: the abstract model holds their shapes and shardings already.
        flat = [(p, var.replace(self._target(name)) if name in self.infos else var) for p, name, var in names]
        return nnx.merge(graphdef, nnx.from_flat_state(flat))

    @property
    def stages(self) -> Stages | None:
        """The pipeline's split of the layers when the mesh has pp > 1 (from the memory plan), else None."""
        return stages_of(self.memory_plan, self.infos.values())

    def _target(self, name: str) -> jax.ShapeDtypeStruct:
        info = self.infos[name]
        return jax.ShapeDtypeStruct(info.shape, plan_lib.stored_dtype(info, DTYPES[self.dtype]),
                                    sharding=param_sharding(info, self.mesh, self.stages))

    def check_checkpoint(self, path: Path) -> dict:
        """The manifest of the checkpoint at `path`, after checking that its parameters are this model's.

        Raises:
            CheckpointError: not a checkpoint, or a parameter missing, of another shape, or unknown to the model.
        """
        manifest = checkpoint.read_manifest(path)
        problems = manifest_problems(manifest, self.infos.values())
        if problems:
            raise CheckpointError(f"{path}: {problems[0]}")
        return manifest

    def engine(self):
        """The `Engine` the restored `Model` will run (made on first call: it allocates the KV page pool); until
        `restore` its parameters are shapes, enough to compile its programs but not to run them. With speculative
        method "draft", the draft model is loaded here (its weights, on the same mesh)."""
        if self._engine is None:
            from day0jax.engine.engine import Engine

            self._engine = Engine(self.sharded_abstract(), self.mesh, jnp.dtype(self.dtype),
                                  context_length=self.layout.max_model_len, eos_token_ids=(),
                                  config=self.engine_config, draft=self.draft_module())
        return self._engine

    def draft_module(self):
        """The draft model's module when the engine config speculates with one (`load_draft`), else None."""
        spec = self.engine_config.speculative
        if spec is None or spec.method != "draft":
            return None
        return load_draft(spec.draft_model, dtype=self.dtype, mesh=self.mesh, max_model_len=self.layout.max_model_len)


def load_draft(path: str | Path, *, dtype: str, mesh: Mesh, max_model_len: int) -> nnx.Module:
    """A speculative draft model's module, loaded on the target's mesh and dtype (its KV pools are the engine's, in
    the target's layout, so its own plan is for one short sequence).

    Raises:
        As `load`.
    """
    engine = EngineConfig(max_model_len=max_model_len, max_num_seqs=1, kv_cache_tokens=max_model_len,
                          chunk_buckets=(32,))
    log.info("loading the draft model %s", path)
    return load(path, dtype=dtype, mesh=mesh, engine=engine).module


def prepare(hf: dict, *, dtype: str | None = None, mesh: Mesh | str | None = None,
            engine: EngineConfig | None = None, memory_budget: int | None = None, kernels: str = "auto",
            timeline: Timeline | None = None, folder: str | Path | None = None) -> Prepared:
    """The first half of `load`, from a config.json's contents alone: the abstract model, the memory plan, the
    mesh and the kernel choices. Arguments and errors as `load`'s (but no checkpoint is read); `folder`, the
    checkpoint's, where its image processor bounds the images a vision tower takes (its programs cover them)."""
    timeline = timeline or null_timeline()
    engine = engine or EngineConfig()
    config = models.config_from_hf(hf)
    dtype = dtype or default_dtype()
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    with timeline.phase("build model") as info:
        spec = engine.speculative
        abstract = models.abstract_model(config, DTYPES[dtype], quantization=specs_from_config(hf),
                                         mtp=spec is not None and spec.method == "mtp")
        if folder is not None and hasattr(abstract, "image_patch_limit"):
            from day0jax.vision.processors import patch_limit

            abstract.image_patch_limit = patch_limit(folder)
        infos = {i.path: i for i in models.param_infos(abstract)}
        adapters = None
        if engine.lora_modules:  # checked before any weight is read; every device holds them whole
            adapters = ServedAdapters(engine.lora_modules, abstract, engine.max_loras, engine.max_lora_rank)
            log.info("LoRA adapters: %s", adapters.describe())
        reserved = 0 if adapters is None else adapters.nbytes(abstract, jnp.dtype(DTYPES[dtype]).itemsize)
        layout, memory_plan, mesh = plan_memory(abstract, config, engine, dtype, mesh, memory_budget, reserved)
        info["mesh"] = describe(mesh)
    if adapters is not None:
        replicated = NamedSharding(mesh, PartitionSpec())
        adapters.attach(abstract, {path: tuple(jax.ShapeDtypeStruct(shape, DTYPES[dtype], sharding=replicated)
                                               for shape in shapes)
                                   for path, shapes in adapters.shapes(abstract).items()})
    # Before anything is traced: the kernel choices are part of every program.
    with timeline.phase("kernel self-test", mode=kernels):
        report = kernel_selftest.startup([call for _, call in abstract.op_calls()], dtype=DTYPES[dtype],
                                         mode=kernels, tp=mesh.shape.get("tp", 1))
    return Prepared(hf, config, dtype, abstract, infos, layout, memory_plan, mesh, engine, report, adapters)


def restore(prepared: Prepared, path: str | Path, *, timeline: Timeline | None = None,
            load_concurrency: int | None = None) -> Model:
    """The second half of `load`: reads the checkpoint at `path` into `prepared`'s shardings and returns the `Model`
    (whose engine is `prepared.engine()` if that was made, now holding the weights); `load_concurrency` as `load`'s.

    Raises:
        CheckpointError: not a checkpoint, or parameters that do not match the model.
    """
    t0 = time.perf_counter()
    timeline = timeline or null_timeline()
    path = Path(path).absolute()
    manifest = prepared.check_checkpoint(path)
    config, mesh, dtype = prepared.config, prepared.mesh, prepared.dtype
    timings = stream.Timings()
    with timeline.phase("restore parameters") as info:
        with large_buffers_back_to_the_os():
            arrays = restore_arrays(path, manifest, prepared.infos, mesh, DTYPES[dtype], prepared.stages,
                                    concurrency=load_concurrency, timings=timings)
        if prepared.adapters is not None:
            for module, pair in prepared.adapters.stacked(prepared.abstract, DTYPES[dtype]).items():
                key = ".".join(map(str, module))
                arrays[f"{key}.lora_a"], arrays[f"{key}.lora_b"] = (put(x, mesh) for x in pair)
        graphdef, abstract_state = nnx.split(prepared.abstract)
        flat = [(p, var.replace(arrays[".".join(map(str, p))])) for p, var in nnx.to_flat_state(abstract_state)]
        module = nnx.merge(graphdef, nnx.from_flat_state(flat))
        here = [a for a in arrays.values() if isinstance(a, jax.Array)]
        jax.block_until_ready(here)
        info["bytes"] = sum(a.nbytes for a in here)
        info["parameters"] = sum(a.size for a in here)
        info["read_bytes"] = timings.bytes_read
    seconds = time.perf_counter() - t0
    # Reader-thread seconds, summed over the threads: they overlap each other and the wall time.
    log.info("loaded %s (%s, %d parameters) on %s in %.1fs: %.2f GB read at %.2f GB/s (threads: read %.1fs, "
             "convert %.1fs, place %.1fs; at most %d MB in flight)", path, config.model_type, info["parameters"],
             describe(mesh), seconds, timings.bytes_read / 1e9, timings.bytes_read / 1e9 / max(seconds, 1e-9),
             timings.read, timings.convert, timings.place, timings.peak_in_flight >> 20)
    generation_file = path / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
    # A vision-language config.json may name it only in its language model's text_config.
    eos = generation.get("eos_token_id", prepared.hf.get("eos_token_id",
                                                         (prepared.hf.get("text_config") or {}).get("eos_token_id")))
    model = Model(module, config, path=path, mesh=mesh, dtype=dtype,
                  eos_token_ids=eos if isinstance(eos, list) else [eos] if eos is not None else [],
                  engine_config=prepared.engine_config, context_length=prepared.layout.max_model_len,
                  memory_plan=prepared.memory_plan, kernel_report=prepared.kernel_report)
    model.draft_loader = lambda draft_path: load_draft(draft_path, dtype=dtype, mesh=mesh,
                                                       max_model_len=prepared.layout.max_model_len)
    if prepared._engine is not None:
        model.adopt_engine(prepared._engine)
    return model


@dataclasses.dataclass(frozen=True)
class EnginePlanInputs:
    """What the memory planner needs: the engine's layout, the model's shape, the workload, and the workload at
    another max_model_len (for suggestions)."""

    layout: EngineLayout
    shape: plan_lib.ModelShape
    workload: plan_lib.Workload
    workload_for: Callable[[int], plan_lib.Workload]

    @classmethod
    def of(cls, abstract: nnx.Module, config, engine: EngineConfig) -> "EnginePlanInputs":
        """`load` and `check` both plan from this, so the same flags give the same plan.

        Raises:
            GenerationError: an engine config that cannot work for this model.
        """
        full_context = model_context_length(config.rope, config.max_position_embeddings)
        windows = layer_windows(abstract.cache_layout())
        layout = engine.layout(full_context, windows)
        kv_cache_refusal(abstract.cache_layout(), config.model_type, engine.kv_cache_dtype)
        return cls(layout, plan_lib.ModelShape.from_model(abstract, models.param_infos(abstract), full_context), layout.workload(),
                   lambda n: dataclasses.replace(engine, max_model_len=n).layout(full_context, windows).workload())

    def plan(self, sizes, dtype: str, available: int | None) -> plan_lib.Plan:
        return plan_lib.plan(self.shape, sizes, self.workload, dtype=DTYPES[dtype], available=available)

    def require_fit(self, p: plan_lib.Plan, n_devices: int) -> None:
        plan_lib.require_fit(p, self.shape, self.workload, self.workload_for, n_devices=n_devices)


def plan_memory(abstract: nnx.Module, config, engine: EngineConfig, dtype: str, mesh: Mesh | str | None,
                memory_budget: int | None = None, reserved: int = 0) -> tuple[EngineLayout, plan_lib.Plan, Mesh]:
    """The engine's layout, the memory plan for it, and the mesh (made here unless a `Mesh` is given); `reserved`:
    bytes each device holds besides what the plan counts (served LoRA adapters), taken off its budget.

    Raises:
        GenerationError, MeshError, OutOfMemoryPlan: as `load`.
    """
    inputs = EnginePlanInputs.of(abstract, config, engine)
    infos = models.param_infos(abstract)
    devices = jax.devices()
    if isinstance(mesh, Mesh):
        bad = problems(dict(mesh.shape), infos)
        if bad:
            raise MeshError(f"mesh {describe(mesh)} does not fit the model: {'; '.join(bad)}")
    else:
        budget = (memory_budget if memory_budget is not None else plan_lib.device_memory(devices)) - reserved
        mesh = make_mesh(mesh, infos=infos, fits=lambda s: inputs.plan(s, dtype, budget).fits)
    budget = (memory_budget if memory_budget is not None else
              plan_lib.device_memory(list(mesh.devices.flat))) - reserved
    if "pp" in mesh.axis_names:
        from day0jax.engine.stages import pipeline_refusal

        refusal = pipeline_refusal(abstract)
        if refusal:
            raise MeshError(f"mesh {describe(mesh)}: {refusal}")
    memory_plan = inputs.plan(dict(mesh.shape), dtype, budget)
    log.info("memory plan: %s", memory_plan.summary())
    inputs.require_fit(memory_plan, n_devices=len(devices))
    return inputs.layout, memory_plan, mesh


def stages_of(memory_plan: plan_lib.Plan, infos) -> Stages | None:
    """The `Stages` a memory plan split the layers into (None without pipeline stages)."""
    if not memory_plan.stages:
        return None
    tied = not any(i.path.startswith("lm_head.") for i in infos)
    return Stages(tuple(range(a, b) for a, b in memory_plan.stages), tied)
