"""Granite 4 (GraniteMoeHybrid): Mamba2 mixers (`layers.mamba2`, gate-then-norm) in most layers and GQA attention in
the rest, with or without RoPE (`position_embedding_type`); after each, a top-k MoE (softmax over the chosen
logits) beside a shared SwiGLU MLP, or the shared MLP alone; Granite's muP multipliers (embeddings, attention scale,
residual branches, logits). HF reference: transformers/models/granitemoehybrid/modeling_granitemoehybrid.py.

Checkpoints keep IBM's names, which transformers renames when it loads: the router `block_sparse_moe.router.layer`,
the experts' fused gate/up `input_linear` [E, 2F, D] and `output_linear`, the shared MLP's `input_linear` [2F, D]
(gate then up) and `output_linear`; see `hf_source`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from flax import nnx

from day0jax.core.cache_layout import KVLayer, StateLayer
from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.mamba2 import Mamba2Mixer
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.moe import Experts, MoE, Router, swiglu
from day0jax.models import granite, llama
from day0jax.models.base import DecoderLayer, fused_experts_source
from day0jax.models.contract import Family
from day0jax.models.nemotron_h import LEGACY_KINDS, mamba2_source, mamba_shape

LAYER_KINDS = ("linear_attention", "full_attention")


@dataclass(frozen=True, eq=False)
class Config(granite.Config):
    ALIASES = {"layers_block_type": "layer_types"}
    intermediate_size: int = 11008
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    shared_intermediate_size: int = 1024
    position_embedding_type: str | None = None
    layer_types: list | None = None
    mamba_n_heads: int = 128
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_head: int | str = "auto"
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: list | tuple = (0.0, float("inf"))
    model_type: str = "granitemoehybrid"

    def __post_init__(self):
        super().__post_init__()
        self._check_derived("layer_kinds", "mamba_shape")
        # The convolution runs hidden_act too, and only SiLU is implemented there.
        self._refuse_if("hidden_act", lambda a: a != "silu", "is not implemented for Mamba2 (only silu)")
        self._refuse_if("position_embedding_type", lambda v: v not in (None, "nope", "rope"),
                        "is not implemented (HF rotates with 'rope' and with nothing else)")
        self._refuse_if("time_step_limit", lambda v: len(v) != 2 or not 0 <= v[0] <= v[1],
                        "must be [low, high] with 0 <= low <= high")
        self._refuse_if("mlp_bias", bool, "is not implemented: HF's Granite 4 MLPs have no biases")

    @cached_property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's kind: `layer_types` (IBM's 'mamba' and 'attention' read as HF reads them), else Mamba2
        everywhere (HF's default).

        Raises:
            UnsupportedArchitecture: too few entries or a kind HF's model does not build.
        """
        L = self.num_hidden_layers
        kinds = [LEGACY_KINDS.get(k, k) for k in self.layer_types or ["linear_attention"] * L]
        if len(kinds) < L:
            refuse("layer_types", self.layer_types, f"has {len(kinds)} entries for num_hidden_layers={L}")
        for kind in kinds:
            if kind not in LAYER_KINDS:
                refuse("layer_types", kind, f"is not implemented (known: {', '.join(LAYER_KINDS)})")
        return tuple(kinds[:L])

    @cached_property
    def mamba_shape(self) -> tuple[int, int, int, int, int]:
        """(N, H, G, Z, W) of the Mamba2 layers: mamba_expand * hidden_size channels in heads (`nemotron_h`)."""
        return mamba_shape(self, self.mamba_expand * self.hidden_size)


