"""ERNIE 4.5 MoE (ERNIE-4.5-21B-A3B, 300B-A47B; text only): the dense ERNIE 4.5 (biases per `use_bias`, RoPE on
interleaved pairs, reordered at conversion by `ernie4_5.interleaved_to_halves`) whose layers from
`moe_layer_start_index` to `moe_layer_end_index`, every `moe_layer_interval`-th, are MoEs: softmax scores, top
`moe_k` chosen by score + `e_score_correction_bias`, weighted by the plain scores renormalized (the sum floored at
`moe_norm_min`), plus `moe_num_shared_experts` shared experts as one MLP every token goes through.
Its one multi-token-prediction layer (`mtp_emb_norm.0`, `mtp_hidden_norm.0`, `mtp_linear_proj.0`, `mtp_block.0`;
speculative method "mtp") is transformers' generic one, its post-norm the model's final norm.
HF reference: transformers/models/ernie4_5_moe/modeling_ernie4_5_moe.py."""

from __future__ import annotations

import re
from dataclasses import dataclass

import jax.numpy as jnp
from flax import nnx

from day0jax.core.errors import UnsupportedArchitecture
from day0jax.core.hf_tensors import Source, default_source, same
from day0jax.layers.linear import Linear
from day0jax.layers.mtp import MtpLayer, MtpStack
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.moe import Experts, MoE, Router, swiglu
from day0jax.models import ernie4_5, llama
from day0jax.models.base import per_expert_source
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(ernie4_5.Config):
    ALIASES = {"num_experts": "moe_num_experts", "num_experts_per_tok": "moe_k",
               "num_mtp_layers": "num_nextn_predict_layers"}
    hidden_size: int = 2560
    intermediate_size: int = 12288
    num_hidden_layers: int = 28
    num_attention_heads: int = 20
    num_key_value_heads: int | None = 4
    head_dim: int | None = None
    moe_intermediate_size: int = 1536
    moe_k: int = 6
    moe_num_experts: int = 64
    moe_num_shared_experts: int = 2
    moe_layer_start_index: int = 1
    moe_layer_end_index: int = -1   # -1: the last layer (HF rewrites it to num_hidden_layers - 1)
    moe_layer_interval: int = 1
    moe_norm_min: float = 1e-12
    # Keys of Baidu's own config.json that HF's class does not declare. Without aux-free balancing the checkpoint
    # holds no e_score_correction_bias, and HF's stays at its zero init: the experts are chosen by plain scores.
    moe_use_aux_free: bool = True
    moe_gate_act: str = "softmax"
    use_rmsnorm: bool = True
    moe_capacity: list | None = None            # token capacity per expert, a training-time limit
    num_nextn_predict_layers: int | None = None  # multi-token-prediction layers ("mtp" speculation; None, 0 or 1)
    multi_token_pred_lambda: float | None = None  # their training loss weight
    model_type: str = "ernie4_5_moe"

    def __post_init__(self):
        super().__post_init__()
        # ERNIE 4.5 VL writes per-modality lists here; HF's text model takes one value each.
        for key in ("moe_num_experts", "moe_k", "moe_intermediate_size", "moe_layer_start_index",
                    "moe_layer_end_index"):
            self._refuse_if(key, lambda v: not isinstance(v, int), "must be one int (lists are ERNIE 4.5 VL's)")
        self._refuse_if("moe_k", lambda v: not 1 <= v <= self.moe_num_experts,
                        f"must be in 1..moe_num_experts={self.moe_num_experts}")
        self._refuse_if("moe_layer_interval", lambda v: v < 1, "must be at least 1")
        self._refuse_if("num_nextn_predict_layers", lambda v: (v or 0) > 1,
                        "must be 0 or 1 (HF's ERNIE 4.5 MoE runs a single multi-token-prediction layer)")
        # HF's router always applies a softmax and its layers always RMSNorm, whatever these say.
        self._refuse_if("moe_gate_act", lambda v: v != "softmax", "is not implemented (HF's router is a softmax)")
        self._refuse_if("use_rmsnorm", lambda v: not v, "is not implemented (HF's layers use RMSNorm)")
        # HF's lm_head keeps a bias of its own beside the tied weight; the runtime's tied head has no parameter
        # of its own (pipeline stages tell tied heads by that), so this pair is refused.
        self._refuse_if("use_bias", lambda v: v and self.tie_word_embeddings,
                        "with tie_word_embeddings=True is not implemented (HF adds an lm_head.bias to the tied head)")

    def is_sparse(self, index: int) -> bool:
        """Whether layer `index` is an MoE: on the interval, between the start and end indices (both included)."""
        end = self.num_hidden_layers - 1 if self.moe_layer_end_index == -1 else self.moe_layer_end_index
        return (index + 1) % self.moe_layer_interval == 0 and self.moe_layer_start_index <= index <= end


