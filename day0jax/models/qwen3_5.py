"""Qwen3.5 (dense), text model: Qwen3-Next's hybrid layers (qwen3_next.py) with dense SwiGLU MLPs, and the
linear-attention projections stored apart (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`). Released
checkpoints are multimodal (`qwen3_5`): their language model converts with the vision tower dropped.
HF reference: transformers/models/qwen3_5/modeling_qwen3_5.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from day0jax.models import llama, qwen3_next
from day0jax.models.base import HFConfig, Source, default_source, in_language_model, per_expert_source
from day0jax.models.contract import Family

# Interleaved multimodal RoPE: text positions are equal on its three axes, where it is exactly 1-D RoPE.
MROPE_KEYS = ("mrope_section", "mrope_interleaved")


class Qwen35:
    """Mixin of the Qwen3.5 configs: text-only multimodal RoPE, and refusals of what they do not implement."""

    COMPOSITE = ("qwen3_5", "qwen3_5_moe")

    def _rope(self, params: dict | None = None, **kwargs):
        params = {k: v for k, v in (params or self.rope_parameters or {}).items() if k not in MROPE_KEYS} or None
        return super()._rope(params, **kwargs)


@dataclass(frozen=True, eq=False)
class Config(Qwen35, qwen3_next.Hybrid, HFConfig):
    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 4
    head_dim: int | None = 256
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list | None = None
    full_attention_interval: int = 4
    model_type: str = "qwen3_5_text"

    def is_sparse(self, index: int) -> bool:
        return False


def split_projection_source(config, prefix: str, part: str) -> Source | None:
    """q, k and v from `in_proj_qkv` [Nk Hk + Nk Hk + Nv Hv, D]; z, b and a keep HF's own tensors."""
    if part not in "qkv":
        return None
    c = config
    qk, v = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    start, size = {"q": (0, qk), "k": (qk, qk), "v": (2 * qk, v)}[part]
    return Source((f"{prefix}.in_proj_qkv.weight",),
                  lambda arrays, shape: arrays[0][start:start + size].reshape(shape), ((2 * qk + v, c.hidden_size),))


def hf_source(config, path: str, shape: tuple[int, ...], metadata: dict) -> Source:
    src = (per_expert_source(path, shape)
           or qwen3_next.linear_attention_source(config, path, split_projection_source)
           or default_source(path, shape, metadata))
    return in_language_model(src) if config.is_composite else src


def dropped_for(config) -> dict[str, str]:
    if not config.is_composite:
        return {}
    return {r"model\.visual\..*": "the vision tower: images are not supported yet, this checkpoint runs as text only"}


DROPPED = {**llama.ROPE_BUFFERS, r"mtp\..*": "multi-token prediction layers (used for speculation, not decoding)"}

FAMILY = Family(model_types=("qwen3_5_text", "qwen3_5"), config=Config, model=qwen3_next.Model, dropped=DROPPED,
                dropped_for=dropped_for, hf_source=hf_source)
