"""dots.llm1 (rednote): Qwen3's attention (GQA, RMSNorm on each head's q and k before RoPE, biases per
`attention_bias`, sliding windows on the layers `layer_types` marks, by default those from `max_window_layers` on)
and, after `first_k_dense_replace` dense layers, DeepSeek-V3's MoE: grouped sigmoid routing chosen by score +
`e_score_correction_bias`, renormalized per `norm_topk_prob`, times `routed_scaling_factor`, and shared experts.
HF reference: transformers/models/dots1/modeling_dots1.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from flax import nnx

from day0jax.core.hf_config import refuse
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.moe import Experts, MoE, Router, swiglu
from day0jax.models import llama
from day0jax.models.base import HFConfig, LayerTypes, per_expert_hf_source
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(LayerTypes, HFConfig):
    ALIASES = {"num_local_experts": "n_routed_experts"}
    vocab_size: int = 152064
    hidden_size: int = 4608
    intermediate_size: int = 10944
    moe_intermediate_size: int = 1408
    num_hidden_layers: int = 62
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    head_dim: int | None = None  # not an HF field, but HF's attention reads it when config.json has it
    n_shared_experts: int | None = None
    n_routed_experts: int | None = None
    n_group: int | None = 1
    topk_group: int | None = 1
    num_experts_per_tok: int | None = None
    first_k_dense_replace: int | None = 0
    norm_topk_prob: bool | None = False
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    attention_bias: bool = False
    routed_scaling_factor: float = 1.0
    sliding_window: int | None = 4096
    max_window_layers: int | None = 62
    layer_types: list | None = None
    # Keys of the original code that transformers does not read: only the values it runs are accepted.
    use_sliding_window: bool | None = None
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    moe_layer_freq: int = 1
    model_type: str = "dots1"

    def __post_init__(self):
        super().__post_init__()
        for key in ("n_routed_experts", "num_experts_per_tok", "first_k_dense_replace"):
            self._refuse_if(key, lambda v: v is None, "must be set (HF's dots1 has no fallback for None)")
        # HF always builds the shared experts; with none, its checkpoint holds empty tensors we do not map.
        self._refuse_if("n_shared_experts", lambda v: not v or v < 1,
                        "must be at least 1 (HF always has shared experts)")
        n_group, topk_group = self.groups
        self._refuse_if("n_group", lambda v: n_group < 1 or self.n_routed_experts % n_group,
                        f"does not divide n_routed_experts={self.n_routed_experts}")
        self._refuse_if("topk_group", lambda v: not 1 <= topk_group <= n_group, f"must be in 1..n_group={n_group}")
        kept = topk_group * (self.n_routed_experts // n_group)
        self._refuse_if("num_experts_per_tok", lambda v: v > kept,
                        f"exceeds the {kept} experts of topk_group={self.topk_group} groups")
        self._refuse_if("scoring_func", lambda v: v != "sigmoid", "is not implemented (only 'sigmoid')")
        self._refuse_if("topk_method", lambda v: v != "noaux_tc", "is not implemented (only 'noaux_tc')")
        self._refuse_if("moe_layer_freq", lambda v: v != 1,
                        "is not implemented (transformers makes every layer after first_k_dense_replace an MoE)")
        self._check_derived("layer_kinds")
        # transformers slides the layers `layer_types` marks whatever this says: refuse the two disagreeing.
        if self.use_sliding_window is False and "sliding_attention" in self.layer_kinds and self.window:
            refuse("use_sliding_window", False, "contradicts layer_types/max_window_layers, which transformers "
                   "follows: sliding layers would run")

    @property
    def groups(self) -> tuple[int, int]:
        """(n_group, topk_group); released dots.llm1 configs write null for both (transformers' view fails on None),
        which the original code reads as no group limit: one group, kept."""
        return (1 if self.n_group is None else self.n_group), (1 if self.topk_group is None else self.topk_group)

    def slides_by_default(self, index: int) -> bool:
        return self.sliding_window is not None and index >= self.max_window_layers


class Model(llama.LlamaLike):
    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        return dict(rope=self.rope, qkv_bias=c.attention_bias, o_bias=c.attention_bias, qk_norm_eps=c.rms_norm_eps,
                    sliding_window=c.layer_window(index))

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        D = c.hidden_size
        if index < c.first_k_dense_replace:
            return super().make_mlp(index, dtype=dtype, rngs=rngs)
        return MoE(Router(D, c.n_routed_experts, c.num_experts_per_tok, routing="sigmoid_grouped",
                          norm_topk_prob=bool(c.norm_topk_prob), n_group=c.groups[0], topk_group=c.groups[1],
                          routed_scaling_factor=c.routed_scaling_factor, dtype=dtype, rngs=rngs),
                   Experts(c.n_routed_experts, D, c.moe_intermediate_size, swiglu(c.hidden_act), dtype=dtype,
                           rngs=rngs),
                   shared=GatedMLP(D, c.moe_intermediate_size * c.n_shared_experts, c.hidden_act, dtype=dtype,
                                   rngs=rngs),
                   shared_name="shared_experts")


FAMILY = Family(model_types=("dots1",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS,
                hf_source=per_expert_hf_source)
