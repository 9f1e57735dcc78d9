"""Qwen3-Next: Gated DeltaNet linear attention in three of every four layers, gated full attention (q/k RMSNorm,
partial RoPE, a sigmoid gate on the output) in the rest, (1 + weight) RMSNorms, and Qwen2-MoE style sparse MLPs
with a gated shared expert. HF reference: transformers/models/qwen3_next/modeling_qwen3_next.py.

The base of Qwen3.5 (qwen3_5.py, qwen3_5_moe.py), which differs only in how checkpoints store the linear-attention
projections and in which MLP it uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
from flax import nnx

from day0jax.core.cache_layout import KVLayer, StateLayer
from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source
from day0jax.layers.gated_delta_net import GatedDeltaNet
from day0jax.layers.mtp import FusedMTP
from day0jax.layers.norms import RMSNorm
from day0jax.models import llama, qwen2_moe
from day0jax.models.base import DecoderLayer, HFConfig, per_expert_source
from day0jax.models.contract import Family

LAYER_KINDS = ("linear_attention", "full_attention")


@dataclass(frozen=True, eq=False)
class HybridConfig(HFConfig):
    """The keys Qwen3-Next, Qwen3.5 and Qwen3.5-MoE share (with Qwen3-Next's defaults; each family restates those
    HF gives other values), each layer's kind, partial RoPE and the linear-attention checks."""

    vocab_size: int = 151936
    hidden_size: int = 2048
    num_hidden_layers: int = 48
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 2
    head_dim: int | None = 256
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list | None = None
    full_attention_interval: int = 4
    # Multi-token-prediction layers (`mtp.*`, speculative method "mtp"); HF's config class leaves them unset.
    mtp_num_hidden_layers: int = 0
    mtp_use_dedicated_embeddings: bool = False

    def __post_init__(self):
        super().__post_init__()
        self._check_derived("layer_kinds")
        self._refuse_if("mtp_use_dedicated_embeddings", bool, "is not implemented (the MTP layers share the model's "
                        "embedding)")
        # The convolution and the gated norm use hidden_act too, and only SiLU is implemented there.
        self._refuse_if("hidden_act", lambda a: a != "silu", "is not implemented for linear attention (only silu)")
        self._refuse_if("linear_num_value_heads", lambda n: n % self.linear_num_key_heads,
                        f"is not a multiple of linear_num_key_heads={self.linear_num_key_heads}")

    def _rope(self, params: dict | None = None, **kwargs):
        return super()._rope(params, partial_rotary_factor=self.partial_rotary_factor, **kwargs)

    @cached_property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's kind: `layer_types`, else full attention every `full_attention_interval` layers."""
        L = self.num_hidden_layers
        kinds = self.layer_types or ["full_attention" if (i + 1) % self.full_attention_interval == 0
                                     else "linear_attention" for i in range(L)]
        if len(kinds) < L:
            refuse("layer_types", kinds, f"has {len(kinds)} entries for num_hidden_layers={L}")
        for kind in kinds:
            if kind not in LAYER_KINDS:
                refuse("layer_types", kind, f"is not implemented (known: {', '.join(LAYER_KINDS)})")
        return tuple(kinds[:L])


@dataclass(frozen=True, eq=False)
class Config(HybridConfig):
    intermediate_size: int = 5632
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 10
    num_experts: int = 512
    norm_topk_prob: bool = True
    mlp_only_layers: list | None = None
    model_type: str = "qwen3_next"

    def is_sparse(self, index: int) -> bool:
        """Whether layer `index` is an MoE: not in `mlp_only_layers`, and on the `decoder_sparse_step`."""
        return (index not in (self.mlp_only_layers or ()) and self.num_experts > 0
                and (index + 1) % self.decoder_sparse_step == 0)


