"""Hunyuan MoE (HunYuanMoEV1, Hunyuan-A13B): the Hunyuan dense attention (q/k/v/o biases per `attention_bias`,
RMSNorm on each head's q and k after RoPE, "dynamic" RoPE with an `alpha` read as a fixed NTK stretch of the base)
with an MoE on every layer: a softmax router (`gate.wg`) picking `moe_topk` experts (one count for all layers, or
a list with one per layer), their weights always renormalized, plus a shared MLP (`shared_mlp`) every token goes
through, ungated. The experts and the shared MLP are all `intermediate_size` wide.
HF reference: transformers/models/hunyuan_v1_moe/modeling_hunyuan_v1_moe.py."""

from __future__ import annotations

import re
from dataclasses import dataclass

from flax import nnx

from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.moe import Experts, MoE, Router, swiglu
from day0jax.models import hunyuan_v1_dense, llama
from day0jax.models.base import per_expert_source
from day0jax.models.contract import Family


def _per_layer(value) -> list:
    """A key Tencent's configs give either once for all layers or as a list with one value per layer, as a list."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


@dataclass(frozen=True, eq=False)
class Config(hunyuan_v1_dense.Config):
    ALIASES = {"num_experts_per_tok": "moe_topk", "num_local_experts": "num_experts"}  # HF's attribute_map
    num_experts: int = 1
    moe_topk: int | list = 1
    # Keys of Tencent's own config.json that HF's model does not read: its experts and its one shared MLP are
    # `intermediate_size` wide, every layer is an MoE, so values saying otherwise are refused.
    moe_intermediate_size: int | list | None = None
    num_shared_expert: int | list = 1
    moe_layer_num_skipped: int = 0
    use_mixed_mlp_moe: bool = True  # the shared MLP beside the experts
    model_type: str = "hunyuan_v1_moe"

    def _refuse_mlp(self):
        """Refuses what HF's MoE does not run: per-layer expert counts, other widths, no or several shared MLPs."""
        L, E = self.num_hidden_layers, self.num_experts
        # HF's config types it an int; its router would index a list by layer, but its experts would not build.
        self._refuse_if("num_experts", lambda v: not isinstance(v, int) or v < 1,
                        "is not implemented (one expert count, at least 1, for every layer)")
        self._refuse_if("moe_topk", lambda v: isinstance(v, (list, tuple)) and len(v) < L,
                        f"has fewer entries than num_hidden_layers={L}")
        self._refuse_if("moe_topk", lambda v: any(not 1 <= k <= E for k in _per_layer(v)),
                        f"must be in 1..num_experts={E}")
        self._refuse_if("moe_intermediate_size",
                        lambda v: v is not None and any(f != self.intermediate_size for f in _per_layer(v)),
                        f"differs from intermediate_size={self.intermediate_size}, the experts' width in HF's model")
        self._refuse_if("num_shared_expert", lambda v: any(n != 1 for n in _per_layer(v)),
                        "is not implemented (HF's model has one shared MLP per layer)")
        self._refuse_if("moe_layer_num_skipped", bool, "is not implemented (every layer of HF's model is an MoE)")
        self._refuse_if("use_mixed_mlp_moe", lambda v: not v,
                        "is not implemented (HF's model always adds the shared MLP)")

    def layer_topk(self, index: int) -> int:
        """How many experts layer `index` routes each token to."""
        k = self.moe_topk
        return k[index] if isinstance(k, (list, tuple)) else k


class Model(hunyuan_v1_dense.Model):
    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        D, F, E = c.hidden_size, c.intermediate_size, c.num_experts
        # HF keeps the router weight in float32; Router scores in float32 whatever the weight's dtype.
        return MoE(Router(D, E, c.layer_topk(index), routing="softmax_topk", norm_topk_prob=True, dtype=dtype,
                          rngs=rngs),
                   Experts(E, D, F, swiglu(c.hidden_act), dtype=dtype, rngs=rngs),
                   shared=GatedMLP(D, F, c.hidden_act, dtype=dtype, rngs=rngs), shared_name="shared_mlp")


def hf_source(config: Config, path: str, shape: tuple, metadata: dict) -> Source | None:
    """The router `mlp.gate.kernel` <- HF's `mlp.gate.wg.weight`; the experts from save_pretrained's one Linear per
    expert; the q/k norms as in the dense family (`query_layernorm`, `key_layernorm`)."""
    m = re.fullmatch(r"(.*\.mlp\.gate)\.kernel", path)
    if m:
        return default_source(f"{m[1]}.wg.kernel", shape, metadata)
    return per_expert_source(path, shape) or hunyuan_v1_dense.hf_source(config, path, shape, metadata)


FAMILY = Family(model_types=("hunyuan_v1_moe",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS,
                hf_source=hf_source)
