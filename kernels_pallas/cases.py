"""Test cases for every op, built from model configs: what `selfcheck`, the startup self-test and the tests run.

A model's `config.json` (Hugging Face keys) fixes the shapes the kernels will see: head counts and head dim,
GQA ratio, sliding window, soft-cap, sinks, multi-head latent attention, hidden size, experts and their width.
`cases_from_config` turns one into `Case`s; sequence lengths and batch sizes come from the scale:
- 'full': serving-sized (prefill of 2048 tokens, 32 decode rows over 4096 cached tokens, 1024 MoE tokens);
- 'startup': the model's real dims with short sequences, cheap enough to run at every load;
- 'tiny': the family's features (GQA, window, soft-cap, sinks, head dim) with few heads, rows and experts and
  a small hidden size, for the CPU interpreter in CI.
`FAMILIES` holds the config excerpts of the supported families' flagship shapes.

Inputs are random normal (never zeros: zeros hide unwritten outputs and wrong indexing), drawn fresh per run
unless a seed is given, and every query sees at least one key, so every output element is defined and compared.
`TOLERANCE` is the largest accepted max|out - ref| / max|ref| per dtype: bf16 rounds to 2^-9 relative per
element and kernels round P or partial sums differently from the reference; float32 on GPUs may go through
TF32 matrix units (about 1e-3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 2e-3}

# Config excerpts (HF keys, the values of the released checkpoints) of the families the selfcheck covers.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama-3-8b": {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5},
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "hidden_size": 2048, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                      "moe_intermediate_size": 768, "rms_norm_eps": 1e-6},
    "deepseek-v3": {"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128,
                    "num_key_value_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                    "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8,
                    "moe_intermediate_size": 2048, "rms_norm_eps": 1e-6},
    "gemma-2-9b": {"model_type": "gemma2", "hidden_size": 3584, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 256, "sliding_window": 4096,
                   "attn_logit_softcapping": 50.0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6},
    "gpt-oss-20b": {"model_type": "gpt_oss", "hidden_size": 2880, "num_attention_heads": 64,
                    "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128, "num_local_experts": 32,
                    "num_experts_per_tok": 4, "intermediate_size": 2880, "rms_norm_eps": 1e-5},
}
# What `selfcheck` runs by default: the three layer-shape sources.
DEFAULT_FAMILIES = ("llama-3-8b", "qwen3-30b-a3b", "deepseek-v3")
SCALES = ("full", "startup", "tiny")


@dataclass(frozen=True)
class Case:
    """One call of one op: `build(seed)` makes (args, kwargs) with random arrays.

    Attributes:
        op: the op's registry name.  name: family and what the case exercises.  dtype: of the inputs.
        spec: the static description the inputs are built from (shapes and flags).
    """

    op: str
    name: str
    dtype: str
    spec: dict[str, Any] = field(hash=False)

    def build(self, seed: int, *, abstract: bool = False) -> tuple[tuple, dict]:
        """(args, kwargs) for the op, random from `seed`. `abstract`: the large float arrays as
        `jax.ShapeDtypeStruct`s (for lowering serving-sized cases without allocating them); small integer
        inputs stay concrete."""
        return _BUILDERS[self.op](_Random(seed, abstract), jnp.dtype(self.dtype), **self.spec)

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.dtype]

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.spec.items() if v is not None)


# --- config -> model dims --------------------------------------------------------------------------------

def attention_dims(hf: dict[str, Any]) -> dict[str, Any]:
    """N, K, H (and the value head dim, scale, window, soft-cap, sinks) of a config's attention."""
    N = int(hf["num_attention_heads"])
    if "kv_lora_rank" in hf:  # MLA in the absorbed form: one kv head over [latent ; rope key], value = key
        H = int(hf["kv_lora_rank"]) + int(hf["qk_rope_head_dim"])
        scale = (int(hf["qk_nope_head_dim"]) + int(hf["qk_rope_head_dim"])) ** -0.5
        return dict(N=N, K=1, H=H, scale=scale, window=None, softcap=None, sinks=False)
    K = int(hf.get("num_key_value_heads") or N)
    H = int(hf.get("head_dim") or hf["hidden_size"] // N)
    scalar = hf.get("query_pre_attn_scalar")
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    return dict(N=N, K=K, H=H, scale=None if scalar is None else float(scalar) ** -0.5,
                window=None if window is None else int(window), softcap=hf.get("attn_logit_softcapping"),
                sinks=hf.get("model_type") == "gpt_oss")


def moe_dims(hf: dict[str, Any]) -> dict[str, int] | None:
    """Experts G, chosen per token k, hidden D and expert width F; None for dense models."""
    G = hf.get("num_experts") or hf.get("n_routed_experts") or hf.get("num_local_experts")
    if not G:
        return None
    k = hf.get("num_experts_per_tok") or hf.get("experts_per_token") or 1
    F = hf.get("moe_intermediate_size") or hf["intermediate_size"]
    return dict(G=int(G), k=int(k), D=int(hf["hidden_size"]), F=int(F))


def cases_from_config(hf: dict[str, Any], dtype: str = "bfloat16", *, scale: str = "full", name: str = "",
                      tp: int = 1, ops: tuple[str, ...] | None = None) -> list[Case]:
    """The cases one model's shapes call for.

    Args:
        hf: a parsed config.json (or a `FAMILIES` entry).
        dtype: input dtype name.
        scale: 'full', 'startup' or 'tiny' (see the module docstring).
        name: prefix of the case names (the family).
        tp: tensor-parallel size; heads are split across it as the model's shards see them.
        ops: restrict to these ops.
    Returns:
        Cases for attention, paged_attention, rms_norm and, for MoE models, moe.
    """
    if scale not in SCALES:
        raise ValueError(f"scale {scale!r} is not one of {SCALES}")
    dtype = jnp.dtype(dtype).name
    a = attention_dims(hf)
    N, K, H = a["N"], a["K"], a["H"]
    if tp > 1 and N % tp == 0 and K % tp == 0:
        N, K = N // tp, K // tp
    elif tp > 1 and N % tp == 0 and K == 1:
        N //= tp
    D = int(hf["hidden_size"])
    eps = float(hf.get("rms_norm_eps") or hf.get("layer_norm_epsilon") or 1e-6)
    offset = 1.0 if str(hf.get("model_type", "")).startswith("gemma") else 0.0
    window = a["window"]
    if scale == "tiny":
        G = N // K
        K, N = 1, min(G, 4)
        D = 256
        window = None if window is None else min(window, 48)
    prefix = f"{name} " if name else ""
    attn = dict(N=N, K=K, H=H, scale=a["scale"], softcap=a["softcap"], sinks=a["sinks"])
    out: list[Case] = []
    if scale == "full":
        prefill = [("prefill", dict(B=1, T=2048, S=2048, window=None, offsets=False))]
        if window:
            prefill.append(("prefill sliding", dict(B=1, T=2048, S=2048, window=window, offsets=False)))
        prefill.append(("chunked prefill", dict(B=4, T=256, S=1024, window=window, offsets=True)))
        paged = dict(B=32, T=1, page=16, max_len=4096, window=window)
        tokens_prefill, tokens_decode, rows = 1024, 8, 2048
    elif scale == "startup":
        prefill = [("prefill", dict(B=1, T=256, S=256, window=window, offsets=False)),
                   ("chunked prefill", dict(B=2, T=128, S=384, window=window, offsets=True))]
        paged = dict(B=4, T=1, page=16, max_len=512, window=window)
        tokens_prefill, tokens_decode, rows = 128, 8, 64
    else:
        prefill = [("prefill", dict(B=1, T=128, S=128, window=window, offsets=False)),
                   ("chunked prefill", dict(B=2, T=64, S=192, window=window, offsets=True))]
        paged = dict(B=2, T=2, page=16, max_len=200, window=window)
        tokens_prefill, tokens_decode, rows = 24, 4, 12
    for label, spec in prefill:
        out.append(Case("attention", f"{prefix}{label}", dtype, {**attn, **spec}))
    out.append(Case("paged_attention", f"{prefix}decode", dtype, {**attn, **paged}))
    out.append(Case("rms_norm", f"{prefix}residual", dtype, dict(M=rows, D=D, eps=eps, offset=offset)))
    m = moe_dims(hf)
    if m is not None:
        G, k, F = m["G"], m["k"], m["F"]
        Dm = m["D"]
        if scale == "tiny":
            G, k, Dm, F = min(G, 6), min(k, 2), 128, 128
        for label, tokens in (("prefill", tokens_prefill), ("decode", tokens_decode)):
            out.append(Case("moe", f"{prefix}gate/up {label}", dtype, dict(M=tokens * k, G=G, D=Dm, F=F, k=k)))
        out.append(Case("moe", f"{prefix}down prefill", dtype, dict(M=tokens_prefill * k, G=G, D=F, F=Dm, k=k)))
    return [c for c in out if ops is None or c.op in ops]


def family_cases(families=DEFAULT_FAMILIES, dtype: str = "bfloat16", *, scale: str = "full",
                 ops: tuple[str, ...] | None = None) -> list[Case]:
    """`cases_from_config` over `FAMILIES` entries."""
    return [c for f in families for c in cases_from_config(FAMILIES[f], dtype, scale=scale, name=f, ops=ops)]


# --- input builders (one per op) -------------------------------------------------------------------------

class _Random:
    """Inputs from one seed: NumPy for small arrays (nothing to compile, which dominates on a CPU), jax.random
    on the device for large ones (serving-sized weights would take minutes and gigabytes on the host)."""

    LARGE = 1 << 22

    def __init__(self, seed: int, abstract: bool):
        self.rng, self.seed, self.abstract, self.count = np.random.default_rng(seed), seed, abstract, 0

    def normal(self, shape, dtype, scale: float = 1.0):
        self.count += 1
        if self.abstract:
            return jax.ShapeDtypeStruct(tuple(shape), dtype)
        if math.prod(shape) >= self.LARGE:
            key = jax.random.fold_in(jax.random.key(self.seed), self.count)
            return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)
        return jnp.asarray((self.rng.standard_normal(shape, np.float32) * scale).astype(dtype))

    def integers(self, low: int, high: int, size) -> np.ndarray:
        return self.rng.integers(low, high, size).astype(np.int32)



