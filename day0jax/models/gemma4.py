"""Gemma 4 (text; the language model of the multimodal `gemma4` checkpoints, `gemma4_vl`): Gemma 3's sandwich layers and
sliding/global pattern, with
- plain `x * weight` RMSNorms (not Gemma's 1 + weight), q/k norms, a weightless norm on v, and a softmax scale of 1;
- global layers of their own shape (`global_head_dim`, and `num_global_key_value_heads` where keys are also the
  values, `attention_k_eq_v`: no v_proj), rotated by proportional RoPE (`layers.rope`);
- KV sharing: the last `num_kv_shared_layers` layers compute no keys or values, they attend over those of the last
  earlier layer of their kind (`core.cache_layout.SharedKV`; the engine gives them no pages); with
  `use_double_wide_mlp` their MLP is twice as wide;
- per-layer inputs (`hidden_size_per_layer_input`): a second embedding table gives every layer a small vector per
  token, mixed with a projection of the embeddings, which gates a residual branch after the feed-forward block;
- a learned scalar per layer (`layer_scalar`) on the layer's output;
- optionally (`enable_moe_block`) routed experts beside the dense MLP, the router reading the residual through a
  weightless norm and a learned scale, its top-k weights renormalized and scaled per expert.
HF reference: transformers/models/gemma4/modeling_gemma4.py (Gemma4TextModel)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.core.cache_layout import KVLayer, SharedKV
from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source, default_source, same
from day0jax.layers.attention import ContextKV
from day0jax.layers.linear import Embedding, Linear
from day0jax.layers.mlp import GatedMLP, activation
from day0jax.layers.moe import Experts, Router, swiglu
from day0jax.layers.norms import L2Norm, RMSNorm
from day0jax.layers.rope import Rope, rope_parameters
from day0jax.models import gemma2, llama
from day0jax.models.base import HFConfig, LayerTypes, fused_experts_source
from day0jax.models.contract import Family
from kernels_pallas.calls import OpCall

# HF's defaults when config.json gives no rope_parameters.
DEFAULT_ROPES = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                    "rope_theta": 1_000_000.0}}
PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")


def _ones(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple, dtype) -> nnx.Param:
    return nnx.Param(nnx.with_partitioning(nnx.initializers.ones, axes)(rngs.params(), shape, dtype))


@dataclass(frozen=True, eq=False)
class Config(LayerTypes, HFConfig):
    vocab_size: int = 262_144
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 30
    num_attention_heads: int = 8
    num_key_value_heads: int | None = 4
    head_dim: int | None = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    rope_parameters: dict | None = None
    attention_bias: bool = False
    sliding_window: int | None = 512
    layer_types: list | None = None
    final_logit_softcapping: float | None = None
    use_bidirectional_attention: str | None = None
    vocab_size_per_layer_input: int = 262_144
    hidden_size_per_layer_input: int | None = 256
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    enable_moe_block: bool = False
    use_double_wide_mlp: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    # HF derives `per_layer_config` from these two when config.json has none, and saves only per_layer_config.
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    per_layer_config: dict | None = None
    model_type: str = "gemma4_text"

    def __post_init__(self):
        self._activation("hidden_activation")
        # "vision" changes the mask among an image's tokens only: text-only input runs causally either way.
        self._refuse_if("use_bidirectional_attention", lambda v: v == "all", "(non-causal attention) is not "
                        "implemented")
        if self.enable_moe_block and not (self.num_experts and self.top_k_experts and self.moe_intermediate_size):
            refuse("enable_moe_block", True, "needs num_experts, top_k_experts and moe_intermediate_size")
        self._check_derived("layer_kinds", "layer_shapes", "kv_sources", "ropes")
        for kv_heads, _ in self.layer_shapes:
            if self.num_attention_heads % kv_heads:
                refuse("num_key_value_heads", kv_heads, f"does not divide num_attention_heads="
                       f"{self.num_attention_heads}")

    def slides_by_default(self, index: int) -> bool:
        return (index + 1) % 6 != 0  # five sliding layers, then a global one

    @cached_property
    def layer_kinds(self) -> tuple[str, ...]:
        kinds = super().layer_kinds
        # HF forces the last layer global (with a warning) whatever layer_types says.
        return kinds[:-1] + ("full_attention",)

    @cached_property
    def layer_shapes(self) -> tuple[tuple[int, int], ...]:
        """(kv heads K, head dim H) per layer: `per_layer_config`'s overrides, or HF's derivation of them (the
        global layers take `global_head_dim`, and `num_global_key_value_heads` where keys are values).

        Raises:
            UnsupportedArchitecture: an override of a key other than the head shapes, or of an unknown layer.
        """
        base = {"head_dim": self.head_size, "num_key_value_heads": self.kv_heads}
        if self.per_layer_config is None:
            globals_ = {"head_dim": self.global_head_dim}
            if self.attention_k_eq_v and self.num_global_key_value_heads is not None:
                globals_["num_key_value_heads"] = self.num_global_key_value_heads
            overrides = {i: globals_ for i, kind in enumerate(self.layer_kinds) if kind == "full_attention"}
        else:
            overrides = {}
            for key, values in self.per_layer_config.items():
                if not str(key).isdigit() or int(key) >= self.num_hidden_layers:
                    refuse("per_layer_config", {key: values}, "names no layer of this model")
                unknown = set(values) - set(PER_LAYER_KEYS)
                if unknown:
                    refuse("per_layer_config", {key: values}, f"overrides {sorted(unknown)}; only "
                           f"{', '.join(PER_LAYER_KEYS)} are implemented per layer")
                overrides[int(key)] = values
        shapes = []
        for i in range(self.num_hidden_layers):
            layer = dict(base, **overrides.get(i, {}))
            shapes.append((layer["num_key_value_heads"], layer["head_dim"]))
        return tuple(shapes)

    @cached_property
    def kv_sources(self) -> tuple[int | None, ...]:
        """Per layer, the layer whose keys and values it attends over instead of its own (HF's
        `kv_sharing_modes`: from layer L - num_kv_shared_layers on, the last earlier layer of the same kind)."""
        L, shared = self.num_hidden_layers, self.num_kv_shared_layers
        if not shared:
            return (None,) * L
        first = L - shared
        if first <= 0:
            refuse("num_kv_shared_layers", shared, f"leaves no layer of the {L} computing keys and values")
        sources = [None] * first
        for i in range(first, L):
            same = [j for j in range(first) if self.layer_kinds[j] == self.layer_kinds[i]]
            if not same:
                refuse("num_kv_shared_layers", shared, f"makes layer {i} ({self.layer_kinds[i]}) share the keys "
                       "of an earlier layer of its kind, and there is none")
            if self.layer_shapes[same[-1]] != self.layer_shapes[i]:
                refuse("per_layer_config", self.per_layer_config, f"gives layer {i} another head shape than layer "
                       f"{same[-1]}, whose keys and values it reads")
            sources.append(same[-1])
        return tuple(sources)

    @cached_property
    def ropes(self) -> dict[str, dict]:
        """The normalized RoPE dict of each layer kind."""
        given = self.rope_parameters or DEFAULT_ROPES
        out = {}
        for kind in sorted(set(self.layer_kinds)):
            if not given.get(kind):
                refuse("rope_parameters", given, f"has no entry for {kind!r}")
            out[kind] = rope_parameters(given[kind], None, None, max_position_embeddings=self.max_position_embeddings)
        return out

    @cached_property
    def rope(self) -> dict:
        """The global layers' RoPE, the one the context length depends on."""
        return self.ropes["full_attention"]


