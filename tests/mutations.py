"""The features of each family in tests/families.py and, for each, a way to break it in day0jax alone.

tests/test_models.py runs every mutation on the family's loaded model and asserts that the logits move, against the
cached transformers logits, by at least `MUTATION_FACTOR` times the family's parity tolerance: each feature listed
here shows in the parity test, so deleting its implementation, or getting a constant of it wrong, fails that test.
A feature that did not show in a family's tiny config got a config in which it does (tests/families.py).

A mutation edits a copy of the loaded model (`mutated_logits`); the loaded model, its parameters and its compiled
programs stay as they were. Kinds, combined by listing several in a tuple:
- `set_(cls, **values)`: attributes of every submodule of type `cls` (of the layers in `layers=` only);
- `edit(cls, fn)`: `fn(submodule, root)` changes each such submodule (a parameter is replaced by a new one, never
  written to: the copy shares the loaded model's arrays);
- `config(**changes)`, `rope_update(**changes)`: the model rebuilt from its config with these HF keys changed
  (day0jax only), same parameters;
- `patch(owner, name, wrap)`: `owner.name` replaced by `wrap(original)` while the copy is traced;
- `inputs(fn)`: a vision-language model's image inputs changed (`VL_MUTATIONS`, tests/test_multimodal.py).
Features whose parameters the checkpoint holds (biases, tied embeddings, per-layer widths) are not listed: with
random values (tests/ref/reference.py) the parity test sees them, and the converter refuses a checkpoint whose
tensors the model does not take.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from day0jax import models
from day0jax.layers import mlp as mlp_layers
from day0jax.layers import hyper
from day0jax.layers.attention import Attention
from day0jax.layers.block_sparse_attention import (BlockSparseAttention, PooledIndexer, PooledSparseMLAttention,
                                                   QSAAttention)
from day0jax.layers.gated_delta_net import KimiDeltaAttention
from day0jax.layers.ple import PLELayer
from day0jax.layers.mla import MLAttention
from day0jax.layers.moe import Experts, HashRouter, MoE, Router, clamped_swiglu
from day0jax.layers.decoder import ParallelDecoderLayer
from day0jax.layers.norms import LayerNorm, RMSNorm
from day0jax.layers.sparse_mla import Indexer, SparseMLAttention
from day0jax.models import base, gemma, gemma3, gemma4, glm_moe_dsa, mistral_large4
from kernels_pallas.attention import api as attention_api
from kernels_pallas.causal_conv1d import api as conv_api
from kernels_pallas.gated_delta_rule import api as delta_rule_api
from kernels_pallas.hyper_connection import api as hc_api
from kernels_pallas.ngram_embedding import reference as ngram_ref

MUTATION_FACTOR = 100


def feature_id(family: str, feature: str) -> str:
    """A pytest id for a family's feature: its name with runs of other characters as '_'."""
    return family + "-" + re.sub(r"[^\w+.-]+", "_", feature)


# The prompt (of families.PROMPTS) mutated models are compared on: the longest, past the windows, the chunks and the
# original context lengths of the tiny configs.
PROMPT = 2


# --- kinds of mutation ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Edit:
    cls: type
    fn: Callable[[nnx.Module, nnx.Module], None]
    layers: tuple[int, ...] | None = None

    def __call__(self, root: nnx.Module) -> nnx.Module:
        hits = [m for path, m in nnx.iter_modules(root)
                if isinstance(m, self.cls) and (self.layers is None or _layer(path) in self.layers)]
        assert hits, f"the mutation found no {self.cls.__name__} in layers {self.layers or 'any'}"
        for m in hits:
            self.fn(m, root)
        return root


def _layer(path: tuple) -> int | None:
    """The decoder layer a module path lies in (`model.layers.<i>...`), or None."""
    for a, b in zip(path, path[1:]):
        if a == "layers" and isinstance(b, int):
            return b
    return None


def set_(cls: type, layers: tuple[int, ...] | None = None, **values: Any) -> Edit:
    """Every `cls` submodule (of `layers`) with these attribute values."""
    def fn(module, root):
        for name, value in values.items():
            setattr(module, name, value)
    return Edit(cls, fn, layers)


def edit(cls: type, fn: Callable[[nnx.Module, nnx.Module], None], layers: tuple[int, ...] | None = None) -> Edit:
    """fn(submodule, root) for every `cls` submodule (of `layers`)."""
    return Edit(cls, fn, layers)


@dataclass(frozen=True)
class Config:
    changes: dict

    def __call__(self, root: nnx.Module) -> nnx.Module:
        c = root.config
        changed = dataclasses.replace(c, **{k: v(c) if callable(v) else v for k, v in self.changes.items()})
        graphdef, _ = nnx.split(models.abstract_model(changed))
        return nnx.merge(graphdef, nnx.split(root)[1])


def config(**changes: Any) -> Config:
    """HF keys of the model's config changed (a value may be a function of the config)."""
    return Config(changes)


def rope_update(kind: str | None = None, **changes: Any) -> Config:
    """rope_parameters (its `kind` entry, for configs with one RoPE per layer kind) with these keys changed."""
    def params(c):
        out = copy.deepcopy(c.rope_parameters)
        (out if kind is None else out[kind]).update(changes)
        return out
    return config(rope_parameters=params)


@dataclass(frozen=True)
class Patch:
    owner: Any
    name: str
    wrap: Callable[[Any], Any]

    def apply(self, monkeypatch) -> None:
        monkeypatch.setattr(self.owner, self.name, self.wrap(getattr(self.owner, self.name)))


def patch(owner: Any, name: str, wrap: Callable[[Any], Any]) -> Patch:
    """`owner.name` replaced by `wrap(original)` while the mutated copy is traced."""
    return Patch(owner, name, wrap)


@dataclass(frozen=True)
class Inputs:
    fn: Callable[[dict], dict]


def inputs(fn: Callable[[dict], dict]) -> Inputs:
    """A vision-language model's image inputs (`Model.image_arrays`: image_features, image_mask, rope_positions,
    deepstack) changed before the forward pass."""
    return Inputs(fn)


