"""Hunyuan dense (HunYuanDenseV1): Llama with q/k/v/o biases per `attention_bias` and RMSNorm on each head's q and
k after RoPE (HF's `query_layernorm`, `key_layernorm`). Its checkpoints label their RoPE "dynamic" with an
`alpha`: HF reads that as a fixed NTK stretch of the base, theta * alpha ** (H / (H - 2)), not as dynamic scaling.
HF reference: transformers/models/hunyuan_v1_dense/modeling_hunyuan_v1_dense.py."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from day0jax.core.hf_tensors import Source, default_source
from day0jax.models import llama
from day0jax.models.base import HFConfig
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    vocab_size: int = 290943
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    attention_bias: bool = False
    eod_token_id: int | None = 3  # a token id
    # Keys of Tencent's own config.json, which HF's model does not read: it always has what these values say, so
    # any other value is refused.
    use_qk_norm: bool = True
    use_rotary_pos_emb: bool = True
    use_cla: bool = False           # cross-layer attention (shared KV between layers)
    cla_share_factor: int = 1       # read only under use_cla
    mlp_bias: bool = False
    attention_head_dim: int | None = None
    norm_type: str = "rms"
    use_mixed_mlp_moe: bool = False
    model_type: str = "hunyuan_v1_dense"

    def __post_init__(self):
        super().__post_init__()
        self._refuse_if("use_qk_norm", lambda v: not v, "is not implemented (HF always normalizes q and k)")
        self._refuse_if("use_rotary_pos_emb", lambda v: not v, "is not implemented (HF always applies RoPE)")
        self._refuse_if("use_cla", bool, "(cross-layer attention) is not implemented")
        self._refuse_if("mlp_bias", bool, "is not implemented (HF's MLP has no biases)")
        self._refuse_if("attention_head_dim", lambda v: v is not None and v != self.head_size,
                        f"differs from the head size {self.head_size}")
        self._refuse_if("norm_type", lambda v: v != "rms", "is not implemented (only 'rms')")
        self._refuse_mlp()

    def _refuse_mlp(self):
        """Refuses the MLP keys this family does not implement; the MoE family (a subclass) refuses its own."""
        self._refuse_if("use_mixed_mlp_moe", bool, "(an MoE) is not implemented by the dense family")

    @cached_property
    def rope(self) -> dict:
        """The normalized RoPE dict; "dynamic" with an `alpha` becomes the plain RoPE of the stretched base."""
        params = dict(self.rope_parameters or self.rope_scaling or {})
        kind = params.get("rope_type") or params.get("type")
        if kind == "dynamic" and params.get("alpha"):
            H = self.head_size
            theta = params.get("rope_theta", self.rope_theta if self.rope_theta is not None else self.DEFAULT_THETA)
            # HF's ntk_alpha reads only these two; the other keys of the dict do not change its frequencies.
            params = {"rope_type": "default", "rope_theta": theta * params["alpha"] ** (H / (H - 2))}
        return self._rope(params)


class Model(llama.LlamaLike):
    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        return dict(rope=self.rope, qkv_bias=c.attention_bias, o_bias=c.attention_bias, qk_norm_eps=c.rms_norm_eps,
                    qk_norm_after_rope=True)


def hf_source(config: Config, path: str, shape: tuple, metadata: dict) -> Source | None:
    """`self_attn.q_norm` / `k_norm` <- HF's `self_attn.query_layernorm` / `key_layernorm`."""
    m = re.fullmatch(r"(.*\.self_attn)\.([qk])_norm\.weight", path)
    if not m:
        return None
    return default_source(f"{m[1]}.{'query' if m[2] == 'q' else 'key'}_layernorm.weight", shape, metadata)


FAMILY = Family(model_types=("hunyuan_v1_dense",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS,
                hf_source=hf_source)
