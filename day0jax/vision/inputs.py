"""A vision-language model's images on their way in: OpenAI-style chat messages' image parts, the checkpoint's
preprocessing (`processors`), the placeholders expanded and checked, and `ImageInputs`, what a request hands the
engine (pixels, tokens per image, later the tower's features).

`ModelImages` is what `Model` delegates its image work to: `prepare`, `logits` and `generate` and the server all
go through it, so an image is preprocessed, checked and laid out one way.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from day0jax.core.errors import GenerationError
from day0jax.vision.images import load_image
from day0jax.vision.spec import VisionSpec
from day0jax.vision.video import Video


class ImageInputs:
    """A request's images, preprocessed for the model's vision tower (`VisionSpec.pack`), shared by the request's
    sequences.

    Attributes:
        pixels: float32, in order of appearance: [I, ...] one image per entry, or the patches of all images one after
            another (towers that take images of any size).
        counts: each image's number of placeholder tokens.
        grids: each image's (t, h, w) patch grid, for towers that take images of any size (else None).
        digest: a hash of the pixels and grids: it salts the prefix cache, so equal placeholder tokens over other
            images never share cached keys and values.
        features, deepstack: [n, D] the projected features, one per image token, and [k, n, D] the DeepStack
            features where the model has them; computed by the engine on the first prefill chunk (None until then).
        spans: [(start, end)] of each run of image tokens in the prompt, where a model's image tokens attend to
            each other both ways: the scheduler never ends a prefill chunk inside one (empty otherwise).
        rope_positions, rope_delta: multimodal RoPE: the prompt's positions [T, 3] and the offset of those after it.
        timestamps: per entry, None for an image, or a video's seconds shown before each temporal patch's frames
            (videos are entries like images, of grid (temporal patches, h, w), their tokens the video placeholder).
    """

    def __init__(self, pixels: np.ndarray, counts: Sequence[int], grids: tuple | None = None,
                 timestamps: Sequence | None = None):
        self.pixels = np.ascontiguousarray(pixels, dtype=np.float32)
        self.counts, self.grids = list(counts), grids
        self.timestamps = list(timestamps) if timestamps is not None else [None] * len(self.counts)
        self.digest = hashlib.blake2b(self.pixels.tobytes() + repr((self.pixels.shape, grids,
                                                                    self.timestamps)).encode(),
                                      digest_size=16, person=b"day0jax-images").digest()
        self.features: np.ndarray | None = None
        self.deepstack: np.ndarray | None = None
        self.spans: list[tuple[int, int]] = []
        self.rope_positions: np.ndarray | None = None
        self.rope_delta = 0

    def __len__(self) -> int:
        return len(self.counts)


def chat_images(messages: Sequence[dict], allowed_media_dir=None) -> tuple[list[dict], list[Any]]:
    """OpenAI-style messages -> (messages whose image parts are `{"type": "image"}` and video parts (`video`:
    frames, `video_url`: an animated GIF / WebP / PNG) `{"type": "video"}`, as chat templates expect, and the
    images and `Video`s, decoded, in order of appearance).

    Raises:
        ImageError: an image part that cannot be read.
        GenerationError: an image part without its image.
    """
    out, images = [], []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in ("image_url", "image"):
                    source = part.get(kind)
                    if kind == "image_url" and isinstance(source, dict):
                        source = source.get("url")
                    if source is None:
                        raise GenerationError(f"a content part of type {kind!r} has no {kind!r} field")
                    images.append(load_image(source, allowed_media_dir=allowed_media_dir))
                    parts.append({"type": "image"})
                elif kind in ("video_url", "video"):
                    images.append(Video.from_part(part, allowed_media_dir=allowed_media_dir))
                    parts.append({"type": "video"})
                else:
                    parts.append(part)
            m = dict(m, content=parts)
        out.append(m)
    return out, images


def place_features(tokens: np.ndarray, spec: VisionSpec, rows: Sequence[Any]) -> dict[str, np.ndarray]:
    """Host side, for a cache-less forward: each row's image inputs laid out at its placeholder positions.

    Args:
        tokens: [B, T] token ids.
        spec: the model's `VisionSpec`.
        rows: per row, its `ImageInputs` with features encoded, or None (text only).
    Returns:
        The model's image inputs: `image_features` [B, T, D] float32 and `image_mask` [B, T] bool, and where the
        model has them `rope_positions` [B, T, 3] int32 and `deepstack` [k, B, T, D].
    """
    B, T = tokens.shape
    mask = spec.placeholders(tokens)
    out = {"image_features": np.zeros((B, T, spec.dim), np.float32), "image_mask": mask}
    if spec.mrope is not None:
        out["rope_positions"] = np.broadcast_to(np.arange(T, dtype=np.int32)[None, :, None], (B, T, 3)).copy()
    if spec.deepstack:
        out["deepstack"] = np.zeros((spec.deepstack, B, T, spec.dim), np.float32)
    for b, images in enumerate(rows):
        if images is None or not len(images):
            mask[b] = False  # a text-only row's ids that equal the placeholder are text
            continue
        out["image_features"][b, mask[b]] = images.features
        if spec.deepstack:
            out["deepstack"][:, b, mask[b]] = images.deepstack
        if spec.mrope is not None:  # over the whole row: padding after the tokens is text that changes none of them
            out["rope_positions"][b] = spec.mrope(tokens[b].tolist(), images.grids)[0]
    return out


class ModelImages:
    """One model's image handling: its checkpoint's preprocessing (read on first use), the expansion of each
    image's placeholder, and the checks and layout of images beside token ids.

    Args:
        spec: the model's `VisionSpec`, or None for a text-only model (every image is then refused).
        path: the checkpoint folder (its preprocessor_config.json / processor_config.json).
        model_type: for messages.
        expand: the family's `expand_image_placeholders(text, counts, tokenizer, grids=...)`.
        encode: `ImageInputs` -> (features, DeepStack features): the runner's vision tower.
    """

    def __init__(self, spec: VisionSpec | None, path: Path, model_type: str,
                 expand: Callable[[str, Sequence[int], Any], str] | None,
                 encode: Callable[["ImageInputs"], tuple[np.ndarray, np.ndarray | None]]):
        self.spec, self.path, self.model_type = spec, Path(path), model_type
        self._expand, self._encode = expand, encode
        self._processor = self._video_processor = None

    def _refuse_unless_vision(self) -> None:
        if self.spec is None:
            raise GenerationError(f"this {self.model_type} model takes no images")

    @property
    def processor(self):
        """The checkpoint's image preprocessing (`processors.image_processor`), read on first use.

        Raises:
            GenerationError: a text-only model, or a checkpoint without preprocessor_config.json.
        """
        self._refuse_unless_vision()
        if self._processor is None:
            from day0jax.vision.processors import image_processor

            files = [self.path / n for n in ("preprocessor_config.json", "processor_config.json")]
            if not any(f.is_file() for f in files):
                raise GenerationError(f"{self.path} has no preprocessor_config.json: images cannot be preprocessed "
                                      "(convert the checkpoint again from a folder that has it)")
            self._processor = image_processor(self.path)
        return self._processor

    @property
    def video_processor(self):
        """The checkpoint's video preprocessing (`video.video_processor`), read on first use.

        Raises:
            GenerationError: a model that takes no videos, or a checkpoint without a video processor config.
        """
        self._refuse_unless_vision()
        if self.spec.video_token_id is None:
            raise GenerationError(f"this {self.model_type} model takes no videos")
        if self._video_processor is None:
            from day0jax.core.errors import ConfigError
            from day0jax.vision.video import video_processor

            try:
                self._video_processor = video_processor(self.path)
            except ConfigError as e:
                raise GenerationError(str(e)) from e
        return self._video_processor

    def inputs(self, images: Sequence[Any]) -> "ImageInputs":
        """One row's images (PIL images or uint8 HxWx3 arrays) and videos (`Video`), in order of appearance,
        preprocessed for the vision tower.

        Raises:
            ImageError: an image or video that cannot be read; GenerationError: a text-only model, or a video for a
                model that takes none.
        """
        processor = self.processor
        # Arrays go to the processor as they are: a torchvision-backend processor converts RGBA arrays its own way.
        processed = [self.video_processor.preprocess(im) if isinstance(im, Video)
                     else processor.preprocess(im if isinstance(im, np.ndarray) else load_image(im)) for im in images]
        return ImageInputs(*self.spec.pack(processed), timestamps=[getattr(p, "timestamps", None) for p in processed])

    def expand(self, text: str, images: Sequence[Any], tokenizer) -> tuple[str, "ImageInputs"]:
        """A rendered chat `text` with each image's placeholder expanded to its tokens, and the images'
        `ImageInputs` (the server and `Model.prepare` share this).

        Raises:
            GenerationError: a text-only model, or a template that does not show each image once.
            ImageError: an image that cannot be read.
        """
        inputs = self.inputs(images)
        if any(t is not None for t in inputs.timestamps):  # only families that take videos know the keyword
            return self._expand(text, inputs.counts, tokenizer, grids=inputs.grids,
                                timestamps=inputs.timestamps), inputs
        return self._expand(text, inputs.counts, tokenizer, grids=inputs.grids), inputs

    def encode(self, inputs: "ImageInputs") -> tuple[np.ndarray, np.ndarray | None]:
        """`ImageInputs` through the vision tower and projector: (features [n, D], DeepStack features [k, n, D] or
        None), float32; kept on `inputs` (`.features`, `.deepstack`)."""
        if inputs.features is None:
            inputs.features, inputs.deepstack = self._encode(inputs)
        return inputs.features, inputs.deepstack

    def features(self, images: Sequence[Any]) -> np.ndarray:
        """One row's images through the vision tower and projector: [n, D] float32, one per image token."""
        self._refuse_unless_vision()
        if not images:
            return np.zeros((0, self.spec.dim), np.float32)
        return self.encode(self.inputs(images))[0]

    def rows(self, images: Sequence[Sequence[Any]] | None, token_rows: Sequence[Sequence[int]]) -> list:
        """Per row of token ids, its `ImageInputs` (None: no images), after checking that each row's placeholders
        take exactly its images.

        Raises:
            GenerationError: a row count that differs, images for a text-only model, or placeholders that do not
                match the images.
        """
        if images is None:
            inputs = [None] * len(token_rows)
        else:
            if len(images) != len(token_rows):
                raise GenerationError(f"images has {len(images)} rows for {len(token_rows)} rows of token ids")
            if any(images):
                self._refuse_unless_vision()
            inputs = [self.inputs(row) if row else None for row in images]
        if self.spec is not None:
            for b, (tokens, row) in enumerate(zip(token_rows, inputs)):
                found = int(self.spec.placeholders(np.asarray(tokens, np.int64)).sum())
                needed = 0 if row is None else sum(row.counts)
                if found != needed:
                    raise GenerationError(
                        f"row {b} has {found} image placeholder tokens (id {self.spec.image_token_id}) for "
                        f"{0 if row is None else len(row)} image(s) that take {needed}; expand each image's "
                        "placeholder (`Model.prepare` does)")
        return inputs

    def arrays(self, tokens: np.ndarray, rows: Sequence[Any]) -> dict[str, np.ndarray]:
        """A cache-less forward's image inputs for padded `tokens` [B, T] and each row's `ImageInputs` (or None),
        encoded and laid out on the host (`place_features`)."""
        for inputs in rows:
            if inputs is not None:
                self.encode(inputs)
        return place_features(tokens, self.spec, list(rows) + [None] * (len(tokens) - len(rows)))
