"""Llama 4 (the text model of Scout and Maverick): Llama attention where the RoPE layers attend within chunks of
`attention_chunk_size` positions and L2-normalize q and k (no weight), and every `no_rope_layer_interval`-th layer
is global, without positions, its queries scaled by a log-position temperature; MoE layers (every
`interleave_moe_layer_step`-th) route each token to its top-k experts by sigmoid scores that multiply the expert's
input, beside a shared expert; dense layers use `intermediate_size_mlp`. Released checkpoints are multimodal
(`llama4`): their language model converts with the vision tower dropped.
HF reference: transformers/models/llama4/modeling_llama4.py. HF's RoPE rotates interleaved pairs of dims (complex
numbers): `hf_source` reorders each q and k head's rows (evens, then odds) into the runtime's half-split layout, as
ernie4_5.py does; scores, the L2 norm and the temperature are unchanged by it. HF names the MLP `feed_forward` and
fuses the experts' gate and up projections (`experts.gate_up_proj` [E, D, 2F]); `hf_source` maps both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from flax import nnx

from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.moe import Experts, MoE, Router, swiglu
from day0jax.models import llama
from day0jax.models.base import HFConfig, vision_dropped
from day0jax.models.contract import Family
from day0jax.models.ernie4_5 import interleaved_to_halves

KINDS = ("chunked_attention", "full_attention")


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    COMPOSITE = ("llama4",)
    DEFAULT_THETA = 500000.0
    vocab_size: int = 202048
    hidden_size: int = 5120
    intermediate_size: int = 8192
    intermediate_size_mlp: int = 16384
    num_hidden_layers: int = 48
    num_attention_heads: int = 40
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096 * 32
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    attention_bias: bool = False
    num_experts_per_tok: int = 1
    num_local_experts: int = 16
    moe_layers: list | None = None
    interleave_moe_layer_step: int = 1
    use_qk_norm: bool = True
    router_jitter_noise: float = 0.0  # training-time noise; HF's router does not read it
    no_rope_layers: list | None = None
    no_rope_layer_interval: int = 4
    attention_chunk_size: int | None = 8192
    layer_types: list | None = None
    attn_temperature_tuning: bool | int = True  # HF tests its truth only (some released configs say 4)
    floor_scale: int = 8192
    attn_scale: float = 0.1
    for_llm_compressor: bool = False  # a quantization tooling flag of older configs, read by no model code
    model_type: str = "llama4_text"

    def __post_init__(self):
        super().__post_init__()
        # HF's complex rotation covers every dim of the head; a partial one would rotate other pairs.
        self._refuse_if("rope_parameters", lambda v: self.rope.get("partial_rotary_factor", 1.0) != 1.0,
                        "sets a partial_rotary_factor, which HF's Llama 4 does not apply")
        self._check_derived("rope_layers", "layer_kinds", "moe_layer_set")
        if self.attn_temperature_tuning and not all(self.rope_layers):
            self._refuse_if("floor_scale", lambda v: not v or v < 0, "must be a positive number of tokens")

    @cached_property
    def rope_layers(self) -> tuple[bool, ...]:
        """Whether each layer applies RoPE: `no_rope_layers` (1: RoPE, 0: NoPE), by default (also when empty, as
        in HF) all but every `no_rope_layer_interval`-th layer.

        Raises:
            UnsupportedArchitecture: not a 0 or 1 for each layer.
        """
        L = self.num_hidden_layers
        rope_on = list(self.no_rope_layers or [int((i + 1) % self.no_rope_layer_interval != 0) for i in range(L)])
        if len(rope_on) < L or any(v not in (0, 1) for v in rope_on):
            refuse("no_rope_layers", rope_on, f"must hold a 0 or 1 for each of the {L} layers")
        return tuple(bool(v) for v in rope_on[:L])

    @cached_property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's attention: `layer_types`, by default chunked on the RoPE layers (when there is a chunk size).

        Raises:
            UnsupportedArchitecture: too few entries, an unknown kind, or chunked layers without a chunk size.
        """
        L, chunk = self.num_hidden_layers, self.attention_chunk_size
        types = list(self.layer_types or ["chunked_attention" if rope and chunk is not None else "full_attention"
                                          for rope in self.rope_layers])
        if len(types) < L:
            refuse("layer_types", types, f"has {len(types)} entries for num_hidden_layers={L}")
        for t in types[:L]:
            if t not in KINDS:
                refuse("layer_types", t, f"is not implemented (known: {', '.join(KINDS)})")
        if "chunked_attention" in types[:L] and (chunk is None or chunk <= 0):
            refuse("attention_chunk_size", chunk, "must be a positive size for the chunked_attention layers")
        return tuple(types[:L])

    @cached_property
    def moe_layer_set(self) -> frozenset[int]:
        """The MoE layers: `moe_layers`, by default every `interleave_moe_layer_step`-th layer.

        Raises:
            UnsupportedArchitecture: a step below 1, or a layer index out of range.
        """
        L, step = self.num_hidden_layers, self.interleave_moe_layer_step
        if self.moe_layers is None:
            if step < 1:
                refuse("interleave_moe_layer_step", step, "must be at least 1")
            return frozenset(range(step - 1, L, step))
        if any(not 0 <= i < L for i in self.moe_layers):
            refuse("moe_layers", self.moe_layers, f"must hold layer indices below num_hidden_layers={L}")
        return frozenset(self.moe_layers)


