"""ERNIE 4.5 (dense): Llama with biases on every projection per `use_bias` and RoPE on interleaved pairs of dims
(2i, 2i + 1), where the runtime rotates halves (i, i + H/2).
HF reference: transformers/models/ernie4_5/modeling_ernie4_5.py. Attention scores are dot products of q and k, so
any permutation of a head's dims applied to both leaves them unchanged: `hf_source` reorders each q and k head's
rows (evens, then odds), which turns HF's interleaved rotation into the runtime's half-split one."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from day0jax.core.hf_tensors import Source, default_source
from day0jax.models import llama
from day0jax.models.base import HFConfig
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    DEFAULT_THETA = 500000.0
    vocab_size: int = 103424
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 18
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 2
    head_dim: int | None = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    use_bias: bool = False
    model_type: str = "ernie4_5"

    def __post_init__(self):
        super().__post_init__()
        # HF's interleaved rotation covers every dim of the head; a partial one would rotate other pairs.
        self._refuse_if("rope_parameters", lambda v: self.rope.get("partial_rotary_factor", 1.0) != 1.0,
                        "sets a partial_rotary_factor, which HF's ERNIE 4.5 does not apply")


class Model(llama.LlamaLike):
    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        return dict(rope=self.rope, qkv_bias=c.use_bias, o_bias=c.use_bias)

    def mlp_kwargs(self, index: int) -> dict:
        return dict(use_bias=self.config.use_bias)


def interleaved_to_halves(config: HFConfig, path: str, shape: tuple, metadata: dict) -> Source | None:
    """q_proj and k_proj weights (and biases) with the rotated rows of each head reordered, even dims first, then
    odd ones; the rows past the rotary dims (a partial RoPE) keep their place. None for other parameters."""
    if not re.fullmatch(r".*\.self_attn\.[qk]_proj\.(kernel|bias)", path):
        return None
    H = config.head_size
    rot = int(H * config.rope.get("partial_rotary_factor", 1.0))
    order = np.concatenate([np.arange(0, rot, 2), np.arange(1, rot, 2), np.arange(rot, H)])
    plain = default_source(path, shape, metadata)

    def combine(arrays, shape):
        a = arrays[0]
        return a.reshape(-1, H, *a.shape[1:])[:, order].reshape(shape)
    return Source(plain.names, combine, plain.shapes)


FAMILY = Family(model_types=("ernie4_5",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS,
                hf_source=interleaved_to_halves)
