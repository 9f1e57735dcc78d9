"""The runner's compiled programs: what one is (`Program`) and which ones an engine needs (`ProgramCatalog`): all of
them, the set a server compiles before it is ready, the rest in the order a background compiler takes them, and
those a given batch of requests can reach. With speculative decoding, the verify programs (decode rows with their
drafts, logits at every position) and the acceptance are compiled like the others.
"""

from __future__ import annotations

from dataclasses import dataclass

from day0jax.engine.config import EngineLayout, smallest_bucket


@dataclass(frozen=True)
class Program:
    """One compiled program of the runner, for one bucket."""

    # "forward" (shape: rows, tokens, width in pages), "verify" (the same shape: decode rows and their drafts, the
    # logits of every position), "draft" (a draft model's forward over a prefill chunk), "propose" (a device
    # proposer's drafting after a verify step or a prompt: rows, tokens kept, width), "sample" (shape: rows),
    # "accept" (shape: rows, tokens: speculative acceptance) or
    # "encode" (a vision tower's call on one image: shape () for towers of one image size, (patches,) padded for
    # those of any size)
    name: str
    shape: tuple[int, ...]
    # Samplers only (mode and logprobs are run-time choices): taking the [B, V] penalty arrays, taking the grammar
    # masks and logit biases.
    penalized: bool = False
    guided: bool = False
    # Forward programs of a model split into pipeline stages: the stage this program runs, on the micro-batches of
    # a batch of `shape`.
    stage: int | None = None

    @property
    def label(self) -> str:
        if self.name in ("forward", "verify", "draft", "propose"):
            return "x".join(map(str, self.shape)) + ("" if self.stage is None else f" stage {self.stage}")
        if self.name == "encode":
            return "image" + "".join(f" {n} patches" for n in self.shape)
        extras = "".join(f"+{x}" for x, on in (("penalties", self.penalized), ("guidance", self.guided)) if on)
        return "x".join(map(str, self.shape)) + extras