class Attention(nnx.Module):
    """Gemma 4's self-attention: RMSNorm on q and k (per head), a weightless one on v, RoPE on q and k, softmax
    scale 1. `keys_are_values`: no v_proj, v is k's projection before its norm and RoPE. `reads_shared`: no k/v
    projections at all; the layer attends over the cache its `kv_source` layer wrote this step."""

    def __init__(self, *, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rope: Rope,
                 sliding_window: int | None, eps: float, bias: bool, keys_are_values: bool, reads_shared: bool,
                 dtype, rngs: nnx.Rngs):
        D, N, K, H = hidden_size, num_heads, num_kv_heads, head_dim
        self.q_proj = Linear((D,), (N, H), ("embed", "heads", "head_dim"), use_bias=bias, dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(H, eps, dtype=dtype, rngs=rngs)
        kv_axes = ("embed", "kv_heads", "head_dim")
        if not reads_shared:
            self.k_proj = Linear((D,), (K, H), kv_axes, use_bias=bias, dtype=dtype, rngs=rngs)
            self.v_proj = None if keys_are_values else Linear((D,), (K, H), kv_axes, use_bias=bias, dtype=dtype,
                                                              rngs=rngs)
            self.k_norm = RMSNorm(H, eps, dtype=dtype, rngs=rngs)
            self.v_norm = L2Norm(H, eps)
        self.o_proj = Linear((N, H), (D,), ("heads", "head_dim", "embed"), use_bias=bias, dtype=dtype, rngs=rngs)
        self.rope, self.sliding_window, self.reads_shared = rope, sliding_window, reads_shared
        self.shape = dict(N=N, K=K, H=H, Hv=H, scale=1.0, window=sliding_window, softcap=None, sinks=False,
                          latent=False)

    def __call__(self, x, positions, rope_tables, cache=None):
        cos, sin = rope_tables[self.rope]
        q = self.rope.apply(self.q_norm(self.q_proj(x)), cos, sin)
        kwargs = dict(sliding_window=self.sliding_window, scale=1.0)
        if self.reads_shared:  # the source layer's cache, holding this step's keys already
            return self.o_proj(cache.attend(q, positions, **kwargs)), None
        k = self.k_proj(x)
        v = self.v_norm(k if self.v_proj is None else self.v_proj(x))
        k = self.rope.apply(self.k_norm(k), cos, sin)
        cache = (ContextKV() if cache is None else cache).update(k, v, positions)
        return self.o_proj(cache.attend(q, positions, **kwargs)), cache

    def op_calls(self) -> list[OpCall]:
        calls = [OpCall.of("attention", **self.shape), OpCall.of("paged_attention", **self.shape)]
        norms = [] if self.reads_shared else self.k_norm.op_calls() + self.v_norm.op_calls()
        return calls + self.q_norm.op_calls() + norms + [self.rope.op_call()]


class GemmaRouter(Router):
    """Softmax top-k over the experts of a weightless-normed input times a learned `scale` and 1/sqrt(D), the k
    weights renormalized, then times each chosen expert's `per_expert_scale`. HF's `router.proj` is `kernel`, its
    `router.scale` is `input_scale` (`Router.scale` is the routed scaling factor)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float, *, dtype, rngs: nnx.Rngs):
        super().__init__(hidden_size, num_experts, top_k, routing="softmax_topk", norm_topk_prob=True, dtype=dtype,
                         rngs=rngs)
        self.norm = L2Norm(hidden_size, eps)
        self.input_scale = _ones(rngs, (hidden_size,), ("norm",), dtype)
        self.per_expert_scale = _ones(rngs, (num_experts,), (None,), dtype)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = self.norm(x) * self.input_scale[...] * (x.shape[-1] ** -0.5)
        weights, experts = super().__call__(x)
        return weights * self.per_expert_scale[...].astype(jnp.float32)[experts], experts


@dataclass
class Carry:
    """What Gemma 4's layers hand on: the per-layer inputs [B, T, L, Dp] (or None) and, by layer index, the caches of
    the layers whose keys and values later layers read."""

    per_layer: jax.Array | None
    kv: dict


class DecoderLayer(nnx.Module):
    """x + post_attention_layernorm(attn(input_layernorm(x))); then x + post_feedforward_layernorm(f) where f is the
    MLP of pre_feedforward_layernorm(x) (with experts: post_feedforward_layernorm_1 of it plus
    post_feedforward_layernorm_2 of the experts of pre_feedforward_layernorm_2(x), routed on x); then the per-layer
    input branch; the whole times `layer_scalar`."""

    carries = True

    def __init__(self, index: int, self_attn: Attention, mlp: GatedMLP, *, config: Config, dtype, rngs: nnx.Rngs):
        c, D = config, config.hidden_size

        def norm():
            return RMSNorm(D, c.rms_norm_eps, dtype=dtype, rngs=rngs)

        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.layer_scalar = _ones(rngs, (1,), (None,), dtype)
        moe, Dp = c.enable_moe_block, c.hidden_size_per_layer_input
        self.router = (GemmaRouter(D, c.num_experts, c.top_k_experts, c.rms_norm_eps, dtype=dtype, rngs=rngs)
                       if moe else None)
        self.experts = (Experts(c.num_experts, D, c.moe_intermediate_size, swiglu(c.hidden_activation),
                                dtype=dtype, rngs=rngs) if moe else None)
        if moe:
            self.post_feedforward_layernorm_1, self.post_feedforward_layernorm_2 = norm(), norm()
            self.pre_feedforward_layernorm_2 = norm()
        self.per_layer_input_gate = Linear((D,), (Dp,), ("embed", None), dtype=dtype, rngs=rngs) if Dp else None
        if Dp:
            self.per_layer_projection = Linear((Dp,), (D,), (None, "embed"), dtype=dtype, rngs=rngs)
            self.post_per_layer_input_norm = norm()
            self.act = activation(c.hidden_activation, "hidden_activation")
        self.index, self.kv_source = index, c.kv_sources[index]
        self.keeps_kv = index in c.kv_sources

    def __call__(self, x, positions, rope_tables, cache, carry: Carry):
        if self.kv_source is not None:
            cache = carry.kv[self.kv_source]
        h, cache = self.self_attn(self.input_layernorm(x), positions, rope_tables, cache)
        if self.keeps_kv:
            carry.kv[self.index] = cache
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.experts is not None:
            flat = x.reshape(-1, x.shape[-1])
            routed = self.experts(self.pre_feedforward_layernorm_2(flat), *self.router(flat)).reshape(x.shape)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(h)
        if self.per_layer_input_gate is not None:
            gated = self.act(self.per_layer_input_gate(x)) * carry.per_layer[:, :, self.index]
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar[...], cache, carry

    def op_calls(self) -> list[OpCall]:
        norms = [self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
                 self.post_feedforward_layernorm]
        calls = self.self_attn.op_calls() + self.mlp.op_calls()
        if self.experts is not None:
            E, D, F = self.experts.gate_proj.shape
            calls.append(OpCall.of("moe", E=E, k=self.router.top_k, D=D, F=F, routing=self.router.routing,
                                   shared=None))
            norms += [self.post_feedforward_layernorm_1, self.post_feedforward_layernorm_2,
                      self.pre_feedforward_layernorm_2]
        if self.per_layer_input_gate is not None:
            norms.append(self.post_per_layer_input_norm)
        return calls + [call for n in norms for call in n.op_calls()]


class Model(gemma2.Model):
    """Gemma 2's embedding scale and final soft-cap; layers, norms, RoPEs and caches of Gemma 4."""

    def __init__(self, config: Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(config, dtype=dtype, rngs=rngs)
        c, Dp = config, config.hidden_size_per_layer_input
        if Dp:
            L, D = c.num_hidden_layers, c.hidden_size
            self.model.embed_tokens_per_layer = Embedding(c.vocab_size_per_layer_input, L * Dp, dtype=dtype,
                                                          rngs=rngs)
            self.model.per_layer_model_projection = Linear((D,), (L, Dp), ("embed", "layers", None), dtype=dtype,
                                                           rngs=rngs)
            self.model.per_layer_projection_norm = RMSNorm(Dp, c.rms_norm_eps, dtype=dtype, rngs=rngs)

    def make_rope(self) -> None:
        return None  # no model-wide RoPE: one per (layer kind, head dim), `layer_rope`

    def make_ropes(self) -> list[Rope]:
        c = self.config
        self.rope_of = {}
        for kind, (_, H) in zip(c.layer_kinds, c.layer_shapes):
            self.rope_of.setdefault((kind, H), Rope(c.ropes[kind], H, c.max_position_embeddings))
        return list(self.rope_of.values())

    def make_norm(self, dim: int, *, dtype, rngs: nnx.Rngs) -> RMSNorm:
        return RMSNorm(dim, self.config.rms_norm_eps, dtype=dtype, rngs=rngs)

    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> DecoderLayer:
        c = self.config
        (K, H), kind = c.layer_shapes[index], c.layer_kinds[index]
        reads_shared = c.kv_sources[index] is not None
        attn = Attention(hidden_size=c.hidden_size, num_heads=c.num_attention_heads, num_kv_heads=K, head_dim=H,
                         rope=self.rope_of[(kind, H)], sliding_window=c.layer_window(index), eps=c.rms_norm_eps,
                         bias=c.attention_bias, keys_are_values=c.attention_k_eq_v and kind == "full_attention",
                         reads_shared=reads_shared, dtype=dtype, rngs=rngs)
        F = c.intermediate_size * (2 if c.use_double_wide_mlp and reads_shared else 1)
        mlp = GatedMLP(c.hidden_size, F, c.hidden_activation, dtype=dtype, rngs=rngs)
        return DecoderLayer(index, attn, mlp, config=c, dtype=dtype, rngs=rngs)

    def cache_layout(self) -> list[KVLayer | SharedKV]:
        c = self.config
        return [KVLayer(K, H, H) if source is None else SharedKV(source)
                for (K, H), source in zip(c.layer_shapes, c.kv_sources)]

    def begin_carry(self, tokens: jax.Array, x: jax.Array) -> Carry:
        c, Dp = self.config, self.config.hidden_size_per_layer_input
        if not Dp:
            return Carry(None, {})
        B, T = tokens.shape
        # Each layer's slice: (the token's own row of the second table + a normed projection of the (scaled)
        # embeddings) / sqrt(2), every part scaled as HF does.
        own = self.model.embed_tokens_per_layer(tokens)
        own = (own * jnp.asarray(Dp ** 0.5, own.dtype)).reshape(B, T, c.num_hidden_layers, Dp)
        mixed = self.model.per_layer_model_projection(x) * (c.hidden_size ** -0.5)
        mixed = self.model.per_layer_projection_norm(mixed)
        return Carry((mixed + own) * (2.0 ** -0.5), {})


def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict) -> Source:
    src = fused_experts_source(path, shape)
    for ours, theirs in ((".router.kernel", ".router.proj.weight"), (".router.input_scale", ".router.scale")):
        if path.endswith(ours):
            src = Source((path[: -len(ours)] + theirs,), same, (shape,))
    return src or default_source(path, shape, metadata)


FAMILY = Family(model_types=("gemma4_text",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS,
                hf_source=hf_source)
