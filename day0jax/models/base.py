"""What every decoder-only family shares: the config base and its refusals, the embed -> layers -> norm -> head
skeleton (`CausalLM`), and the default mapping from HF tensor names to runtime parameters."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, ClassVar, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from day0jax.core import hf_config as config_lib
from day0jax.core.cache_layout import KVLayer, StateLayer
from day0jax.core.errors import UnsupportedArchitecture
from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.linear import Embedding, Linear, linear_op_calls
from day0jax.layers.mlp import activation
from day0jax.layers.mtp import NextN, NextNStack
from day0jax.layers.norms import RMSNorm
from day0jax.layers.quantized import quantized_op_calls
from day0jax.layers.rope import Rope, rope_parameters
from kernels_pallas.calls import OpCall
from sharding.rules import constrain

# Set while a training forward pass is traced (`rematerialized_layers`): each decoder layer then runs under
# `jax.checkpoint`, its activations recomputed in the backward pass rather than kept from the forward one. A trace-time
# setting, like jax's matmul-precision context; the inference paths never set it.
_REMAT_LAYERS = contextvars.ContextVar("day0jax_remat_layers", default=False)


@contextlib.contextmanager
def rematerialized_layers(enabled: bool = True):
    """Forward passes traced in this context checkpoint each decoder layer (gradient checkpointing): a gradient
    keeps only the layers' inputs and recomputes the rest. Set it inside the traced function, so that a jit cache
    keyed on the flag (a static argument) never hands one kind of program to the other."""
    token = _REMAT_LAYERS.set(enabled)
    try:
        yield
    finally:
        _REMAT_LAYERS.reset(token)


def _call_layer(layer, x, positions, rope_tables, cache, carry):
    """One decoder layer -> (x, cache, carry); layers that do not `carries` hand the carry on unchanged."""
    if getattr(layer, "carries", False):
        return layer(x, positions, rope_tables, cache, carry)
    x, cache = layer(x, positions, rope_tables, cache)
    return x, cache, carry


# --- configs ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class HFConfig:
    """Base of family configs (conventions: docs/adding_a_family.md). Fields keep exactly what config.json gave;
    what HF derives is a property (`kv_heads` K, `head_size` H, `rope`) read from the head, hidden_size, rope_* and
    max_position_embeddings keys every family declares, overridden where HF derives it otherwise. `__post_init__`
    only refuses, reading the properties so that a bad value fails at load. `ALIASES` is HF's `attribute_map` (old
    key -> field), `DEFAULT_THETA` its `default_theta`."""

    ALIASES: ClassVar[dict[str, str]] = {}
    DEFAULT_THETA: ClassVar[float] = 10000.0
    # Multimodal model_types whose config.json nests this family's keys in `text_config` (see `from_hf`).
    COMPOSITE: ClassVar[tuple[str, ...]] = ()
    unknown_keys: tuple = dataclasses.field(default=(), kw_only=True)

    @classmethod
    def from_hf(cls, hf: dict, *, strict: bool = True):
        """The config for a parsed config.json.

        Args:
            hf: the config.json dict.
            strict: refuse keys neither declared nor in `core.hf_config.IGNORED_KEYS` (`check` passes False).
        Raises:
            UnsupportedArchitecture: an unknown key (when strict) or a value the family does not implement.
            ConfigError: a required key is missing.
        """
        hf = dict(hf)
        if hf.get("model_type") in cls.COMPOSITE and isinstance(hf.get("text_config"), dict):
            # The language model of a multimodal checkpoint: its own keys, under the outer model_type (what
            # `is_composite` and the tensor names depend on). The other keys describe the vision side.
            outer = hf
            hf = dict(outer["text_config"], model_type=outer["model_type"])
            if "tie_word_embeddings" in outer:
                hf["tie_word_embeddings"] = outer["tie_word_embeddings"]
        return build_config(cls, hf, strict)

    def __post_init__(self):
        """Refuses uneven kv head groups, an unknown `hidden_act`, an unimplemented RoPE; families extend it."""
        self._check_heads()
        self._activation()
        self._check_derived("rope")

    @property
    def is_composite(self) -> bool:
        """Whether this is the language model of a multimodal checkpoint (its tensors under `language_model`)."""
        return self.model_type in self.COMPOSITE

    @property
    def kv_heads(self) -> int:
        return self.num_attention_heads if self.num_key_value_heads is None else self.num_key_value_heads

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads if self.head_dim is None else self.head_dim

    @cached_property
    def rope(self) -> dict[str, Any]:
        """The normalized RoPE dict (`layers.rope.rope_parameters`).

        Raises:
            UnsupportedArchitecture: a rope_type, or a key of it, that is not implemented.
        """
        return self._rope()

    def _check_heads(self) -> None:
        if self.num_attention_heads % self.kv_heads:
            refuse("num_key_value_heads", self.kv_heads,
                   f"does not divide num_attention_heads={self.num_attention_heads}")

    def _check_derived(self, *names: str) -> None:
        for name in names:
            getattr(self, name)

    def _rope(self, params: dict | None = None, **kwargs) -> dict[str, Any]:
        return rope_parameters(self.rope_parameters if params is None else params, self.rope_scaling,
                               self.rope_theta, default_theta=self.DEFAULT_THETA,
                               max_position_embeddings=self.max_position_embeddings, **kwargs)

    def _activation(self, key: str = "hidden_act") -> None:
        activation(getattr(self, key), key)  # raises, naming the key, for an activation we do not have

    def _refuse_if(self, key: str, bad: Callable[[Any], bool], why: str = "is not implemented") -> None:
        value = getattr(self, key)
        if bad(value):
            refuse(key, value, why)


def build_config(cls, hf: dict, strict: bool):
    """`cls` (a config dataclass with `ALIASES`) from config.json's keys, HF's old key names read as their fields.

    Raises:
        UnsupportedArchitecture: an unknown key (when strict), or a value the family does not implement.
        ConfigError: a required key is missing.
    """
    hf = dict(hf)
    for alias, field in cls.ALIASES.items():
        if alias in hf:
            hf.setdefault(field, hf.pop(alias))
    config = config_lib.from_hf(cls, hf)
    if strict and config.unknown_keys:
        shown = ", ".join(f"{k}={hf.get(k)!r}" for k in config.unknown_keys)
        raise UnsupportedArchitecture(
            f"config key(s) not implemented by the {config.model_type} family: {shown}. They may change the "
            "math, so day0jax refuses to run rather than give wrong numbers (`python -m day0jax.check` lists "
            "every key)")
    return config


class LayerTypes:
    """Mixin of configs with HF's `layer_types` and `sliding_window`: each layer's attention kind and window.
    A family gives HF's default pattern (`slides_by_default`) and overrides `window` where HF gates it by a flag."""

    def slides_by_default(self, index: int) -> bool:
        """Whether layer `index` slides when `layer_types` is None."""
        raise NotImplementedError

    @property
    def window(self) -> int | None:
        return self.sliding_window

    @cached_property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's attention kind: `layer_types`, or HF's default pattern when it is None.

        Raises:
            UnsupportedArchitecture: too few entries, or a kind other than full and sliding attention.
        """
        L, allowed = self.num_hidden_layers, ("full_attention", "sliding_attention")
        types = list(self.layer_types or ["sliding_attention" if self.slides_by_default(i) else "full_attention"
                                          for i in range(L)])
        if len(types) < L:
            refuse("layer_types", types, f"has {len(types)} entries for num_hidden_layers={L}")
        for t in types:
            if t not in allowed:
                refuse("layer_types", t, f"is not implemented (known: {', '.join(allowed)})")
        return tuple(types[:L])

    def layer_window(self, index: int) -> int | None:
        """The sliding window of layer `index` (None: full attention)."""
        return self.window if self.layer_kinds[index] == "sliding_attention" else None


# --- modules ---------------------------------------------------------------------------------------------------

class LocalRope:
    """Mixin of models whose sliding layers rotate with a RoPE of their own (the config's `local_rope` dict,
    beside `rope` for the full-attention layers): Gemma 3, OLMo 3."""

    def make_ropes(self) -> Sequence[Rope]:
        c = self.config
        self.local_rope = Rope(c.local_rope, c.head_size, c.max_position_embeddings)
        return [self.rope, self.local_rope]

    def layer_rope(self, index: int) -> Rope:
        return self.local_rope if self.config.layer_kinds[index] == "sliding_attention" else self.rope


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)), each block's output times
    `residual_multiplier` (Granite; 1.0 elsewhere). HF names kept: the token mixer is `self_attn`, or
    `mixer_name` where HF names it otherwise (`linear_attn`)."""

    def __init__(self, self_attn: nnx.Module, mlp: nnx.Module, input_layernorm: RMSNorm,
                 post_attention_layernorm: RMSNorm, residual_multiplier: float = 1.0, *,
                 mixer_name: str = "self_attn"):
        setattr(self, mixer_name, self_attn)
        self.mixer_name, self.mlp = mixer_name, mlp
        self.input_layernorm, self.post_attention_layernorm = input_layernorm, post_attention_layernorm
        self.residual_multiplier = residual_multiplier

    @property
    def mixer(self) -> nnx.Module:
        return getattr(self, self.mixer_name)

    def __call__(self, x, positions, rope_tables, cache=None):
        m = self.residual_multiplier
        h, cache = self.mixer(self.input_layernorm(x), positions, rope_tables, cache)
        x = x + (h if m == 1.0 else h * m)
        h = self.mlp(self.post_attention_layernorm(x))
        return x + (h if m == 1.0 else h * m), cache

    def op_calls(self) -> list[OpCall]:
        norms = self.input_layernorm.op_calls() + self.post_attention_layernorm.op_calls()
        return self.mixer.op_calls() + self.mlp.op_calls() + norms


