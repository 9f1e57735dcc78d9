"""LFM3 (Liquid AI): LFM2's gated short convolutions beside attention layers of two kinds, sliding-window (plain RoPE)
and full (proportional RoPE over part of each head), with Qwen3's per-head q/k norms, a sigmoid gate per head on
the attention output (`g_proj`), MLPs of intermediate_size, and sandwich norms (each block's output normed before
the residual). HF reference: transformers/models/lfm3/modeling_lfm3.py.

Checkpoints name the gate `gate_proj` (transformers renames it `g_proj` when it loads them) and the norms
`operator_norm`, `post_operator_norm`, `ffn_norm`, `post_ffn_norm`: see `hf_source`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from flax import nnx

from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.attention import OutputGate
from day0jax.layers.decoder import SandwichDecoderLayer
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.rope import rope_parameters
from day0jax.models import llama, lfm2
from day0jax.models.base import LocalRope
from day0jax.models.contract import Family

ATTENTION_KINDS = ("full_attention", "sliding_attention")
# HF's RoPEs when config.json gives none.
DEFAULT_ROPES = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                 "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                                    "partial_rotary_factor": 0.5}}


@dataclass(frozen=True, eq=False)
class Config(lfm2.HybridConfig):
    KINDS = ("conv",) + ATTENTION_KINDS
    ALIASES = {"rms_norm_eps": "norm_eps"}
    vocab_size: int = 128000
    hidden_size: int = 2048
    intermediate_size: int = 7680
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 4
    head_dim: int | None = 128
    conv_L_cache: int = 7
    sliding_window: int | None = 256
    use_sandwich_norm: bool = True
    use_attention_gate: bool = True
    attention_bias: bool = False
    model_type: str = "lfm3"

    def __post_init__(self):
        super().__post_init__()
        self._check_derived("local_rope")
        if "sliding_attention" in self.layer_kinds:
            self._refuse_if("sliding_window", lambda w: w is None, "leaves the sliding layers without a window")

    def default_layer_types(self) -> list[str]:
        """Full attention at every fourth layer from layer 2, sliding at every fourth from layer 4, else conv."""
        return ["full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i > 0 else "conv"
                for i in range(self.num_hidden_layers)]

    def layer_window(self, index: int) -> int | None:
        return self.sliding_window if self.layer_kinds[index] == "sliding_attention" else None

    @cached_property
    def ropes(self) -> dict[str, dict]:
        """Each attention kind's normalized RoPE dict: rope_parameters is one dict per kind, as HF reads it.

        Raises:
            UnsupportedArchitecture: a key other than an attention kind, no entry for a kind some layer has, or a
                RoPE not implemented.
        """
        given = DEFAULT_ROPES if self.rope_parameters is None else self.rope_parameters
        if set(given) - set(ATTENTION_KINDS):
            refuse("rope_parameters", given, f"has keys outside {ATTENTION_KINDS}, which HF's LFM3 does not read")
        out = {}
        for kind in ATTENTION_KINDS:
            if kind not in given:
                if kind in self.layer_kinds:
                    refuse("rope_parameters", given, f"has no entry for the {kind} layers")
                continue
            out[kind] = rope_parameters(given[kind], None, None, default_theta=self.DEFAULT_THETA,
                                        max_position_embeddings=self.max_position_embeddings)
            self._refuse_partial_rope(out[kind])
        return out

    @cached_property
    def rope(self) -> dict:
        """The RoPE of the full-attention layers (or of the sliding ones, in a model without full attention)."""
        ropes = self.ropes
        return ropes.get("full_attention") or ropes.get("sliding_attention") or rope_parameters(
            DEFAULT_ROPES["full_attention"], None, None, max_position_embeddings=self.max_position_embeddings)

    @cached_property
    def local_rope(self) -> dict:
        """The RoPE of the sliding layers."""
        return self.ropes.get("sliding_attention", self.rope)


class Model(LocalRope, lfm2.Model):
    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        gate = OutputGate(name="g_proj", per_head=True, fn="sigmoid") if c.use_attention_gate else None
        return dict(rope=self.layer_rope(index), qkv_bias=c.attention_bias, o_bias=c.attention_bias,
                    qk_norm_eps=c.norm_eps, gate=gate, sliding_window=c.layer_window(index))

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config  # no sizing rule: intermediate_size is the width
        return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, dtype=dtype, rngs=rngs)

    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        if not self.config.use_sandwich_norm:
            return super().make_layer(index, dtype=dtype, rngs=rngs)
        mixer, name = self.make_mixer(index, dtype=dtype, rngs=rngs)
        norms = [self.make_norm(self.config.hidden_size, dtype=dtype, rngs=rngs) for _ in range(4)]
        return SandwichDecoderLayer(mixer, self.make_mlp(index, dtype=dtype, rngs=rngs), input_layernorm=norms[0],
                                    post_attention_layernorm=norms[1], pre_feedforward_layernorm=norms[2],
                                    post_feedforward_layernorm=norms[3], mixer_name=name)


# Runtime name -> HF's beyond LFM2's (`lfm2.NAMES`): the gate, and the sandwich layer's norms.
GATE = {"g_proj": "gate_proj"}
NORMS = {"post_attention_layernorm": "post_operator_norm", "pre_feedforward_layernorm": "ffn_norm",
         "post_feedforward_layernorm": "post_ffn_norm"}


def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict) -> Source:
    names = {**lfm2.NAMES, **GATE, **(NORMS if config.use_sandwich_norm else {})}
    src = lfm2.conv_source(path, shape) or default_source(path, shape, metadata)
    return src.renamed(lfm2.renamer(names))


FAMILY = Family(model_types=("lfm3",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS, hf_source=hf_source)
