"""LFM2-VL: SigLIP2's NaFlex tower (`vision.siglip2`, images at their own size) in front of an LFM2 language model.
The projector gathers each downsample_factor x downsample_factor block of patches (the pixel unshuffle: the block's
patches row by row, each one's channels whole), then LayerNorm, linear_1, the activation and linear_2. An image is
`<|image_start|>` + its tokens + `<|image_end|>`; an image the processor splits into tiles
(`vision.torchvision_processors.Lfm2VlImageProcessor`) has each tile's tokens after `<|img_row_R_col_C|>`, then
`<|img_thumbnail|>` and the thumbnail's.
HF reference: transformers/models/lfm2_vl/modeling_lfm2_vl.py, processing_lfm2_vl.py."""

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
from day0jax.layers.norms import LayerNorm
from day0jax.models.contract import Family
from day0jax.models.vision_language import (VisionLanguageConfig, VisionLanguageModel, expand_markers,
                                            language_model_dropped, language_model_source, prefixed_source)
from day0jax.vision import siglip2
from day0jax.vision.spec import VisionSpec
from kernels_pallas.calls import OpCall

TEXT_TYPES = ("lfm2",)
DEFAULT_MAX_PATCHES = 1024  # the image processor's default: 256 tokens of 2x2 patches, or one 512-pixel tile
PROJECTOR_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which HF's projector keeps


@dataclass(frozen=True, eq=False)
class Config(VisionLanguageConfig):
    ALIASES = {"tie_embedding": "tie_word_embeddings"}
    DEFAULT_TEXT_TYPE = "lfm2"
    VISION_CONFIG = siglip2.VisionConfig
    image_token_id: int = 396
    projector_hidden_act: str = "gelu"
    projector_hidden_size: int = 2560
    projector_bias: bool = True
    projector_use_layernorm: bool = True
    downsample_factor: int = 2
    tie_word_embeddings: bool | None = True
    model_type: str = "lfm2_vl"

    def __post_init__(self):
        self._check_derived("text", "vision")
        if self.text.model_type not in TEXT_TYPES:
            refuse("text_config.model_type", self.text.model_type,
                   f"is not one of LFM2-VL's language models ({', '.join(TEXT_TYPES)})")
        activation(self.projector_hidden_act, "projector_hidden_act")
        if not isinstance(self.downsample_factor, int) or self.downsample_factor < 1:
            refuse("downsample_factor", self.downsample_factor, "must be a positive integer")

    @cached_property
    def vision(self) -> siglip2.VisionConfig:
        return siglip2.VisionConfig.from_hf(self.vision_config or {})

    @property
    def tokens_per_image(self) -> None:
        return None  # one per downsample_factor^2 patches of the image


class Projector(nnx.Module):
    """HF's `multi_modal_projector`: the pixel unshuffle of each block (gathered by `blocks`), layer_norm,
    linear_1, act, linear_2."""

    def __init__(self, c: Config, *, dtype, rngs: nnx.Rngs):
        width = c.vision.hidden_size * c.downsample_factor ** 2
        self.layer_norm = (LayerNorm(width, PROJECTOR_NORM_EPS, dtype=dtype, rngs=rngs)
                           if c.projector_use_layernorm else None)
        self.linear_1 = Linear((width,), (c.projector_hidden_size,), (None, "mlp"), use_bias=c.projector_bias,
                               dtype=dtype, rngs=rngs)
        self.linear_2 = Linear((c.projector_hidden_size,), (c.text.hidden_size,), ("mlp", "embed"),
                               use_bias=c.projector_bias, dtype=dtype, rngs=rngs)
        self.act = activation(c.projector_hidden_act, "projector_hidden_act")

    def __call__(self, x: jax.Array, blocks: jax.Array) -> jax.Array:
        x = jnp.take(x, blocks, axis=0).reshape(blocks.shape[0], -1)  # [tokens, m*m*D]
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return self.linear_2(self.act(self.linear_1(x)))


class Model(VisionLanguageModel):
    def make_vision(self, *, dtype, rngs: nnx.Rngs) -> None:
        c = self.config
        self.vision_tower = siglip2.VisionModel(c.vision, dtype=dtype, rngs=rngs)
        self.multi_modal_projector = Projector(c, dtype=dtype, rngs=rngs)

    @property
    def vision_spec(self) -> VisionSpec:
        c, m = self.config, self.config.downsample_factor
        most = self.image_patch_limit or DEFAULT_MAX_PATCHES
        most = -(-most // m ** 2) * m ** 2  # whole blocks
        return VisionSpec(c.image_token_id, None, None, c.text.hidden_size, merge=m,
                          encoder=siglip2.Patches(c.vision, most, m))

    @jax.named_scope("vision")
    def encode_images(self, patches, weights, valid, blocks) -> tuple[jax.Array, None]:
        """One image's padded patches and what its grid fixes (`siglip2.Patches`) -> ([P / m^2, D], None)."""
        return self.multi_modal_projector(self.vision_tower(patches, weights, valid), blocks), None

    def vision_op_calls(self):
        c = self.config
        return self.vision_tower.op_calls() + [OpCall.of(
            "mlp", D=c.vision.hidden_size * c.downsample_factor ** 2, F=c.projector_hidden_size,
            act=c.projector_hidden_act, gated=False)]

    def expand_image_placeholders(self, text: str, counts: Sequence[int], tokenizer, grids=None) -> str:
        """Lfm2VlProcessor's expansion: `<|image_start|>`, the image's tokens (a split one's tile by tile, each
        after its `<|img_row_R_col_C|>`, then `<|img_thumbnail|>` and the thumbnail's), `<|image_end|>`."""
        marker, m = tokenizer.decode([self.config.image_token_id]), self.config.downsample_factor
        expand_markers(text, marker, marker, len(counts))  # refuses a template that drops or adds images
        parts, out = text.split(marker), []
        for grid, rest in zip(grids, parts[1:]):
            body = marker * (grid[1] * grid[2] // m ** 2)
            if len(grid) == 6:
                tile = marker * (grid[5] // m) ** 2
                body = "".join(f"<|img_row_{r + 1}_col_{c + 1}|>" + tile for r in range(grid[3])
                               for c in range(grid[4])) + ("<|img_thumbnail|>" + body if body else "")
            out.append("<|image_start|>" + body + "<|image_end|>" + rest)
        return parts[0] + "".join(out)


def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict):
    if path.startswith("language_model."):
        return language_model_source(config, path, shape, metadata)
    return prefixed_source(path, shape, metadata)


HEAD_DROPPED = "SigLIP2's pooling head: LFM2-VL reads the patches, not the pooled output"


def dropped_for(config: Config) -> dict[str, str]:
    out = language_model_dropped(config)
    out[r"model\.vision_tower\.head\..*"] = HEAD_DROPPED
    return out


# Older layouts (a `vision_model.` level inside the tower; transformers 4's top-level names) -> the names
# `hf_source` reads.
RENAMES = ((r"^model\.vision_tower\.vision_model\.", "model.vision_tower."),
           (r"^language_model\.model\.", "model.language_model."), (r"^language_model\.lm_head\.", "lm_head."),
           (r"^vision_tower\.(vision_model\.)?", "model.vision_tower."),
           (r"^multi_modal_projector\.", "model.multi_modal_projector."))

FAMILY = Family(model_types=("lfm2_vl",), config=Config, model=Model, dropped={}, dropped_for=dropped_for,
                hf_source=hf_source, renames=RENAMES)
