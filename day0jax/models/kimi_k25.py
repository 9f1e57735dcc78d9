"""Kimi K2.5: the MoonViT vision tower (`vision.moonvit`: images at their own size, a token per 2x2 patches) and its
projector in front of the DeepSeek-V3 language model (`deepseek_v3`: MLA, grouped sigmoid MoE; Kimi K2's
checkpoints). Image features replace the `<|media_pad|>` placeholders, one per merged block; positions stay 1-D.

Checkpoints keep the layout of Moonshot's own code, which transformers reads through a conversion mapping (and
writes back when it saves): `vision_tower.encoder.blocks.N.wqkv` with q and k rows in interleaved rotary pairs,
`mm_projector.proj.0`, `language_model.model.`, and the published config's own keys (`vt_*`). Tensors are renamed
as that mapping renames them (`RENAMES`, which also takes the names transformers 5 saves), the fused q/k/v split
and turned into the rotate_half layout on conversion (transformers' `PermuteForRope`).
HF reference: transformers/models/kimi_k25/modeling_kimi_k25.py; transformers/conversion_mapping.py ("kimi_k25").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

import jax
import numpy as np
from flax import nnx

from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source
from day0jax.models.contract import Family
from day0jax.models.vision_language import (VisionLanguageConfig, VisionLanguageModel, language_model_dropped,
                                            language_model_source, prefixed_source)
from day0jax.vision import moonvit
from day0jax.vision.spec import VisionSpec
from kernels_pallas.calls import OpCall

TEXT_TYPES = ("deepseek_v3", "kimi_k2")


@dataclass(frozen=True, eq=False)
class Config(VisionLanguageConfig):
    """`Kimi_K25Config`'s keys; the published config's own names and keys read too."""

    ALIASES = {"media_placeholder_token_id": "image_token_id"}
    DEFAULT_TEXT_TYPE = "deepseek_v3"
    VISION_CONFIG = moonvit.VisionConfig
    projection_hidden_size: int | None = 1152
    projection_layer_norm_eps: float = 1e-5
    image_token_id: int = 163605
    video_token_id: int = 163840
    vision_start_token_id: int = 163602
    vision_end_token_id: int = 163604
    tie_word_embeddings: bool | None = True
    # The published config's: the loss's ignored label (training only), how its own processor cuts videos into
    # chunks and the placeholder text of a video (prompt building, not the forward pass).
    ignore_index: int = -100
    use_unified_vision_chunk: bool = True
    video_placeholder: str = "<|kimi_k25_video_placeholder|>"
    model_type: str = "kimi_k25"

    def __post_init__(self):
        self._check_derived("text", "vision")
        v, D = self.vision, self.text.hidden_size
        if self.text.model_type not in TEXT_TYPES:
            refuse("text_config.model_type", self.text.model_type,
                   f"is not Kimi K2.5's language model ({', '.join(TEXT_TYPES)})")
        if self.projection_hidden_size is not None and self.projection_hidden_size != v.hidden_size:
            refuse("projection_hidden_size", self.projection_hidden_size,
                   f"differs from the tower's hidden_size={v.hidden_size} (the projector norms each patch)")
        for key, want in (("mm_hidden_size", v.hidden_size), ("text_hidden_size", D),
                          ("projector_ln_eps", self.projection_layer_norm_eps)):
            if getattr(v, key) is not None and getattr(v, key) != want:
                refuse(f"vision_config.{key}", getattr(v, key), f"differs from the {want} the model uses")

    @cached_property
    def vision(self) -> moonvit.VisionConfig:
        return moonvit.VisionConfig.from_hf(self.vision_config or {})

    @property
    def tokens_per_image(self) -> None:
        return None  # one per merge block of the image's patches


class Model(VisionLanguageModel):
    def make_vision(self, *, dtype, rngs: nnx.Rngs) -> None:
        c = self.config
        self.vision_tower = moonvit.VisionModel(c.vision, dtype=dtype, rngs=rngs)
        self.mm_projector = moonvit.Projector(c.vision, c.text.hidden_size, c.projection_layer_norm_eps,
                                              dtype=dtype, rngs=rngs)

    @property
    def vision_spec(self) -> VisionSpec:
        c = self.config
        return VisionSpec(c.image_token_id, None, None, c.text.hidden_size, merge=c.vision.merge,
                          encoder=moonvit.PatchBuckets(c.vision, limit=self.image_patch_limit))

    @jax.named_scope("vision")
    def encode_images(self, *inputs: jax.Array) -> tuple[jax.Array, None]:
        """One image's padded patches and what its grid fixes (`moonvit.PatchBuckets`) -> ([P / 4, D], None)."""
        return moonvit.encode(self.vision_tower, self.mm_projector, *inputs), None

    def vision_op_calls(self):
        c = self.config.vision
        M = c.hidden_size * c.merge ** 2
        return self.vision_tower.op_calls() + [OpCall.of("mlp", D=M, F=M, act="gelu", gated=False)]