class Model(granite.Model):
    def make_ropes(self) -> list:
        return [self.rope] if self.config.position_embedding_type == "rope" else []

    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        return dict(rope=self.rope if c.position_embedding_type == "rope" else None, qkv_bias=c.attention_bias,
                    o_bias=c.attention_bias, scale=c.attention_multiplier)

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        D = c.hidden_size
        shared = GatedMLP(D, c.shared_intermediate_size, c.hidden_act, dtype=dtype, rngs=rngs)
        if not c.num_local_experts:
            return shared
        return MoE(Router(D, c.num_local_experts, c.num_experts_per_tok, routing="topk_softmax", dtype=dtype,
                          rngs=rngs),
                   Experts(c.num_local_experts, D, c.intermediate_size, swiglu(c.hidden_act), dtype=dtype, rngs=rngs),
                   router_name="router", shared=shared, shared_name="shared_mlp")

    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> DecoderLayer:
        c = self.config
        if c.layer_kinds[index] == "full_attention":
            return super().make_layer(index, dtype=dtype, rngs=rngs)
        N, H, G, Z, W = c.mamba_shape
        D = c.hidden_size
        mamba = Mamba2Mixer(hidden_size=D, num_heads=N, head_dim=H, n_groups=G, state_size=Z, conv_kernel=W,
                            chunk_size=c.mamba_chunk_size, eps=c.rms_norm_eps, norm="gate_then_norm",
                            use_bias=c.mamba_proj_bias, out_bias=c.mamba_proj_bias, conv_bias=c.mamba_conv_bias,
                            dt_limit=tuple(c.time_step_limit), dtype=dtype, rngs=rngs)
        return DecoderLayer(mamba, self.make_mlp(index, dtype=dtype, rngs=rngs),
                            self.make_norm(D, dtype=dtype, rngs=rngs), self.make_norm(D, dtype=dtype, rngs=rngs),
                            c.residual_multiplier, mixer_name="mamba")

    def cache_layout(self) -> list[KVLayer | StateLayer]:
        c = self.config
        full = KVLayer(c.kv_heads, c.head_size, c.head_size)
        return [layer.mixer.state_layout() if kind == "linear_attention" else full
                for kind, layer in zip(c.layer_kinds, self.model.layers)]


# --- checkpoint layout ---------------------------------------------------------------------------------------

def shared_mlp_source(path: str, shape: tuple[int, ...]) -> Source | None:
    """The shared MLP's gate_proj and up_proj [F, D] kernels, halves of `shared_mlp.input_linear.weight` [2F, D];
    down_proj is `output_linear`."""
    m = re.fullmatch(r"(.*)\.mlp\.shared_mlp\.(gate_proj|up_proj|down_proj)\.kernel", path)
    if not m:
        return None
    if m[2] == "down_proj":
        return Source((f"{m[1]}.shared_mlp.output_linear.weight",), lambda a, s: a[0].reshape(s), (shape,))
    F, D = shape
    start = 0 if m[2] == "gate_proj" else F
    return Source((f"{m[1]}.shared_mlp.input_linear.weight",), lambda a, s: a[0][start:start + F], ((2 * F, D),))


EXPERT_NAMES = {"experts.gate_up_proj": "input_linear.weight", "experts.down_proj": "output_linear.weight",
                "router.weight": "router.layer.weight"}


def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict) -> Source | None:
    if config.num_local_experts:
        src = shared_mlp_source(path, shape)
        if src is not None:
            return src
    else:  # the shared MLP is the layer's whole MLP
        src = shared_mlp_source(path.replace(".mlp.", ".mlp.shared_mlp.", 1), shape)
        if src is not None:
            return src
    m = re.fullmatch(r"(model\.layers\.\d+)\.mlp\.(.*)", path)
    if m:
        src = fused_experts_source(path, shape) or default_source(path, shape, metadata)

        def rename(name: str) -> str:
            rest = name[len(f"{m[1]}.mlp."):]
            return f"{m[1]}.block_sparse_moe.{EXPERT_NAMES.get(rest, rest)}"
        return src.renamed(rename)
    return mamba2_source(path, shape, config.mamba_shape, prefix="mamba")


FAMILY = Family(model_types=("granitemoehybrid",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS,
                hf_source=hf_source)
