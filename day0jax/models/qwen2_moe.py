"""Qwen2-MoE: Qwen2 attention (q/k/v biases per `qkv_bias`) with sparse MoE MLPs: softmax routing over
`num_experts`, top `num_experts_per_tok` (renormalized when `norm_topk_prob`), plus a shared expert every token
uses, scaled by sigmoid(shared_expert_gate(x)).

HF reference: transformers/models/qwen2_moe/modeling_qwen2_moe.py. A layer is sparse unless listed in
`mlp_only_layers` or skipped by `decoder_sparse_step`; dense layers use `intermediate_size`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from flax import nnx

from day0jax.layers.linear import Linear
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.moe import Experts, MoE, Router, swiglu
from day0jax.models import llama
from day0jax.models.base import HFConfig, Source, per_expert_source
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 16
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: list | None = None
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 1408
    shared_expert_intermediate_size: int = 5632
    num_experts_per_tok: int = 4
    num_experts: int = 60
    norm_topk_prob: bool = False
    mlp_only_layers: list | None = None
    qkv_bias: bool = True
    model_type: str = "qwen2_moe"

    def __post_init__(self):
        self._check_heads()
        self._activation()
        self._check_derived("rope", "layer_kinds")

    @property
    def window(self) -> int | None:
        """The sliding window HF uses: `sliding_window` when `use_sliding_window`, else None (no window)."""
        return self.sliding_window if self.use_sliding_window else None

    @cached_property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's attention kind: `layer_types`, by default with a window every other layer below
        `max_window_layers`."""
        return self._checked_layer_kinds(
            ["sliding_attention" if self.window is not None and (i + 1) % 2 and i < self.max_window_layers
             else "full_attention" for i in range(self.num_hidden_layers)])

    def layer_window(self, index: int) -> int | None:
        """The sliding window of layer `index` (None: full attention)."""
        return self.window if self.layer_kinds[index] == "sliding_attention" else None

    def is_sparse(self, index: int) -> bool:
        """Whether layer `index` is an MoE: not in `mlp_only_layers`, and on the `decoder_sparse_step`."""
        return (index not in (self.mlp_only_layers or ()) and self.num_experts > 0
                and (index + 1) % self.decoder_sparse_step == 0)


class Model(llama.LlamaLike):
    def attention_kwargs(self, index: int) -> dict:
        return dict(rope=self.rope, qkv_bias=self.config.qkv_bias, sliding_window=self.config.layer_window(index))

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        D = c.hidden_size
        if not c.is_sparse(index):
            return GatedMLP(D, c.intermediate_size, c.hidden_act, dtype=dtype, rngs=rngs)
        return MoE(Router(D, c.num_experts, c.num_experts_per_tok, routing="softmax_topk",
                          norm_topk_prob=c.norm_topk_prob, dtype=dtype, rngs=rngs),
                   Experts(c.num_experts, D, c.moe_intermediate_size, swiglu(c.hidden_act), dtype=dtype, rngs=rngs),
                   shared=GatedMLP(D, c.shared_expert_intermediate_size, c.hidden_act, dtype=dtype, rngs=rngs),
                   shared_gate=Linear((D,), (1,), ("embed", None), dtype=dtype, rngs=rngs))


def hf_source(config: Config, path: str, shape: tuple, metadata: dict) -> Source | None:
    return per_expert_source(path, shape)


FAMILY = Family(model_types=("qwen2_moe",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS,
                hf_source=hf_source)
