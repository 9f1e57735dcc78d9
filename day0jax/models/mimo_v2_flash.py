"""MiMo-V2-Flash (Xiaomi): sliding-window layers (by default five of every six) with twice the kv heads of the full
layers and learned attention sinks; queries and keys of `head_dim`, values of `v_head_dim`, scaled by
`attention_value_scale`; a RoPE per layer kind, each over a part of the head (`partial_rotary_factor`, 0.334 unless
given); a dense first layer, then MoEs with DeepSeek-V3's routing (sigmoid scores with a score bias, in groups) and no
shared expert. HF reference: transformers/models/mimo_v2_flash/modeling_mimo_v2_flash.py.

Checkpoints keep Xiaomi's names for the sinks (`attention_sink_bias`) and one Linear per expert. The
multi-token-prediction layers (`model.mtp.layers.{i}.*`, `num_nextn_predict_layers`; speculative method "mtp") are
transformers' generic MTP layer in Xiaomi's names: enorm, hnorm, eh_proj, then a sliding-window attention layer (the
sliding layers' heads, sinks and RoPE; `input_layernorm`) with a dense MLP (`pre_mlp_layernorm`), and its own
post-norm `final_layernorm`, read by the shared head and chained into the next layer (the inference engines' MiMo-V2
MTP modules; transformers skips these tensors).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from flax import nnx

from day0jax.core.cache_layout import KVLayer
from day0jax.core.errors import UnsupportedArchitecture
from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.attention import Attention
from day0jax.layers.moe import Experts, MoE, Router, swiglu
from day0jax.layers.mtp import MtpLayer, MtpStack
from day0jax.layers.rope import rope_parameters
from day0jax.models import llama
from day0jax.models.base import DecoderLayer, LayerTypes, LocalRope, per_expert_source
from day0jax.models.contract import Family

KINDS = ("full_attention", "sliding_attention")
PARTIAL_ROTARY = 0.334  # HF's default where a kind's RoPE dict does not say
DEFAULT_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}


@dataclass(frozen=True, eq=False)
class Config(LayerTypes, llama.Config):
    ALIASES = {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}
    vocab_size: int = 152576
    hidden_size: int = 4096
    intermediate_size: int = 16384
    num_hidden_layers: int = 48
    num_attention_heads: int = 64
    num_key_value_heads: int | None = 4
    head_dim: int | None = 192
    v_head_dim: int = 128
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    moe_intermediate_size: int = 2048
    num_experts_per_tok: int = 8
    n_routed_experts: int = 256
    routed_scaling_factor: float | None = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    sliding_window: int = 129
    # Xiaomi's name: the window without the query itself (HF's sliding_window is this plus one).
    sliding_window_size: int | None = None
    layer_types: list | None = None
    mlp_layer_types: list | None = None
    attention_value_scale: float | None = 0.707
    num_nextn_predict_layers: int = 0  # multi-token-prediction layers (`model.mtp.layers.{i}`)
    model_type: str = "mimo_v2_flash"

    def __post_init__(self):
        super().__post_init__()
        self._check_derived("layer_kinds", "mlp_kinds", "local_rope")
        self._refuse_if("mlp_bias", bool, "is not implemented: HF's MiMo-V2-Flash MLPs have no biases")
        if "sparse" in self.mlp_kinds:
            self._refuse_if("n_group", lambda v: not v or self.n_routed_experts % v,
                            f"does not divide n_routed_experts={self.n_routed_experts}")
            self._refuse_if("topk_group", lambda v: not 1 <= v <= self.n_group, f"must be in 1..n_group={self.n_group}")

    def slides_by_default(self, index: int) -> bool:
        return index != 0 and (index + 1) % 6 != 0

    @property
    def window(self) -> int:
        return self.sliding_window if self.sliding_window_size is None else self.sliding_window_size + 1

    def layer_kv_heads(self, index: int) -> int:
        """Layer `index`'s kv heads (`kind_kv_heads`)."""
        return self.kind_kv_heads(self.layer_kinds[index] == "sliding_attention")

    def kind_kv_heads(self, sliding: bool) -> int:
        """A layer's kv heads: twice `num_key_value_heads` in the sliding layers (and the MTP layers, which slide)."""
        return self.kv_heads * (2 if sliding else 1)

    @cached_property
    def mlp_kinds(self) -> tuple[str, ...]:
        """Each layer's MLP: `mlp_layer_types`, else dense for the first layer and MoE after (HF's default).

        Raises:
            UnsupportedArchitecture: too few entries or an unknown kind.
        """
        L = self.num_hidden_layers
        kinds = list(self.mlp_layer_types or ["dense"] + ["sparse"] * (L - 1))
        if len(kinds) < L:
            refuse("mlp_layer_types", kinds, f"has {len(kinds)} entries for num_hidden_layers={L}")
        for kind in kinds:
            if kind not in ("dense", "sparse"):
                refuse("mlp_layer_types", kind, "is not implemented (known: dense, sparse)")
        return tuple(kinds[:L])

    @cached_property
    def rope(self) -> dict:
        """The full-attention layers' RoPE."""
        return self._kind_rope("full_attention")

    @cached_property
    def local_rope(self) -> dict:
        """The sliding layers' RoPE."""
        return self._kind_rope("sliding_attention")

    def _kind_rope(self, kind: str) -> dict:
        # HF reads only rope_parameters, keyed by layer kind, and its own defaults for the whole dict when it is None
        # (the released model's thetas); the legacy rope_theta / rope_scaling keys it never reads are refused.
        for key in ("rope_theta", "rope_scaling"):
            self._refuse_if(key, lambda v: v is not None, "is not read by HF's MiMo-V2-Flash (see rope_parameters)")
        given = self.rope_parameters or DEFAULT_ROPE
        if set(given) - set(KINDS) or kind not in given:
            refuse("rope_parameters", given, f"must give a RoPE for each of {KINDS}")
        params = dict(given[kind])
        params.setdefault("partial_rotary_factor", PARTIAL_ROTARY)
        return rope_parameters(params, None, None, max_position_embeddings=self.max_position_embeddings)


