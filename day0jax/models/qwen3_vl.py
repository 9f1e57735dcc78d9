"""Qwen3-VL: the Qwen3-VL vision tower (`vision.qwen_vit`) over images of any size (a grid of 2x2-merged patches
each), a Qwen3 language model (`qwen3_vl_text`) with interleaved multimodal RoPE (image tokens at 3-D positions,
text after an image continuing from its largest side, the offset carried into decoding), and DeepStack: the tower's
intermediate features added to the first layers' hidden states at the image tokens. Videos (`vision.video`) go
the same way: one tower call over frame pairs (temporal patches), each shown after its timestamp as a run of video
tokens at (start, row, column) positions.
HF reference: transformers/models/qwen3_vl/modeling_qwen3_vl.py (`Qwen3VLModel.get_rope_index`,
`Qwen3VLTextModel._deepstack_process`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from day0jax.core.errors import GenerationError
from day0jax.core.hf_config import refuse
from day0jax.models.contract import Family
from day0jax.models.vision_language import (VisionLanguageConfig, VisionLanguageModel, language_model_dropped,
                                            language_model_source, prefixed_source)
from day0jax.vision import qwen_vit
from day0jax.vision.spec import VisionSpec

@dataclass(frozen=True, eq=False)
class Config(VisionLanguageConfig):
    DEFAULT_TEXT_TYPE = "qwen3_vl_text"
    TEXT_TYPES = ("qwen3_vl_text",)  # the language models this family's checkpoints hold
    VISION_CONFIG = qwen_vit.VisionConfig
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tie_word_embeddings: bool | None = False
    model_type: str = "qwen3_vl"

    def __post_init__(self):
        self._check_derived("text", "vision")
        if self.text.model_type not in self.TEXT_TYPES:
            refuse("text_config.model_type", self.text.model_type,
                   f"is not this family's language model ({', '.join(self.TEXT_TYPES)})")
        if self.vision.out_hidden_size != self.text.hidden_size:
            refuse("vision_config.out_hidden_size", self.vision.out_hidden_size,
                   f"differs from the language model's hidden_size={self.text.hidden_size}")
        if len(self.vision.deepstack_layers) > self.text.num_hidden_layers:
            refuse("vision_config.deepstack_visual_indexes", self.vision.deepstack_visual_indexes,
                   f"feeds more layers than the language model's {self.text.num_hidden_layers}")

    @cached_property
    def vision(self) -> qwen_vit.VisionConfig:
        given = dict(self.vision_config or {})
        # HF's default tower feeds 3584 wide features, which no default language model takes: without the key, the
        # features are as wide as the language model.
        given.setdefault("out_hidden_size", self.text.hidden_size)
        return qwen_vit.VisionConfig.from_hf(given)

    @property
    def tokens_per_image(self) -> None:
        return None  # as many as the image's merged patches


def rope_positions(tokens: Sequence[int], grids: Sequence[tuple[int, int, int]], *, image_token_id: int,
                   merge: int, video_token_id: int | None = None) -> tuple[np.ndarray, int]:
    """HF's `get_rope_index` for one sequence: each token's (t, h, w) RoPE positions [T, 3] and the offset of the
    positions after it (the largest + 1 - T), which decoding adds to a token's index.

    Text tokens count on from the last position; an image's tokens (its runs of `image_token_id`, grids taken in
    order) sit at (start + frame, start + row, start + column) of its merged grid, and the text after it starts at
    start + its larger side. A video's grid (t, h, w) is t frames of (1, h, w), each its own run of `video_token_id`
    (timestamps and frame markers between them), as HF splits `video_grid_thw`."""
    tokens = np.asarray(tokens)
    out = np.zeros((len(tokens), 3), np.int64)
    grids, current, i, frames_left = list(grids), 0, 0, 0
    while i < len(tokens):
        if tokens[i] == video_token_id:
            if not frames_left:
                frames_left, video_h, video_w = grids.pop(0)
            frames_left, t, h, w = frames_left - 1, 1, video_h // merge, video_w // merge
        elif tokens[i] == image_token_id:
            t, h, w = grids.pop(0)
            h, w = h // merge, w // merge
        else:
            out[i] = current
            current, i = current + 1, i + 1
            continue
        frames, rows, cols = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        n = t * h * w
        out[i:i + n] = current + np.stack([frames, rows, cols], -1).reshape(n, 3)
        current, i = current + max(h, w), i + n
    return out.astype(np.int32), int(out.max() + 1 - len(tokens)) if len(tokens) else 0


class Model(VisionLanguageModel):
    def make_vision(self, *, dtype, rngs: nnx.Rngs) -> None:
        self.visual = qwen_vit.VisionModel(self.config.vision, dtype=dtype, rngs=rngs)

    @property
    def vision_spec(self) -> VisionSpec:
        c = self.config
        merge = c.vision.spatial_merge_size
        return VisionSpec(c.image_token_id, None, None, c.text.hidden_size, merge=merge,
                          mrope=partial(rope_positions, image_token_id=c.image_token_id, merge=merge,
                                        video_token_id=c.video_token_id),
                          deepstack=len(c.vision.deepstack_layers),
                          encoder=qwen_vit.PatchBuckets(c.vision, limit=self.image_patch_limit),
                          video_token_id=c.video_token_id)

    def expand_image_placeholders(self, text: str, counts: Sequence[int], tokenizer, grids=None,
                                  timestamps=None) -> str:
        """As `VisionLanguageModel.expand_image_placeholders`, with videos among the images (`timestamps`: per
        entry None for an image, a video's seconds per temporal patch): Qwen3VLProcessor's expansion of each
        `<|vision_start|><|video_pad|><|vision_end|>` the template renders into, per temporal patch,
        `<{seconds:.1f} seconds><|vision_start|>` + its video tokens + `<|vision_end|>`.

        Raises:
            GenerationError: the template's image and video placeholders are not the entries, in order.
        """
        if timestamps is None or all(t is None for t in timestamps):
            return super().expand_image_placeholders(text, counts, tokenizer, grids=grids)
        c, merge = self.config, self.config.vision.spatial_merge_size
        image, video, start, end = (tokenizer.decode([i]) for i in (c.image_token_id, c.video_token_id,
                                                                     c.vision_start_token_id, c.vision_end_token_id))
        pattern = re.compile("|".join(re.escape(m) for m in (start + video + end, image, video)))
        found, rest = pattern.findall(text), pattern.split(text)
        kinds = ["image" if f == image else "video" for f in found]
        wanted = ["image" if t is None else "video" for t in timestamps]
        if kinds != wanted:
            raise GenerationError(f"the chat template rendered the placeholders {kinds} for the entries {wanted}; "
                                  "this checkpoint's template may not take them")
        out = rest[0]
        for n, grid, seconds, after in zip(counts, grids, timestamps, rest[1:]):
            if seconds is None:
                out += image * n
            else:
                frame = video * (grid[1] * grid[2] // merge ** 2)
                out += "".join(f"<{s:.1f} seconds>{start}{frame}{end}" for s in seconds)
            out += after
        return out

    @jax.named_scope("vision")
    def encode_images(self, patches, taps, weights, rotary, segments) -> tuple[jax.Array, jax.Array | None]:
        """One image's patches [P, C * T * p * p], padded, and what its grid fixes (`qwen_vit.PatchBuckets`) ->
        (features [P / merge^2, D], DeepStack features [k, P / merge^2, D])."""
        embeds, deepstack = self.visual.forward(patches, taps, weights, rotary, segments)
        return embeds, (jnp.stack(deepstack) if deepstack else None)

    def vision_op_calls(self):
        return self.visual.op_calls()

    def _inputs(self, tokens, image_features, image_mask, rope_positions, deepstack) -> dict:
        """The language model's inputs: embeddings with the image features, the 3-D RoPE positions, and the
        DeepStack features at the image tokens, added after the first layers (zero elsewhere)."""
        injections = () if deepstack is None else tuple(jnp.where(image_mask[..., None], d, 0.0) for d in deepstack)
        return dict(embeds=self.embed(tokens, image_features, image_mask), rope_positions=rope_positions,
                    injections=injections)

    def __call__(self, tokens, positions, caches=None, seq_len=None, image_features=None, image_mask=None,
                 rope_positions=None, deepstack=None):
        return self.language_model(tokens, positions, caches, seq_len,
                                   **self._inputs(tokens, image_features, image_mask, rope_positions, deepstack))

    def hidden_states(self, tokens, positions, seq_len=None, image_features=None, image_mask=None,
                      rope_positions=None, deepstack=None):
        return self.language_model.hidden_states(
            tokens, positions, seq_len, **self._inputs(tokens, image_features, image_mask, rope_positions, deepstack))


def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict):
    if path.startswith("language_model."):
        return language_model_source(config, path, shape, metadata)
    tower = "visual."

    def own(p, s):
        src = qwen_vit.hf_source(p[len(tower):], s, metadata) if p.startswith(tower) else None
        return None if src is None else src.renamed(lambda n: tower + n)
    return prefixed_source(path, shape, metadata, own)


def dropped_for(config: Config) -> dict[str, str]:
    return language_model_dropped(config)

FAMILY = Family(model_types=("qwen3_vl",), config=Config, model=Model, dropped={}, dropped_for=dropped_for,
                hf_source=hf_source)
