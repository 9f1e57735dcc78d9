"""DeepSeek-V4: n residual streams mixed by manifold-constrained hyper-connections (`layers/hyper.py`), attention of
one shared key-value head over a sliding window plus compressed entries of the context, all of them (HCA) or the
top-k a lightning indexer picks (CSA) (`layers/compressed_attention.py`), then MoE layers routed by a token-id table
(hash layers) or by sqrt(softplus) scores, with SwiGLU clamped before the activation.
HF reference: transformers/models/deepseek_v4/modeling_deepseek_v4.py (and its conversion mapping, for the original
tensor names that checkpoints keep: `wq_a`, `attn_sink`, `ffn.experts.N.w1`...)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from flax import nnx

from day0jax.core.cache_layout import CompressedKV, KVLayer, StateLayer
from day0jax.core.errors import UnsupportedArchitecture
from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.compressed_attention import CompressedAttention, Compressor, Indexer
from day0jax.layers.hyper import HyperConnected, HyperDecoderLayer
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.moe import SCORES, Experts, HashRouter, MoE, Router, clipped_swiglu
from day0jax.layers.mtp import StreamLayer, StreamMTP
from day0jax.layers.rope import Rope, rope_parameters
from day0jax.models.base import CausalLM, HFConfig, per_expert_source
from day0jax.models.contract import Family

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LEGACY_KINDS = {0: SLIDING, 4: CSA, 128: HCA}  # the released config's `compress_ratios` per layer


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    ALIASES = {"num_local_experts": "n_routed_experts", "intermediate_size": "moe_intermediate_size"}
    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1024
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True  # declared by HF's config; its routers always renormalize
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    layer_types: list | None = None
    compress_rates: dict | None = None
    compress_rope_theta: float = 160000.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    mlp_layer_types: list | None = None
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    rope_scaling: dict | None = None  # the released config's name for the compressed branch's YaRN
    partial_rotary_factor: float | None = None
    attention_bias: bool = False  # declared by HF's config, never read by its attention
    mlp_bias: bool = False
    router_jitter_noise: float = 0.0  # training only
    # The released config's older keys, which HF folds into the ones above.
    compress_ratios: list | None = None
    compress_rate_csa: int | None = None
    compress_rate_hca: int | None = None
    num_hash_layers: int | None = None
    qk_rope_head_dim: int | None = None
    expert_dtype: str | None = None  # the checkpoint's storage of expert weights; the converter reads what is there
    model_type: str = "deepseek_v4"

    def __post_init__(self):
        self._refuse_if("num_key_value_heads", lambda k: k != 1, "is not implemented (one shared key-value head)")
        self._refuse_if("n_shared_experts", lambda n: n != 1,
                        "is not implemented: transformers builds one shared expert of moe_intermediate_size")
        self._refuse_if("scoring_func", lambda f: f not in SCORES, f"is not implemented (known: {', '.join(SCORES)})")
        self._refuse_if("o_groups", lambda g: g < 1 or self.num_attention_heads % g,
                        f"does not divide num_attention_heads={self.num_attention_heads}")
        self._refuse_if("hc_mult", lambda n: n < 1, "must be at least 1")
        self._refuse_if("sliding_window", lambda w: w < 1, "must be at least 1")
        self._activation()
        self._check_derived("rope", "compress_rope", "layer_kinds", "mlp_kinds", "rates")
        self._refuse_if("index_head_dim", lambda d: d < self.rotary_dim, f"is below the {self.rotary_dim} rotated dims")

    @property
    def head_size(self) -> int:
        return self.head_dim

    @property
    def rotary_dim(self) -> int:
        """P: the rotated tail of each head (and of the index keys), head_dim * partial_rotary_factor."""
        if self.partial_rotary_factor is not None:
            factor = self.partial_rotary_factor
        else:
            factor = (self.qk_rope_head_dim or 64) / (self.head_dim if self.qk_rope_head_dim else 512)
        return int(self.head_dim * factor)

    def _nested(self) -> dict | None:
        p = self.rope_parameters or {}
        return p if isinstance(p.get("main"), dict) and isinstance(p.get("compress"), dict) else None

    @cached_property
    def rope(self) -> dict[str, Any]:
        """The sliding layers' RoPE ("main"): plain, `rope_theta`, over the rotated tail."""
        main = (self._nested() or {}).get("main") or {"rope_type": "default", "rope_theta": self.rope_theta}
        return rope_parameters(dict(main, partial_rotary_factor=self.rotary_dim / self.head_dim), None,
                               self.rope_theta)

    @cached_property
    def compress_rope(self) -> dict[str, Any]:
        """The compressed layers' RoPE ("compress"): `compress_rope_theta`, with the config's YaRN, whose attention
        factor HF pins to 1 (the reference does not scale cos and sin)."""
        nested = self._nested()
        if nested is not None:
            params = dict(nested["compress"])
        else:
            params = {k: v for k, v in (self.rope_parameters or self.rope_scaling or {}).items()
                      if k not in ("main", "compress")}
            params["rope_theta"] = self.compress_rope_theta
        params["rope_type"] = params.pop("type", None) or params.get("rope_type") or "default"
        if params["rope_type"] == "yarn":
            params.setdefault("attention_factor", 1.0)
        params["partial_rotary_factor"] = self.rotary_dim / self.head_dim
        return rope_parameters(params, None, self.compress_rope_theta,
                               max_position_embeddings=self.max_position_embeddings)

    @cached_property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's attention: `layer_types`, else the older `compress_ratios`, else HF's default (two HCA
        layers, then CSA and HCA in turn)."""
        L = self.num_hidden_layers
        if self.layer_types is not None:
            kinds = list(self.layer_types)
        elif self.compress_ratios is not None:
            kinds = [LEGACY_KINDS.get(r, r) for r in self.compress_ratios]
        else:
            kinds = [HCA] * min(L, 2) + [CSA if i % 2 else HCA for i in range(max(L - 2, 0))]
        if len(kinds) < L:
            refuse("layer_types", kinds, f"has {len(kinds)} entries for num_hidden_layers={L}")
        for kind in kinds[:L]:
            if kind not in (SLIDING, CSA, HCA):
                refuse("layer_types", kind, f"is not implemented (known: {SLIDING}, {CSA}, {HCA})")
        return tuple(kinds[:L])

    @cached_property
    def mlp_kinds(self) -> tuple[str, ...]:
        """Each layer's MoE: "hash_moe" (routed by the token-id table) or "moe"; default: the first
        `num_hash_layers` (3) hashed."""
        L = self.num_hidden_layers
        if self.mlp_layer_types is not None:
            kinds = list(self.mlp_layer_types)
        else:
            n = 3 if self.num_hash_layers is None else self.num_hash_layers
            kinds = ["hash_moe"] * min(L, n) + ["moe"] * max(0, L - n)
        if len(kinds) < L:
            refuse("mlp_layer_types", kinds, f"has {len(kinds)} entries for num_hidden_layers={L}")
        for kind in kinds[:L]:
            if kind not in ("hash_moe", "moe"):
                refuse("mlp_layer_types", kind, "is not implemented (known: hash_moe, moe)")
        return tuple(kinds[:L])

    @cached_property
    def rates(self) -> dict[str, int]:
        """Positions per compressed entry of CSA and HCA layers (HF's defaults 4 and 128)."""
        rates = {CSA: 4, HCA: 128, **(self.compress_rates or {})}
        if self.compress_rate_csa is not None:
            rates[CSA] = self.compress_rate_csa
        if self.compress_rate_hca is not None:
            rates[HCA] = self.compress_rate_hca
        for kind, r in rates.items():
            if kind not in (CSA, HCA) or not isinstance(r, int) or r < 1:
                refuse("compress_rates", self.compress_rates, f"has {kind}={r!r}")
        return rates


class Model(HyperConnected, CausalLM):
    def make_ropes(self):
        c = self.config
        self.compress = Rope(c.compress_rope, c.head_dim, c.max_position_embeddings)
        return [self.rope, self.compress]

    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> HyperDecoderLayer:
        c = self.config
        # Past the last layer: an MTP layer's, sliding attention (`make_mtp`).
        D, kind = c.hidden_size, c.layer_kinds[index] if index < c.num_hidden_layers else SLIDING
        compressor = None
        if kind != SLIDING:
            m = c.rates[kind]
            compressor = Compressor(D, c.head_dim, m, overlap=kind == CSA, eps=c.rms_norm_eps, dtype=dtype, rngs=rngs)
            if kind == CSA:
                compressor.indexer = Indexer(D, c.q_lora_rank, c.index_n_heads, c.index_head_dim, m, c.index_topk,
                                             eps=c.rms_norm_eps, dtype=dtype, rngs=rngs)
        attn = CompressedAttention(hidden_size=D, num_heads=c.num_attention_heads, head_dim=c.head_dim,
                                   q_lora_rank=c.q_lora_rank, o_groups=c.o_groups, o_lora_rank=c.o_lora_rank,
                                   window=c.sliding_window, rope=self.rope if kind == SLIDING else self.compress,
                                   compress_rope=self.compress, eps=c.rms_norm_eps, compressor=compressor, dtype=dtype,
                                   rngs=rngs)
        return self.hyper_layer(index, attn, dtype=dtype, rngs=rngs, form="mhc", sinkhorn_iters=c.hc_sinkhorn_iters)

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> MoE:
        c = self.config
        D, E, k, F = c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size
        if index < c.num_hidden_layers and c.mlp_kinds[index] == "hash_moe":  # MTP layers' are scored
            router = HashRouter(D, E, k, c.vocab_size, score_fn=c.scoring_func,
                                routed_scaling_factor=c.routed_scaling_factor, dtype=dtype, rngs=rngs)
        else:
            router = Router(D, E, k, routing="scored_topk", score_fn=c.scoring_func, norm_topk_prob=True,
                            routed_scaling_factor=c.routed_scaling_factor, dtype=dtype, rngs=rngs)
        return MoE(router, Experts(E, D, F, clipped_swiglu(c.hidden_act, c.swiglu_limit), dtype=dtype, rngs=rngs),
                   shared=GatedMLP(D, F, c.hidden_act, use_bias=c.mlp_bias, input_limit=c.swiglu_limit, dtype=dtype,
                                   rngs=rngs), shared_name="shared_experts")

    def make_mtp(self, *, dtype, rngs: nnx.Rngs) -> StreamMTP:
        """The multi-token-prediction layers released checkpoints ship as `mtp.{i}.` (DeepSeek's and vLLM's forward:
        `layers.mtp.StreamMTP`), each around a decoder layer of sliding attention and a scored MoE, as their
        configs declare them (the entries of `compress_ratios` / `layer_types` and `mlp_layer_types` past the last
        layer, where given).

        Raises:
            UnsupportedArchitecture: none declared, or one declared with compressed attention or hash routing.
        """
        c = self.config
        L, n = c.num_hidden_layers, c.num_nextn_predict_layers
        if not n:
            raise UnsupportedArchitecture("this deepseek_v4 config declares no multi-token-prediction layers")
        kinds = c.layer_types if c.layer_types is not None else [LEGACY_KINDS.get(r, r) for r in
                                                                   c.compress_ratios or []]
        for i in range(L, L + n):
            if i < len(kinds) and kinds[i] != SLIDING:
                refuse("layer_types" if c.layer_types is not None else "compress_ratios", kinds[i],
                       f"declares multi-token-prediction layer {i - L} with compressed attention, which is not "
                       "implemented (sliding attention only)")
            if c.mlp_layer_types is not None and i < len(c.mlp_layer_types) and c.mlp_layer_types[i] != "moe":
                refuse("mlp_layer_types", c.mlp_layer_types[i],
                       f"declares multi-token-prediction layer {i - L} with hash routing, which is not implemented")
        D = c.hidden_size
        return StreamMTP([StreamLayer(self.make_layer(L + i, dtype=dtype, rngs=rngs), self.make_norm, D, c.hc_mult,
                                      norm_eps=c.rms_norm_eps, hc_eps=c.hc_eps, dtype=dtype, rngs=rngs)
                          for i in range(n)], c.hc_mult)

    def mtp_step(self, index, tokens, hidden, positions, cache=None, seq_len=None):
        """As `CausalLM.mtp_step`, on the plain embeddings (not copied into streams) and the tokens' ids."""
        return self.mtp.step(index, self.model.embed_tokens(tokens), hidden, positions,
                             self.rope_tables(positions, seq_len), cache, tokens=tokens)

    def mtp_hidden(self, x):
        """The last layer's streams [B, T, n, D], before the hyper head, flattened: [B, T, n D]."""
        return x.reshape(*x.shape[:2], -1)

    @property
    def mtp_hidden_size(self) -> int:
        return self.config.hc_mult * self.config.hidden_size

    def mtp_cache_layout(self) -> list[KVLayer]:
        """Each MTP layer's sliding window: one key head that is also the value."""
        return [KVLayer(1, self.config.head_dim, 0)] * self.mtp_layers

    def cache_layout(self) -> list[KVLayer | StateLayer]:
        """Per layer the window's keys (one head, also the values); compressed layers add their entries (and index
        keys) per block of positions and each sequence's buffer of projections not yet pooled."""
        c = self.config
        window = KVLayer(1, c.head_dim, 0, window=c.sliding_window)
        out = []
        for layer, kind in zip(self.model.layers, c.layer_kinds):
            if kind == SLIDING:
                out.append(window)
                continue
            parts = [layer.self_attn.compressor] + ([layer.self_attn.indexer] if kind == CSA else [])
            arrays = tuple(((p.buffer, 2 * p.kv_proj.out_shape[0]), (None, None)) for p in parts)
            out.append(StateLayer(arrays, kind="compressed sparse attention" if kind == CSA else
                                  "heavily compressed attention", kv=window,
                                  compressed=CompressedKV(c.rates[kind], c.head_dim,
                                                          c.index_head_dim if kind == CSA else 0)))
        return out


# Runtime path -> the original checkpoint's name (what transformers saves and DeepSeek's checkpoints hold), in order.
ORIGINAL_NAMES = [
    (r"\.kernel$", ".weight"), (r"^lm_head\.", "head."),
    (r"\.attn_hc\.", ".hc_attn_"), (r"\.ffn_hc\.", ".hc_ffn_"),
    (r"\.input_layernorm\.", ".attn_norm."), (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.self_attn\.compressor\.indexer\.scorer\.", ".attn.indexer."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."), (r"\.mlp\.", ".ffn."),
    (r"compressor\.kv_proj\.", "compressor.wkv."), (r"compressor\.gate_proj\.", "compressor.wgate."),
    (r"compressor\.position_bias$", "compressor.ape"), (r"compressor\.kv_norm\.", "compressor.norm."),
    (r"\.attn\.q_a_proj\.", ".attn.wq_a."), (r"\.attn\.q_a_norm\.", ".attn.q_norm."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."), (r"\.attn\.kv_proj\.", ".attn.wkv."), (r"\.attn\.kv_norm\.", ".attn.norm."),
    (r"\.attn\.o_a_proj\.", ".attn.wo_a."), (r"\.attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."), (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
]
EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict) -> Source | None:
    """Every parameter from its original name (`ORIGINAL_NAMES`); experts stacked from `ffn.experts.N.w1|w3|w2`. An
    MTP layer's (`mtp.layers.{i}.[decoder.]X`) from `mtp.{i}.X`, named as a main layer's tensors are, its hyper
    head's as `hc_head_fn|base|scale`."""
    mtp = re.fullmatch(r"mtp\.layers\.(\d+)\.(decoder\.)?(.*)", path)
    if mtp:  # through a main layer's naming, under a prefix no rule touches
        path = f"model.layers.MTP{mtp[1]}.{mtp[3]}"
    experts = per_expert_source(path, shape, lambda p: p.replace(".mlp", ".ffn"), EXPERT_NAMES)
    src = experts or default_source(path, shape, metadata)
    names = []
    for name in src.names:
        if experts is None:
            for pattern, repl in ORIGINAL_NAMES:
                name = re.sub(pattern, repl, name)
        if mtp:
            name = re.sub(r"\.hc_head\.hc_(fn|base|scale)$", r".hc_head_\1", name)
            name = name.replace(f"model.layers.MTP{mtp[1]}.", f"mtp.{mtp[1]}.")
        names.append(name)
    return Source(tuple(names), src.combine, src.shapes)


# DeepSeek's own checkpoints name the same tensors without the `model.` prefix, and the head's and embeddings' apart.
RELEASED_NAMES = ((r"^layers\.", "model.layers."), (r"^embed\.weight$", "model.embed_tokens.weight"),
                  (r"^norm\.weight$", "model.norm.weight"), (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"))

FAMILY = Family(model_types=("deepseek_v4",), config=Config, model=Model,
                dropped={r"mtp\.\d+\.(emb\.tok_emb|head)\.weight": "the multi-token-prediction layer's copy of the "
                         "model's embedding or output head (shared)",
                         r"(model\.)?mtp\..*": "multi-token-prediction layers, used only for speculative decoding "
                         "(converted without them)"},
                hf_source=hf_source, renames=RELEASED_NAMES,
                mtp=lambda c: r"mtp\.\d+\..*" if c.num_nextn_predict_layers else None)