class Backbone(nnx.Module):
    """HF's `model.` prefix: embed_tokens, layers, norm."""

    def __init__(self, embed_tokens: Embedding, layers: list[nnx.Module], norm: RMSNorm):
        self.embed_tokens, self.layers, self.norm = embed_tokens, nnx.List(layers), norm


class CausalLM(nnx.Module):
    """Token ids -> hidden states (with an optional per-layer KV cache) -> float32 logits. Subclasses implement
    `make_layer`; hooks: `make_rope`/`make_ropes`, `make_norm`, `embed`, `logits`, `cache_layout`, and `make_mtp`
    for families whose checkpoints ship multi-token-prediction layers (built with `mtp=True`: `mtp_step`)."""

    def __init__(self, config: Any, *, dtype=jnp.float32, rngs: nnx.Rngs, mtp: bool = False):
        self.config = config
        D = config.hidden_size
        self.rope = self.make_rope()
        self.ropes = tuple(self.make_ropes())
        layers = [self.make_layer(i, dtype=dtype, rngs=rngs) for i in range(config.num_hidden_layers)]
        self.model = Backbone(Embedding(config.vocab_size, D, dtype=dtype, rngs=rngs), layers,
                              self.make_norm(D, dtype=dtype, rngs=rngs))
        self.lm_head = None if config.tie_word_embeddings else Linear(
            (D,), (config.vocab_size,), ("embed", "vocab"), dtype=dtype, rngs=rngs)
        self.mtp = self.make_mtp(dtype=dtype, rngs=rngs) if mtp else None

    def make_mtp(self, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        """The multi-token-prediction layers (`layers.mtp`) the family's checkpoints ship.

        Raises:
            UnsupportedArchitecture: the family has none (or this config declares none).
        """
        raise UnsupportedArchitecture(f"{self.config.model_type} has no multi-token-prediction layers that day0jax "
                                      "runs; use speculative method 'ngram' or 'draft'")

    @property
    def mtp_layers(self) -> int:
        """Multi-token-prediction layers built (0: none)."""
        return 0 if self.mtp is None else len(self.mtp)

    def mtp_cache_layout(self) -> list[KVLayer]:
        """What the engine allocates for each multi-token-prediction layer (its attention's keys and values)."""
        if self.mtp is None:
            return []
        kv = next(x for x in self.cache_layout() if isinstance(x, KVLayer))  # full attention, like theirs
        return [KVLayer(kv.kv_heads, kv.k_dim, kv.v_dim, kv.index_dim)] * self.mtp_layers

    def mtp_step(self, index: int, tokens: jax.Array, hidden: jax.Array, positions: jax.Array, cache=None,
                 seq_len: jax.Array | None = None) -> tuple[jax.Array, Any]:
        """MTP layer `index` at `positions` [B, T]: `hidden` [B, T, D] the model's final hidden state there (or the
        previous MTP step's, chained), `tokens` [B, T] the token after each position. Returns (h' [B, T, D], the
        layer's updated cache); `mtp_logits` turns h' into the logits of the token after that one, `mtp_chained`
        into the next step's hidden state."""
        rope_tables = self.rope_tables(positions, seq_len)
        return self.mtp.step(index, self.embed(tokens), hidden, positions, rope_tables, cache)

    def mtp_hidden(self, x: jax.Array) -> jax.Array:
        """What the MTP layers read from the last decoder layer's output x (`__call__` with `raw=True`): the final
        hidden state, normed as the head reads it ([B, T, `mtp_hidden_size`])."""
        return self.final_norm(x)

    @property
    def mtp_hidden_size(self) -> int:
        return self.config.hidden_size

    def mtp_logits(self, index: int, h: jax.Array) -> jax.Array:
        """float32 logits [..., V] from MTP layer `index`'s h' (the model's own head)."""
        return self.logits(self.mtp.head_input(index, h))

    def mtp_chained(self, index: int, h: jax.Array) -> jax.Array:
        return self.mtp.chained(index, h)

    def make_rope(self) -> Rope:
        c = self.config
        return Rope(c.rope, c.head_size, c.max_position_embeddings)

    def make_ropes(self) -> Sequence[Rope]:
        """Every RoPE some layer uses; each gets its cos/sin tables computed once per call."""
        return [self.rope]

    def make_norm(self, dim: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        return RMSNorm(dim, self.config.rms_norm_eps, dtype=dtype, rngs=rngs)

    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        raise NotImplementedError

    def cache_layout(self) -> list[KVLayer | StateLayer]:
        """Per layer, what the engine allocates for it: a `KVLayer` (paged keys and values) or a `StateLayer`
        (fixed-size state per sequence)."""
        c = self.config
        return [KVLayer(c.kv_heads, c.head_size, c.head_size, window=self.attention_window(i))
                for i in range(c.num_hidden_layers)]

    def attention_window(self, index: int) -> int:
        """Layer `index`'s sliding window (0: it attends over every position), read from its attention module."""
        layer = self.model.layers[index]
        mixer = getattr(layer, "mixer", None) or getattr(layer, "self_attn", None)
        return int(getattr(mixer, "sliding_window", None) or 0)

    def embed(self, tokens: jax.Array) -> jax.Array:
        return self.model.embed_tokens(tokens)

    def op_calls(self) -> list[tuple[int | None, OpCall]]:
        """(layer index, call) for every op call of the forward pass (None: outside the decoder layers, as the final
        norm and the output projection): the one description of the model's operators that the readiness report,
        the kernel self-test and the memory planner read."""
        calls = [(i, call) for i, layer in enumerate(self.model.layers) for call in layer.op_calls()]
        L = len(self.model.layers)
        # Multi-token-prediction layers, numbered after the last layer as checkpoints number them.
        mtp = [] if self.mtp is None else [(L + i, call) for i in range(len(self.mtp))
                                           for call in self.mtp.op_calls(i)]
        tied = self.model.embed_tokens.attend_calls() if self.lm_head is None else []
        return (calls + mtp + [(None, call) for call in self.model.norm.op_calls()] + quantized_op_calls(self)
                + linear_op_calls(self) + [(None, call) for call in tied])

    def __call__(self, tokens: jax.Array, positions: jax.Array, caches: Sequence[Any] | None = None,
                 seq_len: jax.Array | None = None, **inputs: Any) -> tuple[jax.Array, list[Any] | None]:
        """tokens, positions [B, T] int32 -> (final hidden states [B, T, D], updated caches or None). `seq_len`:
        the unpadded length of the longest sequence, for RoPE variants that depend on it. `inputs` (vision-language
        models): `embeds` [B, T, D] in place of `embed(tokens)`, image features merged in; `rope_positions`
        [B, T, 3] for multimodal RoPE in place of `positions` (the cache and the masks keep those);
        `injections`: [B, T, D] arrays added to the residual stream after the first layers, one each (DeepStack);
        `raw=True`: the last layer's output before `final_norm` (what `mtp_hidden` reads)."""
        return self._run(tokens, positions, caches, seq_len, collect=False, **inputs)[:2]

    def hidden_states(self, tokens: jax.Array, positions: jax.Array, seq_len: jax.Array | None = None,
                      caches: Sequence[Any] | None = None, **inputs: Any) -> list[jax.Array]:
        """The residual stream as transformers' `output_hidden_states=True` reports it (no KV cache; `caches` only
        hands each layer this call's keys and values with a mask of its own, as `ContextKV`s): L + 1 arrays
        [B, T, D], the embeddings, the output of layers 1..L-1, and the final normed output. `inputs`: as in
        `__call__`."""
        x, _, hidden = self._run(tokens, positions, caches, seq_len, collect=True, **inputs)
        return hidden[:-1] + [x]

    def stage(self, inputs: jax.Array, positions: jax.Array, caches: Sequence[Any] | None, seq_len: jax.Array | None,
              layers: range) -> tuple[jax.Array, list[Any] | None]:
        """One pipeline stage: the decoder layers in `layers` (with their `caches`, in order). `inputs` are the
        token ids [B, T] when the range starts at layer 0 (embedded first), else the residual stream [B, T, D] the
        previous stage returned; the last stage's output is normed. Families whose layers hand each other a carry
        cannot be split (`pipeline_refusal`)."""
        first = layers.start == 0
        return self._run(inputs if first else None, positions, caches, seq_len, collect=False,
                         embeds=None if first else inputs, layers=layers)[:2]

    def pipeline_refusal(self) -> str | None:
        """Why this model cannot be split into pipeline stages (None: it can)."""
        if any(getattr(layer, "carries", False) for layer in self.model.layers):
            return (f"{self.config.model_type}'s layers hand each other a carry besides the residual stream; "
                    "pipeline stages are not implemented for it (use tp, ep and dp)")
        return None

    def _run(self, tokens, positions, caches, seq_len, collect: bool, embeds=None, rope_positions=None,
             injections=(), layers: range | None = None, raw: bool = False):
        # The residual stream is pinned (batch over dp) at block boundaries only; XLA derives the rest.
        x = constrain(self.embed(tokens) if embeds is None else embeds)
        rope_tables = self.rope_tables(positions if rope_positions is None else rope_positions, seq_len)
        new_caches = [] if caches is not None else None
        hidden = [x] if collect else None
        carry = self.begin_carry(tokens, x)  # what a layer hands to those after it, for layers that `carries`
        layers = range(len(self.model.layers)) if layers is None else layers
        remat = _REMAT_LAYERS.get()
        for i in layers:
            layer = self.model.layers[i]
            cache = None if caches is None else caches[i - layers.start]
            if remat:  # the layer (its parameters), positions and RoPE tables closed over, read and never written
                x, cache, carry = jax.checkpoint(lambda x, carry, layer=layer, cache=cache: _call_layer(
                    layer, x, positions, rope_tables, cache, carry))(x, carry)
            else:
                x, cache, carry = _call_layer(layer, x, positions, rope_tables, cache, carry)
            if i < len(injections):
                x = x + injections[i].astype(x.dtype)
            x = constrain(x)
            if caches is not None:
                new_caches.append(cache)
            if collect:
                hidden.append(x)
        return self.final_norm(x) if layers.stop == len(self.model.layers) and not raw else x, new_caches, hidden

    def final_norm(self, x: jax.Array) -> jax.Array:
        """The last layer's output -> the normed hidden states [B, T, D] the head reads (a hyper-connected model
        collapses its streams first: `layers.hyper.HyperConnected`)."""
        return self.model.norm(x)

    def rope_tables(self, positions: jax.Array, seq_len: jax.Array | None) -> dict[Rope, tuple[jax.Array, jax.Array]]:
        """{Rope: (cos, sin)} for every RoPE of `ropes`, computed once per call; Mistral Large 4 scales its
        frequencies by learned parameters here."""
        return {rope: rope.cos_sin(positions, seq_len) for rope in self.ropes}

    def begin_carry(self, tokens: jax.Array, x: jax.Array) -> Any:
        """What the first layer that `carries` receives (layers that do take and return a carry beside x and their
        cache): None, for GLM-5's top-k that one layer picks for the next; Gemma 4 starts its per-layer inputs;
        hyper-connected models the token ids (`layers.hyper.HyperCarry`)."""
        return None

    @jax.named_scope("vocab")
    def logits(self, hidden: jax.Array) -> jax.Array:
        """[..., D] -> float32 [..., V]."""
        out = self.model.embed_tokens.attend(hidden) if self.lm_head is None else self.lm_head(hidden)
        return out.astype(jnp.float32)


# --- Hugging Face tensor mapping -----------------------------------------------------------------------------

def in_language_model(src: Source) -> Source:
    """`src` reading a multimodal checkpoint, whose language model sits under `model.language_model.`."""
    return src.renamed(lambda n: "model.language_model." + n[len("model."):] if n.startswith("model.") else n)


VISION_DROPPED = "the vision tower: images are not supported yet, this checkpoint runs as text only"


def vision_dropped(config: Any, *patterns: str) -> dict[str, str]:
    """A `Family.dropped_for` body: the vision tensors `patterns` of a multimodal checkpoint, dropped with why."""
    return {p: VISION_DROPPED for p in patterns} if config.is_composite else {}


def per_expert_source(path: str, shape: tuple[int, ...], prefix: Callable[[str], str] = lambda p: p,
                      names: dict[str, str] | None = None) -> Source | None:
    """`<p>.experts.gate_proj|up_proj|down_proj` [E, in, out] <- each e's `<prefix(p)>.experts.<e>.<name>.weight`
    [out, in], transposed and stacked: save_pretrained's one Linear per expert (Mixtral, Qwen-MoE, DeepSeek).
    `names` renames the projections and `prefix` the block (Mixtral: w1/w3/w2, `block_sparse_moe`); None for
    other paths."""
    m = re.fullmatch(r"(.*)\.experts\.(gate_proj|up_proj|down_proj)", path)
    if not m:
        return None
    E, fan_in, fan_out = shape
    name = (names or {}).get(m[2], m[2])
    return Source(tuple(f"{prefix(m[1])}.experts.{e}.{name}.weight" for e in range(E)),
                  lambda arrays, shape: np.stack([a.T for a in arrays]).reshape(shape), ((fan_out, fan_in),) * E)


def fused_experts_source(path: str, shape: tuple[int, ...]) -> Source | None:
    """`<p>.experts.gate_proj|up_proj|down_proj` from transformers 5's fused expert tensors: gate_proj and up_proj
    [E, D, F] are the halves of `gate_up_proj` [E, 2F, D] transposed, down_proj [E, F, D] is `down_proj` [E, D, F]
    transposed (Mistral 4, Gemma 4); None for other paths."""
    m = re.fullmatch(r"(.*\.experts)\.(gate_proj|up_proj|down_proj)", path)
    if not m:
        return None
    E, fan_in, fan_out = shape
    if m[2] == "down_proj":
        return Source((f"{m[1]}.down_proj",), lambda a, s: np.swapaxes(a[0], 1, 2).reshape(s), ((E, fan_out, fan_in),))
    start = 0 if m[2] == "gate_proj" else fan_out
    return Source((f"{m[1]}.gate_up_proj",), lambda a, s: np.swapaxes(a[0][:, start:start + fan_out], 1, 2).reshape(s),
                  ((E, 2 * fan_out, fan_in),))


def per_expert_hf_source(config: Any, path: str, shape: tuple[int, ...], metadata: dict) -> Source | None:
    """The `contract.Family.hf_source` of MoE checkpoints with HF's own names (Qwen-MoE, DeepSeek)."""
    return per_expert_source(path, shape)


# --- multi-token prediction stored as layers after the last one (DeepSeek-V3, GLM-4.5) ---------------------------

def nextn_mtp(model: CausalLM, count: int, *, dtype, rngs: nnx.Rngs) -> NextNStack:
    """`count` DeepSeek-style MTP layers for `model`, each around the decoder layer `make_layer(L + i)` builds (as
    the checkpoint's layer L + i is built: MoE where the family's layers at that index are).

    Raises:
        UnsupportedArchitecture: the config declares none.
    """
    if not count:
        raise UnsupportedArchitecture(f"this {model.config.model_type} config declares no multi-token-prediction "
                                      "layers")
    L, D = model.config.num_hidden_layers, model.config.hidden_size
    return NextNStack([NextN(model.make_layer(L + i, dtype=dtype, rngs=rngs), model.make_norm, D, dtype=dtype,
                             rngs=rngs) for i in range(count)])


def nextn_tensors(config: Any, count: int) -> str | None:
    """The regex of the MTP layers' tensors, `model.layers.{L + i}.*` (None: none)."""
    if not count:
        return None
    L = config.num_hidden_layers
    return rf"model\.layers\.({'|'.join(str(L + i) for i in range(count))})\..*"


def nextn_dropped(config: Any, count: int) -> dict[str, str]:
    """The `Family.dropped_for` of DeepSeek-style MTP layers: their copies of the embedding and of the output head
    (the model's own, shared in training) always; the rest where the model is built without them."""
    pattern = nextn_tensors(config, count)
    if pattern is None:
        return {}
    L = config.num_hidden_layers
    indices = "|".join(str(L + i) for i in range(count))
    return {rf"model\.layers\.({indices})\.(embed_tokens|shared_head\.head)\.weight":
            "the multi-token-prediction layer's copy of the model's embedding or output head (shared)",
            pattern: "multi-token-prediction layers, used only for speculative decoding (converted without them)"}


def stored_mtp_path(path: str, prefix: Callable[[int], str], parts: dict[str, str]) -> str | None:
    """The checkpoint name of an MTP parameter `mtp.layers.{i}.X` for checkpoints that store MTP layer i flat under
    `prefix(i)`: X with its leading runtime part renamed by `parts` (`NextNStack`'s `decoder.`, `MtpStack`'s
    `mtp_block.` and `post_norm.`: the checkpoint's names for the decoder layer and the head's norm, "" where the
    decoder layer's tensors sit beside enorm, hnorm and eh_proj); None for other paths."""
    m = re.fullmatch(r"mtp\.layers\.(\d+)\.(.*)", path)
    if not m:
        return None
    rest = next((theirs + m[2][len(ours):] for ours, theirs in parts.items() if m[2].startswith(ours)), m[2])
    return prefix(int(m[1])) + rest


def nextn_source(config: Any, path: str, shape: tuple[int, ...], metadata: dict, inner) -> Source | None:
    """The Source of an MTP parameter `mtp.layers.{i}.[decoder.]X`: the checkpoint's `model.layers.{L + i}.X`, read
    as `inner` (the family's `hf_source`) or HF's plain naming reads a main layer's; None for other paths."""
    renamed = stored_mtp_path(path, lambda i: f"model.layers.{config.num_hidden_layers + i}.", {"decoder.": ""})
    if renamed is None:
        return None
    return inner(config, renamed, shape, metadata) or default_source(renamed, shape, metadata)