# The checkpoint's names -> transformers' module names (each tensor through the first pattern that matches it):
# the published layout's, and those transformers 5 writes back when it saves (its reverse mapping also turns the
# language model's `layers` into `blocks`, and the patch embedding's prefix into `vision_tower.encoder.`).
RENAMES = ((r"^language_model\.model\.blocks\.", "model.language_model.layers."),
           (r"^language_model\.model\.", "model.language_model."), (r"^language_model\.lm_head\.", "lm_head."),
           (r"^vision_tower\.encoder\.blocks\.(\d+)\.norm0\.", r"model.vision_tower.layers.\1.norm1."),
           (r"^vision_tower\.encoder\.blocks\.(\d+)\.norm1\.", r"model.vision_tower.layers.\1.norm2."),
           (r"^vision_tower\.encoder\.blocks\.(\d+)\.mlp\.fc0\.", r"model.vision_tower.layers.\1.mlp.fc1."),
           (r"^vision_tower\.encoder\.blocks\.(\d+)\.mlp\.fc1\.", r"model.vision_tower.layers.\1.mlp.fc2."),
           (r"^vision_tower\.encoder\.blocks\.(\d+)\.wo\.", r"model.vision_tower.layers.\1.attn.proj."),
           (r"^vision_tower\.encoder\.blocks\.(\d+)\.wqkv\.", r"model.vision_tower.layers.\1.attn.wqkv."),
           (r"^vision_tower\.encoder\.final_layernorm\.", "model.vision_tower.final_layernorm."),
           (r"^vision_tower\.patch_embed\.pos_emb\.weight$",
            "model.vision_tower.patch_embed.pos_emb.position_embeddings"),
           (r"^vision_tower\.(encoder\.)?patch_embed\.proj\.", "model.vision_tower.patch_embed.proj."),
           (r"^mm_projector\.proj\.0\.", "model.mm_projector.in_proj."),
           (r"^mm_projector\.proj\.2\.", "model.mm_projector.out_proj."),
           (r"^mm_projector\.pre_norm\.", "model.mm_projector.pre_norm."),
           (r"^vision_tower\.encoder\.blocks\.(\d+)\.", r"model.vision_tower.layers.\1."))


def _from_fused(part: int, rotary: bool, heads: int):
    """Rows `part` (0 q, 1 k, 2 v) of a fused `wqkv` weight [3D, D] or bias [3D]; q and k rows turned from
    interleaved rotary pairs into halves per head (transformers' `PermuteForRope`)."""
    def combine(arrays, shape):
        fused = arrays[0]
        rows = fused[part * fused.shape[0] // 3:(part + 1) * fused.shape[0] // 3]
        if rotary:
            rows = rows.reshape(heads, -1, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
        return np.ascontiguousarray(rows).reshape(shape)
    return combine


def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict) -> Source | None:
    if path.startswith("language_model."):
        return language_model_source(config, path, shape, metadata)
    tower = "vision_tower."
    m = re.fullmatch(r"vision_tower\.layers\.(\d+)\.attn\.(q|k|v)_proj\.(kernel|bias)", path)
    if m:
        D = config.vision.hidden_size
        kind = "weight" if m[3] == "kernel" else "bias"
        return Source((f"model.vision_tower.layers.{m[1]}.attn.wqkv.{kind}",),
                      _from_fused("qkv".index(m[2]), m[2] != "v", config.vision.num_attention_heads),
                      ((3 * D, D) if kind == "weight" else (3 * D,),))

    def own(p, s):
        src = moonvit.hf_source(p[len(tower):], s) if p.startswith(tower) else None
        return None if src is None else src.renamed(lambda n: tower + n)
    return prefixed_source(path, shape, metadata, own)


FAMILY = Family(model_types=("kimi_k25",), config=Config, model=Model, dropped={}, dropped_for=language_model_dropped,
                hf_source=hf_source, renames=RENAMES)
