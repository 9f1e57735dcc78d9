"""What vision-language families share: the outer config (its `text_config` is any supported text family's), the
module holding that language model beside a vision tower and a projector, and the merge of image features into the
token embeddings at the image placeholder tokens.

The language model keeps its own family's code and HF names under `language_model.` (HF: `model.language_model.`);
its engine protocol (`cache_layout`, `logits`, the cache) is the language model's, so the engine runs a
vision-language model as it runs a text one, with image features as one more input of its programs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, ClassVar, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from day0jax import models
from day0jax.core.errors import GenerationError, UnsupportedArchitecture
from day0jax.core.hf_tensors import Source, default_source
from day0jax.models.base import build_config


@dataclass(frozen=True, eq=False)
class VisionLanguageConfig:
    """Base of vision-language configs: fields are the outer config.json keys; `text` is the language model's family
    config (built from `text_config`, the outer `tie_word_embeddings` applying), and any attribute this config lacks
    is the language model's (`hidden_size`, `vocab_size`, ...), so code written for text models reads it unchanged.
    Families add their keys, `vision` (the tower's config) and `tokens_per_image`."""

    ALIASES: ClassVar[dict[str, str]] = {}
    DEFAULT_TEXT_TYPE: ClassVar[str] = "llama"  # HF's default `text_config` model_type
    VISION_CONFIG: ClassVar[type]  # the tower's config class (its fields are `vision_config`'s keys)
    text_config: dict | None = None
    vision_config: dict | None = None
    tie_word_embeddings: bool | None = None
    model_type: str = ""
    unknown_keys: tuple = dataclasses.field(default=(), kw_only=True)

    @classmethod
    def from_hf(cls, hf: dict, *, strict: bool = True):
        """The config for a parsed config.json.

        Raises:
            UnsupportedArchitecture: an unknown outer key (when strict), a text family or vision tower we lack, or a
                value the family does not implement.
            ConfigError: a required key is missing.
        """
        return build_config(cls, hf, strict)

    def __post_init__(self):
        self._check_derived("text", "vision")

    def _check_derived(self, *names: str) -> None:
        for name in names:
            getattr(self, name)

    def __getattr__(self, name: str) -> Any:
        # Only for attributes not found otherwise: the language model's. Fields and dunders never come here
        # unless missing (during construction), and must not recurse into `text`.
        if name.startswith("_") or name in {f.name for f in dataclasses.fields(self)} or name == "text":
            raise AttributeError(name)
        return getattr(self.text, name)

    @cached_property
    def text(self) -> Any:
        """The language model's config, of its own family (`text_config.model_type`)."""
        hf = dict(self.text_config or {})
        hf.setdefault("model_type", self.DEFAULT_TEXT_TYPE)
        if self.tie_word_embeddings is not None:
            hf["tie_word_embeddings"] = self.tie_word_embeddings
        fam = models.family(hf["model_type"])
        if not isinstance(fam.model, type) or not issubclass(fam.model, models.base.CausalLM):
            raise UnsupportedArchitecture(f"text_config model_type {hf['model_type']!r} cannot be the language "
                                          f"model of {self.model_type}")
        return fam.config.from_hf(hf)

    @property
    def vision(self) -> Any:
        raise NotImplementedError

    @property
    def image_token_id(self) -> int:
        raise NotImplementedError

    @property
    def tokens_per_image(self) -> int | None:
        """Placeholder tokens (and image features) per image; None where each image has as many as its patches."""
        raise NotImplementedError

    @property
    def is_composite(self) -> bool:
        return False


@dataclass(frozen=True)
class VisionSpec:
    """What the engine needs to know of a model's images.

    Attributes:
        image_token_id: the placeholder token; dim: the features' width (the language model's).
        tokens_per_image, pixel_shape: for towers of one image size (LLaVA, Gemma 3): tokens per image and one
            preprocessed image's shape; None where images keep their own size (Qwen-VL).
        bidirectional: one image's tokens attend to each other both ways (Gemma 3): a prefill chunk holds them all.
        merge: images of their own size: patches per token side (an image of grid (t, h, w) takes t*h*w / merge^2
            tokens).
        encoder: how one image becomes the tower's inputs, and the program shapes that cover every image
            (`WholeImages`, `vision.qwen_vit.PatchBuckets`).
        mrope: multimodal RoPE: (prompt tokens, image grids) -> (RoPE positions [T, 3], the offset of the positions
            after the prompt), on the host.
        deepstack: how many feature arrays the tower adds to the first layers' hidden states (DeepStack).
    """

    image_token_id: int
    tokens_per_image: int | None
    pixel_shape: tuple[int, ...] | None
    dim: int
    bidirectional: bool = False
    merge: int | None = None
    mrope: Callable | None = None
    deepstack: int = 0
    encoder: Any = None

    def pack(self, processed: Sequence[Any]) -> tuple[np.ndarray, list[int], tuple | None]:
        """Processed images (`vision.processors.ProcessedImage`s) -> (pixels as the tower takes them: stacked, or
        the patches of all images one after another; tokens per image; grids or None)."""
        if self.pixel_shape is not None:
            pixels = (np.stack([np.asarray(p.pixel_values, np.float32) for p in processed]) if processed
                      else np.zeros((0, *self.pixel_shape), np.float32))
            return pixels, [self.tokens_per_image] * len(processed), None
        grids = tuple(tuple(int(v) for v in p.grid_thw) for p in processed)
        pixels = np.concatenate([np.asarray(p.pixel_values, np.float32) for p in processed])
        return pixels, [t * h * w // self.merge ** 2 for t, h, w in grids], grids

    def encoder_calls(self, pixels: np.ndarray, grids: tuple | None) -> list[tuple[tuple, tuple, int]]:
        """One (program key, tower inputs, token count) per image of packed `pixels` (see `pack`)."""
        if grids is None:
            return [self.encoder.inputs(p, None) for p in pixels]
        calls, start = [], 0
        for t, h, w in grids:
            calls.append(self.encoder.inputs(pixels[start:start + t * h * w], (t, h, w)))
            start += t * h * w
        return calls


@dataclass(frozen=True)
class WholeImages:
    """The `VisionSpec.encoder` of towers of one image size: one image per call, one program."""

    pixel_shape: tuple[int, ...]
    tokens: int

    def keys(self) -> list[tuple]:
        return [()]

    def inputs(self, pixels: np.ndarray, grid=None) -> tuple[tuple, tuple[np.ndarray], int]:
        return (), (pixels[None],), self.tokens

    def example(self, key: tuple) -> tuple[np.ndarray]:
        return (np.zeros((1, *self.pixel_shape), np.float32),)


def encode_host(spec: VisionSpec, pixels: np.ndarray, grids: tuple | None, run: Callable
                ) -> tuple[np.ndarray, np.ndarray | None]:
    """Encodes packed images one call each: `run(key, arrays)` -> (features, DeepStack features or None) of one
    (possibly padded) call; returns their real tokens concatenated: ([n, D], [k, n, D] or None), float32."""
    features, deepstack = [], []
    for key, arrays, tokens in spec.encoder_calls(pixels, grids):
        f, d = run(key, arrays)
        features.append(np.asarray(f, np.float32)[:tokens])
        if d is not None:
            deepstack.append(np.asarray(d, np.float32)[:, :tokens])
    return np.concatenate(features), (np.concatenate(deepstack, axis=1) if deepstack else None)


class VisionLanguageModel(nnx.Module):
    """The language model (`language_model`, its family's module) beside the vision parts a family makes in
    `make_vision`. `encode_images` turns preprocessed pixels into features of the language model's width; `__call__`
    puts them in place of the embeddings of the positions `image_mask` marks."""

    def __init__(self, config: VisionLanguageConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.language_model = models.family(config.text.model_type).model(config.text, dtype=dtype, rngs=rngs)
        self.make_vision(dtype=dtype, rngs=rngs)

    def make_vision(self, *, dtype, rngs: nnx.Rngs) -> None:
        raise NotImplementedError

    @property
    def vision_spec(self) -> VisionSpec:
        c = self.config
        return VisionSpec(c.image_token_id, c.tokens_per_image, self.pixel_shape, c.text.hidden_size,
                          encoder=WholeImages(self.pixel_shape, c.tokens_per_image))

    @property
    def pixel_shape(self) -> tuple[int, ...]:
        """One preprocessed image's shape (default: [C, S, S] of a square-image tower)."""
        v = self.config.vision
        return (v.num_channels, v.image_size, v.image_size)

    def encode_images(self, *inputs: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """One call's tower inputs (`VisionSpec.encoder.inputs`) -> (features [n, D], one per image token in order,
        padding's after; DeepStack features [k, n, D] or None)."""
        raise NotImplementedError

    def vision_hidden_states(self, pixels: jax.Array) -> list[jax.Array]:
        """The tower's hidden states as HF's `output_hidden_states` reports them, as far as this model computes
        them (`day0jax.verify` compares them layer by layer)."""
        return self.vision_tower.vision_model(pixels)

    def expand_image_placeholders(self, text: str, counts: Sequence[int], tokenizer) -> str:
        """The rendered chat `text` with each image's placeholder expanded as the family's HF processor does
        (default: the image token's text, once per image in the template, repeated as many times as the image has
        tokens, `counts` in order).

        Raises:
            GenerationError: the template does not show each image exactly once.
        """
        marker = tokenizer.decode([self.config.image_token_id])
        expand_markers(text, marker, marker, len(counts))  # refuses a template that drops or adds images
        parts = text.split(marker)
        return parts[0] + "".join(marker * n + rest for n, rest in zip(counts, parts[1:]))

    def cache_layout(self):
        return self.language_model.cache_layout()

    def op_calls(self):
        """The language model's (layer, call)s, then the vision side's, labelled "vision"."""
        return self.language_model.op_calls() + [("vision", call) for call in self.vision_op_calls()]

    def vision_op_calls(self) -> list:
        """The tower's and projector's operators (`OpCall`s)."""
        return self.vision_tower.vision_model.op_calls()

    def logits(self, hidden: jax.Array) -> jax.Array:
        return self.language_model.logits(hidden)

    def embed(self, tokens: jax.Array, image_features: jax.Array | None, image_mask: jax.Array | None) -> jax.Array:
        """The language model's embeddings of `tokens` [B, T], with `image_features` [B, T, D] where `image_mask`
        [B, T] is set (the features are not scaled as Gemma scales its token embeddings, as in HF)."""
        x = self.language_model.embed(tokens)
        if image_features is None:
            return x
        return jnp.where(image_mask[..., None], image_features.astype(x.dtype), x)

    def __call__(self, tokens, positions, caches=None, seq_len=None, image_features=None, image_mask=None):
        """As `CausalLM.__call__`, with the image features of the marked positions (None: text only)."""
        embeds = self.embed(tokens, image_features, image_mask)
        return self.language_model(tokens, positions, caches, seq_len, embeds=embeds)

    def hidden_states(self, tokens, positions, seq_len=None, image_features=None, image_mask=None):
        return self.language_model.hidden_states(tokens, positions, seq_len,
                                                 embeds=self.embed(tokens, image_features, image_mask))


def expand_markers(text: str, marker: str, expansion: str, num_images: int) -> str:
    """`text` with each of its `num_images` occurrences of `marker` replaced by `expansion`.

    Raises:
        GenerationError: `marker` occurs another number of times (the template drops images, or the text holds
            placeholders of its own).
    """
    found = text.count(marker)
    if found != num_images:
        raise GenerationError(f"the chat template rendered {found} image placeholder(s) {marker!r} for {num_images} "
                              "image(s); this checkpoint's template may not take images")
    return text.replace(marker, expansion)


def chat_images(messages: Sequence[dict], allowed_media_dir=None) -> tuple[list[dict], list[Any]]:
    """OpenAI-style messages -> (messages whose image parts are `{"type": "image"}`, as chat templates expect, and
    the images, decoded, in order of appearance).

    Raises:
        ImageError: an image part that cannot be read.
        GenerationError: an image part without its image.
    """
    from day0jax.vision.images import load_image

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
        rows: per row, its `engine.requests.ImageInputs` with features encoded, or None (text only).
    Returns:
        The model's image inputs: `image_features` [B, T, D] float32 and `image_mask` [B, T] bool, and where the
        model has them `rope_positions` [B, T, 3] int32 and `deepstack` [k, B, T, D].
    """
    B, T = tokens.shape
    mask = tokens == spec.image_token_id
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


# --- Hugging Face tensor mapping ---------------------------------------------------------------------------------

# The layouts LLaVA-style checkpoints come in -> the one `hf_source` reads (`model.language_model.`,
# `model.vision_tower.vision_model.`, `model.multi_modal_projector.`, `lm_head.`): before transformers 4.52
# (`language_model.model.`, `vision_tower.vision_model.`), and as transformers 5 saves them (its towers without
# `vision_model.`).
LEGACY_NAMES = ((r"^language_model\.model\.", "model.language_model."), (r"^language_model\.lm_head\.", "lm_head."),
                (r"^(model\.)?vision_tower\.(vision_model\.)?", "model.vision_tower.vision_model."),
                (r"^multi_modal_projector\.", "model.multi_modal_projector."))


def language_model_source(config: VisionLanguageConfig, path: str, shape: tuple[int, ...],
                          metadata: dict) -> Source | None:
    """The Source of a `language_model.` parameter: its text family's mapping, under `model.language_model.`;
    None for other paths."""
    if not path.startswith("language_model."):
        return None
    rel = path[len("language_model."):]
    fam = models.family(config.text.model_type)
    src = fam.hf_source(config.text, rel, shape, metadata) or default_source(rel, shape, metadata)
    return src.renamed(lambda n: "model.language_model." + n[len("model."):] if n.startswith("model.") else n)


def prefixed_source(path: str, shape: tuple[int, ...], metadata: dict,
                    own: Callable[[str, tuple[int, ...]], Source | None] = lambda p, s: None) -> Source:
    """The Source of a vision-side parameter: `own(path, shape)` or the plain mapping, under HF's `model.`."""
    src = own(path, shape) or default_source(path, shape, metadata)
    return src.renamed(lambda n: "model." + n)


def language_model_dropped(config: VisionLanguageConfig) -> dict[str, str]:
    """The text family's dropped tensors (their patterns match under any prefix or are made to)."""
    fam = models.family(config.text.model_type)
    dropped = {**fam.dropped, **fam.dropped_for(config.text)}
    return {(p if p.startswith(".*") else r"model\.language_model\." + p.removeprefix(r"model\.")): why
            for p, why in dropped.items()}
