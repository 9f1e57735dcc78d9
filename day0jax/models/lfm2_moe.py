"""LFM2-MoE (Liquid AI): LFM2's layers (gated short convolutions and attention) with MoE MLPs after the first
`num_dense_layers`: sigmoid scores, experts chosen by score + `expert_bias`, weights renormalized (HF adds 1e-6 to
their sum) and times `routed_scaling_factor`. HF reference: transformers/models/lfm2_moe/modeling_lfm2_moe.py.

Checkpoints keep one Linear per expert (`experts.<e>.w1/w3/w2`, which transformers fuses when it loads them) and the
routing bias `feed_forward.expert_bias` beside the router `feed_forward.gate`: see `hf_source`.
"""

from __future__ import annotations

from dataclasses import dataclass

from flax import nnx

from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.moe import Experts, MoE, Router, swiglu
from day0jax.models import llama, lfm2
from day0jax.models.base import per_expert_source
from day0jax.models.contract import Family

EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


@dataclass(frozen=True, eq=False)
class Config(lfm2.HybridConfig):
    ALIASES = {"tie_embedding": "tie_word_embeddings"}  # Liquid's name, which HF's config reads in its place
    hidden_size: int = 2048
    intermediate_size: int = 7168
    moe_intermediate_size: int = 1792
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    num_dense_layers: int = 2
    num_experts_per_tok: int = 4
    num_experts: int = 32
    use_expert_bias: bool = True
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    model_type: str = "lfm2_moe"

    def __post_init__(self):
        super().__post_init__()
        self._refuse_partial_rope(self.rope)
        self._refuse_if("use_expert_bias", lambda b: not b, "is not implemented (routing without the bias)")
        self._refuse_if("num_experts", lambda e: e < 2, "is not implemented (fewer than 2 experts)")


class Model(lfm2.Model):
    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        D = c.hidden_size
        if index < c.num_dense_layers:  # no sizing rule: intermediate_size is the width
            return GatedMLP(D, c.intermediate_size, c.hidden_act, dtype=dtype, rngs=rngs)
        # One group holding every expert: the top-k of the biased scores.
        return MoE(Router(D, c.num_experts, c.num_experts_per_tok, routing="sigmoid_grouped",
                          norm_topk_prob=c.norm_topk_prob, routed_scaling_factor=c.routed_scaling_factor,
                          norm_eps=1e-6, dtype=dtype, rngs=rngs),
                   Experts(c.num_experts, D, c.moe_intermediate_size, swiglu(c.hidden_act), dtype=dtype, rngs=rngs))


def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict) -> Source:
    if path.endswith(".mlp.gate.e_score_correction_bias"):
        src = default_source(path.replace(".gate.e_score_correction_bias", ".expert_bias"), shape, metadata)
    else:
        src = (per_expert_source(path, shape, names=EXPERT_NAMES) or lfm2.conv_source(path, shape)
               or default_source(path, shape, metadata))
    return src.renamed(lfm2.renamer({**lfm2.NAMES, **lfm2.ATTENTION_NAMES}))


FAMILY = Family(model_types=("lfm2_moe",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS,
                hf_source=hf_source)