def _attention(rnd: _Random, dtype, *, B, T, S, N, K, H, scale, window, softcap, sinks, offsets):
    q = rnd.normal((B, T, N, H), dtype)
    k = rnd.normal((B, S, K, H), dtype)
    v = rnd.normal((B, S, K, H), dtype)
    if offsets:  # chunked prefill / ragged batch: row b holds kv_len_b keys, its T queries are the last ones
        lengths = rnd.integers(T, S + 1, (B,))
        lengths[0] = S
    else:
        lengths = np.full((B,), S, np.int32)
    positions = lengths[:, None] - T + np.arange(T, dtype=np.int32)[None, :]
    kwargs = dict(q_positions=jnp.asarray(positions), kv_lengths=jnp.asarray(lengths), causal=True,
                  sliding_window=window, logit_softcap=softcap, scale=scale,
                  sinks=rnd.normal((N,), jnp.float32) if sinks else None)
    return (q, k, v), kwargs


def _paged_attention(rnd: _Random, dtype, *, B, T, N, K, H, page, max_len, scale, window, softcap, sinks):
    width = -(-max_len // page)
    pages = B * width + 1  # page 0 stays unused, as the engine's trash page
    lengths = rnd.integers(T, max_len + 1, (B,))
    lengths[0] = max_len
    tables = rnd.rng.permutation(np.arange(1, pages, dtype=np.int32))[: B * width].reshape(B, width)
    for b in range(B):  # entries past a row's pages point at the trash page, as the engine leaves them
        tables[b, -(-lengths[b] // page):] = 0
    positions = lengths[:, None] - T + np.arange(T, dtype=np.int32)[None, :]
    args = (rnd.normal((B, T, N, H), dtype), rnd.normal((pages, page, K, H), dtype),
            rnd.normal((pages, page, K, H), dtype), jnp.asarray(tables), jnp.asarray(lengths),
            jnp.asarray(positions))
    kwargs = dict(sliding_window=window, logit_softcap=softcap, scale=scale,
                  sinks=rnd.normal((N,), jnp.float32) if sinks else None)
    return args, kwargs


def _moe(rnd: _Random, dtype, *, M, G, D, F, k):
    # Rows routed like a softmax router's top-k: each token picks k distinct experts; group sizes follow.
    tokens = max(M // k, 1)
    logits = rnd.rng.standard_normal((tokens, G))
    chosen = np.argsort(-logits, axis=1)[:, :min(k, G)].reshape(-1)
    sizes = np.bincount(chosen, minlength=G)[:G].astype(np.int32)
    sizes[-1] += M - int(sizes.sum())  # M may exceed tokens * k by rounding; those rows go to the last expert
    lhs = rnd.normal((M, D), dtype)
    rhs = rnd.normal((G, D, F), dtype, 1 / math.sqrt(D))  # unit-scale outputs
    return (lhs, rhs, jnp.asarray(sizes)), {}


def _rms_norm(rnd: _Random, dtype, *, M, D, eps, offset):
    x = rnd.normal((M, D), dtype)
    residual = rnd.normal((M, D), dtype)
    weight = jax.ShapeDtypeStruct((D,), dtype) if rnd.abstract else jnp.asarray(
        (1.0 - offset + 0.1 * rnd.rng.standard_normal(D)).astype(dtype))
    return (x, weight), dict(eps=eps, offset=offset, residual=residual)


_BUILDERS = {"attention": _attention, "paged_attention": _paged_attention, "moe": _moe, "rms_norm": _rms_norm}


def upcast(tree: Any) -> Any:
    """The tree with its bfloat16 arrays in float32: the inputs of the float32 reference answer."""
    return jax.tree.map(lambda x: x.astype(jnp.float32) if isinstance(x, jax.Array) and x.dtype == jnp.bfloat16
                        else x, tree)


def max_relative_error(out: Any, ref: Any) -> float:
    """max|out - ref| / max|ref| over every array of the outputs (float64; NaN or a shape mismatch -> inf)."""
    worst = 0.0
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        o, r = np.asarray(o, np.float64), np.asarray(r, np.float64)
        if o.shape != r.shape or not np.all(np.isfinite(o)):
            return math.inf
        worst = max(worst, float(np.abs(o - r).max() / max(np.abs(r).max(), 1e-30)))
    return worst
