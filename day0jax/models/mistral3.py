"""Mistral 3 (Mistral Small 3.1/3.2, Magistral Small): the Pixtral tower (`vision.pixtral`) over a Mistral or
Ministral language model. The projector norms each patch of the tower's chosen hidden state (RMSNorm), merges
spatial_merge_size x spatial_merge_size patches into one (`patch_merger`: the block flattened channel by channel, as
torch's unfold lays it out, then a linear map), then a two-layer MLP. An image's tokens are its rows of `[IMG]`, each
row ended by `[IMG_BREAK]` and the last by `[IMG_END]` (regular tokens between the image features).
HF reference: transformers/models/mistral3/modeling_mistral3.py, transformers/models/pixtral/processing_pixtral.py."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.core.hf_config import refuse
from day0jax.layers.linear import Linear
from day0jax.layers.mlp import activation
from day0jax.layers.norms import RMSNorm
from day0jax.models.contract import Family
from day0jax.models.vision_language import (VisionLanguageConfig, VisionLanguageModel, expand_markers,
                                            language_model_dropped, language_model_source, prefixed_source)
from day0jax.vision import pixtral
from day0jax.vision.spec import VisionSpec
from kernels_pallas.calls import OpCall

TEXT_TYPES = ("mistral", "ministral")
# Mistral3Config's tower when config.json has none (Mistral Small 3.1's).
DEFAULT_TOWER = dict(intermediate_size=4096, hidden_size=1024, patch_size=14, image_size=1540, num_hidden_layers=24,
                     num_attention_heads=16, head_dim=64, hidden_act="gelu")


@dataclass(frozen=True, eq=False)
class Config(VisionLanguageConfig):
    ALIASES = {"image_token_id": "image_token_index"}
    DEFAULT_TEXT_TYPE = "mistral"
    VISION_CONFIG = pixtral.VisionConfig
    image_token_index: int = 10
    projector_hidden_act: str = "gelu"
    vision_feature_layer: int | list[int] = -1
    multimodal_projector_bias: bool = False
    spatial_merge_size: int = 2
    tie_word_embeddings: bool | None = True
    model_type: str = "mistral3"

    def __post_init__(self):
        self._check_derived("text", "vision")
        if self.text.model_type not in TEXT_TYPES:
            refuse("text_config.model_type", self.text.model_type,
                   f"is not one of Mistral 3's language models ({', '.join(TEXT_TYPES)})")
        activation(self.projector_hidden_act, "projector_hidden_act")
        L = self.vision.num_hidden_layers
        if not isinstance(self.vision_feature_layer, int) or not -(L + 1) <= self.vision_feature_layer <= L:
            # HF's projector norms vision_config.hidden_size features: several layers concatenated do not fit it.
            refuse("vision_feature_layer", self.vision_feature_layer,
                   f"must name one hidden state of the {L}-layer tower")
        if not isinstance(self.spatial_merge_size, int) or self.spatial_merge_size < 1:
            refuse("spatial_merge_size", self.spatial_merge_size, "must be a positive integer")

    @cached_property
    def vision(self) -> pixtral.VisionConfig:
        return pixtral.VisionConfig.from_hf(self.vision_config if self.vision_config is not None else DEFAULT_TOWER)

    @property
    def image_token_id(self) -> int:
        return self.image_token_index

    @property
    def tokens_per_image(self) -> None:
        return None  # one per merged block of the image's patches

    @property
    def depth(self) -> int:
        """The tower layers run: up to the hidden state read."""
        return self.vision_feature_layer % (self.vision.num_hidden_layers + 1)


class PatchMerger(nnx.Module):
    """HF's `patch_merger`: each block's patches, flattened channel-major ([D, merge**2]), through `merging_layer`."""

    def __init__(self, c: Config, *, dtype, rngs: nnx.Rngs):
        D = c.vision.hidden_size
        self.merging_layer = Linear((D * c.spatial_merge_size ** 2,), (D,), (None, "embed"), dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, blocks: jax.Array) -> jax.Array:
        gathered = jnp.take(x, blocks, axis=0)  # [M, merge**2, D]
        return self.merging_layer(jnp.swapaxes(gathered, 1, 2).reshape(gathered.shape[0], -1))


class Projector(nnx.Module):
    """HF's `multi_modal_projector`: norm (RMSNorm with the language model's eps), patch_merger, linear_1, act,
    linear_2."""

    def __init__(self, c: Config, *, dtype, rngs: nnx.Rngs):
        Dv, D, bias = c.vision.hidden_size, c.text.hidden_size, c.multimodal_projector_bias
        self.norm = RMSNorm(Dv, c.text.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.patch_merger = PatchMerger(c, dtype=dtype, rngs=rngs)
        self.linear_1 = Linear((Dv,), (D,), (None, "mlp"), use_bias=bias, dtype=dtype, rngs=rngs)
        self.linear_2 = Linear((D,), (D,), ("mlp", "embed"), use_bias=bias, dtype=dtype, rngs=rngs)
        self.act = activation(c.projector_hidden_act, "projector_hidden_act")

    def __call__(self, x: jax.Array, blocks: jax.Array) -> jax.Array:
        return self.linear_2(self.act(self.linear_1(self.patch_merger(self.norm(x), blocks))))


class Model(VisionLanguageModel):
    def make_vision(self, *, dtype, rngs: nnx.Rngs) -> None:
        c = self.config
        self.vision_tower = pixtral.VisionModel(c.vision, num_layers=c.depth, dtype=dtype, rngs=rngs)
        self.multi_modal_projector = Projector(c, dtype=dtype, rngs=rngs)

    @property
    def vision_spec(self) -> VisionSpec:
        c = self.config
        # The image processor's patches are the merged blocks: one token each.
        return VisionSpec(c.image_token_id, None, None, c.text.hidden_size, merge=1,
                          encoder=pixtral.PatchBuckets(c.vision, limit=self.image_patch_limit,
                                                           merge=c.spatial_merge_size))

    @jax.named_scope("vision")
    def encode_images(self, patches, positions, segments, blocks) -> tuple[jax.Array, None]:
        """One image's padded tower patches and what its grid fixes (`pixtral.PatchBuckets`) -> ([P / m^2, D], None)."""
        hidden = self.vision_tower(patches, positions, segments)[-1]
        return self.multi_modal_projector(hidden, blocks), None

    def vision_op_calls(self):
        c = self.config
        return self.vision_tower.op_calls() + [OpCall.of("mlp", D=c.vision.hidden_size, F=c.text.hidden_size,
                                                         act=c.projector_hidden_act, gated=False)]

    def expand_image_placeholders(self, text: str, counts: Sequence[int], tokenizer, grids=None) -> str:
        """PixtralProcessor's expansion: each `[IMG]` becomes the image's rows of `[IMG]`, each row ended by
        `[IMG_BREAK]`, the last by `[IMG_END]` (the tokenizer's tokens of those names)."""
        marker = tokenizer.decode([self.config.image_token_id])
        expand_markers(text, marker, marker, len(counts))  # refuses a template that drops or adds images
        brk, end = "[IMG_BREAK]", "[IMG_END]"
        parts = text.split(marker)
        out = parts[0]
        for (_, rows, cols), rest in zip(grids, parts[1:]):
            image = ((marker * cols + brk) * rows)[:-len(brk)] + end
            out += image + rest
        return out