def op_kwargs(owner: Any, name: str, **overrides: Any) -> Patch:
    """`owner.name(*args, **kwargs)` called with `overrides` in place of the caller's keyword arguments."""
    return Patch(owner, name, lambda op: lambda *args, **kwargs: op(*args, **{**kwargs, **overrides}))


# XLA:CPU compiles a tiny model about twice as fast without its LLVM optimizations; the numbers checked move by
# orders of magnitude more than those optimizations do.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def mutated_logits(model, mutations: dict[str, Any], tokens: list[int], images: list | None = None
                   ) -> dict[str | None, Any]:
    """`model`'s logits [T, V] for `tokens` (and `images`, a vision-language model's, in order), unmutated (key None)
    and under each of `mutations` (feature -> one kind above, or a tuple of them), all from one compiled program:
    XLA compiles one program of several copies of a tiny model in a fraction of the time it takes for each copy
    alone. Each copy is a new module sharing the loaded model's arrays, traced by the forward pass of `Model.logits`,
    with its patches in place while it is traced only; the images are encoded once, by the loaded model. A mutation
    that cannot be applied or traced gives its exception in place of logits."""
    T = len(tokens)
    padded = np.zeros((1, max(16, 1 << (T - 1).bit_length())), np.int32)  # as `Model.logits` pads
    padded[0, :T] = tokens
    image = None if images is None else model.images.arrays(padded, model.images.rows([images], [tokens]))
    graphdef, state = nnx.split(model.module)
    copies, patches, changes, out = {}, {}, {}, {}
    for feature, mutation in [(None, ())] + list(mutations.items()):
        steps = mutation if isinstance(mutation, tuple) else (mutation,)
        try:
            module = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))  # new Variables: edits stay in the copy
            for step in steps:
                if not isinstance(step, (Patch, Inputs)):
                    module = step(module)
        except Exception as e:  # reported by this feature's test
            out[feature] = e
            continue
        # The runner's cache-less forward, on this copy's graph: a single-stage runner merges its graph with the
        # parameters' leaves (`ModelRunner._model`).
        view = copy.copy(model.runner)
        view._graphdef, params = nnx.split(module)
        leaves, view._params_def = jax.tree.flatten(params)
        copies[feature], patches[feature] = (view, leaves), [s for s in steps if isinstance(s, Patch)]
        changes[feature] = [s.fn for s in steps if isinstance(s, Inputs)]

    features = list(copies)  # pytrees take a list: dictionary keys would be sorted, and None is one

    def forward(params, padded, length, image):
        logits = []
        for feature, p in zip(features, params):
            with pytest.MonkeyPatch.context() as monkeypatch:
                try:
                    for step in patches[feature]:
                        step.apply(monkeypatch)
                    arrays = image
                    for change in changes[feature]:
                        arrays = change(dict(arrays))
                    logits.append(copies[feature][0]._whole_fn(0, p, padded, length, arrays))
                except Exception as e:
                    out[feature] = e
                    logits.append(None)
        return logits

    options = FAST_COMPILE if jax.default_backend() == "cpu" else None
    with jax.set_mesh(model.mesh):
        logits = jax.jit(forward, compiler_options=options)([copies[f][1] for f in features], padded, np.int32(T),
                                                             image)
    out.update({f: np.asarray(a)[0, :T] for f, a in zip(features, logits) if a is not None})
    return out


# --- the features several families share ---------------------------------------------------------------------------

class Identity(nnx.Module):
    def __call__(self, x):
        return x


NO_ROPE = set_(Attention, rope=None)
NO_WINDOW = set_(Attention, sliding_window=None)
NO_QK_NORM = set_(Attention, q_norm=None, k_norm=None)
NO_NORM_OFFSET = set_(RMSNorm, offset=0.0)  # (1 + w) norms read as w
FLIP_RENORM = edit(Router, lambda r, root: setattr(r, "norm_topk_prob", not r.norm_topk_prob))
NO_ROUTED_SCALE = set_(Router, scale=1.0)
NO_SCORE_BIAS = set_(Router, e_score_correction_bias=None)
NO_GROUP_LIMIT = set_(Router, n_group=1, topk_group=1)
# "scored_topk" routers always add their bias: a zero one chooses by the plain scores.
ZERO_SCORE_BIAS = edit(Router, lambda r, root: setattr(
    r, "e_score_correction_bias", nnx.Param(jnp.zeros_like(r.e_score_correction_bias[...]))))
SOFTMAX_SCORES = set_(Router, routing="softmax_grouped")  # for "sigmoid_grouped" routers
SIGMOID_SCORES = set_(Router, routing="sigmoid_grouped")  # for "softmax_grouped" routers (no score bias)
NO_SHARED = set_(MoE, has_shared=False)
NO_SHARED_GATE = set_(MoE, has_shared_gate=False)
NO_GATE = set_(Attention, gate=None)  # an output gate from a projection of its own
NO_SOFTCAP = set_(Attention, logit_softcap=None)
NO_FINAL_SOFTCAP = config(final_logit_softcapping=None)
FULL_ROTARY = rope_update(partial_rotary_factor=1.0)
MLA_HALF_SPLIT = set_(MLAttention, rope_interleave=False)
MLA_INTERLEAVED = set_(MLAttention, rope_interleave=True)
MLA_PLAIN_SCALE = edit(MLAttention, lambda a, root: setattr(a, "scale", root.config.qk_head_size ** -0.5))
DENSE_TOP_K = set_(SparseMLAttention, topk=1024)  # more than the keys: sparse attention selects every one


def rope(rope_type: str = "default", **params: Any) -> dict:
    return dict(rope_type=rope_type, **params)


def _sequential(call):
    # The parallel block made sequential: the MLP reads the norm of x + attn(n), not n.
    def run(self, x, positions, rope_tables, cache=None):
        h, cache = self.self_attn(self.input_layernorm(x), positions, rope_tables, cache)
        x = x + h
        return x + self.mlp(self.input_layernorm(x)), cache
    return run


def _uncentered(call):
    # A LayerNorm read as an RMSNorm: the mean is not subtracted.
    def run(self, x):
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + self.eps) * self.weight[...]
        return (h if self.bias is None else h + self.bias[...]).astype(x.dtype)
    return run