class ProgramCatalog:
    """Which programs an engine runs.

    Args:
        layout: the engine's buckets.
        stages: the pipeline stages this process runs (indices), or None for a model that is not split.
        encode_keys: a vision tower's program shapes (`VisionSpec.encoder.keys()`), empty for text models.
    """

    def __init__(self, layout: EngineLayout, stages: list[int] | None, encode_keys: list[tuple] = ()):
        self.layout, self.stages, self.encode_keys = layout, stages, list(encode_keys)
        # The device proposer of speculative decoding, whose programs these are too: "draft" (a draft model: its
        # prefill chunks and its drafting) or "mtp" (the model's own layers: its drafting); None for none.
        self.proposer: str | None = None

    def proposing(self, widths=None, rows: int | None = None, chunks=None) -> list[Program]:
        """The device proposer's programs: drafting after a verify step (per verify batch and width) and after a
        prompt (one row, one token), and a draft model's prefill chunks; none without a device proposer."""
        L = self.layout
        if self.proposer is None or not L.spec_tokens:
            return []
        widths = L.decode_widths if widths is None else widths
        top = L.spec_rows if rows is None else min(smallest_bucket(L.batch_buckets, rows), L.spec_rows)
        out = [Program("propose", (b, L.spec_tokens + 1, w)) for w in widths for b in L.batch_buckets if b <= top]
        chunks = L.chunk_buckets if chunks is None else chunks
        if self.proposer == "draft":  # its prefill chunks, and its drafting after a prompt's last one
            out += [Program("propose", (1, 1, w)) for w in widths]
            out += [Program("draft", (1, c, w)) for w in L.prefill_widths for c in chunks]
        else:  # the MTP layers over each prefill chunk (drafting after a prompt's last one)
            out += [Program("propose", (1, c, w)) for w in L.prefill_widths for c in chunks]
        return list(dict.fromkeys(out))

    def forward(self, shape: tuple[int, int, int]) -> list[Program]:
        """The programs a forward call of `shape` (rows, tokens, width in pages) runs: one, or one per local stage."""
        if self.stages is None:
            return [Program("forward", shape)]
        return [Program("forward", shape, stage=s) for s in self.stages]

    def verify(self, shape: tuple[int, int, int]) -> list[Program]:
        """The verify programs of `shape` (rows, k + 1 tokens, width in pages): one, or one per local stage."""
        if self.stages is None:
            return [Program("verify", shape)]
        return [Program("verify", shape, stage=s) for s in self.stages]

    def accepts(self, rows: int | None = None) -> list[Program]:
        """The acceptance programs (with and without penalties, with and without guidance) per verify batch
        bucket, up to `rows`' bucket."""
        L = self.layout
        if not L.spec_tokens:
            return []
        top = L.spec_rows if rows is None else min(smallest_bucket(L.batch_buckets, rows), L.spec_rows)
        return [Program("accept", (b, L.spec_tokens + 1), penalized, guided) for b in L.batch_buckets if b <= top
                for penalized in (False, True) for guided in (False, True)]

    def encode(self) -> list[Program]:
        """A vision-language model's tower programs: one per image shape bucket (none for text models)."""
        return [Program("encode", k) for k in self.encode_keys]

    def all(self, max_len: int | None = None) -> list[Program]:
        """The forward programs of `layout.forward_shapes(max_len)`, then the samplers (with and without penalties,
        with and without guidance) per row count, then the tower's."""
        limit = max(max_len, self.layout.page_size * self.layout.decode_widths[0]) if max_len else None
        verify = [p for s in self.layout.verify_shapes() if not limit or s[2] * self.layout.page_size <= limit
                  for p in self.verify(s)]
        return ([p for s in self.layout.forward_shapes(max_len) for p in self.forward(s)] + verify +
                [Program("sample", (r,), penalized, guided) for r in self.layout.sampler_batches()
                 for penalized in (False, True) for guided in (False, True)] + self.accepts() + self.encode() +
                [p for p in self.proposing() if not limit or p.shape[2] * self.layout.page_size <= limit
                 or p.name == "draft" or p.shape[1] not in (1, self.layout.spec_tokens + 1)])

    def ready(self) -> list[Program]:
        """What a server compiles before it is ready (`--warmup ready`): decode at the smallest span for one row and
        for the most rows (which covers every decode batch at that span, padded), each prefill chunk at the
        smallest span, and the plain sampler (no penalties, no grammar) for those row counts."""
        L = self.layout
        rows = sorted({L.batch_buckets[0], L.batch_buckets[-1]})
        shapes = [(r, 1, L.decode_widths[0]) for r in rows] + [(1, c, L.prefill_widths[0]) for c in L.chunk_buckets]
        forward = [p for shape in shapes for p in self.forward(shape)]
        if L.spec_tokens:  # verify at the smallest span for one row and for the most that speculate
            forward += [p for r in sorted({L.batch_buckets[0], L.spec_rows})
                        for p in self.verify((r, L.spec_tokens + 1, L.decode_widths[0]))]
            forward += [p for p in self.accepts() if not p.penalized and not p.guided
                        and p.shape[0] in (L.batch_buckets[0], L.spec_rows)]
            forward += [p for p in self.proposing([L.decode_widths[0]]) if p.shape[0] in (1, L.spec_rows)
                        and p.shape[2] in (L.decode_widths[0], L.prefill_widths[0])]
        return forward + [Program("sample", (r,)) for r in sorted(set(rows) | {1})] + self.encode()

    def background(self, ready: list[Program], max_len: int | None = None) -> list[Program]:
        """`all(max_len)` not in `ready`, most likely needed first: the tower's, plain samplers, then forward
        programs by span (the short spans every request starts with), the most rows first, then the samplers with
        penalties or guidance."""
        def rank(p: Program):
            if p.name == "encode":  # first: an image's prefill waits for its tower
                return (-1, *p.shape)
            if p.name in ("sample", "accept"):
                return (2 if p.penalized or p.guided else 0, p.shape[0], p.penalized, p.guided)
            rows, tokens, width = p.shape
            return (1, width, -rows, tokens, p.name)  # the most rows first: padded, they serve every smaller batch
        return sorted((p for p in self.all(max_len) if p not in ready), key=rank)

    def for_requests(self, rows: int, longest_prompt: int, max_len: int, *, sampled: bool, penalized: bool,
                     guided: bool) -> list[Program]:
        """The programs `rows` sequences can take whose prompts are at most `longest_prompt` tokens and which end by
        `max_len`: decode for each batch bucket up to `rows`' and each span width up to `max_len`, prefill for each
        chunk up to the longest prompt's, and (`sampled`: some row samples, takes penalties, a grammar or logprobs)
        the sampler per row count."""
        layout = self.layout

        def up_to(buckets, n):  # the buckets up to the one that covers n
            return [b for b in buckets if b <= smallest_bucket(buckets, n)]

        pages = -(-max_len // layout.page_size)
        prompt_pages = -(-longest_prompt // layout.page_size)
        top = min(rows, layout.max_rows)
        shapes = [(r, 1, w) for w in up_to(layout.decode_widths, pages) for r in up_to(layout.batch_buckets, top)]
        shapes += [(1, c, w) for w in up_to(layout.prefill_widths, prompt_pages)
                   for c in up_to(layout.chunk_buckets, longest_prompt)]
        forward = [p for shape in shapes for p in self.forward(shape)]
        if layout.spec_tokens:
            forward += [p for w in up_to(layout.decode_widths, pages) for r in up_to(layout.batch_buckets, top)
                        if r <= layout.spec_rows for p in self.verify((r, layout.spec_tokens + 1, w))]
            forward += [p for p in self.accepts(top) if (p.penalized, p.guided) == (False, False)
                        or sampled and (penalized or not p.penalized) and (guided or not p.guided)]
            chunks = up_to(layout.chunk_buckets, longest_prompt)
            widest = smallest_bucket(layout.prefill_widths, prompt_pages)
            forward += [p for p in self.proposing(up_to(layout.decode_widths, pages), top, chunks)
                        if p.shape[1] in (1, layout.spec_tokens + 1) and p.name == "propose" or p.shape[2] <= widest]
        samplers = [Program("sample", (r,), penalized, guided) for r in layout.sampler_batches()
                    if r <= smallest_bucket(layout.batch_buckets, top)]
        return forward + (samplers if sampled else [])
