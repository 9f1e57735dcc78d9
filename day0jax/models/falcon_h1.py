"""Falcon-H1 (TII): every layer runs a Mamba2 mixer and GQA attention side by side on the same normed input and adds
both to the residual, then a SwiGLU MLP; muP multipliers throughout (embeddings, the mixers' inputs and outputs, the
keys, each part of the Mamba2 in_proj, the MLP's gate and output, the logits); the Mamba2 gated norm optional and
in either order. HF reference: transformers/models/falcon_h1/modeling_falcon_h1.py.

Each layer keeps both caches: the Mamba2 state per sequence and the attention's keys and values in the page pool
(a `StateLayer` with a `kv` part); the engine hands the layer both (`cache.state`, `cache.kv`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import jax
from flax import nnx

from day0jax.core.cache_layout import KVLayer, StateLayer
from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.attention import Attention
from day0jax.layers.mamba2 import Mamba2Mixer
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.norms import RMSNorm
from day0jax.models import llama
from day0jax.models.base import CausalLM, HFConfig
from day0jax.models.contract import Family
from day0jax.models.nemotron_h import mamba2_source, mamba_shape


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    vocab_size: int = 128000
    tie_word_embeddings: bool = False
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    # Not in HF's config class, but its attention reads it when config.json has it.
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    mamba_d_ssm: int | None = 1024
    mamba_n_heads: int = 128
    mamba_d_head: int | str = "auto"
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_norm_before_gate: bool = True
    mamba_rms_norm: bool = False
    time_step_limit: list | tuple = (0.0, float("inf"))
    projectors_bias: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    lm_head_multiplier: float = 1.0
    embedding_multiplier: float = 1.0
    mlp_multipliers: list | None = None
    key_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    ssm_multipliers: list | None = None
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    attention_bias: bool = False
    mlp_bias: bool = False
    num_logits_to_keep: int | None = 1  # what generate() keeps, not the math
    model_type: str = "falcon_h1"

    def __post_init__(self):
        super().__post_init__()
        self._check_derived("mamba_shape")
        # The convolution runs hidden_act too, and only SiLU is implemented there.
        self._refuse_if("hidden_act", lambda a: a != "silu", "is not implemented for Mamba2 (only silu)")
        self._refuse_if("time_step_limit", lambda v: len(v) != 2 or not 0 <= v[0] <= v[1],
                        "must be [low, high] with 0 <= low <= high")
        self._refuse_if("mlp_multipliers", lambda v: v is not None and len(v) != 2, "must be [gate, down]")
        self._refuse_if("ssm_multipliers", lambda v: v is not None and len(v) != 5, "must be [z, x, B, C, dt]")

    @cached_property
    def mamba_shape(self) -> tuple[int, int, int, int, int]:
        """(N, H, G, Z, W) of the Mamba2 mixers: mamba_d_ssm (else mamba_expand * hidden_size) channels in heads
        (`nemotron_h`)."""
        return mamba_shape(self, self.mamba_expand * self.hidden_size if self.mamba_d_ssm is None else self.mamba_d_ssm)


class DecoderLayer(nnx.Module):
    """HF's `FalconH1DecoderLayer`: x + mamba(h) * ssm_out + self_attn(h * attn_in) * attn_out with h =
    input_layernorm(x), then x + feed_forward(pre_ff_layernorm(x))."""

    def __init__(self, mamba: Mamba2Mixer, self_attn: Attention, feed_forward: GatedMLP, input_layernorm: RMSNorm,
                 pre_ff_layernorm: RMSNorm, multipliers: tuple[float, float, float]):
        self.mamba, self.self_attn, self.feed_forward = mamba, self_attn, feed_forward
        self.input_layernorm, self.pre_ff_layernorm = input_layernorm, pre_ff_layernorm
        self.multipliers = multipliers  # (attention in, attention out, Mamba2 out)

    def __call__(self, x: jax.Array, positions: jax.Array, rope_tables: dict, cache=None):
        """x [B, T, D] -> ([B, T, D], the cache). `cache`: the engine's pair of caches (`.state`, `.kv`), or what the
        attention alone takes (None, or this call's keys and values) when there is no state to keep."""
        parallel = hasattr(cache, "with_parts")
        state, kv = (cache.state, cache.kv) if parallel else (None, cache)
        attn_in, attn_out, ssm_out = self.multipliers
        h = self.input_layernorm(x)
        m, state = self.mamba(h, positions, rope_tables, state)
        a, kv = self.self_attn(h * attn_in, positions, rope_tables, kv)
        x = x + m * ssm_out + a * attn_out
        x = x + self.feed_forward(self.pre_ff_layernorm(x))
        return x, cache.with_parts(state, kv) if parallel else kv

    def op_calls(self):
        norms = self.input_layernorm.op_calls() + self.pre_ff_layernorm.op_calls()
        return self.mamba.op_calls() + self.self_attn.op_calls() + self.feed_forward.op_calls() + norms


class Model(CausalLM):
    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> DecoderLayer:
        c = self.config
        D, (N, H, G, Z, W) = c.hidden_size, c.mamba_shape
        norm = ("norm_before_gate" if c.mamba_norm_before_gate else "gate_then_norm") if c.mamba_rms_norm else None
        mamba = Mamba2Mixer(hidden_size=D, num_heads=N, head_dim=H, n_groups=G, state_size=Z, conv_kernel=W,
                            chunk_size=c.mamba_chunk_size, eps=c.rms_norm_eps, norm=norm, use_bias=c.mamba_proj_bias,
                            out_bias=c.projectors_bias, conv_bias=c.mamba_conv_bias, dt_limit=tuple(c.time_step_limit),
                            in_multiplier=c.ssm_in_multiplier, proj_multipliers=tuple(c.ssm_multipliers or (1.0,) * 5),
                            dtype=dtype, rngs=rngs)
        # The keys times key_multiplier: the same scores as the scale times it, with the cache holding plain keys.
        attention = Attention(hidden_size=D, num_heads=c.num_attention_heads, num_kv_heads=c.kv_heads,
                              head_dim=c.head_size, rope=self.rope, qkv_bias=c.attention_bias, o_bias=c.attention_bias,
                              scale=c.head_size ** -0.5 * c.key_multiplier, dtype=dtype, rngs=rngs)
        mlp = GatedMLP(D, c.intermediate_size, c.hidden_act, use_bias=c.mlp_bias,
                       multipliers=tuple(c.mlp_multipliers or (1.0, 1.0)), dtype=dtype, rngs=rngs)
        return DecoderLayer(mamba, attention, mlp, self.make_norm(D, dtype=dtype, rngs=rngs),
                            self.make_norm(D, dtype=dtype, rngs=rngs),
                            (c.attention_in_multiplier, c.attention_out_multiplier, c.ssm_out_multiplier))

    def cache_layout(self) -> list[StateLayer]:
        c = self.config
        kv = KVLayer(c.kv_heads, c.head_size, c.head_size)
        return [dataclasses.replace(layer.mamba.state_layout(), kv=kv) for layer in self.model.layers]

    def embed(self, tokens: jax.Array) -> jax.Array:
        return self.model.embed_tokens(tokens) * self.config.embedding_multiplier

    def logits(self, hidden: jax.Array) -> jax.Array:
        return super().logits(hidden) * self.config.lm_head_multiplier


def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict) -> Source:
    """The Mamba2 mixers' fused tensors split; the final norm is HF's `final_layernorm`."""
    src = mamba2_source(path, shape, config.mamba_shape, prefix="mamba") or default_source(path, shape, metadata)
    return src.renamed(lambda n: n.replace("model.norm.", "model.final_layernorm.", 1))


FAMILY = Family(model_types=("falcon_h1",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS,
                hf_source=hf_source)