HALF_SPLIT_ROPE = set_(Attention, rope_interleave=False)
SEQUENTIAL_BLOCK = patch(ParallelDecoderLayer, "__call__", _sequential)
UNCENTERED_NORM = patch(LayerNorm, "__call__", _uncentered)


def rope_on(layer: int) -> Edit:
    """A layer without positions (NoPE) rotated by the model's RoPE."""
    return edit(Attention, lambda a, root: setattr(a, "rope", root.rope), layers=(layer,))


def rope_params(layer: int, **changes: Any) -> Edit:
    """Layer `layer` rotated by a RoPE of its own: its RoPE's parameters with these changed (where a config change
    would be refused)."""
    def fn(a, root):
        a.rope = dataclasses.replace(a.rope, params={**a.rope.params, **changes})
        root.ropes = root.ropes + (a.rope,)  # the model computes tables for each of its `ropes`
    return edit(Attention, fn, layers=(layer,))


def window_on(layer: int, window: int = 8) -> Edit:
    return set_(Attention, layers=(layer,), sliding_window=window)


def _halves_to_pairs(a: Attention, root) -> None:
    """The converter's reordering of q/k rows (interleaved RoPE pairs -> HF's halves) undone: the rows rotate as the
    checkpoint stores them."""
    H = a.head_dim
    rot = H if a.rope is None else a.rope.rotary_dim
    back = np.argsort(np.concatenate([np.arange(0, rot, 2), np.arange(1, rot, 2), np.arange(rot, H)]))
    for proj in (a.q_proj, a.k_proj):
        proj.kernel = nnx.Param(proj.kernel[...][:, back])
        if proj.bias is not None:
            proj.bias = nnx.Param(proj.bias[...][:, back])


INTERLEAVED_PAIRS = edit(Attention, _halves_to_pairs)


def _drop_q_gate(a: Attention, root) -> None:
    """The output gate from q_proj [N, 2H] dropped (Qwen3-Next): q_proj keeps each head's query half."""
    if not a.output_gate:
        return
    H, q = a.head_dim, nnx.merge(*nnx.split(a.q_proj))
    q.kernel, q.out_shape = nnx.Param(a.q_proj.kernel[...][:, :H]), (q.out_shape[0], H)
    if q.bias is not None:
        q.bias = nnx.Param(a.q_proj.bias[...][:, :H])
    a.q_proj, a.output_gate = q, False


NO_Q_GATE = edit(Attention, _drop_q_gate)


def _one_expert_set(r: HashRouter, root) -> None:
    """Every token id routed to the same experts (0..k-1): the hash table's choice per token gone."""
    table = r.tid2eid[...]
    r.tid2eid = nnx.Param(jnp.broadcast_to(jnp.arange(table.shape[1], dtype=table.dtype), table.shape))


