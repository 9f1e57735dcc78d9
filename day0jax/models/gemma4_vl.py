"""Gemma 4 with images: its vision tower (`vision.gemma4_vit`: images at their own size, k x k patches pooled into
a token) and `embed_vision` in front of the `gemma4_text` language model. An image is `<boi>` + its tokens +
`<eoi>`; with `use_bidirectional_attention: "vision"` an image's tokens attend to each other both ways in the
sliding layers only (global layers stay causal, unlike Gemma 3). Per-layer inputs see an image token as the pad
token. The audio tower is not implemented: its tensors are dropped, said by name at conversion.
HF reference: transformers/models/gemma4/modeling_gemma4.py (`Gemma4Model`), processing_gemma4.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.core.hf_config import refuse
from day0jax.layers.attention import ContextKV
from day0jax.models.contract import Family
from day0jax.models.gemma3 import visible_until
from day0jax.models.vision_language import (VisionLanguageConfig, VisionLanguageModel, expand_markers,
                                            language_model_dropped, language_model_source, prefixed_source)
from day0jax.vision import gemma4_vit
from day0jax.vision.spec import VisionSpec

DEFAULT_SOFT_TOKENS = 280  # the image processor's max_soft_tokens default, for a checkpoint without its config
AUDIO_DROPPED = "the audio tower: audio input is not implemented (text and images are)"


@dataclass(frozen=True, eq=False)
class Config(VisionLanguageConfig):
    """`Gemma4Config`'s keys. `audio_config` is read only to say that audio is dropped."""

    DEFAULT_TEXT_TYPE = "gemma4_text"
    VISION_CONFIG = gemma4_vit.VisionConfig
    audio_config: dict | None = None
    boi_token_id: int | None = 255_999
    eoi_token_id: int | None = 258_882
    image_token_id: int | None = 258_880
    video_token_id: int | None = 258_884
    boa_token_id: int | None = 256_000
    eoa_token_index: int | None = 258_883
    audio_token_id: int | None = 258_881
    initializer_range: float | None = 0.02
    tie_word_embeddings: bool | None = True
    model_type: str = "gemma4"

    def __post_init__(self):
        if self.vision_config is None:
            refuse("vision_config", None, "is missing: a Gemma 4 checkpoint without its vision tower is not "
                   "implemented")
        self._check_derived("text", "vision")
        if self.text.model_type != "gemma4_text":
            refuse("text_config.model_type", self.text.model_type, "is not Gemma 4's language model (gemma4_text)")

    @cached_property
    def vision(self) -> gemma4_vit.VisionConfig:
        return gemma4_vit.VisionConfig.from_hf(self.vision_config)

    @property
    def tokens_per_image(self) -> None:
        return None  # one per k x k block of the image's patches

    @property
    def pad_token_id(self) -> int:
        """The language model's pad token (HF's `text_config.pad_token_id`, default 0): what per-layer inputs read
        at image tokens."""
        pad = (self.text_config or {}).get("pad_token_id", 0)
        return 0 if pad is None else int(pad)


class Model(VisionLanguageModel):
    def make_vision(self, *, dtype, rngs: nnx.Rngs) -> None:
        c = self.config
        self.vision_tower = gemma4_vit.VisionModel(c.vision, dtype=dtype, rngs=rngs)
        self.embed_vision = gemma4_vit.Embedder(c.vision, c.text.hidden_size, dtype=dtype, rngs=rngs)

    @property
    def vision_spec(self) -> VisionSpec:
        c, k = self.config, self.config.vision.pooling_kernel_size
        most = self.image_patch_limit or DEFAULT_SOFT_TOKENS * k * k
        return VisionSpec(c.image_token_id, None, None, c.text.hidden_size, merge=k,
                          bidirectional=c.text.use_bidirectional_attention == "vision",
                          encoder=gemma4_vit.Patches(c.vision, most))

    @jax.named_scope("vision")
    def encode_images(self, patches, positions, pooled) -> tuple[jax.Array, None]:
        """One image's patches padded to the processor's most (`gemma4_vit.Patches`) -> ([P / k^2, D], None)."""
        return self.embed_vision(self.vision_tower(patches, positions, pooled)), None

    def vision_op_calls(self):
        return self.vision_tower.op_calls()

    def expand_image_placeholders(self, text: str, counts, tokenizer, grids=None) -> str:
        """Gemma4Processor's expansion: each image token becomes `<boi>` + the image's tokens + `<eoi>`."""
        c = self.config
        boi, eoi, image = (tokenizer.decode([i]) for i in (c.boi_token_id, c.eoi_token_id, c.image_token_id))
        expand_markers(text, image, image, len(counts))  # refuses a template that drops or adds images
        parts = text.split(image)
        return parts[0] + "".join(boi + image * n + eoi + rest for n, rest in zip(counts, parts[1:]))

    def text_tokens(self, tokens: jax.Array) -> jax.Array:
        """`tokens` as the language model's embeddings read them: image, video and audio tokens (wherever they
        are, generated ones too) as the pad token, as HF does."""
        c = self.config
        special = [t for t in (c.image_token_id, c.video_token_id, c.audio_token_id) if t is not None]
        return jnp.where(jnp.isin(tokens, jnp.asarray(special, tokens.dtype)), c.pad_token_id, tokens)

    def embed(self, tokens, image_features, image_mask):
        return super().embed(self.text_tokens(tokens), image_features, image_mask)

    def _inputs(self, tokens, positions, caches, image_mask):
        """(the tokens per-layer inputs read: `text_tokens`; each layer's cache, the sliding layers' seeing an
        image's later tokens where its tokens attend both ways)."""
        tokens = self.text_tokens(tokens)
        if image_mask is None or not self.vision_spec.bidirectional or tokens.shape[1] == 1:
            return tokens, caches
        until = visible_until(positions, image_mask)
        kinds = self.config.text.layer_kinds
        if caches is None:  # the cache-less forward: caches of this call's keys and values carry the spans
            return tokens, [ContextKV(visible_until=until) if kind == "sliding_attention" else None
                            for kind in kinds]
        return tokens, [c if c is None or kind != "sliding_attention" else dataclasses.replace(c, visible_until=until)
                        for c, kind in zip(caches, kinds)]

    def __call__(self, tokens, positions, caches=None, seq_len=None, image_features=None, image_mask=None):
        embeds = self.embed(tokens, image_features, image_mask)
        carry_tokens, layer_caches = self._inputs(tokens, positions, caches, image_mask)
        hidden, new = self.language_model(carry_tokens, positions, layer_caches, seq_len, embeds=embeds)
        return hidden, (None if caches is None else new)

    def hidden_states(self, tokens, positions, seq_len=None, image_features=None, image_mask=None):
        embeds = self.embed(tokens, image_features, image_mask)
        carry_tokens, layer_caches = self._inputs(tokens, positions, None, image_mask)
        return self.language_model.hidden_states(carry_tokens, positions, seq_len, embeds=embeds,
                                                 caches=layer_caches)


def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict):
    if path.startswith("language_model."):
        return language_model_source(config, path, shape, metadata)
    return prefixed_source(path, shape, metadata)


def dropped_for(config: Config) -> dict[str, str]:
    out = language_model_dropped(config)
    out.update({r"model\.audio_tower\..*": AUDIO_DROPPED, r"model\.embed_audio\..*": AUDIO_DROPPED})
    return out


FAMILY = Family(model_types=("gemma4",), config=Config, model=Model, dropped={}, dropped_for=dropped_for,
                hf_source=hf_source)
