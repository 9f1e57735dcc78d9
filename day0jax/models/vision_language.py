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
from flax import nnx

from day0jax import models
from day0jax.core.errors import GenerationError, UnsupportedArchitecture
from day0jax.core.hf_tensors import Source, default_source
from day0jax.models.base import build_config
from day0jax.vision.spec import VisionSpec, WholeImages


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


class VisionLanguageModel(nnx.Module):
    """The language model (`language_model`, its family's module) beside the vision parts a family makes in
    `make_vision`. `encode_images` turns preprocessed pixels into features of the language model's width; `__call__`
    puts them in place of the embeddings of the positions `image_mask` marks."""

    def __init__(self, config: VisionLanguageConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        # The most patches the checkpoint's image processor makes of one image (`loader.prepare` reads it), for
        # towers of any image size: their programs cover up to it. None: unknown.
        self.image_patch_limit: int | None = None
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

    def expand_image_placeholders(self, text: str, counts: Sequence[int], tokenizer, grids=None) -> str:
        """The rendered chat `text` with each image's placeholder expanded as the family's HF processor does
        (default: the image token's text, once per image in the template, repeated as many times as the image has
        tokens, `counts` in order; `grids`, each image's (t, rows, columns) where images keep their size, for
        families that lay the tokens out by row).

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
