"""DeepSeek-V2 / V2.5 / V2-Lite / Coder-V2: DeepSeek-V3's multi-head latent attention (with or without a low-rank
query, RoPE dims always interleaved, YaRN's mscale in the softmax scale) and, after `first_k_dense_replace` dense
layers, MoE layers with shared experts whose router scores experts by softmax: top-k over all experts
(`topk_method` "greedy") or within the `topk_group` groups of best single score ("group_limited_greedy"), the
weights never renormalized, times `routed_scaling_factor`. Dense and shared MLPs take `mlp_bias`.
HF reference: transformers/models/deepseek_v2/modeling_deepseek_v2.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from flax import nnx

from day0jax.layers.mlp import GatedMLP
from day0jax.layers.moe import Experts, MoE, Router, swiglu
from day0jax.models import deepseek_v3, llama
from day0jax.models.base import HFConfig, per_expert_hf_source
from day0jax.models.contract import Family

TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    ALIASES = {"num_experts": "n_routed_experts"}
    vocab_size: int = 102400
    hidden_size: int = 4096
    intermediate_size: int = 11008
    moe_intermediate_size: int = 1407
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    n_shared_experts: int | None = 2
    n_routed_experts: int | None = 64
    routed_scaling_factor: float = 1.0
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    topk_method: str | None = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    num_experts_per_tok: int | None = None
    first_k_dense_replace: int = 0
    norm_topk_prob: bool | None = False
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    # HF writes these to config.json but recomputes them from the qk_* dims whatever they say (see `head_size`).
    head_dim: int | None = None
    qk_head_dim: int | None = None
    # Keys of DeepSeek's own config.json that transformers does not read: only the values it runs are accepted.
    scoring_func: str = "softmax"
    moe_layer_freq: int = 1
    ep_size: int = 1                # the original code's expert-parallel hint; the mesh decides here
    aux_loss_alpha: float = 0.0     # training only
    seq_aux: bool = True            # training only
    model_type: str = "deepseek_v2"

    head_size = deepseek_v3.Config.head_size
    qk_head_size = deepseek_v3.Config.qk_head_size
    softmax_scale = deepseek_v3.Config.softmax_scale

    def __post_init__(self):
        deepseek_v3.refuse_grouped_kv(self)
        self._activation()
        for key in ("n_routed_experts", "num_experts_per_tok"):
            self._refuse_if(key, lambda v: not v, "must be set (HF's DeepSeek-V2 has no fallback)")
        # HF always builds the shared experts; with none, its checkpoint holds empty tensors we do not map.
        self._refuse_if("n_shared_experts", lambda v: not v or v < 1,
                        "must be at least 1 (HF always has shared experts)")
        self._refuse_if("topk_method", lambda v: v not in TOPK_METHODS,
                        f"is not implemented (known: {', '.join(TOPK_METHODS)})")
        self._refuse_if("scoring_func", lambda v: v != "softmax", "is not implemented (only 'softmax')")
        self._refuse_if("moe_layer_freq", lambda v: v != 1,
                        "is not implemented (transformers makes every layer after first_k_dense_replace an MoE)")
        # transformers never renormalizes the top-k weights while DeepSeek's own code does when this is set: the two
        # references disagree, so only the value they agree on runs.
        self._refuse_if("norm_topk_prob", bool, "is not implemented (transformers' DeepSeek-V2 ignores it)")
        if self.topk_method == "group_limited_greedy":
            self._refuse_if("n_group", lambda v: not v or self.n_routed_experts % v,
                            f"does not divide n_routed_experts={self.n_routed_experts}")
            self._refuse_if("topk_group", lambda v: not v or v > self.n_group,
                            f"must be in 1..n_group={self.n_group}")
            # Beyond what the chosen groups hold, HF would pick masked-out experts (score 0) in no defined order.
            kept = self.topk_group * (self.n_routed_experts // self.n_group)
            self._refuse_if("num_experts_per_tok", lambda v: v > kept,
                            f"exceeds the {kept} experts of topk_group={self.topk_group} groups")
        self._check_derived("rope")

    @property
    def rope_interleave(self) -> bool:
        """Always: HF's DeepSeek-V2 rotates (even, odd) pairs as complex numbers (DeepSeek's layout)."""
        return True

    def is_sparse(self, index: int) -> bool:
        """Whether layer `index` is an MoE: all after the first `first_k_dense_replace`."""
        return index >= self.first_k_dense_replace


class Model(deepseek_v3.Model):
    def mlp_kwargs(self, index: int) -> dict:
        return dict(use_bias=self.config.mlp_bias)

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        D = c.hidden_size
        if not c.is_sparse(index):
            return super(deepseek_v3.Model, self).make_mlp(index, dtype=dtype, rngs=rngs)
        # "greedy" is one group holding every expert; a group's score is its best expert's (group_top=1).
        groups = (c.n_group, c.topk_group) if c.topk_method == "group_limited_greedy" else (1, 1)
        return MoE(Router(D, c.n_routed_experts, c.num_experts_per_tok, routing="softmax_grouped",
                          n_group=groups[0], topk_group=groups[1], group_top=1,
                          routed_scaling_factor=c.routed_scaling_factor, dtype=dtype, rngs=rngs),
                   Experts(c.n_routed_experts, D, c.moe_intermediate_size, swiglu(c.hidden_act), dtype=dtype,
                           rngs=rngs),
                   shared=GatedMLP(D, c.moe_intermediate_size * c.n_shared_experts, c.hidden_act,
                                   use_bias=c.mlp_bias, dtype=dtype, rngs=rngs),
                   shared_name="shared_experts")


FAMILY = Family(model_types=("deepseek_v2",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS,
                hf_source=per_expert_hf_source)
