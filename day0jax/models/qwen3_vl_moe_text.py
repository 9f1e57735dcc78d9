"""Qwen3-VL-MoE's language model (`qwen3_vl_moe_text`): Qwen3-MoE's layers (per-head q/k norms, softmax top-k
experts, always renormalized, no shared expert) rotated by Qwen3-VL's interleaved multimodal RoPE
(`qwen3_vl_text`). Its experts are stored fused as the released checkpoints store them: `gate_up_proj` [E, D, 2F]
(gate columns first) and `down_proj` [E, F, D], day0jax's [E, in, out] layouts as they are; transformers 5 saves
them transposed, which is read too.
HF reference: transformers/models/qwen3_vl_moe/modeling_qwen3_vl_moe.py (`Qwen3VLMoeTextModel`,
`Qwen3VLMoeTextTopKRouter`); transformers/conversion_mapping.py ("qwen3_vl_moe": the transposes)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from flax import nnx

from day0jax.core.hf_tensors import Source
from day0jax.layers.moe import Experts, MoE, Router, swiglu
from day0jax.layers.rope import MRope
from day0jax.models import base, llama, qwen3_moe, qwen3_vl_text
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(qwen3_moe.Config):
    """`Qwen3VLMoeTextConfig`: Qwen3-MoE's keys with its own defaults, `rope_parameters` carrying `mrope_section`.
    HF's model has no sliding window and always renormalizes the top-k weights, whatever `use_sliding_window`,
    `sliding_window` or `norm_topk_prob` say."""

    DEFAULT_THETA = 500000.0
    intermediate_size: int = 5632
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 16
    max_position_embeddings: int = 128000
    tie_word_embeddings: bool = True
    moe_intermediate_size: int = 1408
    num_experts_per_tok: int = 4
    num_local_experts: int = 60
    model_type: str = "qwen3_vl_moe_text"

    def _rope(self, params: dict | None = None, **kwargs):
        params = {k: v for k, v in (params or self.rope_parameters or {}).items()
                  if k not in qwen3_vl_text.MROPE_KEYS} or None
        return super()._rope(params, **kwargs)

    mrope_section = qwen3_vl_text.Config.mrope_section  # the same property: it reads rope_parameters only

    def __post_init__(self):
        super().__post_init__()
        self._check_derived("mrope_section")

    @property
    def window(self) -> None:
        return None


class Model(qwen3_moe.Model):
    def make_rope(self) -> MRope:
        c = self.config
        return MRope(c.rope, c.head_size, c.max_position_embeddings, sections=c.mrope_section, interleaved=True)

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        if not c.is_sparse(index):
            return super().make_mlp(index, dtype=dtype, rngs=rngs)
        return MoE(Router(c.hidden_size, c.num_local_experts, c.num_experts_per_tok, routing="softmax_topk",
                          norm_topk_prob=True, dtype=dtype, rngs=rngs),
                   Experts(c.num_local_experts, c.hidden_size, c.moe_intermediate_size, swiglu(c.hidden_act),
                           dtype=dtype, rngs=rngs))


def fused_experts_source(path: str, shape: tuple[int, ...]) -> Source | None:
    """`...experts.gate_proj|up_proj` [E, D, F]: the halves of `gate_up_proj` [E, D, 2F]; `down_proj` [E, F, D] as
    stored. transformers 5 saves them transposed ([E, 2F, D], [E, D, F]: its modules' layout), read as the
    alternative (`base.fused_experts_source`). None for other paths."""
    m = re.fullmatch(r"(.*\.experts)\.(gate_proj|up_proj|down_proj)", path)
    if not m:
        return None
    E, fan_in, fan_out = shape
    saved = base.fused_experts_source(path, shape)
    if m[2] == "down_proj":
        return Source((f"{m[1]}.down_proj",), lambda a, s: np.ascontiguousarray(a[0]).reshape(s), (tuple(shape),),
                      saved)
    start = 0 if m[2] == "gate_proj" else fan_out
    return Source((f"{m[1]}.gate_up_proj",), lambda a, s: np.ascontiguousarray(a[0][:, :, start:start + fan_out]),
                  ((E, fan_in, 2 * fan_out),), saved)


def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict) -> Source | None:
    return fused_experts_source(path, shape)


FAMILY = Family(model_types=("qwen3_vl_moe_text",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS,
                hf_source=hf_source)
