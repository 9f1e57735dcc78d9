"""Qwen3: Qwen2's layer layout with RMSNorm on each head's q and k (before RoPE) and `attention_bias` (off).
HF reference: transformers/models/qwen3/modeling_qwen3.py."""

from __future__ import annotations

from dataclasses import dataclass

from day0jax.models import llama, qwen2
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(qwen2.Config):
    intermediate_size: int = 22016
    head_dim: int | None = 128
    attention_bias: bool = False
    model_type: str = "qwen3"


class Model(llama.LlamaLike):
    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        return dict(rope=self.rope, qkv_bias=c.attention_bias, o_bias=c.attention_bias, qk_norm_eps=c.rms_norm_eps,
                    sliding_window=c.layer_window(index))


FAMILY = Family(model_types=("qwen3",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS)
