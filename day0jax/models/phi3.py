"""Phi-3: Llama math with partial rotary dims, LongRoPE (switching at the top-level
`original_max_position_embeddings`, as HF), and fused `qkv_proj`, `gate_up_proj` in the checkpoint.
HF reference: transformers/models/phi3/modeling_phi3.py. `hf_source` splits the fused weights on conversion, so
tensor parallelism splits heads and the MLP as for Llama."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source
from day0jax.models import llama
from day0jax.models.base import HFConfig
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    vocab_size: int = 32064
    hidden_size: int = 3072
    intermediate_size: int = 8192
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    original_max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    partial_rotary_factor: float | None = None
    sliding_window: int | None = None
    attention_bias: bool = False  # in Phi-3 configs, always false: HF's Phi-3 has no biases
    model_type: str = "phi3"

    def __post_init__(self):
        self._check_heads()
        self._activation()
        self._refuse_if("attention_bias", bool, "is not implemented (HF's Phi-3 has no attention biases)")
        self._check_derived("rope")

    @cached_property
    def rope(self) -> dict:
        """The normalized RoPE dict, with HF's Phi-3 renames ("su" and "yarn" are LongRoPE).

        Raises:
            UnsupportedArchitecture: a rope_type Phi-3 does not have.
        """
        params = dict(self.rope_parameters or self.rope_scaling or {})
        kind = params.pop("type", None) or params.get("rope_type") or "default"
        params["rope_type"] = "longrope" if kind in ("su", "yarn") else kind  # HF's Phi-3 renames these
        if params["rope_type"] not in ("default", "longrope"):
            refuse("rope_parameters.rope_type", kind, "is not one Phi-3 has (default, longrope)")
        if params["rope_type"] == "longrope":
            params["original_max_position_embeddings"] = self.original_max_position_embeddings
        return self._rope(params, partial_rotary_factor=self.partial_rotary_factor)


class Model(llama.LlamaLike):
    def attention_kwargs(self, index: int) -> dict:
        return dict(rope=self.rope, sliding_window=self.config.sliding_window)


def hf_source(config: Config, path: str, shape: tuple, metadata: dict) -> Source | None:
    """q/k/v_proj from row blocks of `qkv_proj.weight`, gate/up_proj from the halves of `gate_up_proj.weight`."""
    D, N, K, H, F = (config.hidden_size, config.num_attention_heads, config.kv_heads, config.head_size,
                     config.intermediate_size)
    if m := re.fullmatch(r"(.*\.self_attn)\.([qkv])_proj\.kernel", path):
        fused, rows = f"{m[1]}.qkv_proj.weight", (N + 2 * K) * H
        start, stop = {"q": (0, N * H), "k": (N * H, (N + K) * H), "v": ((N + K) * H, (N + 2 * K) * H)}[m[2]]
    elif m := re.fullmatch(r"(.*\.mlp)\.(gate|up)_proj\.kernel", path):
        fused, rows = f"{m[1]}.gate_up_proj.weight", 2 * F
        start, stop = (0, F) if m[2] == "gate" else (F, 2 * F)
    else:
        return None
    return Source((fused,), lambda arrays, shape: arrays[0][start:stop].reshape(shape), ((rows, D),))


FAMILY = Family(model_types=("phi3",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS, hf_source=hf_source)
