"""Mixture-of-experts blocks: routers, stacked expert weights run through the `kernels_pallas` grouped matmul
(`jax.lax.ragged_dot`'s contract), and optional shared experts. Work is proportional to tokens x top_k, not
tokens x experts. Shapes: M tokens (B*T flattened), D model, E experts, F expert hidden size, k experts per token.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.layers.linear import Linear, param
from day0jax.layers.mlp import activation
from day0jax.layers.quantized import QuantizedExperts
from kernels_pallas.calls import OpCall
from kernels_pallas.moe import api as moe_op

ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_grouped", "topk_sigmoid", "softmax_grouped", "scored_topk")
# DeepSeek-V4's `scoring_func`s: an expert's score from its router logit.
SCORES = {"sqrtsoftplus": lambda x: jnp.sqrt(jax.nn.softplus(x)), "sigmoid": jax.nn.sigmoid,
          "softmax": lambda x: jax.nn.softmax(x, axis=-1)}


class Router(nnx.Module):
    """Chooses k experts per token and their weights, from float32 logits (as DeepSeek's router).

    Args:
        routing: "softmax_topk": softmax over all experts, top k (by score + `e_score_correction_bias` with
            `score_bias`, weighted by the plain scores), renormalized when `norm_topk_prob` (Mixtral, Qwen MoE; ERNIE
            4.5 MoE with the bias); "topk_softmax": softmax over the top k logits (gpt-oss); "sigmoid_grouped":
            experts chosen by sigmoid score + `e_score_correction_bias` within the `topk_group` best of `n_group`
            groups (a group's score: the sum of its top two), weighted by the plain scores, renormalized when
            `norm_topk_prob`, times `routed_scaling_factor` (DeepSeek-V3); "topk_sigmoid": the top k logits, each
            through a sigmoid, not renormalized (Llama 4); "softmax_grouped": as "sigmoid_grouped" with softmax
            scores and no score bias (Mistral 4, DeepSeek-V2).
        group_top: the grouped routings score a group by the sum of its `group_top` best scores (DeepSeek-V3: the top
            two; DeepSeek-V2's "group_limited_greedy": 1, the group's best).
        use_bias: a bias on the router logits (gpt-oss).
        norm_eps: added to the sum of the grouped routings' weights when they are renormalized (LFM2-MoE: 1e-6).
        logit_softcap: if set, the logits go through cap * tanh(logits / cap) before any scoring (Laguna).
        score_bias: "softmax_topk" chooses by score + `e_score_correction_bias` ("sigmoid_grouped" always does).
        norm_min: "softmax_topk" renormalizes by max(sum, norm_min) where set (ERNIE 4.5 MoE's `moe_norm_min`).
        score_fn: "scored_topk"'s scores (`SCORES`).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, routing: str, norm_topk_prob: bool = False,
                 use_bias: bool = False, n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
                 norm_eps: float = 1e-20, logit_softcap: float | None = None, score_bias: bool = False,
                 norm_min: float | None = None, score_fn: str = "sigmoid", group_top: int = 2, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        assert routing in ROUTINGS and score_fn in SCORES, (routing, score_fn)
        E = num_experts
        # HF's [experts, hidden] layout, like every Linear kernel.
        self.kernel = param(rngs, (E, hidden_size), (None, "embed"), dtype, 1 / math.sqrt(hidden_size), in_ndim=1)
        self.bias = param(rngs, (E,), (None,), dtype, 0.0) if use_bias else None
        self.e_score_correction_bias = (param(rngs, (E,), (None,), jnp.float32, 0.0)
                                        if routing in ("sigmoid_grouped", "scored_topk") or score_bias else None)
        self.routing, self.top_k, self.norm_topk_prob = routing, top_k, norm_topk_prob
        self.n_group, self.topk_group, self.scale = n_group, topk_group, routed_scaling_factor
        self.norm_eps = norm_eps
        self.logit_softcap = logit_softcap
        self.norm_min = norm_min
        self.score_fn = score_fn
        self.group_top = group_top

    def logits(self, x: jax.Array) -> jax.Array:
        """x [M, D] -> float32 router logits [M, E]."""
        return jnp.einsum("md,ed->me", x.astype(jnp.float32), self.kernel[...].astype(jnp.float32))

    def weigh(self, scores: jax.Array, experts: jax.Array) -> jax.Array:
        """The chosen experts' scores [M, k], renormalized when `norm_topk_prob`, times `routed_scaling_factor`."""
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + self.norm_eps)
        return weights * self.scale

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [M, D] -> (weights [M, k] float32, expert ids [M, k] int32)."""
        logits = self.logits(x)
        if self.bias is not None:
            logits = logits + self.bias[...].astype(jnp.float32)
        if self.logit_softcap:
            logits = jnp.tanh(logits / self.logit_softcap) * self.logit_softcap
        k = self.top_k
        if self.routing == "softmax_topk":
            scores = jax.nn.softmax(logits, axis=-1)
            if self.e_score_correction_bias is None:
                weights, experts = jax.lax.top_k(scores, k)
            else:  # the bias only balances the choice; the weights stay the plain scores
                _, experts = jax.lax.top_k(scores + self.e_score_correction_bias[...], k)
                weights = jnp.take_along_axis(scores, experts, axis=-1)
            if self.norm_topk_prob:
                total = weights.sum(-1, keepdims=True)
                weights = weights / (total if self.norm_min is None else jnp.maximum(total, self.norm_min))
        elif self.routing == "topk_softmax":
            top, experts = jax.lax.top_k(logits, k)
            weights = jax.nn.softmax(top, axis=-1)
        elif self.routing == "topk_sigmoid":
            top, experts = jax.lax.top_k(logits, k)
            weights = jax.nn.sigmoid(top)
        elif self.routing == "scored_topk":
            scores = SCORES[self.score_fn](logits)
            _, experts = jax.lax.top_k(scores + self.e_score_correction_bias[...], k)
            weights = self.weigh(scores, experts)
        else:
            scores = jax.nn.sigmoid(logits) if self.routing == "sigmoid_grouped" else jax.nn.softmax(logits, axis=-1)
            choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias[...]
            M, E = choice.shape
            groups = choice.reshape(M, self.n_group, E // self.n_group)
            group_score = jax.lax.top_k(groups, self.group_top)[0].sum(-1)  # [M, n_group]
            _, best = jax.lax.top_k(group_score, self.topk_group)
            keep = jnp.zeros_like(group_score, dtype=bool).at[jnp.arange(M)[:, None], best].set(True)
            choice = jnp.where(jnp.repeat(keep, E // self.n_group, axis=1), choice, -jnp.inf)
            _, experts = jax.lax.top_k(choice, k)
            weights = self.weigh(scores, experts)
        return weights, experts.astype(jnp.int32)


class HashRouter(Router):
    """Hash routing (DeepSeek-V4's first layers): a fixed table `tid2eid` [V, k] names each token id's k experts;
    the learned router only weighs them (`score_fn` of its logits, renormalized when `norm_topk_prob`, times
    `routed_scaling_factor`). HF's `gate.weight` and `gate.tid2eid` (an integer table, never split)."""

    takes_tokens = True

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, vocab_size: int, *, score_fn: str,
                 norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        super().__init__(hidden_size, num_experts, top_k, routing="softmax_topk", norm_topk_prob=norm_topk_prob,
                         routed_scaling_factor=routed_scaling_factor, score_fn=score_fn, dtype=dtype, rngs=rngs)
        self.routing = "hash"
        init = nnx.with_partitioning(nnx.initializers.zeros, (None, None))
        self.tid2eid = nnx.Param(init(rngs.params(), (vocab_size, top_k), jnp.int32))

    def __call__(self, x: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [M, D], tokens [M] int -> (weights [M, k] float32, expert ids [M, k] int32)."""
        experts = jnp.take(self.tid2eid[...], tokens, axis=0, mode="clip").astype(jnp.int32)
        return self.weigh(SCORES[self.score_fn](self.logits(x)), experts), experts


def swiglu(act: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """act(gate) * up, the gated unit of Llama-style MLPs."""
    fn = activation(act)
    return lambda gate, up: fn(gate) * up


def clamped_swiglu(alpha: float, limit: float) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """gpt-oss: (up + 1) * gate * sigmoid(alpha * gate), with gate <= limit and |up| <= limit."""
    def glu(gate, up):
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))
    return glu


def limited_swiglu(act: str, limit: float) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """Step-3.7: min(act(gate), limit) * clip(up, -limit, limit), the clamps after the activation."""
    fn = activation(act)
    return lambda gate, up: jnp.minimum(fn(gate), limit) * jnp.clip(up, -limit, limit)


def clipped_swiglu(act: str, limit: float) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """DeepSeek-V4, HY-V4: act(min(gate, limit)) * clip(up, -limit, limit), the clamps before the activation."""
    fn = activation(act)
    return lambda gate, up: fn(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def ungated(act: str) -> Callable[[jax.Array], jax.Array]:
    """act(up), the unit of experts without gate_proj (NemotronH's ReLU squared)."""
    return activation(act)


class Experts(nnx.Module):
    """E experts' weights stacked: gate_proj, up_proj [E, D, F], down_proj [E, F, D].

    Args:
        glu: (gate [.., F], up [.., F]) -> [.., F], e.g. `swiglu("silu")` or `clamped_swiglu(...)`; with
            `gated=False`, up [.., F] -> [.., F] (`ungated(act)`), and there is no gate_proj.
        use_bias: per-expert biases gate_proj_bias, up_proj_bias [E, F] and down_proj_bias [E, D] (gpt-oss).
        scale_inputs: each routing weight multiplies the token going into its expert, not what comes out (Llama 4;
            the experts are not linear, so the two differ).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 glu: Callable[..., jax.Array], *, use_bias: bool = False, scale_inputs: bool = False,
                 gated: bool = True, dtype=jnp.float32, rngs: nnx.Rngs):
        E, D, F = num_experts, hidden_size, intermediate_size
        self.gate_proj = (param(rngs, (E, D, F), ("experts", "embed", "expert_mlp"), dtype, 1 / math.sqrt(D))
                          if gated else None)
        self.up_proj = param(rngs, (E, D, F), ("experts", "embed", "expert_mlp"), dtype, 1 / math.sqrt(D))
        self.down_proj = param(rngs, (E, F, D), ("experts", "expert_mlp", "embed"), dtype, 1 / math.sqrt(F))
        assert gated or not use_bias
        self.gate_proj_bias = param(rngs, (E, F), ("experts", "expert_mlp"), dtype, 0.0) if use_bias else None
        self.up_proj_bias = param(rngs, (E, F), ("experts", "expert_mlp"), dtype, 0.0) if use_bias else None
        self.down_proj_bias = param(rngs, (E, D), ("experts", "embed"), dtype, 0.0) if use_bias else None
        self.num_experts, self.glu = E, glu
        self.scale_inputs = scale_inputs

    def __call__(self, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
        """x [M, D], weights and expert ids [M, k] -> sum over k of weight * expert(x) (with `scale_inputs`:
        expert(weight * x)), [M, D].

        Rows (token, choice) are sorted by expert, run through each expert's weights in one grouped matmul, then
        weighted and summed back per token: tokens never meet experts they were not routed to.
        """
        M, k = experts.shape
        flat = experts.reshape(-1)                   # [M*k], row r = (token r // k, its (r % k)-th choice)
        order = jnp.argsort(flat, stable=True)       # rows grouped by expert
        token = order // k
        sorted_expert = flat[order]
        group_sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        rows = x[token]                              # [M*k, D]
        row_weights = weights.reshape(-1)[order][:, None]
        if self.scale_inputs:
            rows = rows * row_weights.astype(rows.dtype)
        up = moe_op.grouped_matmul(rows, self.weight("up_proj"), group_sizes)
        if self.gate_proj is None:
            hidden = self.glu(up)
        else:
            gate = moe_op.grouped_matmul(rows, self.weight("gate_proj"), group_sizes)
            if self.gate_proj_bias is not None:
                gate = gate + self.gate_proj_bias[...][sorted_expert]
                up = up + self.up_proj_bias[...][sorted_expert]
            hidden = self.glu(gate, up)
        out = moe_op.grouped_matmul(hidden, self.weight("down_proj"), group_sizes)  # [M*k, D]
        if self.down_proj_bias is not None:
            out = out + self.down_proj_bias[...][sorted_expert]
        if not self.scale_inputs:
            out = out * row_weights.astype(out.dtype)
        return jnp.zeros_like(x).at[token].add(out)

    def weight(self, name: str):
        """The stacked weight `name` (gate_proj, up_proj, down_proj) as the grouped matmul takes it: a subclass
        adds to it (LoRA on the experts, `layers.lora.LoRAExperts`)."""
        return _weight(getattr(self, name))


def _weight(w):
    """A stacked experts' weight as the grouped matmul takes it: float [E, in, out], or quantized codes and scales."""
    return w.weight() if isinstance(w, QuantizedExperts) else w[...]


class MoE(nnx.Module):
    """Router + experts (+ shared experts, optionally gated), under the attribute names the family's HF code uses.

    Args:
        router / experts: the two parts; `router_name` is HF's name for the router ("gate" or "router").
        shared: an MLP every token also goes through, named `shared_name` (Qwen2-MoE's `shared_expert`,
            DeepSeek's `shared_experts`), or None.
        shared_gate: Linear D -> 1; the shared output is scaled by sigmoid(shared_gate(x)) (Qwen2-MoE).
        latent: (fc1_latent_proj D -> L, fc2_latent_proj L -> D): the routed experts work in an L-dim latent space,
            the tokens projected into it after routing and their sum back out (NemotronH's `moe_latent_size`); the
            router and the shared experts see x itself.
    """

    def __init__(self, router: Router, experts: Experts, *, router_name: str = "gate", shared: nnx.Module | None = None,
                 shared_name: str = "shared_expert", shared_gate: Linear | None = None,
                 latent: tuple[Linear, Linear] | None = None):
        setattr(self, router_name, router)
        self.experts = experts
        self.router_name, self.shared_name = router_name, shared_name
        if shared is not None:
            setattr(self, shared_name, shared)
        if shared_gate is not None:
            self.shared_expert_gate = shared_gate
        self.has_shared, self.has_shared_gate = shared is not None, shared_gate is not None
        self.fc1_latent_proj, self.fc2_latent_proj = latent if latent is not None else (None, None)

    @property
    def takes_tokens(self) -> bool:
        """Whether the router reads the token ids (hash routing): the block then needs them beside x."""
        return getattr(getattr(self, self.router_name), "takes_tokens", False)

    @jax.named_scope("mlp")
    def __call__(self, x: jax.Array, tokens: jax.Array | None = None) -> jax.Array:
        """x [B, T, D] (and the token ids [B, T] for hash routing) -> [B, T, D]."""
        flat = x.reshape(-1, x.shape[-1])
        router = getattr(self, self.router_name)
        if self.takes_tokens:
            weights, experts = router(flat, tokens.reshape(-1))
        else:
            weights, experts = router(flat)
        if self.fc1_latent_proj is None:
            out = self.experts(flat, weights, experts)
        else:
            out = self.fc2_latent_proj(self.experts(self.fc1_latent_proj(flat), weights, experts))
        if self.has_shared:
            shared = getattr(self, self.shared_name)(flat)
            if self.has_shared_gate:
                shared = jax.nn.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.reshape(x.shape)

    def op_calls(self) -> list[OpCall]:
        """The routed experts' grouped matmul, then the shared experts' own calls."""
        router = getattr(self, self.router_name)
        E, D, F = self.experts.up_proj.shape  # D: what the experts see (the latent size of a latent MoE)
        shared = self.shared_name + (" (gated)" if self.has_shared_gate else "") if self.has_shared else None
        weights = self.experts.up_proj
        extra = dict(quantized=weights.spec.describe()) if isinstance(weights, QuantizedExperts) else {}
        if self.experts.gate_proj is None:  # only where set: other families' calls (and flagships.json) unchanged
            extra["gated"] = False
        if self.fc1_latent_proj is not None:
            extra["latent_of"] = self.fc1_latent_proj.in_shape[0]
        routing = {"scored_topk": f"{router.score_fn}_topk", "hash": f"hash ({router.score_fn} weights)"}.get(
            router.routing, router.routing)
        calls = [OpCall.of("moe", E=E, k=router.top_k, D=D, F=F, routing=routing, shared=shared, **extra)]
        return calls + (getattr(self, self.shared_name).op_calls() if self.has_shared else [])
