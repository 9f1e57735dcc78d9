"""What one engine step hands the runner's programs, built on the host from the scheduled sequences.

`InputBatch` (owned by the runner, which knows the layout and the vision tower) makes the forward's `Batch` for the
decode rows or one prefill chunk (tokens, positions, block tables, lengths, state slots, and a vision-language
model's image features and RoPE positions) and the sampler's `SamplingMetadata` (per-row seeds and settings, and
only where some row needs them the penalty arrays and the grammar masks with logit biases); with speculative
decoding, the verify batch (each decode row's input token and its drafts) and what the acceptance takes (the drafts,
and a grammar mask per position).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Sequence

import numpy as np

from day0jax.engine.config import EngineLayout, smallest_bucket
from day0jax.engine.paged_cache import TRASH_PAGE
from day0jax.engine.requests import ImageInputs, InvalidRequest, SequenceState
from day0jax.engine.sampling import MAX_LOGIT_BIAS
from day0jax.engine.state_cache import TRASH_SLOT

ROW_ARRAYS = ("seeds", "counters", "temperature", "top_k", "top_p", "min_p")


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
    # Verify batches only: [B, T] the slot for each row's state after each of its tokens (see state_cache.py)
    state_targets: np.ndarray | None = None
    # Models serving LoRA adapters only: [B] each row's adapter slot (0: none; see `layers.lora.adapter_rows`)
    adapters: np.ndarray | None = None
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
                self.state_slots, self.state_targets, self.adapters) + image

    def rows(self, start: int, stop: int) -> "Batch":
        """Rows [start, stop) (a pipeline's micro-batch; DeepStack features keep their layer axis first)."""
        return Batch(**{f.name: None if getattr(self, f.name) is None
                        else getattr(self, f.name)[:, start:stop] if f.name == "deepstack"
                        else getattr(self, f.name)[start:stop] for f in fields(self)})


@dataclass
class SamplingMetadata:
    """The sampler's inputs for one call: `rows` the per-row arrays of `sampling.sample` (ROW_ARRAYS), and the
    optional host arrays: `penalties` (counts, seen, presence, frequency, repetition) and `guidance` (grammar masks,
    logit-bias ids and values), None where no row needs them; `sampled`: some row samples (else its greedy token is
    the forward's own), `logprobs`: some row wants log-probabilities."""

    rows: dict[str, np.ndarray]
    penalties: tuple | None
    guidance: tuple | None
    sampled: bool
    logprobs: bool


class InputBatch:
    """Builds what the runner's programs take, from the scheduled sequences.

    Args:
        layout: the engine's buckets and page size.
        vision: a vision-language model's `VisionSpec` (None: text only).
        vocab_size: V, for the penalty and grammar arrays.
        encode: a request's `ImageInputs` -> (features, DeepStack features), the runner's vision tower.
    """

    def __init__(self, layout: EngineLayout, vision, vocab_size: int,
                 encode: Callable[[ImageInputs], tuple[np.ndarray, np.ndarray | None]]):
        self.layout, self.vision, self.vocab_size, self._encode = layout, vision, vocab_size, encode
        self._penalties: dict[int, RowPenalties] = {}  # by row count: the penalty arrays kept between steps

    @property
    def penalty_builds(self) -> int:
        """[rows, V] penalty arrays allocated so far (one per row count used), and rows written whole (a sequence
        joining a row); tokens added to a row the next step are not counted."""
        return sum(p.builds for p in self._penalties.values())

    def empty(self, rows: int, tokens: int, width: int, verify: bool = False) -> Batch:
        """A batch of padding only: every token goes to the trash page (`verify`: a verify batch, whose state
        targets are the trash slot)."""
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
                     state_targets=np.full((rows, tokens), TRASH_SLOT, np.int32) if verify else None,
                     adapters=np.zeros(rows, np.int32) if self.layout.adapters else None, **image)

    def padded(self, batch: Batch, shape: tuple[int, int, int]) -> Batch:
        """`batch` grown to `shape` with padding: rows and tokens that write to the trash page, and block-table
        columns holding it (a running row's positions never reach them)."""
        out = self.empty(*shape, verify=batch.state_targets is not None)
        B, T = batch.tokens.shape
        if batch.state_targets is not None:
            out.state_targets[:B, :T] = batch.state_targets
        out.tokens[:B, :T], out.positions[:B, :T] = batch.tokens, batch.positions
        out.block_tables[:B, :batch.block_tables.shape[1]] = batch.block_tables
        for name in ("kv_lengths", "last_index", "token_source", "state_slots"):
            getattr(out, name)[:B] = getattr(batch, name)
        if batch.adapters is not None:
            out.adapters[:B] = batch.adapters
        if batch.image_features is not None:
            out.image_features[:B, :T], out.image_mask[:B, :T] = batch.image_features, batch.image_mask
        if batch.rope_positions is not None:
            out.rope_positions[:B, :T] = batch.rope_positions
        if batch.deepstack is not None:
            out.deepstack[:, :B, :T] = batch.deepstack
        return out

    def decode(self, seqs: Sequence[SequenceState], token_source: Callable[[SequenceState], int]) -> Batch:
        """One token per sequence at its next position, in the smallest batch and width buckets that hold them; a
        sequence whose input token is still on the device reads it from row `token_source(seq)` of the previous
        sampler output."""
        L = self.layout
        rows = smallest_bucket(L.batch_buckets, len(seqs))
        width = smallest_bucket(L.decode_widths, max(s.num_computed // L.page_size + 1 for s in seqs))
        batch = self.empty(rows, 1, width)
        for i, s in enumerate(seqs):
            if s.num_computed < len(s.tokens):
                batch.tokens[i, 0] = s.tokens[s.num_computed]
            else:  # sampled last step, not read yet
                batch.token_source[i] = token_source(s)
            batch.positions[i, 0] = s.num_computed
            if batch.rope_positions is not None:  # past the prompt: the index plus the images' offset
                batch.rope_positions[i, 0] = s.num_computed + (s.images.rope_delta if s.images is not None else 0)
            batch.kv_lengths[i] = s.num_computed + 1
            batch.state_slots[i] = s.slot
        self._adapter_rows(batch, seqs)
        batch.block_tables[:] = self._table(seqs, rows, width)
        return batch

    def verify(self, seqs: Sequence[SequenceState], token_source: Callable[[SequenceState], int]) -> Batch:
        """Each decode row's input token at its next position, then its drafts (`seq.drafts`) at the positions
        after it: [rows, k + 1] in the smallest verify batch and width buckets that hold them, rows with fewer
        drafts padded. A row whose input token is still on the device reads it as `decode` does. Each row's state
        after its j-th token goes to its j-th state slot (`seq.slots`)."""
        L = self.layout
        T = L.spec_tokens + 1
        rows = smallest_bucket(L.batch_buckets, len(seqs))
        width = smallest_bucket(L.decode_widths, max((s.num_computed + len(s.drafts)) // L.page_size + 1
                                                     for s in seqs))
        batch = self.empty(rows, T, width, verify=True)
        for i, s in enumerate(seqs):
            n, d = s.num_computed, len(s.drafts)
            if n < len(s.tokens):
                batch.tokens[i, 0] = s.tokens[n]
            else:
                batch.token_source[i] = token_source(s)
            batch.tokens[i, 1:1 + d] = s.drafts
            batch.positions[i, :1 + d] = np.arange(n, n + 1 + d)
            if batch.rope_positions is not None:
                delta = s.images.rope_delta if s.images is not None else 0
                batch.rope_positions[i, :1 + d] = (np.arange(n, n + 1 + d) + delta)[:, None]
            batch.kv_lengths[i] = n + 1 + d
            batch.state_slots[i] = s.slot
            owned = s.slots or [s.slot]
            batch.state_targets[i] = (owned * T)[:T]
        self._adapter_rows(batch, seqs)
        batch.block_tables[:] = self._table(seqs, rows, width)
        return batch

    def block_tables(self, seqs: Sequence[SequenceState], rows: int, last: int) -> np.ndarray:
        """The rows' block tables in the smallest decode width holding position `last`."""
        L = self.layout
        width = smallest_bucket(L.decode_widths, last // L.page_size + 1)
        return self._table(seqs, rows, width)

    def drafts(self, seqs: Sequence[SequenceState], rows: int) -> tuple[np.ndarray, np.ndarray]:
        """The acceptance's drafts [rows, k] (0 past each row's) and their counts [rows]."""
        k = self.layout.spec_tokens
        drafts, counts = np.zeros((rows, k), np.int32), np.zeros(rows, np.int32)
        for i, s in enumerate(seqs):
            drafts[i, :len(s.drafts)] = s.drafts
            counts[i] = len(s.drafts)
        return drafts, counts

    def prefill(self, seq: SequenceState, n: int) -> Batch:
        """The sequence's next `n` prompt tokens as one chunk, in the smallest chunk and width buckets."""
        L = self.layout
        chunk = smallest_bucket(L.chunk_buckets, n)
        start = seq.num_computed
        width = smallest_bucket(L.prefill_widths, -(-(start + n) // L.page_size))
        batch = self.empty(1, chunk, width)
        batch.tokens[0, :n] = seq.tokens[start:start + n]
        batch.positions[0, :n] = np.arange(start, start + n)
        if batch.rope_positions is not None:
            batch.rope_positions[0, :n] = self._rope_positions(seq, start, n)
        batch.kv_lengths[0] = start + n
        batch.last_index[0] = n - 1
        batch.state_slots[0] = seq.slot
        self._adapter_rows(batch, [seq])
        batch.block_tables[:] = self._table([seq], 1, width)
        if seq.images is not None:
            self._place_image_features(seq, batch, start, n)
        return batch

    def adapter_slot(self, name: str | None) -> int:
        """The slot of the served adapter `name` (0: None, the base model).

        Raises:
            InvalidRequest: no adapter of that name is served.
        """
        if name is None:
            return 0
        if name not in self.layout.adapters:
            served = ", ".join(map(repr, self.layout.adapters)) or "none"
            raise InvalidRequest(f"the LoRA adapter {name!r} is not served (served: {served})", "model")
        return self.layout.adapters.index(name) + 1

    def _adapter_rows(self, batch: Batch, seqs: Sequence[SequenceState]) -> None:
        if batch.adapters is not None:
            batch.adapters[:len(seqs)] = [self.adapter_slot(s.params.adapter) for s in seqs]

    def _table(self, seqs: Sequence[SequenceState], rows: int, width: int) -> np.ndarray:
        table = np.full((rows, width), TRASH_PAGE, np.int32)
        for i, s in enumerate(seqs):
            table[i, :len(s.pages)] = s.pages[:width]
        return table

    @staticmethod
    def _rope_positions(seq: SequenceState, start: int, n: int) -> np.ndarray:
        """Multimodal RoPE positions [n, 3] of the sequence's tokens [start, start + n): the prompt's from its
        images' layout, the rest (generated, or all of a text-only prompt) the index plus the images' offset."""
        index = np.arange(start, start + n)
        images = seq.images
        if images is None or images.rope_positions is None:
            return np.repeat(index[:, None], 3, axis=1)
        out = np.repeat((index + images.rope_delta)[:, None], 3, axis=1)
        inside = index < len(images.rope_positions)
        out[inside] = images.rope_positions[index[inside]]
        return out

    def _place_image_features(self, seq: SequenceState, batch: Batch, start: int, n: int) -> None:
        """Fills the chunk's image features (and DeepStack features): the sequence's image tokens in
        [start, start + n) take theirs in order (encoded once, on its first chunk)."""
        images = seq.images
        if images.features is None:
            images.features, images.deepstack = self._encode(images)
        is_image = self.vision.placeholders(np.asarray(seq.tokens[:seq.prompt_len], np.int32))
        first = int(is_image[:start].sum())  # features before this chunk
        mask = is_image[start:start + n]
        where = np.flatnonzero(mask)
        batch.image_mask[0, :len(mask)] = mask
        batch.image_features[0, where] = images.features[first:first + len(where)]
        if images.deepstack is not None:
            batch.deepstack[:, 0, where] = images.deepstack[:, first:first + len(where)]

    def check_images(self, prompt: list[int], images: ImageInputs | None) -> None:
        """Checks a request's images against its prompt and the model, and lays them out for its prefill: the
        multimodal RoPE positions, and the runs of image tokens a chunk must not cut where they attend both ways.

        Raises:
            InvalidRequest: images for a text-only model, placeholders that do not match the images, images
                preprocessed to another shape, or one image's tokens longer than the largest chunk where they must
                be prefilled together.
        """
        vision = self.vision
        if vision is None:
            if images is not None and len(images):
                raise InvalidRequest("this model takes no images", "images")
            return
        placeholders = int(vision.placeholders(np.asarray(prompt, np.int64)).sum())
        given = 0 if images is None else len(images)
        needed = 0 if images is None else sum(images.counts)
        if placeholders != needed:
            raise InvalidRequest(f"the prompt has {placeholders} image placeholder tokens (id {vision.image_token_id})"
                                 f" and its {given} image(s) take {needed}; expand each image's placeholder as "
                                 "`Model.prepare` does", "images")
        if given and vision.pixel_shape is not None and images.pixels.shape[1:] != vision.pixel_shape:
            raise InvalidRequest(f"images are preprocessed to {vision.pixel_shape}, got {images.pixels.shape[1:]}",
                                 "images")
        if given and vision.mrope is not None:
            images.rope_positions, images.rope_delta = vision.mrope(prompt, images.grids)
        if given and vision.bidirectional:
            images.spans = token_runs(prompt, vision.image_token_id)
            longest, chunk = max(e - s for s, e in images.spans), self.layout.chunk_buckets[-1]
            if longest > chunk:
                raise InvalidRequest(f"this model's image tokens attend to each other, so one image's {longest} "
                                     f"tokens are prefilled in one chunk, and the engine's largest chunk is {chunk} "
                                     "(EngineConfig.chunk_buckets)", "images")

    def sampling(self, seqs: Sequence[SequenceState], rows: int, positions: int = 0) -> SamplingMetadata:
        """The sampler's inputs for the leading rows of a [rows, V] logits array, one per sequence (the padding rows
        greedy and unpenalized); `positions`: the acceptance's for a [rows, positions, V] verify, whose grammar masks
        are one per position (the grammar advanced through the row's drafts before it)."""
        pad = rows - len(seqs)
        p = [s.params for s in seqs]

        def col(values, dtype, fill):
            return np.array(list(values) + [fill] * pad, dtype)

        arrays = dict(seeds=col((s.seed for s in seqs), np.uint32, 0),
                      counters=col((s.num_generated for s in seqs), np.int32, 0),
                      temperature=col((q.temperature for q in p), np.float32, 0.0),
                      top_k=col((q.top_k for q in p), np.int32, 0),
                      top_p=col((q.top_p for q in p), np.float32, 1.0),
                      min_p=col((q.min_p for q in p), np.float32, 0.0))
        penalties = self._penalty_arrays(seqs, rows) if any(q.penalized for q in p) else None
        guidance = None
        if any(q.guided for q in p):
            guidance = self._guidance_arrays(seqs, rows) if not positions else \
                self._draft_guidance_arrays(seqs, rows, positions)
        return SamplingMetadata(arrays, penalties, guidance, sampled=any(q.sampled for q in p),
                                logprobs=any(q.logprobs is not None for q in p))

    def _penalty_arrays(self, seqs: Sequence[SequenceState], B: int) -> tuple:
        if B not in self._penalties:
            self._penalties[B] = RowPenalties(B, self.vocab_size)
        return self._penalties[B].update(seqs)

    def _guidance_arrays(self, seqs: Sequence[SequenceState], B: int) -> tuple:
        """Each row's grammar mask (for the token its matcher is at) and logit biases, as `apply_guidance` takes
        them."""
        allowed, bias_ids, bias = self.neutral_guidance(B)
        for i, seq in enumerate(seqs):
            q = seq.params
            if q.grammar is not None:
                if seq.matcher is None:
                    seq.matcher = q.grammar.matcher()
                seq.matcher.fill(allowed[i])
            for j, (token, value) in enumerate(q.logit_bias):
                bias_ids[i, j], bias[i, j] = token, value
        return allowed, bias_ids, bias

    def _draft_guidance_arrays(self, seqs: Sequence[SequenceState], B: int, T: int) -> tuple:
        """As `_guidance_arrays`, with a grammar mask per position: the matcher advanced through the row's drafts
        (as far as its grammar allows them: past a draft it refuses, the draft is rejected and the masks unused),
        then rolled back."""
        allowed, bias_ids, bias = self.neutral_guidance(B)
        allowed = np.repeat(allowed[:, None], T, axis=1)
        for i, seq in enumerate(seqs):
            q = seq.params
            if q.grammar is not None:
                if seq.matcher is None:
                    seq.matcher = q.grammar.matcher()
                consumed = 0
                for t in range(len(seq.drafts) + 1):
                    row = allowed[i, t]
                    seq.matcher.fill(row)
                    if t == len(seq.drafts) or seq.matcher.done:
                        break
                    token = seq.drafts[t]
                    if not (row[token // 32] >> (token % 32)) & 1 or not seq.matcher.consume(token):
                        break
                    consumed += 1
                seq.matcher.rollback(consumed)
            for j, (token, value) in enumerate(q.logit_bias):
                bias_ids[i, j], bias[i, j] = token, value
        return allowed, bias_ids, bias

    def neutral_guidance(self, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`sampling.apply_guidance`'s arrays allowing every token and biasing none."""
        return (np.full((rows, -(-self.vocab_size // 32)), -1, np.int32), np.zeros((rows, MAX_LOGIT_BIAS), np.int32),
                np.zeros((rows, MAX_LOGIT_BIAS), np.float32))

    @staticmethod
    def neutral_rows(rows: int) -> dict[str, np.ndarray]:
        """Per-row sampler arrays of greedy, unfiltered rows."""
        return dict(seeds=np.zeros(rows, np.uint32), counters=np.zeros(rows, np.int32),
                    temperature=np.zeros(rows, np.float32), top_k=np.zeros(rows, np.int32),
                    top_p=np.ones(rows, np.float32), min_p=np.zeros(rows, np.float32))


class RowPenalties:
    """The penalty arrays of a [rows, V] sampler call (`sampling.apply_penalties`), kept from one step to the next:
    a row is written whole only when a sequence joins it and cleared when one leaves, and otherwise only the tokens
    its sequence generated since the last step are added, so a step costs O(rows + new tokens), not O(rows x V).
    Rows of sequences without penalties stay neutral (zero counts, nothing seen, penalties 0, 0 and 1), which leaves
    their logits exactly as they were.

    Args:
        rows: the row count of the calls it serves.
        vocab_size: V.
    """

    def __init__(self, rows: int, vocab_size: int):
        self.counts, self.seen = np.zeros((rows, vocab_size), np.float32), np.zeros((rows, vocab_size), bool)
        self.presence, self.frequency = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
        self.repetition = np.ones(rows, np.float32)
        # Per row, the sequence it holds and how many of its tokens are counted (None: a neutral row).
        self.held: list[tuple[SequenceState, int] | None] = [None] * rows
        self.builds = 1  # the arrays allocated, then one per row written whole

    def update(self, seqs: Sequence[SequenceState]) -> tuple:
        """The arrays for `seqs` in rows 0.. (the rest neutral): (counts, seen, presence, frequency, repetition)."""
        V = self.counts.shape[1]
        for i in range(len(self.held)):
            seq = seqs[i] if i < len(seqs) else None
            if seq is not None and not seq.params.penalized:
                seq = None
            held = self.held[i]
            if seq is None:
                if held is not None:  # a sequence left: neutral again
                    self.counts[i], self.seen[i] = 0, False
                    self.presence[i], self.frequency[i], self.repetition[i] = 0, 0, 1
                    self.held[i] = None
                continue
            if held is not None and held[0] is seq and len(seq.tokens) >= held[1]:
                new = np.asarray(seq.tokens[held[1]:], np.int64)
                if new.size:  # generated since the last step
                    np.add.at(self.counts[i], new, 1)
                    self.seen[i, new] = True
            else:
                if seq.counts is None:  # the sequence's own counts, which the engine keeps as tokens arrive
                    seq.counts = np.zeros(V, np.float32)
                    np.add.at(seq.counts, np.asarray(seq.tokens[seq.prompt_len:], np.int64), 1)
                    seq.seen = np.zeros(V, bool)
                    seq.seen[np.asarray(seq.tokens, np.int64)] = True
                self.counts[i], self.seen[i] = seq.counts, seq.seen
                q = seq.params
                self.presence[i], self.frequency[i] = q.presence_penalty, q.frequency_penalty
                self.repetition[i] = q.repetition_penalty
                self.builds += 1
            self.held[i] = (seq, len(seq.tokens))
        return self.counts, self.seen, self.presence, self.frequency, self.repetition


def token_runs(tokens: Sequence[int], token: int) -> list[tuple[int, int]]:
    """[(start, end)] of each maximal run of `token` in `tokens` (end exclusive)."""
    runs, start = [], None
    for i, t in enumerate(list(tokens) + [None]):
        if t == token and start is None:
            start = i
        elif t != token and start is not None:
            runs.append((start, i))
            start = None
    return runs
