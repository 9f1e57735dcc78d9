"""The engine's runtime choices (`EngineConfig`) and what they resolve to for one model (`EngineLayout`: the KV page
pool and every program's shape buckets). The memory planner sizes exactly this layout, so `check`, `load` and `serve`
given the same flags plan what the engine then allocates."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence, Union

import jax

from day0jax.core.errors import GenerationError
from day0jax.engine.paged_cache import KV_CACHE_DTYPES
from kernels_pallas.paged_attention import xla_blocks
from sharding.plan import Workload


SPECULATIVE_METHODS = ("ngram", "draft", "mtp")
MAX_LORAS = 4  # LoRA adapters one model serves at once, by default (--max-loras)
MAX_LORA_RANK = 64  # the largest adapter rank served, by default (--max-lora-rank)
# Speculation stops above this many decode rows unless `SpeculativeConfig.max_batch` says otherwise. Measured on a
# 2-core CPU with SmolLM2-135M and k = 4 (bench/speculative.py): a verify step costs 1.5, 1.7, 3.0 and 4.4 plain
# steps at 1, 2, 4 and 8 rows (past 16 rows of tokens the linear maps leave the CPU kernel); a rewriting task keeps
# about 4.7 tokens per row and step, 1.8-2.3x plain at 4 rows but only 1.5x at 8 with every row copying the same
# text, so mixed traffic past 4 rows loses more on rejected drafts than it gains. Not measured on accelerators.
DEFAULT_SPEC_MAX_BATCH = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts up to `num_tokens` tokens per decode row, and one engine step scores
    them all with the target model, keeping the longest prefix the target agrees with plus its own next token.

    Attributes:
        method: "ngram" (prompt lookup: the continuation of the longest recent n-gram match in the request's own
            tokens), "draft" (a smaller day0jax checkpoint with the same tokenizer, `draft_model`) or "mtp" (the
            model's own multi-token-prediction layers, kept by conversion).
        num_tokens: k, drafts per row and step (the verify programs score k + 1 tokens per row).
        ngram_min, ngram_max: the n-gram lengths the ngram proposer matches, longest first.
        draft_model: the draft checkpoint's folder (method "draft").
        max_batch: speculation turns off while more decode rows than this run (None: DEFAULT_SPEC_MAX_BATCH).
    """

    method: str
    num_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    draft_model: str | None = None
    max_batch: int | None = None

    def check(self) -> None:
        """Raises GenerationError naming the first value that cannot work."""
        if self.method not in SPECULATIVE_METHODS:
            raise GenerationError(f"speculative method {self.method!r} is not one of {', '.join(SPECULATIVE_METHODS)}")
        if not 1 <= self.num_tokens <= 16:
            raise GenerationError(f"num_speculative_tokens must be in 1..16, got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise GenerationError(f"ngram_min ({self.ngram_min}) and ngram_max ({self.ngram_max}) must satisfy "
                                  "1 <= ngram_min <= ngram_max")
        if self.method == "draft" and not self.draft_model:
            raise GenerationError("speculative method 'draft' needs a draft model (--draft-model PATH)")
        if self.max_batch is not None and self.max_batch < 0:
            raise GenerationError(f"spec_max_batch must be >= 0, got {self.max_batch}")

    @property
    def rows(self) -> int:
        """The most decode rows that speculate."""
        return DEFAULT_SPEC_MAX_BATCH if self.max_batch is None else self.max_batch