class Model(ernie4_5.Model):
    def __init__(self, config: Config, *, dtype=jnp.float32, rngs: nnx.Rngs, mtp: bool = False):
        super().__init__(config, dtype=dtype, rngs=rngs, mtp=mtp)
        if config.use_bias:  # HF builds lm_head with bias=use_bias, unlike the dense ERNIE 4.5
            self.lm_head = Linear((config.hidden_size,), (config.vocab_size,), ("embed", "vocab"), use_bias=True,
                                  dtype=dtype, rngs=rngs)

    def make_mtp(self, *, dtype, rngs: nnx.Rngs) -> MtpStack:
        """The multi-token-prediction layer: its decoder layer built as layer 0 is (HF builds it with layer index
        0: an MoE only where layer 0 is one)."""
        c = self.config
        if not c.num_nextn_predict_layers:
            raise UnsupportedArchitecture("this ernie4_5_moe config declares no multi-token-prediction layers")
        return MtpStack([MtpLayer(self.make_layer(0, dtype=dtype, rngs=rngs), self.make_norm, c.hidden_size,
                                  dtype=dtype, rngs=rngs)])

    def mtp_step(self, index, tokens, hidden, positions, cache=None, seq_len=None):
        """The MTP layer's post-norm is the model's final norm (HF loads `model.norm.weight` into it)."""
        rope_tables = self.rope_tables(positions, seq_len)
        return self.mtp.step(index, self.embed(tokens), hidden, positions, rope_tables, cache,
                             post_norm=self.model.norm)

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        D, F = c.hidden_size, c.moe_intermediate_size
        if not c.is_sparse(index):
            return super().make_mlp(index, dtype=dtype, rngs=rngs)
        shared = (GatedMLP(D, F * c.moe_num_shared_experts, c.hidden_act, use_bias=c.use_bias, dtype=dtype,
                           rngs=rngs) if c.moe_num_shared_experts else None)
        # Routed experts have no biases, whatever use_bias says.
        return MoE(Router(D, c.moe_num_experts, c.moe_k, routing="softmax_topk", norm_topk_prob=True,
                          score_bias=c.moe_use_aux_free, norm_min=c.moe_norm_min, dtype=dtype, rngs=rngs),
                   Experts(c.moe_num_experts, D, F, swiglu(c.hidden_act), dtype=dtype, rngs=rngs),
                   shared=shared, shared_name="shared_experts")


def hf_source(config: Config, path: str, shape: tuple, metadata: dict) -> Source | None:
    """q/k rows reordered (see `ernie4_5`), per-expert weights stacked, and the routing bias, which HF stores as
    `mlp.moe_statics.e_score_correction_bias` [1, E] (one row per modality in the original code)."""
    m = re.fullmatch(r"mtp\.layers\.(\d+)\.(enorm|hnorm|eh_proj|mtp_block)\.(.*)", path)
    if m:  # the MTP layer's parts, each stored as `model.mtp_{part}.{i}.`
        part = {"enorm": "emb_norm", "hnorm": "hidden_norm", "eh_proj": "linear_proj", "mtp_block": "block"}[m[2]]
        renamed = f"model.mtp_{part}.{m[1]}.{m[3]}"
        return hf_source(config, renamed, shape, metadata) or default_source(renamed, shape, metadata)
    if path.endswith(".mlp.gate.e_score_correction_bias"):
        name = path.replace(".gate.", ".moe_statics.")
        return Source((name,), same, ((1, *shape),))
    return ernie4_5.interleaved_to_halves(config, path, shape, metadata) or per_expert_source(path, shape)


MTP = r"model\.mtp_(block|emb_norm|hidden_norm|linear_proj)\..*"


def mtp_tensors(config: Config) -> str | None:
    return MTP if config.num_nextn_predict_layers else None


# Checkpoints that store the MTP layer's parts without the `model.` prefix read as those with it.
FAMILY = Family(model_types=("ernie4_5_moe",), config=Config, model=Model,
                dropped={**llama.ROPE_BUFFERS,
                         MTP: "multi-token-prediction layers, used only for speculative decoding (converted without "
                              "them)"},
                hf_source=hf_source, renames=((r"^(mtp_(block|emb_norm|hidden_norm|linear_proj)\..*)", r"model.\1"),),
                mtp=mtp_tensors)
