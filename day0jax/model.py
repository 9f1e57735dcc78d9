"""`Model`: a loaded checkpoint as users see it; `generate` runs on the server's engine (`day0jax.engine`).

Equal prompts, parameters and seed give the same tokens from either; `logits` is the one other path: no KV cache.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from day0jax.core.cache_layout import layer_windows
from day0jax.core.errors import GenerationError
from day0jax.engine.config import EngineConfig
from day0jax.engine.programs import Program
from day0jax.engine.requests import QueueFull, SamplingParams
from day0jax.engine.runner import ModelRunner
from day0jax.vision.inputs import ModelImages, chat_images
from day0jax.weights.tokenizer import Tokenizer
from sharding.rules import put

log = logging.getLogger(__name__)


class Model:
    """A loaded model. Build it with `day0jax.load`.

    Attributes:
        config: the family's config dataclass (fields are the HF config.json keys).
        tokenizer: the checkpoint's `Tokenizer`, or None when the checkpoint has no tokenizer.json.
        mesh, module: the device mesh the parameters are sharded over; the underlying Flax NNX module.
        vision: a vision-language model's `VisionSpec` (None: text only); images: its image handling
            (`vision.inputs.ModelImages`: preprocessing, placeholders, the tower).
        engine_config: the engine's runtime choices (`generate` and the server run that engine).
        context_length: the longest prompt + new tokens accepted (the engine config's `max_model_len` may lower it).
        memory_plan: per-device memory plan made before loading (sharding/plan.py), for this engine config.
        kernel_report: which implementation each operator uses, from the startup self-test.
        program_store: a `startup.program_store.ProgramStore` that `generate` loads compiled programs from and saves
            them to (None: programs are traced, then compiled or read from JAX's compilation cache if enabled).
    """

    def __init__(self, module: nnx.Module, config: Any, *, path: Path, mesh: Mesh, dtype: str,
                 eos_token_ids: Sequence[int], engine_config: EngineConfig, context_length: int,
                 memory_plan: Any = None, kernel_report: Any = None):
        self.module, self.config, self.path, self.mesh, self.dtype = module, config, Path(path), mesh, dtype
        self.tokenizer = Tokenizer(path) if (Path(path) / "tokenizer.json").is_file() else None
        self.eos_token_ids = tuple(eos_token_ids)
        self.engine_config, self.context_length = engine_config, context_length
        self.memory_plan, self.kernel_report = memory_plan, kernel_report
        self._engine = None
        self._runner = None
        self.program_store = None
        self._grammars, self._grammar_lock = None, threading.Lock()
        self.grammar_cache_bytes: int | None = None  # the grammar compiler's cache bound (None: its default)
        # Loads a speculative draft model's module by path on this model's mesh (set by `day0jax.load`).
        self.draft_loader = None
        self._request_ids = itertools.count()
        self.vision = getattr(module, "vision_spec", None)
        self.images = ModelImages(self.vision, self.path, config.model_type,
                                  getattr(module, "expand_image_placeholders", None),
                                  lambda inputs: self.runner.encode_images(inputs))
        # Batches are split over dp and ep (sharding/rules.py): padded batch sizes are multiples of both.
        self._batch_multiple = mesh.shape.get("dp", 1) * mesh.shape.get("ep", 1)

    @property
    def runner(self):
        """The engine's `ModelRunner` (its parameters and programs; `logits` runs its cache-less forward). Made on
        first use without the engine's KV pools, which only the engine allocates."""
        if self._runner is None:
            layout = self.engine_config.layout(self.context_length, layer_windows(self.module.cache_layout()))
            self._runner = ModelRunner(self.module, self.mesh, jnp.dtype(self.dtype), layout)
        return self._runner

    @property
    def engine(self):
        """The `day0jax.engine.Engine` of this model (made on first use: it allocates the KV page pool)."""
        if self._engine is None:
            from day0jax.engine.engine import Engine

            spec = self.engine_config.speculative
            draft = None
            if spec is not None and spec.method == "draft" and self.runner.draft is None:
                if self.draft_loader is None:
                    raise GenerationError("speculative method 'draft' needs the model loaded by day0jax.load")
                draft = self.draft_loader(spec.draft_model)
            self._engine = Engine(self.module, self.mesh, jnp.dtype(self.dtype), context_length=self.context_length,
                                  eos_token_ids=self.eos_token_ids, config=self.engine_config, runner=self.runner,
                                  draft=draft)
        return self._engine

    @property
    def grammars(self):
        """The `engine.grammar.GrammarCompiler` for this model's tokenizer (made on first use, about a second).

        Raises:
            GrammarError: the checkpoint has no tokenizer or names no end-of-sequence token.
        """
        with self._grammar_lock:
            if self._grammars is None:
                from day0jax.engine.grammar import GrammarCompiler, GrammarError

                if self.tokenizer is None:
                    raise GrammarError("structured output needs the checkpoint's tokenizer.json")
                self._grammars = GrammarCompiler(self.tokenizer.to_json(), int(self.config.vocab_size),
                                                 self.eos_token_ids, **({} if self.grammar_cache_bytes is None else
                                                                        {"cache_bytes": self.grammar_cache_bytes}))
            return self._grammars

    def adopt_engine(self, engine) -> None:
        """Makes `engine`, built on this model's abstract form before the weights were read (its programs possibly
        compiled meanwhile), this model's engine, holding these weights."""
        engine.attach(self.module, self.eos_token_ids)
        self._engine, self._runner = engine, engine.runner

    def _compile_for(self, prompts: Sequence[Sequence[int]], params: SamplingParams, images: Sequence = ()) -> None:
        """Compiles (or loads from the compilation cache), in parallel and before the first token, every program
        this call can take that is not ready yet: no generation stalls midway when its span reaches a new bucket;
        with `images` (the rows' `ImageInputs` or None), the vision tower's for their shape buckets."""
        from day0jax.startup.warmup import compile_programs

        engine = self.engine
        runner = engine.runner
        longest = max(len(p) for p in prompts)
        if longest + params.max_tokens > engine.max_model_len:
            return  # the engine refuses the request, naming the limit
        programs = runner.catalog.for_requests(
            len(prompts) * params.n, longest, longest + params.max_tokens,
            sampled=params.sampled, penalized=params.penalized, guided=params.guided)
        programs += list(dict.fromkeys(Program("encode", key) for inputs in images if inputs is not None
                                       for key, _, _ in self.vision.encoder_calls(inputs.pixels, inputs.grids)))
        missing = [p for p in programs if not runner.installed(p)
                   and not (p.name == "forward" and p.shape in runner.compiled)]
        if missing:
            t0 = time.perf_counter()
            records = compile_programs(runner, missing, store=self.program_store)
            sources = collections.Counter(r.source for r in records)
            log.info("%d programs ready before the first token in %.1fs (%s)", len(records), time.perf_counter() - t0,
                     ", ".join(f"{n} {how}" for how, n in sorted(sources.items())))

    def prepare(self, messages: Sequence[dict], *, allowed_media_dir: str | Path | None = None
                ) -> tuple[list[int], list[Any]]:
        """OpenAI-style chat messages -> (token ids, images): rendered with the chat template, each image's
        placeholder expanded to its tokens. Content parts may be `{"type": "text", "text": ...}`,
        `{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}` or `{"type": "image", "image":
        PIL image | uint8 array}`; for models that take videos (Qwen3-VL), `{"type": "video", "video": [frames]}`
        (optional `video_metadata` {"fps": the frames' rate} and the video processor's `fps`, `num_frames`,
        `do_sample_frames`) or `{"type": "video_url", "video_url": {"url": an animated GIF, WebP or PNG}}`, returned
        as `vision.video.Video`s among the images; `file://` URLs only inside `allowed_media_dir`.

        Raises:
            GenerationError: no tokenizer, images for a text-only model, or a template that shows no image.
            ImageError: an image that cannot be read.
            ChatTemplateError: the template fails.
        """
        if self.tokenizer is None:
            raise GenerationError(f"{self.path} has no tokenizer.json")
        rendered, images = chat_images(messages, allowed_media_dir)
        if images and self.vision is None:
            raise GenerationError(f"this {self.config.model_type} model takes no images")
        text = self.tokenizer.render_chat(rendered)
        if images:
            text = self.images.expand(text, images, self.tokenizer)[0]
        return self.tokenizer.encode(text, add_special_tokens=False), images

    def logits(self, token_ids: Sequence[Sequence[int]] | np.ndarray,
               images: Sequence[Sequence[Any]] | None = None, adapter: str | None = None) -> np.ndarray:
        """A full forward pass, no cache: int32 [B, T] -> float32 numpy [B, T, V]. Shapes are padded to powers of two
        (the batch to a multiple of dp x ep, the length to at least 16), so differing lengths share compiled programs.
        `images`: a vision-language model's images, one list per row (PIL images or uint8 HxWx3 arrays, and
        `vision.video.Video`s for models that take videos, in order of appearance), the rows' placeholders already
        expanded. `adapter`: a served LoRA adapter's name (see `day0jax.load`'s `adapters`); None: the base model.

        Raises:
            GenerationError: not a [B, T] array of token ids, longer than the context, or placeholders that do not
                match the images, or an adapter the model does not serve.
        """
        tokens = np.asarray(token_ids, dtype=np.int32)
        if tokens.ndim != 2 or tokens.shape[1] < 1:
            raise GenerationError(f"logits expects int token ids of shape [B, T] with T >= 1, got {tokens.shape}")
        B, T = tokens.shape
        if T > self.context_length:
            raise GenerationError(f"{T} tokens exceed the model's context of {self.context_length}")
        padded = np.zeros((_round_up_pow2(B, self._batch_multiple), _round_up_pow2(T, 16)), np.int32)
        padded[:B, :T] = tokens
        rows = self.images.rows(images, tokens)
        image = None
        if self.vision is not None:
            def logical(k, x):  # rows split like the tokens; deepstack [k, B, T, D] has them second
                names = ["batch"] + [None] * (x.ndim - 1)
                return names[1:2] + names[:1] + names[2:] if k == "deepstack" else names
            image = {k: put(x, self.mesh, logical(k, x)) for k, x in self.images.arrays(padded, rows).items()}
        return np.asarray(self.runner.full_logits(padded, T, image, adapter))[:B, :T]

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False, *,
                 json_schema: dict | bool | None = None, regex: str | None = None,
                 choice: Sequence[str] | None = None, logit_bias: dict[int, float] | None = None,
                 images: Sequence[Sequence[Any]] | None = None, speculative=None,
                 adapter: str | Sequence[str | None] | None = None) -> list[list[int]]:
        """Generates up to `max_new_tokens` for each prompt (a list of token ids); returns only the new tokens. Each
        prompt is one engine request, ending after EOS (unless `ignore_eos`) or any of `stop_token_ids` (returned last).
        At most one of `json_schema` (output that validates against it; `{"type": "object"}` for any JSON object),
        `regex` (output matching it) and `choice` (exactly one of these strings) constrains the output; `logit_bias`
        adds a value in [-100, 100] to the logits of these token ids. `images`: a vision-language model's images, one
        list per prompt (PIL images, uint8 HxWx3 arrays or `vision.video.Video`s, in order of appearance), the
        prompts' placeholders already expanded (see `prepare`). `speculative`: None follows the engine config
        (`EngineConfig.speculative`); False turns speculative decoding off for these prompts, True leaves it on; a
        method name ("ngram", "draft", "mtp") or a `SpeculativeConfig` makes this model's engine speculate that way
        from now on (a new engine: its programs compile anew). Greedy tokens are the same with or without it;
        sampled ones are distributed alike. `adapter`: the served LoRA adapter (see `day0jax.load`'s `adapters`)
        all prompts take, or one per prompt (None: the base model); prompts of different adapters share batches.

        Raises:
            GenerationError: invalid prompts or parameters, a prompt too long for the context, or an adapter the
                model does not serve.
            GrammarError: more than one constraint, or one that does not compile.
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise GenerationError("prompts must be a non-empty list of non-empty token-id lists")
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if speculative is not None and not isinstance(speculative, bool):
            self.speculate(speculative)
        params = SamplingParams(max_tokens=int(max_new_tokens), temperature=float(temperature), top_p=float(top_p),
                                top_k=int(top_k), seed=seed, stop_token_ids=tuple(stop_token_ids or ()),
                                ignore_eos=ignore_eos, grammar=self._grammar(json_schema, regex, choice),
                                logit_bias=tuple((int(t), float(v)) for t, v in (logit_bias or {}).items()),
                                speculative=speculative is not False)
        inputs = self.images.rows(images, prompts)
        adapters = [adapter] * len(prompts) if adapter is None or isinstance(adapter, str) else list(adapter)
        if len(adapters) != len(prompts):
            raise GenerationError(f"{len(adapters)} adapters for {len(prompts)} prompts; give one, or one per prompt")
        engine = self.engine
        self._compile_for(prompts, params, inputs)
        ids = [f"generate-{next(self._request_ids)}" for _ in prompts]
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        queued, running = list(zip(ids, prompts, inputs, adapters)), set()
        try:
            while queued or running:
                while queued:  # as many as the queue takes; the rest once some have finished
                    rid, prompt, row_images, row_adapter = queued[0]
                    try:
                        engine.add_request(rid, prompt, dataclasses.replace(params, adapter=row_adapter),
                                           images=row_images)
                    except QueueFull:
                        if not running:
                            raise
                        break
                    queued.pop(0)
                    running.add(rid)
                for event in engine.step():
                    if event.request_id in out:
                        if event.token is not None:
                            out[event.request_id].append(event.token)
                        if event.finish_reason is not None:
                            running.discard(event.request_id)
        except BaseException:
            for rid in running:
                engine.abort(rid)
            while engine.has_work():  # frees the aborted requests' pages
                engine.step()
            raise
        return [out[rid] for rid in ids]


    def speculate(self, speculative) -> None:
        """Makes this model's engine speculate as `speculative` says (a `SpeculativeConfig`, a method name, or None
        for off); a new engine (and runner) replaces the current one when that changes its config.

        Raises:
            GenerationError: a speculative config that cannot work.
        """
        from day0jax.engine.config import SpeculativeConfig

        spec = SpeculativeConfig(speculative) if isinstance(speculative, str) else speculative
        if spec == self.engine_config.speculative:
            return
        if self._engine is not None and self._engine.has_work():
            raise GenerationError("the engine is busy; change speculative decoding between generate calls")
        self.engine_config = dataclasses.replace(self.engine_config, speculative=spec)
        self.engine_config.layout(self.context_length)  # checks it
        self._engine = self._runner = None

    def _grammar(self, json_schema, regex, choice):
        from day0jax.engine.grammar import GrammarError

        given = [name for name, v in (("json_schema", json_schema), ("regex", regex), ("choice", choice))
                 if v is not None]
        if len(given) > 1:
            raise GrammarError(f"at most one of json_schema, regex and choice, got {', '.join(given)}", given[1])
        if json_schema is not None:
            return self.grammars.json_schema(json_schema, "json_schema")
        if regex is not None:
            return self.grammars.regex(regex, "regex")
        if choice is not None:
            return self.grammars.choice(list(choice), "choice")
        return None


def _round_up_pow2(n: int, minimum: int) -> int:
    return 1 << (max(n, minimum) - 1).bit_length()