@dataclass(frozen=True)
class EngineConfig:
    """Runtime choices of the engine (not the model's config).

    Decode block-table widths double from `min_width` tokens up to `fine_width` (attention over the table is a large
    part of a CPU decode step, so tight buckets pay), then grow 4x up to max_model_len; prefill widths start at
    max(min_width, 256) and grow 4x.
    """

    page_size: int = 16  # tokens per KV page
    max_model_len: int | None = None  # longest prompt + output (default: the model's context)
    max_num_seqs: int = 16  # the largest decode batch; a CPU gains little past 16 rows, accelerators want more
    kv_cache_tokens: int | None = None  # pool capacity (default: max(max_model_len, 512 per running sequence))
    batch_buckets: tuple[int, ...] | None = None  # decode batch sizes (default: powers of two up to max_num_seqs)
    chunk_buckets: tuple[int, ...] = (32, 256)  # prefill chunk lengths; the largest is the prefill budget per step
    min_width: int = 128
    fine_width: int = 1024
    max_waiting: int = 256  # most queued sequences; more are refused (the server answers 429)
    prefix_caching: bool = True  # reuse cached full blocks across requests
    # What one more prefill step costs, in chunk tokens (the weights read once more, the host's work): a prompt shorter
    # than the largest chunk runs in smaller chunks where that computes fewer tokens in all, padding included. None:
    # 16 on the CPU, where prefill is bound by compute (a 128-token prompt took a 256-token chunk's time); elsewhere
    # the largest chunk, so that no prompt is split to save padding.
    prefill_step_tokens: int | None = None
    # Sliding-window layers keep only their window's pages per sequence (a ring that positions wrap around), so their
    # cache stops growing past the window; their pages then cannot be shared, which turns prefix caching off. False:
    # they keep every page, like full-attention layers.
    window_kv: bool = True
    # A vision-language model's encoded images kept on the host (`vision.spec.FeatureCache`), MiB: an image sent
    # again runs no tower call. 0 turns it off.
    image_cache_mb: int = 256
    # Speculative decoding (None: off); a method name alone ("ngram", "draft", "mtp") takes the defaults.
    speculative: Union[SpeculativeConfig, str, None] = None
    # The KV page pool's dtype: "auto", the model's compute dtype; "fp8", float8_e4m3fn codes with a float32 scale per
    # token and kv head (`kernels_pallas.paged_attention.fp8`), about half of bfloat16's bytes, so twice the tokens in
    # the same memory. Kinds of cache fp8 does not cover are refused (`paged_cache.kv_cache_refusal`).
    kv_cache_dtype: str = "auto"
    # LoRA adapters served beside the model (`adapters.ServedAdapters`): (name, PEFT folder) pairs, a request's
    # `model` naming one; at most `max_loras` of them, each of rank at most `max_lora_rank`.
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = MAX_LORAS
    max_lora_rank: int = MAX_LORA_RANK

    def __post_init__(self):
        if isinstance(self.speculative, str):
            object.__setattr__(self, "speculative", SpeculativeConfig(self.speculative))

    def step_tokens(self, platform: str) -> int:
        """`prefill_step_tokens`, resolved for the devices' platform ('cpu', 'gpu', 'tpu'...)."""
        if self.prefill_step_tokens is not None:
            return self.prefill_step_tokens
        return 16 if platform == "cpu" else max(self.chunk_buckets)

    def layout(self, context_length: int, windows: Sequence[int] = ()) -> "EngineLayout":
        """What this config means for a model whose context is `context_length` tokens and whose sliding-window
        layers have `windows` (0 for full-attention layers).

        Raises:
            GenerationError: a value that cannot work (a pool smaller than one sequence, no rows, ...).
        """
        if self.max_num_seqs < 1:
            raise GenerationError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.page_size < 1:
            raise GenerationError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise GenerationError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not self.chunk_buckets or min(self.chunk_buckets) < 1:
            raise GenerationError(f"chunk sizes must be positive integers, got {self.chunk_buckets}")
        if self.prefill_step_tokens is not None and self.prefill_step_tokens < 0:
            raise GenerationError(f"prefill_step_tokens must be >= 0, got {self.prefill_step_tokens}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise GenerationError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                                  f"{self.kv_cache_dtype!r}")
        spec = self.speculative
        if spec is not None:
            spec.check()
        max_len = min(self.max_model_len or context_length, context_length)
        page = self.page_size
        max_pages_per_seq = -(-max_len // page)
        kv_tokens = self.kv_cache_tokens or max(max_len, 512 * self.max_num_seqs)
        num_pages = -(-kv_tokens // page) + 1  # + the trash page
        if num_pages - 1 < max_pages_per_seq:
            raise GenerationError(f"kv_cache_tokens={kv_tokens} cannot hold one sequence of max_model_len={max_len}")
        # Powers of two below max_num_seqs, and max_num_seqs itself: every running batch has a bucket.
        batches = self.batch_buckets or tuple(1 << i for i in range(self.max_num_seqs.bit_length()))
        batches = tuple(sorted({b for b in batches if b < self.max_num_seqs} | {self.max_num_seqs}))
        chunks = tuple(sorted({min(x, max_len) for x in self.chunk_buckets}))
        k = spec.num_tokens if spec is not None and spec.rows > 0 else 0
        # A window's ring must hold, while a chunk (or a verify step's k + 1 tokens) is written, every position its
        # queries see: window + chunk tokens, over whole pages (+1: they need not start at a page boundary). One
        # ring per running sequence, and the trash's: only where that is fewer pages than the shared pool.
        step = max(chunks[-1], k + 1)
        rings = tuple((w, -(-(w + step) // page) + 1) for w in sorted({w for w in windows if w}))
        rings = tuple((w, r) for w, r in rings if (batches[-1] + 1) * r < num_pages) if self.window_kv else ()
        return EngineLayout(
            max_model_len=max_len, page_size=page, num_pages=num_pages, batch_buckets=batches,
            chunk_buckets=chunks,
            decode_widths=_widths(self.min_width // page, self.fine_width // page, max_pages_per_seq),
            prefill_widths=_widths(max(self.min_width, 256) // page, 0, max_pages_per_seq), rings=rings,
            spec_tokens=k, spec_rows=smallest_bucket(batches, spec.rows) if k else 0,
            image_cache_bytes=max(self.image_cache_mb, 0) << 20, kv_cache_dtype=self.kv_cache_dtype,
            adapters=tuple(name for name, _ in self.lora_modules))


@dataclass(frozen=True)
class EngineLayout:
    """An `EngineConfig` resolved for one model: what the engine allocates and compiles. Buckets ascend."""

    max_model_len: int
    page_size: int
    num_pages: int  # per layer, the trash page included
    batch_buckets: tuple[int, ...]  # decode batch sizes
    chunk_buckets: tuple[int, ...]  # prefill chunk lengths
    decode_widths: tuple[int, ...]  # both widths: block-table pages, the last covering max_model_len
    prefill_widths: tuple[int, ...]
    # (window, pages per sequence) of sliding-window layers that keep only their window: a ring of pages per
    # running sequence (see `paged_cache.ring_table`), ring 0 holding the trash page
    rings: tuple[tuple[int, int], ...] = ()
    # Speculative decoding: k drafts per row (0: off), scored by verify programs of k + 1 tokens per row for batch
    # buckets up to `spec_rows`.
    spec_tokens: int = 0
    spec_rows: int = 0
    image_cache_bytes: int = 256 << 20  # host memory for encoded images (`vision.spec.FeatureCache`)
    kv_cache_dtype: str = "auto"  # `EngineConfig.kv_cache_dtype`
    # The served LoRA adapters' names, adapters[i] in slot i + 1 (`adapters.ServedAdapters`); with any, every
    # forward program takes each row's slot.
    adapters: tuple[str, ...] = ()

    def ring_pages(self, window: int) -> int:
        """Pages per sequence of a layer with this sliding window that keeps only its window (0: it keeps every
        page of the shared pool)."""
        return dict(self.rings).get(window, 0) if window else 0

    @property
    def state_slots(self) -> int:
        """Sequence slots of linear-attention state: one per running sequence (k + 1 with speculation: a verify
        step keeps the state after each of its k + 1 tokens, and the accepted one becomes the sequence's), plus the
        trash slot."""
        return self.batch_buckets[-1] * self.state_copies + 1

    @property
    def state_copies(self) -> int:
        """State slots each running sequence holds."""
        return self.spec_tokens + 1

    @property
    def ring_slots(self) -> int:
        """Rings of a sliding-window layer that keeps only its window: one per running sequence (its group of
        `state_copies` state slots), and the trash's."""
        return self.batch_buckets[-1] + 1

    def verify_shapes(self) -> list[tuple[int, int, int]]:
        """Every (rows, tokens, width in pages) of the verify programs: decode rows with their drafts."""
        if not self.spec_tokens:
            return []
        return [(b, self.spec_tokens + 1, w) for w in self.decode_widths for b in self.batch_buckets
                if b <= self.spec_rows]

    @property
    def max_rows(self) -> int:
        """The largest batch any program sees (decode rows; a prefill chunk is one row)."""
        return self.batch_buckets[-1]

    def forward_shapes(self, max_len: int | None = None) -> list[tuple[int, int, int]]:
        """Every (rows, tokens, width in pages) forward shape the scheduler can ask for; with `max_len`, only
        those attending over at most that many tokens (the smallest widths always included)."""
        shapes = ([(b, 1, w) for w in self.decode_widths for b in self.batch_buckets] +
                  [(1, c, w) for w in self.prefill_widths for c in self.chunk_buckets])
        if max_len:
            limit = max(max_len, self.page_size * min(self.decode_widths[0], self.prefill_widths[0]))
            shapes = [s for s in shapes if s[2] * self.page_size <= limit]
        return shapes

    def workload(self, platform: str | None = None) -> Workload:
        """What the memory planner sizes: the pool's token slots and every program's shape, on `platform` (default:
        JAX's backend), where prefill attention may score keys a block at a time."""
        # where paged attention's xla_blocks takes prefill chunks, and its C++ kernel decode steps
        cpu = (platform or jax.default_backend()) == "cpu"
        return Workload(kv_slots=self.num_pages * self.page_size,
                        forward_shapes=tuple((r, t, w * self.page_size)
                                             for r, t, w in self.forward_shapes() + self.verify_shapes()),
                        sampler_rows=self.max_rows, max_num_seqs=self.max_rows, max_model_len=self.max_model_len,
                        score_block=xla_blocks.BLOCK_PAGES * self.page_size if cpu else None, decode_in_place=cpu,
                        state_slots=self.state_slots,
                        window_slots=tuple((w, self.ring_slots * r * self.page_size) for w, r in self.rings),
                        page_size=self.page_size, kv_cache_dtype=self.kv_cache_dtype)

    def sampler_batches(self) -> list[int]:
        """Every row count the sampler sees: decode batch buckets, and 1 for a prefill's last token."""
        return sorted(set(self.batch_buckets) | {1})


def smallest_bucket(buckets: Sequence[int], n: int) -> int:
    """The smallest bucket >= n (the largest if none is)."""
    for b in buckets:
        if b >= n:
            return b
    return buckets[-1]


@functools.lru_cache(maxsize=4096)
def first_chunk(pending: int, buckets: tuple[int, ...], step_tokens: int) -> int:
    """How many of `pending` prompt tokens (at most the largest bucket) the next prefill step takes: the first chunk of
    the cheapest run of chunks that covers them, each step costing its bucket's length plus `step_tokens`."""
    # cost[r]: the cheapest way to prefill r tokens; pick[r]: its first chunk (the larger one where two tie).
    cost, pick = [0] * (pending + 1), [0] * (pending + 1)
    for r in range(1, pending + 1):
        cost[r] = min(step_tokens + b + cost[max(r - b, 0)] for b in buckets)
        pick[r] = min(r, next(b for b in reversed(buckets) if step_tokens + b + cost[max(r - b, 0)] == cost[r]))
    return pick[pending]


def _widths(smallest: int, fine_until: int, largest: int) -> tuple[int, ...]:
    widths, w = [], max(1, min(smallest, largest))
    while w < largest:
        widths.append(w)
        w *= 2 if w < fine_until else 4
    return tuple(widths) + (largest,)
