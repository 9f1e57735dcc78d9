"""MiniMax-M2: GQA with RMSNorm over the whole q and k projections (all heads together, before RoPE), partial
rotary dims (`rotary_dim`), and an MoE in every layer: sigmoid scores, experts chosen by score +
`e_score_correction_bias`, weighted by the plain scores renormalized; no shared expert.
HF reference: transformers/models/minimax_m2/modeling_minimax_m2.py. Checkpoints keep MiniMax's names
(`block_sparse_moe`, experts' w1/w3/w2, the routing bias beside the gate): see `hf_source`."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from flax import nnx

from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.moe import Experts, MoE, Router, swiglu
from day0jax.models import llama
from day0jax.models.base import HFConfig, per_expert_source
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    ALIASES = {"num_experts": "num_local_experts"}
    DEFAULT_THETA = 5000000.0
    vocab_size: int = 200064
    hidden_size: int = 3072
    intermediate_size: int = 1536  # each expert's
    num_hidden_layers: int = 62
    num_attention_heads: int = 48
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 196608
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    rotary_dim: int | None = None  # HF turns it into partial_rotary_factor = rotary_dim / head_dim
    partial_rotary_factor: float | None = None
    num_experts_per_tok: int = 8
    num_local_experts: int = 256
    router_jitter_noise: float = 0.0  # training-time noise only
    # Keys of MiniMax's own config.json, which HF's MiniMax-M2 does not read: it always has what these values
    # say, so any other value is refused.
    use_qk_norm: bool = True
    qk_norm_type: str = "per_layer"
    scoring_func: str = "sigmoid"
    use_routing_bias: bool = True
    shared_intermediate_size: int = 0
    attn_type_list: list | None = None  # 1: softmax attention; 0 (lightning attention) is MiniMax-Text-01's
    # Multi-token-prediction modules: their tensors are dropped (see `dropped`), they never run here.
    use_mtp: bool = False
    num_mtp_modules: int = 0
    mtp_transformer_layers: int = 1
    model_type: str = "minimax_m2"

    def __post_init__(self):
        super().__post_init__()
        self._refuse_if("use_qk_norm", lambda v: not v, "is not implemented (HF's MiniMax-M2 always normalizes q, k)")
        self._refuse_if("qk_norm_type", lambda v: v != "per_layer", "is not implemented (only 'per_layer')")
        self._refuse_if("scoring_func", lambda v: v != "sigmoid", "is not implemented (only 'sigmoid')")
        self._refuse_if("use_routing_bias", lambda v: not v, "is not implemented (HF always adds the routing bias)")
        self._refuse_if("shared_intermediate_size", bool, "(a shared expert) is not implemented")
        self._refuse_if("attn_type_list", lambda v: v is not None and any(t != 1 for t in v),
                        "has lightning-attention layers (0), which are not implemented")

    @cached_property
    def rope(self) -> dict:
        """The normalized RoPE dict, rotating `rotary_dim` of each head's dims (HF's default: all of them)."""
        factor = self.partial_rotary_factor
        if factor is None and self.rotary_dim is not None:
            factor = self.rotary_dim / self.head_size
        return self._rope(partial_rotary_factor=factor)


class Model(llama.LlamaLike):
    def attention_kwargs(self, index: int) -> dict:
        return dict(rope=self.rope, qk_norm_eps=self.config.rms_norm_eps, qk_norm_over="all")

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> MoE:
        c = self.config
        # One group holding every expert: plain top-k of the biased sigmoid scores, always renormalized.
        return MoE(Router(c.hidden_size, c.num_local_experts, c.num_experts_per_tok, routing="sigmoid_grouped",
                          norm_topk_prob=True, n_group=1, topk_group=1, dtype=dtype, rngs=rngs),
                   Experts(c.num_local_experts, c.hidden_size, c.intermediate_size, swiglu(c.hidden_act),
                           dtype=dtype, rngs=rngs))


def _block(prefix: str) -> str:
    return prefix.replace(".mlp", ".block_sparse_moe")


def hf_source(config: Config, path: str, shape: tuple, metadata: dict) -> Source | None:
    """`mlp.gate` <- `block_sparse_moe.gate`, its routing bias <- `block_sparse_moe.e_score_correction_bias`,
    experts' gate/up/down_proj <- w1/w3/w2."""
    if path.endswith(".mlp.gate.kernel"):
        return default_source(_block(path), shape, metadata)
    if path.endswith(".mlp.gate.e_score_correction_bias"):
        return default_source(_block(path).replace(".gate.", "."), shape, metadata)
    return per_expert_source(path, shape, prefix=_block, names={"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})


def dropped(config: Config) -> dict[str, str]:
    """Released checkpoints store the multi-token-prediction modules as layers after the last decoder layer."""
    L, n = config.num_hidden_layers, config.num_mtp_modules
    if not n:
        return {}
    indices = "|".join(str(L + i) for i in range(n))
    return {rf"model\.layers\.({indices})\..*": "multi-token-prediction modules, used only for speculative decoding"}


# Its configs declare MTP modules, but no published code (transformers included) defines their forward: refused
# rather than guessed.
FAMILY = Family(model_types=("minimax_m2",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS,
                dropped_for=dropped, hf_source=hf_source,
                mtp_refusal="its multi-token-prediction modules (num_mtp_modules) have no published forward "
                            "(transformers defines none), so day0jax does not run them")
