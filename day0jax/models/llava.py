"""LLaVA: a CLIP or SigLIP vision tower, the hidden states of one or more of its layers (`vision_feature_layer`),
with or without CLIP's class token (`vision_feature_select_strategy`), through a two-layer projector into any supported
text family's embeddings, one feature per image placeholder token.
HF reference: transformers/models/llava/modeling_llava.py."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.core.hf_config import refuse
from day0jax.layers.linear import Linear
from day0jax.layers.mlp import activation
from day0jax.models.contract import Family
from day0jax.models.vision_language import (LEGACY_NAMES, VisionLanguageConfig, VisionLanguageModel,
                                            language_model_dropped, language_model_source, prefixed_source)
from day0jax.vision import clip

STRATEGIES = ("default", "full")  # drop the class token, keep it
# HF's tower when config.json has no vision_config: LLaVA-1.5's CLIP ViT-L/14 at 336 pixels.
DEFAULT_TOWER = dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                     num_attention_heads=16, image_size=336, patch_size=14, projection_dim=768)


@dataclass(frozen=True, eq=False)
class Config(VisionLanguageConfig):
    ALIASES = {"image_token_id": "image_token_index"}
    VISION_CONFIG = clip.VisionConfig
    image_token_index: int = 32000
    image_seq_length: int = 576
    projector_hidden_act: str = "gelu"
    vision_feature_select_strategy: str = "default"
    vision_feature_layer: int | list[int] = -2
    multimodal_projector_bias: bool = True
    tie_word_embeddings: bool | None = False
    model_type: str = "llava"

    def __post_init__(self):
        self._check_derived("text", "vision")
        activation(self.projector_hidden_act, "projector_hidden_act")
        if self.vision_feature_select_strategy not in STRATEGIES:
            refuse("vision_feature_select_strategy", self.vision_feature_select_strategy,
                   f"is not implemented (known: {', '.join(STRATEGIES)})")
        L = self.vision.num_hidden_layers
        for i in self.feature_layers:
            if not -(L + 1) <= i <= L:
                refuse("vision_feature_layer", self.vision_feature_layer,
                       f"names a hidden state the {L}-layer vision tower does not have")

    @cached_property
    def vision(self) -> clip.VisionConfig:
        return clip.VisionConfig.from_hf(self.vision_config if self.vision_config is not None else DEFAULT_TOWER)

    @property
    def image_token_id(self) -> int:
        return self.image_token_index

    @property
    def feature_layers(self) -> list[int]:
        """`vision_feature_layer` as a list: the hidden states read (HF's indices, negative from the end)."""
        v = self.vision_feature_layer
        return [v] if isinstance(v, int) else list(v)

    @property
    def tokens_per_image(self) -> int:
        # HF's processor drops one token under "default" whatever the tower; SigLIP has no class token to drop, and
        # its checkpoints use "full".
        return self.vision.num_positions - (self.vision_feature_select_strategy == "default")


class VisionTower(nnx.Module):
    """HF's `vision_tower` (a `CLIPVisionModel` / `SiglipVisionModel`): its `vision_model`."""

    def __init__(self, vision_model: clip.VisionTransformer):
        self.vision_model = vision_model


class Projector(nnx.Module):
    """HF's `multi_modal_projector`: linear_2(act(linear_1(features)))."""

    def __init__(self, c: Config, *, dtype, rngs: nnx.Rngs):
        Dv, D = c.vision.hidden_size * len(c.feature_layers), c.text.hidden_size
        bias = c.multimodal_projector_bias
        self.linear_1 = Linear((Dv,), (D,), (None, "embed"), use_bias=bias, dtype=dtype, rngs=rngs)
        self.linear_2 = Linear((D,), (D,), (None, "embed"), use_bias=bias, dtype=dtype, rngs=rngs)
        self.act = activation(c.projector_hidden_act, "projector_hidden_act")

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_2(self.act(self.linear_1(x)))


class Model(VisionLanguageModel):
    def make_vision(self, *, dtype, rngs: nnx.Rngs) -> None:
        c = self.config
        depth = clip.num_layers_read(c.vision, c.feature_layers)
        self.vision_tower = VisionTower(clip.VisionTransformer(c.vision, num_layers=depth, dtype=dtype, rngs=rngs))
        self.multi_modal_projector = Projector(c, dtype=dtype, rngs=rngs)

    @jax.named_scope("vision")
    def encode_images(self, pixels: jax.Array) -> tuple[jax.Array, None]:
        """pixels [I, C, S, S] (the image processor's output) -> ([I * tokens_per_image, D], None)."""
        c = self.config
        hidden = self.vision_tower.vision_model(pixels)
        L = c.vision.num_hidden_layers
        start = 1 if c.vision_feature_select_strategy == "default" else 0  # HF drops the first token either way
        selected = [hidden[i % (L + 1)][:, start:] for i in c.feature_layers]
        features = self.multi_modal_projector(jnp.concatenate(selected, axis=-1))
        return features.reshape(-1, features.shape[-1]), None


def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict):
    if path.startswith("language_model."):
        return language_model_source(config, path, shape, metadata)
    tower = "vision_tower.vision_model."

    def own(p, s):
        src = clip.hf_source(p[len(tower):], s) if p.startswith(tower) else None
        return None if src is None else src.renamed(lambda n: tower + n)
    return prefixed_source(path, shape, metadata, own)


def dropped_for(config: Config) -> dict[str, str]:
    """The language model's dropped tensors; the tower's layers after the deepest one read, its post-norm and its
    pooling head (SigLIP), which LLaVA never reaches."""
    v = config.vision
    depth = clip.num_layers_read(v, config.feature_layers)
    unused = "not reached: LLaVA reads the tower's hidden states up to vision_feature_layer"
    out = language_model_dropped(config)
    later = "|".join(str(i) for i in range(depth, v.num_hidden_layers))
    if later:
        out[rf"model\.vision_tower\.vision_model\.encoder\.layers\.({later})\..*"] = unused
    out[r"model\.vision_tower\.vision_model\.(post_layernorm|head)\..*"] = unused
    return out


FAMILY = Family(model_types=("llava",), config=Config, model=Model, dropped={}, dropped_for=dropped_for,
                hf_source=hf_source, renames=LEGACY_NAMES)