class Model(llama.LlamaLike):
    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        rope = c.rope_layers[index]
        return dict(rope=self.rope if rope else None, qkv_bias=c.attention_bias, o_bias=c.attention_bias,
                    # HF's L2 norm: per head, no weight, after RoPE, on the RoPE layers only.
                    qk_norm_eps=c.rms_norm_eps if c.use_qk_norm and rope else None, qk_norm_weight=False,
                    qk_norm_after_rope=True,
                    chunk_size=c.attention_chunk_size if c.layer_kinds[index] == "chunked_attention" else None,
                    attn_temperature=(c.floor_scale, c.attn_scale) if c.attn_temperature_tuning and not rope
                    else None)

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        D, F = c.hidden_size, c.intermediate_size
        if index not in c.moe_layer_set:
            return GatedMLP(D, c.intermediate_size_mlp, c.hidden_act, dtype=dtype, rngs=rngs)
        return MoE(Router(D, c.num_local_experts, c.num_experts_per_tok, routing="topk_sigmoid", dtype=dtype,
                          rngs=rngs),
                   Experts(c.num_local_experts, D, F, swiglu(c.hidden_act), scale_inputs=True, dtype=dtype,
                           rngs=rngs),
                   router_name="router", shared=GatedMLP(D, F, c.hidden_act, dtype=dtype, rngs=rngs),
                   shared_name="shared_expert")


def hf_source(config: Config, path: str, shape: tuple, metadata: dict) -> Source:
    """HF's `feed_forward` for the runtime's `mlp`, gate_proj and up_proj [E, D, F] from the halves of
    `experts.gate_up_proj` [E, D, 2F], q and k rows in half-split order; `language_model.` before every name of a
    multimodal checkpoint."""
    hf_path = path.replace(".mlp.", ".feed_forward.")
    m = re.fullmatch(r"(.*\.experts)\.(gate|up)_proj", hf_path)
    if m:
        E, D, F = shape
        start = 0 if m[2] == "gate" else F
        src = Source((f"{m[1]}.gate_up_proj",), lambda a, s: a[0][:, :, start:start + F].reshape(s),
                     ((E, D, 2 * F),))
    else:
        src = interleaved_to_halves(config, hf_path, shape, metadata) or default_source(hf_path, shape, metadata)
    if config.is_composite:  # Llama4ForConditionalGeneration keeps the whole Llama4ForCausalLM as `language_model`
        src = src.renamed(lambda n: "language_model." + n)
    return src


def dropped_for(config: Config) -> dict[str, str]:
    return vision_dropped(config, r"vision_model\..*", r"multi_modal_projector\..*")


FAMILY = Family(model_types=("llama4_text", "llama4"), config=Config, model=Model, dropped=llama.ROPE_BUFFERS,
                dropped_for=dropped_for, hf_source=hf_source)