def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict):
    if path.startswith("language_model."):
        return language_model_source(config, path, shape, metadata)
    tower = "vision_tower."

    def own(p, s):
        src = pixtral.hf_source(p[len(tower):], s) if p.startswith(tower) else None
        return None if src is None else src.renamed(lambda n: tower + n)
    return prefixed_source(path, shape, metadata, own)


def dropped_for(config: Config) -> dict[str, str]:
    """The language model's dropped tensors, and the tower's layers after the hidden state read."""
    out = language_model_dropped(config)
    later = "|".join(str(i) for i in range(config.depth, config.vision.num_hidden_layers))
    if later:
        out[rf"model\.vision_tower\.transformer\.layers\.({later})\..*"] = \
            "not reached: Mistral 3 reads the tower's hidden states up to vision_feature_layer"
    return out


# The layout transformers 5 saves (and older checkpoints) -> the names `hf_source` reads.
RENAMES = ((r"^language_model\.model\.", "model.language_model."), (r"^language_model\.lm_head\.", "lm_head."),
           (r"^vision_tower\.", "model.vision_tower."), (r"^multi_modal_projector\.", "model.multi_modal_projector."))

FAMILY = Family(model_types=("mistral3",), config=Config, model=Model, dropped={}, dropped_for=dropped_for,
                hf_source=hf_source, renames=RENAMES)