class Model(LocalRope, llama.Model):
    def attention_kwargs(self, index: int) -> dict:
        return self._kind_kwargs(self.config.layer_kinds[index] == "sliding_attention")

    def _kind_kwargs(self, sliding: bool) -> dict:
        c = self.config
        return dict(super().attention_kwargs(0), o_bias=False, rope=self.local_rope if sliding else self.rope,
                    sliding_window=c.window if sliding else None, sinks=sliding, v_head_dim=c.v_head_dim,
                    value_scale=1.0 if c.attention_value_scale is None else c.attention_value_scale)

    def make_attention(self, index: int, *, dtype, rngs: nnx.Rngs) -> Attention:
        return self._attention(self.config.layer_kinds[index] == "sliding_attention", dtype=dtype, rngs=rngs)

    def _attention(self, sliding: bool, *, dtype, rngs: nnx.Rngs) -> Attention:
        """A full-attention layer's, or with `sliding` a sliding layer's (twice the kv heads, sinks, its RoPE)."""
        c = self.config
        return Attention(hidden_size=c.hidden_size, num_heads=c.num_attention_heads,
                         num_kv_heads=c.kind_kv_heads(sliding), head_dim=c.head_size,
                         **self._kind_kwargs(sliding), dtype=dtype, rngs=rngs)

    def make_mtp(self, *, dtype, rngs: nnx.Rngs) -> MtpStack:
        """Each MTP layer's decoder layer attends as the sliding layers do and has a dense MLP; its post-norm is
        its own (`final_layernorm`)."""
        c = self.config
        if not c.num_nextn_predict_layers:
            raise UnsupportedArchitecture("this mimo_v2_flash config declares no multi-token-prediction layers "
                                          "(num_nextn_predict_layers)")
        D = c.hidden_size
        return MtpStack([MtpLayer(DecoderLayer(self._attention(True, dtype=dtype, rngs=rngs),
                                               llama.Model.make_mlp(self, 0, dtype=dtype, rngs=rngs),
                                               self.make_norm(D, dtype=dtype, rngs=rngs),
                                               self.make_norm(D, dtype=dtype, rngs=rngs)),
                                  self.make_norm, D, post_norm=True, dtype=dtype, rngs=rngs)
                         for _ in range(c.num_nextn_predict_layers)])

    def mtp_cache_layout(self) -> list[KVLayer]:
        """Whole pages under the shared page table (the attention masks the window), not a window ring."""
        c = self.config
        return [KVLayer(c.kind_kv_heads(True), c.head_size, c.v_head_dim)] * self.mtp_layers

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        if c.mlp_kinds[index] == "dense":
            return super().make_mlp(index, dtype=dtype, rngs=rngs)
        return MoE(Router(c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, routing="sigmoid_grouped",
                          norm_topk_prob=c.norm_topk_prob, n_group=c.n_group, topk_group=c.topk_group,
                          routed_scaling_factor=c.routed_scaling_factor or 1.0, dtype=dtype, rngs=rngs),
                   Experts(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, swiglu(c.hidden_act),
                           dtype=dtype, rngs=rngs))

    def cache_layout(self) -> list[KVLayer]:
        c = self.config
        return [KVLayer(c.layer_kv_heads(i), c.head_size, c.v_head_dim, window=self.attention_window(i))
                for i in range(c.num_hidden_layers)]


# The MTP layer's parameters (`mtp.layers.{i}.` + ours) -> the checkpoint's `model.mtp.layers.{i}.` + Xiaomi's.
MTP_NAMES = (("mtp_block.post_attention_layernorm.", "pre_mlp_layernorm."), ("mtp_block.", ""),
             ("post_norm.", "final_layernorm."))


def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict) -> Source:
    """Xiaomi's `attention_sink_bias` for the sinks, one Linear per expert, the MTP layers' names."""
    mtp = re.fullmatch(r"mtp\.layers\.(\d+)\.(.*)", path)
    if mtp:
        name = next((new + mtp[2][len(ours):] for ours, new in MTP_NAMES if mtp[2].startswith(ours)), mtp[2])
        return hf_source(config, f"model.mtp.layers.{mtp[1]}.{name}", shape, metadata)
    if re.fullmatch(r".*\.self_attn\.sinks", path):
        return Source((path[:-len("sinks")] + "attention_sink_bias",), lambda a, s: a[0], (shape,))
    return per_expert_source(path, shape) or default_source(path, shape, metadata)


MTP = r"model\.mtp\..*"
DROPPED = {**llama.ROPE_BUFFERS, MTP: "multi-token-prediction layers, used only for speculative decoding (converted "
                                     "without them)"}

FAMILY = Family(model_types=("mimo_v2_flash",), config=Config, model=Model, dropped=DROPPED, hf_source=hf_source,
                mtp=lambda c: MTP if c.num_nextn_predict_layers else None)