class Model(qwen2_moe.Model):
    """Qwen2-MoE's MLPs (dense, or sparse with a gated shared expert, per the config's `is_sparse`)."""

    def make_norm(self, dim: int, *, dtype, rngs: nnx.Rngs) -> RMSNorm:
        return RMSNorm(dim, self.config.rms_norm_eps, offset=1.0, dtype=dtype, rngs=rngs)

    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        return dict(rope=self.rope, qkv_bias=c.attention_bias, o_bias=c.attention_bias, qk_norm_eps=c.rms_norm_eps,
                    qk_norm_offset=1.0, output_gate=True)

    def make_linear_attention(self, *, dtype, rngs: nnx.Rngs) -> GatedDeltaNet:
        c = self.config
        return GatedDeltaNet(hidden_size=c.hidden_size, num_k_heads=c.linear_num_key_heads,
                             num_v_heads=c.linear_num_value_heads, k_head_dim=c.linear_key_head_dim,
                             v_head_dim=c.linear_value_head_dim, conv_kernel=c.linear_conv_kernel_dim,
                             eps=c.rms_norm_eps, dtype=dtype, rngs=rngs)

    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> DecoderLayer:
        if self.config.layer_kinds[index] == "full_attention":
            return super().make_layer(index, dtype=dtype, rngs=rngs)
        D = self.config.hidden_size
        return DecoderLayer(self.make_linear_attention(dtype=dtype, rngs=rngs),
                            self.make_mlp(index, dtype=dtype, rngs=rngs), self.make_norm(D, dtype=dtype, rngs=rngs),
                            self.make_norm(D, dtype=dtype, rngs=rngs), mixer_name="linear_attn")

    def cache_layout(self) -> list[KVLayer | StateLayer]:
        c = self.config
        full = KVLayer(c.kv_heads, c.head_size, c.head_size)
        return [layer.mixer.state_layout() if kind == "linear_attention" else full
                for kind, layer in zip(c.layer_kinds, self.model.layers)]

    def make_mtp(self, *, dtype, rngs: nnx.Rngs) -> FusedMTP:
        """`mtp.*`: full-attention decoder layers (their MLP as the model's layer of the same index would have it,
        as vLLM builds them) between the shared input projection and the final norm."""
        c = self.config
        if not c.mtp_num_hidden_layers:
            refuse("mtp_num_hidden_layers", 0, "declares no multi-token-prediction layers")
        layers = [llama.LlamaLike.make_layer(self, i, dtype=dtype, rngs=rngs) for i in range(c.mtp_num_hidden_layers)]
        return FusedMTP(layers, self.make_norm, c.hidden_size, dtype=dtype, rngs=rngs)


# --- checkpoint layout ---------------------------------------------------------------------------------------
# The convolution weight [C, 1, W] runs over the channels [q (Nk*Hk) | k (Nk*Hk) | v (Nv*Hv)]; the runtime keeps
# one weight per projection, [heads, head dim, W].

def conv_source(config: Config, prefix: str, part: str) -> Source:
    c = config
    qk, v = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    start, size = {"q": (0, qk), "k": (qk, qk), "v": (2 * qk, v)}[part]
    W = c.linear_conv_kernel_dim
    return Source((f"{prefix}.conv1d.weight",),
                  lambda arrays, shape: arrays[0][start:start + size, 0, :].reshape(shape), ((2 * qk + v, 1, W),))


def fused_projection_source(config: Config, prefix: str, part: str) -> Source:
    """Qwen3-Next's `in_proj_qkvz` [Nk * (2 Hk + 2 r Hv), D] and `in_proj_ba` [Nk * 2r, D] (r = Nv / Nk): grouped
    by key head, each group [q, k, v (r heads), z (r heads)] and [b (r), a (r)]."""
    c = config
    Nk, Hk, Hv, D = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim, c.hidden_size
    r = c.linear_num_value_heads // Nk
    if part in "ba":
        start = 0 if part == "b" else r
        return Source((f"{prefix}.in_proj_ba.weight",),
                      lambda arrays, shape: arrays[0].reshape(Nk, 2 * r, D)[:, start:start + r].reshape(shape),
                      ((Nk * 2 * r, D),))
    group = 2 * Hk + 2 * r * Hv
    start, size = {"q": (0, Hk), "k": (Hk, Hk), "v": (2 * Hk, r * Hv), "z": (2 * Hk + r * Hv, r * Hv)}[part]
    return Source((f"{prefix}.in_proj_qkvz.weight",),
                  lambda arrays, shape: np.ascontiguousarray(
                      arrays[0].reshape(Nk, group, D)[:, start:start + size]).reshape(shape),
                  ((Nk * group, D),))


def linear_attention_source(config, path: str, projection_source) -> Source | None:
    """The Source of a linear-attention parameter whose layout differs from HF's, else None."""
    prefix, _, name = path.rpartition(".linear_attn.")
    if not name:
        return None
    prefix += ".linear_attn"
    if name in ("conv_q", "conv_k", "conv_v"):
        return conv_source(config, prefix, name[-1])
    if name.startswith("in_proj_") and name.endswith(".kernel"):
        return projection_source(config, prefix, name[len("in_proj_")])
    return None


def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict) -> Source | None:
    return per_expert_source(path, shape) or linear_attention_source(config, path, fused_projection_source)


DROPPED = {**llama.ROPE_BUFFERS,
           r"mtp\..*": "multi-token-prediction layers, used only for speculative decoding (converted without them)"}


def mtp_tensors(config) -> str | None:
    return r"mtp\..*" if config.mtp_num_hidden_layers else None


FAMILY = Family(model_types=("qwen3_next",), config=Config, model=Model, dropped=DROPPED, hf_source=hf_source,
                mtp=mtp_tensors)