def _regroup_heads(a: Attention, root) -> None:
    """Query head n attends with kv head n % K instead of n // (N / K): q_proj's and o_proj's heads permuted."""
    N, K = a.q_proj.out_shape[0], a.k_proj.out_shape[0]
    order = np.arange(N).reshape(K, N // K).T.reshape(-1)
    a.q_proj.kernel = nnx.Param(a.q_proj.kernel[...][order])
    a.o_proj.kernel = nnx.Param(a.o_proj.kernel[...][:, order])


KV_GROUPS = edit(Attention, _regroup_heads)

# Linear attention's and LFM's short convolution: each channel sees its own token only (the last tap).
NO_CONV = patch(conv_api, "causal_conv1d", lambda conv: lambda x, weight, *a, **k: conv(
    x, weight * (jnp.arange(weight.shape[-1]) == weight.shape[-1] - 1), *a, **k))
# The delta rule's decay: none (g = 0, the state never fades), or one per head (the mean of the per-channel ones).
NO_DECAY = patch(delta_rule_api, "gated_delta_rule", lambda rule: lambda q, k, v, g, *a, **kw: rule(
    q, k, v, jnp.zeros_like(g), *a, **kw))
DECAY_PER_HEAD = patch(delta_rule_api, "gated_delta_rule", lambda rule: lambda q, k, v, g, *a, **kw: rule(
    q, k, v, jnp.broadcast_to(g.mean(-1, keepdims=True), g.shape), *a, **kw))
PLAIN_LOGITS = patch(mistral_large4.Model, "logits", lambda logits: base.CausalLM.logits)
# Qwen4-Exp's n-grams: never restarted at eos (no id is eos), or no n-gram at all (every order hashes the token
# alone); its gated residual's per-stream injection weights all 1, or its input mix uniform (sigmoid(0) per channel).
NO_EOS_RESTART = patch(ngram_ref, "shifted_ids", lambda shifted: lambda context, tokens, *, eos: shifted(
    context, tokens, eos=-1))
UNIGRAMS_ONLY = patch(ngram_ref, "shifted_ids", lambda shifted: lambda context, tokens, *, eos: jnp.broadcast_to(
    shifted(context, tokens, eos=eos)[:1], (context.shape[1] + 1, *tokens.shape)))
NO_INJECTION_WEIGHTS = patch(hyper.GatedResidual, "expand", lambda expand: staticmethod(
    lambda x, y, post, comb: expand(x, y, jnp.ones_like(post), comb)))
UNIFORM_INPUT_MIX = edit(hyper.GatedResidual, lambda g, root: setattr(
    g.input_mix_weight_up, "weight", nnx.Param(jnp.zeros_like(g.input_mix_weight_up.weight[...]))))
NO_PLE_CONV = edit(PLELayer, lambda p, root: setattr(p.conv1d, "weight", nnx.Param(jnp.zeros_like(
    p.conv1d.weight[...]))))


def _hand_on_received(call):
    """GLM-5's decoder layer; one marked `hands_on_received_topk` passes on the top-k it received instead of its own,
    so the shared layer after it attends over an earlier full layer's picks."""
    def wrapped(self, x, positions, rope_tables, cache=None, shared_topk=None):
        x, cache, topk = call(self, x, positions, rope_tables, cache, shared_topk)
        return x, cache, shared_topk if getattr(self, "hands_on_received_topk", False) else topk
    return wrapped


def _hyper_hands_on_received(call):
    """A hyper-connected decoder layer; one marked `hands_on_received_topk` passes on the top-k it received instead
    of its own, so the shared layer after it attends over an earlier full layer's picks."""
    def wrapped(self, x, positions, rope_tables, cache=None, carry=None):
        received = carry.topk
        x, cache, carry = call(self, x, positions, rope_tables, cache, carry)
        return x, cache, carry._replace(topk=received) if getattr(self, "hands_on_received_topk", False) else carry
    return wrapped


# The plain form's streams each keep their own residual; this mixes them, evenly, as an mHC comb matrix would.
STREAMS_MIXED = patch(hc_api, "expand", lambda expand: lambda x, y, post, comb: expand(
    x, y, post, jnp.full((*x.shape[:2], x.shape[2], x.shape[2]), 1.0 / x.shape[2]) if comb is None else comb))
# The hyper head's learned weights replaced by the streams' mean.
NO_HYPER_HEAD = patch(hyper.HyperConnected, "final_norm", lambda final: lambda self, x: self.model.norm(
    x.mean(axis=-2)))


# The streams collapsed by their first alone instead of their mean (GLM-5-Next's hyper head).
FIRST_STREAM_HEAD = patch(hyper.MeanHyperHead, "__call__", lambda call: lambda self, x: x[..., 0, :])


# A layer handed an earlier layer's blocks attends over every block instead (the others receive none).
SHARED_BLOCKS_IGNORED = patch(PooledSparseMLAttention, "run", lambda run: lambda self, x, positions, tables, cache=None,
                              shared=None: run(self, x, positions, tables, cache,
                                               None if shared is None else jnp.ones_like(shared)))


def _mean_pooling(indexer, root) -> None:
    """A pooled indexer's block keys as the plain mean of the block's keys (zero pooling logits)."""
    for name in ("index_kpool_compress_gate", "index_kpool_compress_ape"):
        setattr(indexer, name, nnx.Param(jnp.zeros_like(getattr(indexer, name)[...])))


def _without_per_layer_inputs(begin):
    def wrapped(self, tokens, x):
        carry = begin(self, tokens, x)
        return dataclasses.replace(carry, per_layer=carry.per_layer * 0)
    return wrapped


# --- per family ----------------------------------------------------------------------------------------------------
# Each name of families.FAMILIES -> [(feature, mutation)]. Where transformers writes a derived value into config.json
# (layer_types, rope_parameters with partial_rotary_factor, theta and no_rope_layers), day0jax reads that value, so the
# feature is how it is applied, not how HF's default is derived.

MUTATIONS: dict[str, list[tuple[str, Any]]] = {
    "llama": [("rope", NO_ROPE), ("kv head groups", KV_GROUPS)],
    "llama_tied_bias_headdim": [("softmax scale from head_dim", set_(Attention, scale=16 ** -0.5))],
    "llama_mqa_linear": [("linear rope scaling", config(rope_parameters=rope(rope_theta=10000.0)))],
    "llama_dynamic": [("dynamic ntk rope", config(rope_parameters=rope(rope_theta=10000.0)))],
    "llama_yarn": [("yarn frequencies", config(rope_parameters=rope(rope_theta=10000.0))),
                   ("yarn attention factor", rope_update(attention_factor=1.0))],
    "llama3_rope": [("llama3 rope scaling", config(rope_parameters=rope(rope_theta=500000.0)))],
    "llama_longrope": [("longrope factors", config(rope_parameters=rope(rope_theta=10000.0))),
                       ("long factors past the original length",
                        config(rope_parameters=lambda c: dict(c.rope_parameters,
                                                              long_factor=c.rope_parameters["short_factor"]))),
                       ("longrope attention factor", rope_update(attention_factor=1.0))],
    "mistral": [("sliding window", NO_WINDOW)],
    "ministral": [("sliding window", NO_WINDOW), ("layer types", window_on(1))],
    "ministral_default": [("sliding window on every layer", set_(Attention, layers=(1,), sliding_window=None))],
    "exaone": [("llama3 rope scaling", config(rope_parameters=rope(rope_theta=1000000.0)))],
    "exaone_bias_tied": [("rope_theta", rope_update(rope_theta=10000.0))],
    "qwen2": [("sliding window", NO_WINDOW), ("layer types", window_on(0))],
    "qwen3": [("q/k norms", NO_QK_NORM)],
    "qwen2_moe": [("shared expert gate", NO_SHARED_GATE), ("shared expert", NO_SHARED),
                  ("top-k not renormalized", FLIP_RENORM)],
    "qwen3_moe": [("q/k norms", NO_QK_NORM), ("top-k renormalized", FLIP_RENORM)],
    "mixtral": [("top-k renormalized", FLIP_RENORM), ("sliding window", NO_WINDOW)],
    "gemma": [("(1 + w) norms", NO_NORM_OFFSET),
              ("embedding scale", patch(gemma.Model, "embed", lambda embed: base.CausalLM.embed))],
    "gemma2": [("attention soft-cap", NO_SOFTCAP), ("final soft-cap", NO_FINAL_SOFTCAP),
               ("query_pre_attn_scalar", set_(Attention, scale=None)), ("sliding window", NO_WINDOW),
               ("(1 + w) norms", NO_NORM_OFFSET)],
    "gemma3_text": [("q/k norms", NO_QK_NORM), ("final soft-cap", NO_FINAL_SOFTCAP), ("sliding window", NO_WINDOW),
                    ("local rope on sliding layers",
                     edit(Attention, lambda a, root: setattr(a, "rope", root.rope), layers=(0,))),
                    ("linear rope scaling on full layers", config(rope_parameters=lambda c: dict(
                        c.rope_parameters, full_attention=rope(rope_theta=1000000.0))))],
    "gemma4": [("proportional rope on full layers", rope_update("full_attention", rope_type="default")),
               ("value norm", set_(gemma4.Attention, v_norm=Identity())),
               ("softmax scale 1", op_kwargs(attention_api, "attention", scale=None)),
               ("per-layer inputs", patch(gemma4.Model, "begin_carry", _without_per_layer_inputs)),
               ("final soft-cap", NO_FINAL_SOFTCAP), ("sliding window", set_(gemma4.Attention, sliding_window=None))],
    # Renormalizing the top-k weights does not show in Gemma 4: the routed experts' sum goes through an RMSNorm
    # (post_feedforward_layernorm_2), which undoes any per-token scale of the weights.
    "gemma4_moe": [("router input norm and scales",
                    patch(gemma4.GemmaRouter, "__call__", lambda call: Router.__call__))],
    "phi3": [("partial rotary", FULL_ROTARY), ("sliding window", NO_WINDOW)],
    "phi3_longrope": [("longrope factors", config(rope_parameters=rope(rope_theta=10000.0))),
                      ("longrope attention factor", rope_update(attention_factor=1.0))],
    "olmo2": [("q/k norms over all heads", NO_QK_NORM)],
    "deepseek_v3": [("interleaved rope", MLA_HALF_SPLIT), ("yarn softmax scale", MLA_PLAIN_SCALE),
                    ("yarn", config(rope_parameters=rope(rope_theta=10000.0))), ("sigmoid scores", SOFTMAX_SCORES),
                    ("group-limited routing", NO_GROUP_LIMIT), ("routing score bias", NO_SCORE_BIAS),
                    ("top-k renormalized", FLIP_RENORM), ("routed scaling", NO_ROUTED_SCALE),
                    ("shared experts", NO_SHARED)],
    "deepseek_v3_plain_q": [("half-split rope", MLA_INTERLEAVED), ("top-k not renormalized", FLIP_RENORM),
                            ("routed scaling", NO_ROUTED_SCALE)],
    "deepseek_v2": [("interleaved rope", MLA_HALF_SPLIT), ("yarn softmax scale", MLA_PLAIN_SCALE),
                    ("yarn", config(rope_parameters=rope(rope_theta=10000.0))), ("softmax scores", SIGMOID_SCORES),
                    ("group-limited routing", NO_GROUP_LIMIT), ("a group scored by its best expert",
                                                                set_(Router, group_top=2)),
                    ("top-k not renormalized", FLIP_RENORM), ("routed scaling", NO_ROUTED_SCALE),
                    ("shared experts", NO_SHARED)],
    "deepseek_v2_lite": [("interleaved rope", MLA_HALF_SPLIT), ("greedy top-k over all experts",
                                                                 set_(Router, n_group=2, topk_group=1)),
                         ("softmax scores", SIGMOID_SCORES), ("routed scaling", NO_ROUTED_SCALE)],
    "dots1": [("q/k norms", NO_QK_NORM), ("sliding window", NO_WINDOW), ("group-limited routing", NO_GROUP_LIMIT),
              ("routing score bias", NO_SCORE_BIAS), ("top-k renormalized", FLIP_RENORM),
              ("routed scaling", NO_ROUTED_SCALE), ("shared experts", NO_SHARED)],
    "gpt_oss": [("sinks", set_(Attention, sinks=None)), ("sliding window", NO_WINDOW),
                ("softmax over the top-k", set_(Router, routing="softmax_topk")),
                ("swiglu clamp", set_(Experts, glu=clamped_swiglu(1.702, math.inf))),
                ("swiglu alpha", set_(Experts, glu=clamped_swiglu(1.0, 1.5))),
                ("yarn", config(rope_parameters=rope(rope_theta=150000.0)))],
    "smollm3": [("nope layer", rope_on(1)), ("sliding window on the nope layer", NO_WINDOW)],
    "granite": [("embedding multiplier", config(embedding_multiplier=1.0)),
                ("attention multiplier", set_(Attention, scale=None)),
                ("residual multiplier", config(residual_multiplier=1.0)),
                ("logits scaling", config(logits_scaling=1.0))],
    "minimax_m2": [("q/k norms over all heads", NO_QK_NORM), ("partial rotary (rotary_dim)", FULL_ROTARY),
                   ("routing score bias", NO_SCORE_BIAS), ("sigmoid scores", SOFTMAX_SCORES),
                   ("top-k renormalized", FLIP_RENORM)],
    "minimax_m2_full_rotary": [("sigmoid scores", SOFTMAX_SCORES), ("rope", NO_ROPE)],
    "minimax_m3": [("block selection (top-k of the blocks)", set_(BlockSparseAttention, topk_blocks=1024)),
                   ("forced local blocks", set_(BlockSparseAttention, local_blocks=0)),
                   ("per-head q/k norms", NO_QK_NORM), ("(1 + w) norms", NO_NORM_OFFSET),
                   ("partial rotary", FULL_ROTARY), ("routing score bias", NO_SCORE_BIAS),
                   ("routed scaling", NO_ROUTED_SCALE), ("shared experts", NO_SHARED),
                   ("swiglu clamp", set_(Experts, glu=clamped_swiglu(1.702, 0.5))),
                   ("swiglu alpha", set_(Experts, glu=clamped_swiglu(1.0, 7.0)))],
    # The same ops against transformers' own modules, each without its feature: tests/test_qwen4_exp_ops.py.
    "qwen4_exp": [("block selection (budget)", set_(QSAAttention, topk_blocks=1024)),
                  ("n-gram restart at eos", NO_EOS_RESTART), ("n-gram hash", UNIGRAMS_ONLY),
                  ("gated residual injection", NO_INJECTION_WEIGHTS), ("gated residual input mix", UNIFORM_INPUT_MIX),
                  ("per-layer embedding convolution", NO_PLE_CONV), ("(1 + w) norms", NO_NORM_OFFSET),
                  ("partial rotary", FULL_ROTARY), ("shared expert gate", NO_SHARED_GATE),
                  ("top-k renormalized", FLIP_RENORM)],
    "minimax_m3_mqa": [("block selection (top-k of the blocks)", set_(BlockSparseAttention, topk_blocks=1024)),
                       ("forced local block", set_(BlockSparseAttention, local_blocks=0)),
                       ("rope", NO_ROPE)],
    "glm4_moe": [("partial rotary", FULL_ROTARY), ("q/k norms", NO_QK_NORM),
                 ("group-limited routing", NO_GROUP_LIMIT), ("routed scaling", NO_ROUTED_SCALE),
                 ("routing score bias", NO_SCORE_BIAS), ("shared experts", NO_SHARED)],
    "glm4_moe_plain": [("partial rotary", FULL_ROTARY), ("top-k not renormalized", FLIP_RENORM),
                       ("shared experts", NO_SHARED)],
    "olmo3": [("local rope theta", rope_update("sliding_attention", rope_theta=10000.0)),
              ("yarn on full layers", config(rope_parameters=lambda c: dict(
                  c.rope_parameters, full_attention=rope(rope_theta=10000.0)))),
              ("yarn attention factor", rope_update("full_attention", attention_factor=1.0)),
              ("sliding window pattern", window_on(3)), ("q/k norms over all heads", NO_QK_NORM)],
    "olmo3_bias": [("rope_theta on full layers only",
                    edit(Attention, lambda a, root: setattr(a, "rope", root.rope), layers=(0,)))],
    "seed_oss": [("rope", NO_ROPE)],
    "exaone4": [("nope on full layers", rope_on(3)), ("sliding window", NO_WINDOW), ("q/k norms", NO_QK_NORM),
                ("llama3 rope", config(rope_parameters=rope(rope_theta=500000.0)))],
    "exaone4_global": [("q/k norms", NO_QK_NORM), ("rope on every layer without a window", NO_ROPE)],
    "ernie4_5": [("interleaved rope pairs", INTERLEAVED_PAIRS)],
    "ernie4_5_tied": [("interleaved rope pairs", INTERLEAVED_PAIRS)],
    "ernie4_5_moe": [("interleaved rope pairs", INTERLEAVED_PAIRS), ("routing score bias", NO_SCORE_BIAS),
                     ("shared experts", NO_SHARED)],
    "ernie4_5_moe_interval": [("top-k renormalized", FLIP_RENORM)],
    "hunyuan_v1_dense": [("q/k norms after rope", set_(Attention, qk_norm_after_rope=False)),
                         ("alpha rope", config(rope_parameters=rope(rope_theta=100.0)))],
    "hunyuan_v1_moe": [("per-layer top-k", set_(Router, layers=(1,), top_k=2)), ("shared mlp", NO_SHARED),
                       ("q/k norms after rope", set_(Attention, qk_norm_after_rope=False))],
    "hunyuan_v1_moe_top1": [("top-1 renormalized", FLIP_RENORM)],
    "hy_v3": [("q/k norms", NO_QK_NORM), ("q/k norms before rope", set_(Attention, qk_norm_after_rope=True)),
              ("sigmoid scores", set_(Router, score_fn="softmax")), ("routing score bias", ZERO_SCORE_BIAS),
              ("top-k renormalized", FLIP_RENORM), ("routed scaling", NO_ROUTED_SCALE), ("shared experts", NO_SHARED)],
    "hy_v3_default": [("default rope theta", config(rope_parameters=rope(rope_theta=10000.0))),
                      ("routed scaling", NO_ROUTED_SCALE), ("top-k renormalized", FLIP_RENORM)],
    "glm4": [("interleaved rope pairs", INTERLEAVED_PAIRS), ("partial rotary", FULL_ROTARY)],
    "glm4_quarter_rotary": [("partial rotary", FULL_ROTARY)],
    "arcee": [("relu2 mlp", set_(mlp_layers.GatedMLP, act=mlp_layers.ACTIVATIONS["silu"])),
              ("yarn", config(rope_parameters=rope(rope_theta=10000.0)))],
    "arcee_bias_silu": [("hidden_act", set_(mlp_layers.GatedMLP, act=mlp_layers.ACTIVATIONS["relu2"]))],
    "qwen3_next": [("output gate", NO_Q_GATE), ("delta rule decay", NO_DECAY), ("short convolution", NO_CONV),
                   ("(1 + w) norms", NO_NORM_OFFSET), ("partial rotary", FULL_ROTARY),
                   ("shared expert gate", NO_SHARED_GATE)],
    "qwen3_5": [("output gate", NO_Q_GATE), ("delta rule decay", NO_DECAY), ("short convolution", NO_CONV),
                ("(1 + w) norms", NO_NORM_OFFSET), ("partial rotary", FULL_ROTARY)],
    "qwen3_5_moe": [("output gate", NO_Q_GATE), ("delta rule decay", NO_DECAY), ("shared expert gate", NO_SHARED_GATE),
                    ("top-k renormalized", FLIP_RENORM)],
    "kimi_linear": [("decay per key channel", DECAY_PER_HEAD), ("short convolution", NO_CONV),
                    ("sigmoid scores", SOFTMAX_SCORES), ("group-limited routing", NO_GROUP_LIMIT),
                    ("routing score bias", NO_SCORE_BIAS), ("routed scaling", NO_ROUTED_SCALE)],
    "lfm2": [("short convolution", NO_CONV), ("q/k norms", NO_QK_NORM)],
    "lfm2_moe": [("short convolution", NO_CONV), ("routing score bias", NO_SCORE_BIAS),
                 ("routed scaling", NO_ROUTED_SCALE), ("top-k renormalized", FLIP_RENORM)],
    "lfm3": [("output gate", NO_GATE), ("sliding window", NO_WINDOW), ("short convolution", NO_CONV),
             ("proportional rope on the full layer", rope_params(3, rope_type="default"))],
    "llama4": [("chunked attention", set_(Attention, chunk_size=None)), ("l2 q/k norms", NO_QK_NORM),
               ("nope layer", rope_on(1)), ("attention temperature", set_(Attention, attn_temperature=None)),
               ("experts scale their inputs", set_(Experts, scale_inputs=False)),
               ("sigmoid of the top-k", set_(Router, routing="topk_softmax")), ("shared expert", NO_SHARED),
               ("interleaved rope pairs", INTERLEAVED_PAIRS)],
    "llama4_bias_top1": [("llama3 rope", config(rope_parameters=rope(rope_theta=500000.0))),
                         ("chunked attention", set_(Attention, chunk_size=None)),
                         ("attention temperature", set_(Attention, attn_temperature=None)),
                         ("sigmoid of the top-1", set_(Router, routing="topk_softmax"))],
    "afmoe": [("output gate", NO_GATE), ("nope on full layers", rope_on(1)), ("q/k norms", NO_QK_NORM),
              ("sigmoid scores", SOFTMAX_SCORES), ("routing score bias", NO_SCORE_BIAS),
              ("route scale", NO_ROUTED_SCALE), ("shared experts", NO_SHARED), ("sliding window", NO_WINDOW)],
    "afmoe_mup": [("mup embedding scale", config(mup_enabled=False))],
    "laguna": [("per-head softplus gate", NO_GATE), ("sigmoid scores", SOFTMAX_SCORES),
               ("routing score bias", NO_SCORE_BIAS), ("sliding window", NO_WINDOW),
               ("partial rotary on the full layer", rope_update("full_attention", partial_rotary_factor=1.0))],
    "laguna_element": [("per-element softplus gate", NO_GATE),
                       ("router logit soft-cap", set_(Router, logit_softcap=None)),
                       ("routed scaling", NO_ROUTED_SCALE),
                       ("yarn on the full layer", config(rope_parameters=lambda c: dict(
                           c.rope_parameters, full_attention=rope(rope_theta=500000.0, partial_rotary_factor=0.5))))],
    "mistral4": [("query temperature", set_(MLAttention, query_scaling=None)),
                 ("yarn softmax scale", MLA_PLAIN_SCALE), ("interleaved rope", MLA_HALF_SPLIT),
                 ("softmax scores", SIGMOID_SCORES), ("group-limited routing", NO_GROUP_LIMIT),
                 ("routed scaling", NO_ROUTED_SCALE), ("shared experts", NO_SHARED)],
    "mistral4_plain_q": [("half-split rope", MLA_INTERLEAVED), ("top-k not renormalized", FLIP_RENORM)],
    "deepseek_v32": [("sparse top-k", DENSE_TOP_K), ("indexer rope half-split", set_(Indexer, rope_interleave=True)),
                     ("interleaved rope", MLA_HALF_SPLIT), ("group-limited routing", NO_GROUP_LIMIT)],
    "glm_moe_dsa": [("sparse top-k", DENSE_TOP_K), ("indexer rope interleaved", set_(Indexer, rope_interleave=False)),
                    ("top-k of the latest full layer", (
                        set_(glm_moe_dsa.TopKDecoderLayer, layers=(1,), hands_on_received_topk=True),
                        patch(glm_moe_dsa.TopKDecoderLayer, "__call__", _hand_on_received)))],
    "mistral_large4": [
        ("learned rope scale", patch(mistral_large4.Model, "rope_tables", lambda tables: base.CausalLM.rope_tables)),
        ("query softmax scaling", set_(MLAttention, softmax_scaling=None)),
        ("indexer softmax scaling", set_(Indexer, softmax_scaling=None)), ("final soft-cap", PLAIN_LOGITS),
        ("kv sharing source", (set_(mistral_large4.SharingDecoderLayer, layers=(2,), keeps_kv=True),
                               set_(mistral_large4.SharingDecoderLayer, layers=(3,), kv_source=2))),
        ("sparse top-k", DENSE_TOP_K), ("softmax scores", SIGMOID_SCORES), ("group-limited routing", NO_GROUP_LIMIT)],
    "mistral_large4_derived": [("yarn softmax scale", MLA_PLAIN_SCALE), ("final soft-cap", PLAIN_LOGITS),
                               ("sparse top-k", DENSE_TOP_K)],
    # The Mamba2 operator's own features (the D skip, the grouped gated norm, the convolution's state across calls)
    # are tested in tests/test_kernels_mamba2_ssd.py; removing a latent MoE's projections or per-layer head counts
    # changes the parameters' shapes, which the converter refuses.
    "nemotron_h": [("relu2 mlp", config(mlp_hidden_act="relu")),
                   ("group-limited routing", config(n_group=1, topk_group=1))],
    "granitemoehybrid": [("muP multipliers", config(embedding_multiplier=1.0, residual_multiplier=1.0,
                                                    logits_scaling=1.0)),
                         ("attention multiplier", config(attention_multiplier=0.25))],
    # Bamba's attention layers hold other parameters than its Mamba2 layers: misplacing them is a conversion error.
    "bamba": [("half rotary", config(rope_parameters=rope(rope_theta=10000.0, partial_rotary_factor=1.0))),
              ("time step limit", config(time_step_limit=[0.0, float("inf")]))],
    "falcon_h1": [("Mamba2 muP multipliers", config(ssm_in_multiplier=1.0, ssm_out_multiplier=1.0,
                                                    ssm_multipliers=None)),
                  ("attention muP multipliers", config(attention_in_multiplier=1.0, key_multiplier=1.0,
                                                       attention_out_multiplier=1.0)),
                  ("MLP muP multipliers", config(mlp_multipliers=None)),
                  ("embedding and head multipliers", config(embedding_multiplier=1.0, lm_head_multiplier=1.0)),
                  ("gated norm before the gate", config(mamba_norm_before_gate=False))],
    "mimo_v2_flash": [("value scale", config(attention_value_scale=1.0)), ("sinks", set_(Attention, sinks=None)),
                      ("rope theta per kind", rope_update("sliding_attention", rope_theta=50000.0)),
                      ("partial rotary per kind", config(rope_parameters=dict(
                          full_attention=rope(rope_theta=50000.0, partial_rotary_factor=1.0),
                          sliding_attention=rope(rope_theta=100.0, partial_rotary_factor=1.0))))],
    "step3p7": [("clamps after the activation", config(swiglu_limits=None, swiglu_limits_shared=None)),
                ("query_pre_attn_scalar", config(query_pre_attn_scalar=None)),
                ("rope per kind", config(rope_parameters=dict(
                    full_attention=rope(rope_theta=10000.0, partial_rotary_factor=0.5),
                    sliding_attention=rope(rope_theta=10000.0, partial_rotary_factor=0.5)))),
                ("per-head sigmoid gate", NO_GATE)],
    # The plain hyper-connection and the hyper head against transformers' own modules: tests/test_hy_v4_ops.py.
    "hy_v4": [("sparse top-k", DENSE_TOP_K), ("attention sinks", set_(SparseMLAttention, sinks=None)),
              ("per-head sigmoid output gate", set_(SparseMLAttention, gate_proj=None)),
              ("indexer rope on the heads' tail", set_(Indexer, rope_last=False)),
              ("indexer rope interleaved", set_(Indexer, rope_interleave=False)),
              ("interleaved rope", MLA_HALF_SPLIT), ("yarn softmax scale", MLA_PLAIN_SCALE),
              ("top-k of the latest full layer", (
                  set_(hyper.HyperDecoderLayer, layers=(3,), hands_on_received_topk=True),
                  patch(hyper.HyperDecoderLayer, "__call__", _hyper_hands_on_received))),
              ("streams kept apart (plain hyper-connection)", STREAMS_MIXED),
              ("post scaled by hc_magnitude", config(hc_magnitude=2.0)), ("hyper head", NO_HYPER_HEAD),
              ("clamped SwiGLU of routed experts", config(swiglu_limit=100.0)),
              ("routed scaling", NO_ROUTED_SCALE), ("shared experts", NO_SHARED)],
    "hy_v4_bias_tied": [("top-k weights not renormalized", FLIP_RENORM),
                        ("rope_theta", rope_update(rope_theta=10000.0)), ("two shared experts", NO_SHARED)],
    # Its operators' own features (the compressors' overlapping windows, sinks) are broken in
    # tests/test_deepseek_v4_ops.py against transformers' modules.
    "deepseek_v4": [("hash routing", edit(HashRouter, _one_expert_set)),
                    ("indexer's choice of entries", config(index_topk=64)),
                    ("Sinkhorn projection of the residual mixing", config(hc_sinkhorn_iters=1))],
    "glm5_next": [("forget gate lower bound", set_(KimiDeltaAttention, lower_bound=None)),
                  ("short convolution", NO_CONV),
                  ("pooled block selection (top-k of the blocks)", set_(PooledSparseMLAttention, topk_blocks=1024)),
                  ("learned pooling of the block keys", edit(PooledIndexer, _mean_pooling)),
                  ("shared layer's blocks from the layer before", SHARED_BLOCKS_IGNORED),
                  ("Sinkhorn projection of the residual mixing", config(hc_sinkhorn_iters=1)),
                  ("mean of the streams at the head", FIRST_STREAM_HEAD),
                  ("clamped SwiGLU", config(swiglu_limit=100.0)), ("group-limited routing", NO_GROUP_LIMIT),
                  ("routing score bias", NO_SCORE_BIAS), ("routed scaling", NO_ROUTED_SCALE),
                  ("shared experts", NO_SHARED)],
    "cohere": [("interleaved rope", HALF_SPLIT_ROPE), ("logit scale", config(logit_scale=1.0)),
               ("per-head layer norms on q and k", NO_QK_NORM), ("parallel block", SEQUENTIAL_BLOCK),
               ("layer norm's centering", UNCENTERED_NORM)],
    "cohere2": [("interleaved rope", HALF_SPLIT_ROPE), ("logit scale", config(logit_scale=1.0)),
                ("nope full-attention layer", rope_on(2)), ("sliding window", NO_WINDOW),
                ("parallel block", SEQUENTIAL_BLOCK), ("layer norm's centering", UNCENTERED_NORM)],
    "olmoe": [("q/k norms over all heads", NO_QK_NORM), ("clip_qkv", set_(Attention, clip_qkv=None)),
              ("top-k not renormalized", FLIP_RENORM)],
    "starcoder2": [("sliding window", NO_WINDOW), ("layer norm's centering", UNCENTERED_NORM)],
}


# --- vision-language families (families.MULTIMODAL; tests/test_multimodal.py) ---------------------------------------
# What images bring to the language model. The towers and projectors (LLaVA's feature layers and dropped class token,
# Gemma 3's pooling, Qwen-VL's patch merger) are checked by the image-feature parity test, in which a wrong layer or
# token moves the features by their own size: LLaVA's two entries have nothing on the language side beyond their
# text families (tests/families.py). Compared on the case with two images (`VL_CASE`).

VL_CASE = 1


def _block_sections(lm, root) -> None:
    """Multimodal RoPE's frequencies taken per axis in blocks (Qwen2-VL's layout) instead of in turn."""
    old = lm.rope
    new = dataclasses.replace(old, interleaved=False)
    lm.rope, lm.ropes = new, tuple(new if r is old else r for r in lm.ropes)
    for _, a in nnx.iter_modules(lm):
        if isinstance(a, Attention) and a.rope is old:
            a.rope = new


MROPE_BLOCKS = edit(base.CausalLM, _block_sections)
# Image tokens at their 1-D positions, as text: the 3-D positions unused.
TEXT_POSITIONS = inputs(lambda arrays: dict(arrays, rope_positions=np.broadcast_to(
    np.arange(arrays["rope_positions"].shape[1], dtype=np.int32)[None, :, None], arrays["rope_positions"].shape)))

VL_MUTATIONS: dict[str, list[tuple[str, Any]]] = {
    "llava": [],
    "llava_siglip_qwen2": [],
    "gemma3": [("image tokens attend both ways", patch(
        gemma3.Model, "_image_caches", lambda spans: lambda self, tokens, positions, caches, image_mask: caches))],
    "qwen3_vl": [("multimodal rope positions", TEXT_POSITIONS), ("interleaved mrope sections", MROPE_BLOCKS),
                 ("deepstack", inputs(lambda arrays: dict(arrays, deepstack=arrays["deepstack"] * 0)))],
    "qwen3_5": [("multimodal rope positions", TEXT_POSITIONS), ("interleaved mrope sections", MROPE_BLOCKS)],
    "qwen3_vl_moe": [("multimodal rope positions", TEXT_POSITIONS), ("interleaved mrope sections", MROPE_BLOCKS),
                     ("deepstack", inputs(lambda arrays: dict(arrays, deepstack=arrays["deepstack"] * 0)))],
    # Their towers' features (MoonViT's and Pixtral's grids, Gemma 4's pooling and its image tokens attending both
    # ways, SigLIP2's resized position table) are broken one by one in tests/test_multimodal.py's tower tests; their
    # language models take images as plain embeddings at 1-D positions.
    "kimi_k25": [],
    "mistral3": [],
    "mistral3_ministral": [],
    "gemma4": [],
    "lfm2_vl": [],
}
