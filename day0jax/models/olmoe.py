"""OLMoE: Llama's pre-norm blocks with OLMo 2's RMSNorm over the whole q and k projections, q, k and v clamped to
`clip_qkv`, and a softmax top-k MoE in every layer, the top-k weights renormalized only under `norm_topk_prob`.
HF reference: transformers/models/olmoe/modeling_olmoe.py."""

from __future__ import annotations

from dataclasses import dataclass

from flax import nnx

from day0jax.layers.moe import Experts, MoE, Router, swiglu
from day0jax.models import llama, olmo2
from day0jax.models.base import per_expert_hf_source
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(olmo2.Config):
    ALIASES = {"num_local_experts": "num_experts"}
    hidden_size: int = 2048
    intermediate_size: int = 2048  # each expert's width (HF's OLMoE has no dense MLP)
    num_hidden_layers: int = 16
    num_attention_heads: int = 16
    max_position_embeddings: int = 4096
    clip_qkv: float | None = None
    num_experts_per_tok: int = 8
    num_experts: int = 64
    norm_topk_prob: bool = False
    model_type: str = "olmoe"

    def __post_init__(self):
        super().__post_init__()
        # HF sizes the q norm by hidden_size and the k norm by (hidden_size // heads) * kv heads: other head dims
        # do not build there.
        self._refuse_if("head_dim", lambda h: h is not None and h != self.hidden_size // self.num_attention_heads,
                        "differs from hidden_size // num_attention_heads, which HF's OLMoE q/k norms assume")


class Model(llama.LlamaLike):
    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        return dict(rope=self.rope, qkv_bias=c.attention_bias, o_bias=c.attention_bias, qk_norm_eps=c.rms_norm_eps,
                    qk_norm_over="all", clip_qkv=c.clip_qkv)

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> MoE:
        c = self.config
        D = c.hidden_size
        return MoE(Router(D, c.num_experts, c.num_experts_per_tok, routing="softmax_topk",
                          norm_topk_prob=c.norm_topk_prob, dtype=dtype, rngs=rngs),
                   Experts(c.num_experts, D, c.intermediate_size, swiglu(c.hidden_act), dtype=dtype, rngs=rngs))


FAMILY = Family(model_types=("olmoe",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS,
                hf_source=per_expert_hf_source)
