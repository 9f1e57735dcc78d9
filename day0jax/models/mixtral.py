"""Mixtral: Mistral attention with a renormalized softmax top-k MoE in every layer (experts of `intermediate_size`).
HF reference: transformers/models/mixtral/modeling_mixtral.py. Checkpoints say `block_sparse_moe` and w1/w3/w2
where the runtime has transformers 5's `mlp.gate` and `mlp.experts.{gate,up,down}_proj`: see `hf_source`."""

from __future__ import annotations

from dataclasses import dataclass

from flax import nnx

from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.moe import Experts, MoE, Router, swiglu
from day0jax.models import llama
from day0jax.models.base import HFConfig, per_expert_source
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    ALIASES = {"num_experts": "num_local_experts"}
    DEFAULT_THETA = 1000000.0
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096 * 32
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    sliding_window: int | None = None
    num_experts_per_tok: int = 2
    num_local_experts: int = 8
    router_jitter_noise: float = 0.0  # training-time noise only
    model_type: str = "mixtral"


class Model(llama.LlamaLike):
    def attention_kwargs(self, index: int) -> dict:
        return dict(rope=self.rope, sliding_window=self.config.sliding_window)

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> MoE:
        c = self.config
        return MoE(Router(c.hidden_size, c.num_local_experts, c.num_experts_per_tok, routing="softmax_topk",
                          norm_topk_prob=True, dtype=dtype, rngs=rngs),
                   Experts(c.num_local_experts, c.hidden_size, c.intermediate_size, swiglu(c.hidden_act),
                           dtype=dtype, rngs=rngs))


def _block(prefix: str) -> str:
    return prefix.replace(".mlp", ".block_sparse_moe")


def hf_source(config: Config, path: str, shape: tuple, metadata: dict) -> Source | None:
    if path.endswith(".mlp.gate.kernel"):
        return default_source(_block(path), shape, metadata)
    return per_expert_source(path, shape, prefix=_block, names={"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})


FAMILY = Family(model_types=("mixtral",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS,
                hf_source=hf_source)
