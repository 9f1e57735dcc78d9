"""Gemma 3 with images: a SigLIP tower's last hidden state, average-pooled to `mm_tokens_per_image` tokens, through
the soft-embedding norm and a projection into the `gemma3_text` language model's embeddings. The tokens of one image
attend to each other both ways inside the causal mask (HF's `token_type_ids` blocks); the prompt shows an image as
"\\n\\n<start_of_image>" + its tokens + "<end_of_image>\\n\\n".
HF reference: transformers/models/gemma3/modeling_gemma3.py (`Gemma3Model`, `Gemma3MultiModalProjector`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source
from day0jax.layers.attention import ContextKV
from day0jax.layers.linear import Linear
from day0jax.layers.norms import RMSNorm
from day0jax.models.contract import Family
from day0jax.models.llava import VisionTower
from day0jax.models.vision_language import (LEGACY_NAMES, VisionLanguageConfig, VisionLanguageModel, expand_markers,
                                            language_model_dropped, language_model_source, prefixed_source)
from day0jax.vision import clip
from day0jax.vision.spec import VisionSpec


DEFAULT_TOWER = dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                     num_attention_heads=16, image_size=896, patch_size=14, vision_use_head=False)


@dataclass(frozen=True, eq=False)
class Config(VisionLanguageConfig):
    ALIASES = {"image_token_id": "image_token_index", "boi_token_id": "boi_token_index",
               "eoi_token_id": "eoi_token_index"}
    DEFAULT_TEXT_TYPE = "gemma3_text"
    VISION_CONFIG = clip.VisionConfig
    mm_tokens_per_image: int = 256
    boi_token_index: int = 255_999
    eoi_token_index: int = 256_000
    image_token_index: int = 262_144
    initializer_range: float = 0.02
    tie_word_embeddings: bool | None = True
    model_type: str = "gemma3"

    def __post_init__(self):
        self._check_derived("text", "vision")
        if self.text.model_type != "gemma3_text":
            refuse("text_config.model_type", self.text.model_type, "is not Gemma 3's language model (gemma3_text)")
        if self.vision.model_type != "siglip_vision_model":
            refuse("vision_config.model_type", self.vision.model_type, "is not Gemma 3's tower (siglip_vision_model)")
        side, per_side = self.patches_per_side, round(self.mm_tokens_per_image ** 0.5)
        if per_side * per_side != self.mm_tokens_per_image or side % per_side:
            refuse("mm_tokens_per_image", self.mm_tokens_per_image,
                   f"must be a square whose side divides the tower's {side} patches per side")
        if self.image_token_index >= self.text.vocab_size:
            refuse("image_token_index", self.image_token_index,
                   f"is outside the vocabulary ({self.text.vocab_size}); such checkpoints are not implemented")

    @cached_property
    def vision(self) -> clip.VisionConfig:
        # Without a vision_config: Gemma 3's published tower (HF's bare SigLIP default does not fit 256 tokens).
        given = self.vision_config if self.vision_config is not None else DEFAULT_TOWER
        return clip.VisionConfig.from_hf(dict(given, model_type=given.get("model_type", "siglip_vision_model")))

    @property
    def image_token_id(self) -> int:
        return self.image_token_index

    @property
    def tokens_per_image(self) -> int:
        return self.mm_tokens_per_image

    @property
    def patches_per_side(self) -> int:
        return self.vision.image_size // self.vision.patch_size


class Projector(nnx.Module):
    """HF's `multi_modal_projector`: [I, P, Dv] patch states -> average pooling over k x k patch squares ->
    `mm_soft_emb_norm` ((1 + w) RMSNorm) -> `mm_input_projection` (HF's `mm_input_projection_weight` [Dv, D])."""

    def __init__(self, c: Config, *, dtype, rngs: nnx.Rngs):
        Dv = c.vision.hidden_size
        self.mm_soft_emb_norm = RMSNorm(Dv, c.vision.layer_norm_eps, offset=1.0, dtype=dtype, rngs=rngs)
        self.mm_input_projection = Linear((Dv,), (c.text.hidden_size,), (None, "embed"), dtype=dtype, rngs=rngs)
        self.side, self.per_side = c.patches_per_side, round(c.mm_tokens_per_image ** 0.5)

    def __call__(self, x: jax.Array) -> jax.Array:
        I, _, Dv = x.shape
        s, t = self.side, self.per_side
        k = s // t
        pooled = x.reshape(I, t, k, t, k, Dv).astype(jnp.float32).mean(axis=(2, 4)).astype(x.dtype)
        return self.mm_input_projection(self.mm_soft_emb_norm(pooled.reshape(I, t * t, Dv)))


def visible_until(positions: jax.Array, image_mask: jax.Array) -> jax.Array:
    """[B, T] the last position each query sees: for an image token, the last token of its run of image tokens
    (HF's blocks: consecutive image tokens), else its own. The engine keeps a run inside one chunk."""
    T = image_mask.shape[1]
    index = jnp.arange(T, dtype=jnp.int32)
    breaks = jnp.where(image_mask, T, index[None, :])
    run_end = jax.lax.cummin(breaks, axis=1, reverse=True) - 1  # the index before the next non-image token
    end = jnp.take_along_axis(positions, jnp.clip(run_end, 0, T - 1), axis=1)
    return jnp.where(image_mask, end, positions)


class Model(VisionLanguageModel):
    def make_vision(self, *, dtype, rngs: nnx.Rngs) -> None:
        c = self.config
        self.vision_tower = VisionTower(clip.VisionTransformer(c.vision, post_layernorm=True, dtype=dtype, rngs=rngs))
        self.multi_modal_projector = Projector(c, dtype=dtype, rngs=rngs)

    @property
    def vision_spec(self) -> VisionSpec:
        return dataclasses.replace(super().vision_spec, bidirectional=True)

    @jax.named_scope("vision")
    def encode_images(self, pixels: jax.Array) -> tuple[jax.Array, None]:
        """pixels [I, 3, S, S] -> ([I * mm_tokens_per_image, D], None)."""
        features = self.multi_modal_projector(self.vision_tower.vision_model.last_hidden_state(pixels))
        return features.reshape(-1, features.shape[-1]), None

    def expand_image_placeholders(self, text: str, counts, tokenizer, grids=None) -> str:
        """HF's Gemma3Processor: each `<start_of_image>` becomes "\\n\\n<start_of_image>" + the image tokens +
        "<end_of_image>\\n\\n"."""
        c = self.config
        boi, eoi, image = (tokenizer.decode([i]) for i in (c.boi_token_index, c.eoi_token_index, c.image_token_id))
        return expand_markers(text, boi, f"\n\n{boi}{image * c.tokens_per_image}{eoi}\n\n", len(counts))

    def _image_caches(self, tokens, positions, caches, image_mask):
        if image_mask is None or tokens.shape[1] == 1:  # a single token sees nothing after itself
            return caches
        until = visible_until(positions, image_mask)
        if caches is None:  # the cache-less forward: caches of this call's keys and values carry the spans
            return [ContextKV(visible_until=until) for _ in self.language_model.model.layers]
        return [None if c is None else dataclasses.replace(c, visible_until=until) for c in caches]

    def __call__(self, tokens, positions, caches=None, seq_len=None, image_features=None, image_mask=None):
        embeds = self.embed(tokens, image_features, image_mask)
        hidden, new = self.language_model(tokens, positions, self._image_caches(tokens, positions, caches, image_mask),
                                          seq_len, embeds=embeds)
        return hidden, (None if caches is None else new)

    def hidden_states(self, tokens, positions, seq_len=None, image_features=None, image_mask=None):
        return self.language_model.hidden_states(tokens, positions, seq_len,
                                                 embeds=self.embed(tokens, image_features, image_mask),
                                                 caches=self._image_caches(tokens, positions, None, image_mask))


def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict) -> Source | None:
    if path.startswith("language_model."):
        return language_model_source(config, path, shape, metadata)
    tower = "vision_tower.vision_model."
    if path == "multi_modal_projector.mm_input_projection.kernel":
        return Source(("model.multi_modal_projector.mm_input_projection_weight",),
                      lambda arrays, s: np.ascontiguousarray(arrays[0].T), ((shape[1], shape[0]),))

    def own(p, s):
        src = clip.hf_source(p[len(tower):], s) if p.startswith(tower) else None
        return None if src is None else src.renamed(lambda n: tower + n)
    return prefixed_source(path, shape, metadata, own)


def dropped_for(config: Config) -> dict[str, str]:
    out = language_model_dropped(config)
    out[r"model\.vision_tower\.vision_model\.head\..*"] = "SigLIP's pooling head: Gemma 3 reads the patch states"
    return out


FAMILY = Family(model_types=("gemma3",), config=Config, model=Model, dropped={}, dropped_for=dropped_for,
                hf_source=hf_source, renames=LEGACY_NAMES)
