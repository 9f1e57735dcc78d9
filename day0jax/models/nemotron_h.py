"""NemotronH (NVIDIA Nemotron-H, Nemotron 3 Nano / Super / Ultra): one token mixer or MLP per layer, in the order
`layers_block_type` gives: Mamba2 (`layers.mamba2`), attention without positions (no RoPE anywhere), a ReLU-squared
MLP, or a latent MoE (sigmoid scores routed in groups with a score bias, ungated ReLU-squared experts in a projected
latent space, a shared MLP). Each layer is x + mixer(norm(x)). HF reference:
transformers/models/nemotron_h/modeling_nemotron_h.py.

Nemotron 3's multi-token-prediction layer (`mtp.layers.{j}.*`, speculative method "mtp"): transformers does not run
it; the published architecture (NVIDIA's, as vLLM's `NemotronHMTP` runs it) is one MTP step made of blocks in
`mtp_hybrid_override_pattern` order, the first with `enorm`, `hnorm` and `eh_proj` in front, the last with
`final_layernorm` after it (`MtpLayer` around `MtpBlocks`).

Also the home of `mamba2_source`, the Mamba2 mixer's checkpoint layout, which Falcon-H1 and Granite 4 share.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from flax import nnx

from day0jax.core.cache_layout import KVLayer, StateLayer
from day0jax.core.errors import UnsupportedArchitecture
from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.attention import Attention
from day0jax.layers.linear import Linear
from day0jax.layers.mamba2 import PARTS, Mamba2Mixer
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.moe import Experts, MoE, Router, ungated
from day0jax.layers.mtp import MtpLayer, MtpStack
from day0jax.layers.norms import RMSNorm
from day0jax.models.base import CausalLM, HFConfig, build_config, per_expert_source
from day0jax.models.contract import Family

LAYER_KINDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}  # hybrid_override_pattern
# Older checkpoints' layer kinds, which HF's configs read as these (`remap_legacy_layer_types`).
LEGACY_KINDS = {"mamba": "linear_attention", "attention": "full_attention"}


def block_kinds(key: str, kinds: list[str]) -> tuple[str, ...]:
    """The block kinds of config key `key`, older checkpoints' 'mamba' and 'attention' read as HF reads them.

    Raises:
        UnsupportedArchitecture: a kind HF's blocks do not build.
    """
    kinds = [LEGACY_KINDS.get(k, k) for k in kinds]
    for kind in kinds:
        if kind not in LAYER_KINDS.values():
            refuse(key, kind, f"is not implemented (known: {', '.join(LAYER_KINDS.values())})")
    return tuple(kinds)


@dataclass(frozen=True, eq=False)
class Config(HFConfig):
    # HF's attribute_map, and the older names its __post_init__ reads in place of the current ones.
    ALIASES = {"layer_types": "layers_block_type", "num_local_experts": "n_routed_experts",
               "mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
               "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max", "mamba_dt_limit": "time_step_limit",
               "mamba_dt_init_floor": "time_step_floor", "mamba_conv_bias": "use_conv_bias",
               "mamba_chunk_size": "chunk_size", "hybrid_override_pattern": "layers_block_type",
               "mtp_hybrid_override_pattern": "mtp_layers_block_type", "num_hidden_layers": "layers_block_type"}
    vocab_size: int = 131072
    hidden_size: int = 4096
    layers_block_type: list | None = None
    tie_word_embeddings: bool = False
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    max_position_embeddings: int = 4096
    # HF's attention has no biases and no window whatever these say; a window is refused (see __post_init__).
    attention_bias: bool = False
    sliding_window: int | None = None
    intermediate_size: int = 21504
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    ssm_state_size: int = 128
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    mamba_hidden_act: str = "silu"
    n_groups: int = 8
    conv_kernel: int = 4
    time_step_limit: list | tuple = (0.0, float("inf"))
    use_conv_bias: bool = True
    chunk_size: int = 128
    n_routed_experts: int = 8
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None
    num_experts_per_tok: int = 2
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    use_bias: bool = False
    layer_norm_epsilon: float = 1e-5
    # Keys HF's forward never reads: `expand` (the heads give the width), the time step's initialization, the Mamba
    # kernels switch, the state cache's dtype (the runtime keeps float32), one shared MLP whatever n_shared_experts
    # says, the residual's dtype and initialization rules, and what only generation reads.
    expand: int = 2
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    use_mamba_kernels: bool = True
    mamba_proj_bias: bool = False
    mamba_ssm_cache_dtype: str = "float32"
    n_shared_experts: int = 1
    moe_shared_expert_overlap: bool = True
    residual_in_fp32: bool = False
    rescale_prenorm_residual: bool = True
    num_logits_to_keep: int | None = 1
    # The multi-token-prediction layer (tensors `mtp.*`, kept at conversion): speculative method "mtp".
    num_nextn_predict_layers: int = 0
    mtp_layers_block_type: list | None = None
    # No layer rotates: only values that describe no scaling are accepted (see `rope`).
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    model_type: str = "nemotron_h"

    @classmethod
    def from_hf(cls, hf: dict, *, strict: bool = True):
        """As HF reads config.json: an older name over the current one where both are given, the layer kinds from
        `hybrid_override_pattern` (one letter a layer) where `layers_block_type` is absent, and the deprecated
        `num_hidden_layers` only checked against them (HF counts the kinds).

        Raises:
            UnsupportedArchitecture: as `HFConfig.from_hf`, or a pattern letter or layer count HF's model does not
                build.
        """
        hf = dict(hf)
        count = hf.pop("num_hidden_layers", None)
        for old, new in (("hybrid_override_pattern", "layers_block_type"),
                         ("mtp_hybrid_override_pattern", "mtp_layers_block_type")):
            if old in hf:
                pattern = hf.pop(old)
                if hf.get(new) is None:
                    unknown = set(pattern) - set(LAYER_KINDS)
                    if unknown:
                        refuse(old, pattern, f"has letters {sorted(unknown)} (known: {''.join(LAYER_KINDS)})")
                    hf[new] = [LAYER_KINDS[ch] for ch in pattern]
        shadowed = {field for alias, field in cls.ALIASES.items() if alias in hf}
        config = build_config(cls, {k: v for k, v in hf.items() if k not in shadowed}, strict)
        if count is not None and count != config.num_hidden_layers:
            refuse("num_hidden_layers", count, f"differs from the {config.num_hidden_layers} layer kinds HF builds "
                   "(from layers_block_type or hybrid_override_pattern): the checkpoint is ambiguous")
        return config

    def __post_init__(self):
        self._check_heads()
        self._check_derived("layer_kinds", "rope")
        for key in ("mlp_hidden_act", "mamba_hidden_act"):
            self._activation(key)
        # The convolution runs mamba_hidden_act, and only SiLU is implemented there.
        self._refuse_if("mamba_hidden_act", lambda a: a != "silu", "is not implemented for Mamba2 (only silu)")
        self._refuse_if("n_groups", lambda g: self.mamba_num_heads % g,
                        f"does not divide mamba_num_heads={self.mamba_num_heads}")
        self._refuse_if("time_step_limit", lambda v: len(v) != 2 or not 0 <= v[0] <= v[1],
                        "must be [low, high] with 0 <= low <= high")
        self._refuse_if("sliding_window", lambda v: v is not None,
                        "is not implemented: HF's NemotronH attends over every position whatever it says")
        self._refuse_if("tie_word_embeddings", bool,
                        "is not implemented: HF's NemotronH keeps its own lm_head.weight whatever this says")
        if "moe" in self.layer_kinds:
            self._refuse_if("n_group", lambda v: not v or self.n_routed_experts % v,
                            f"does not divide n_routed_experts={self.n_routed_experts}")
            self._refuse_if("topk_group", lambda v: not 1 <= v <= self.n_group, f"must be in 1..n_group={self.n_group}")
            kept = self.topk_group * (self.n_routed_experts // self.n_group)
            self._refuse_if("num_experts_per_tok", lambda v: v > kept,
                            f"exceeds the {kept} experts of topk_group={self.topk_group} groups")

    @cached_property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's kind: `layers_block_type` (older checkpoints' 'mamba' and 'attention' read as HF reads them),
        else HF's default (Mamba2, MoE, attention, MLP).

        Raises:
            UnsupportedArchitecture: a kind HF's model does not build.
        """
        return block_kinds("layers_block_type",
                           self.layers_block_type or ["linear_attention", "moe", "full_attention", "mlp"])

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_kinds)

    @cached_property
    def mtp_layer_kinds(self) -> tuple[str, ...]:
        """The MTP layer's block kinds (`mtp_layers_block_type`, from `mtp_hybrid_override_pattern`; NVIDIA's
        default: attention then MoE).

        Raises:
            UnsupportedArchitecture: a kind HF's blocks do not build.
        """
        return block_kinds("mtp_layers_block_type", self.mtp_layers_block_type or ["full_attention", "moe"])

    @property
    def hidden_act(self) -> str:
        return self.mlp_hidden_act

    @cached_property
    def rope(self) -> dict:
        """The normalized RoPE dict, which must describe plain RoPE: no layer rotates.

        Raises:
            UnsupportedArchitecture: a rope_type other than 'default'.
        """
        rope = self._rope()
        if rope["rope_type"] != "default":
            refuse("rope_parameters.rope_type", rope["rope_type"], "is not implemented for nemotron_h, whose layers "
                   "have no RoPE (only 'default')")
        return rope

    @property
    def mamba_shape(self) -> tuple[int, int, int, int, int]:
        """(N, H, G, Z, W) of the Mamba2 layers."""
        return (self.mamba_num_heads, self.mamba_head_dim, self.n_groups, self.ssm_state_size, self.conv_kernel)


class Block(nnx.Module):
    """HF's `NemotronHBlock`: x + mixer(norm(x)), the mixer Mamba2, attention, an MLP or an MoE."""

    def __init__(self, norm: RMSNorm, mixer: nnx.Module, kind: str):
        self.norm, self.mixer, self.kind = norm, mixer, kind

    def __call__(self, x, positions, rope_tables, cache=None):
        h = self.norm(x)
        if self.kind in ("mlp", "moe"):
            return x + self.mixer(h), cache
        h, cache = self.mixer(h, positions, rope_tables, cache)
        return x + h, cache

    def op_calls(self):
        return self.mixer.op_calls() + self.norm.op_calls()


class MtpBlocks(nnx.Module):
    """The body of Nemotron 3's MTP step: blocks in `mtp_hybrid_override_pattern` order (`layers.{j}`), one of them
    attention, which keeps the step's keys and values."""

    def __init__(self, blocks: list[Block]):
        self.layers = nnx.List(blocks)

    def __call__(self, x, positions, rope_tables, cache=None):
        for block in self.layers:
            if block.kind == "full_attention":
                x, cache = block(x, positions, rope_tables, cache)
            else:
                x, _ = block(x, positions, rope_tables)
        return x, cache

    def op_calls(self):
        return [call for block in self.layers for call in block.op_calls()]


class Model(CausalLM):
    def make_rope(self) -> None:
        return None

    def make_ropes(self) -> list:
        return []

    def make_norm(self, dim: int, *, dtype, rngs: nnx.Rngs) -> RMSNorm:
        return RMSNorm(dim, self.config.layer_norm_epsilon, dtype=dtype, rngs=rngs)

    def make_mixer(self, index: int, *, dtype, rngs: nnx.Rngs, kind: str | None = None) -> nnx.Module:
        c = self.config
        D, kind = c.hidden_size, kind or c.layer_kinds[index]
        if kind == "linear_attention":
            N, H, G, Z, W = c.mamba_shape
            return Mamba2Mixer(hidden_size=D, num_heads=N, head_dim=H, n_groups=G, state_size=Z, conv_kernel=W,
                               chunk_size=c.chunk_size, eps=c.layer_norm_epsilon, norm="gate_then_norm",
                               use_bias=c.use_bias, out_bias=c.use_bias, conv_bias=c.use_conv_bias,
                               dt_limit=tuple(c.time_step_limit), dtype=dtype, rngs=rngs)
        if kind == "full_attention":
            return Attention(hidden_size=D, num_heads=c.num_attention_heads, num_kv_heads=c.kv_heads,
                             head_dim=c.head_size, rope=None, dtype=dtype, rngs=rngs)
        if kind == "mlp":
            return GatedMLP(D, c.intermediate_size, c.mlp_hidden_act, use_bias=c.mlp_bias, gated=False, dtype=dtype,
                            rngs=rngs)
        L = c.moe_latent_size or D
        latent = None if c.moe_latent_size is None else (
            Linear((D,), (L,), ("embed", None), use_bias=c.mlp_bias, dtype=dtype, rngs=rngs),
            Linear((L,), (D,), (None, "embed"), use_bias=c.mlp_bias, dtype=dtype, rngs=rngs))
        return MoE(Router(D, c.n_routed_experts, c.num_experts_per_tok, routing="sigmoid_grouped",
                          norm_topk_prob=c.norm_topk_prob, n_group=c.n_group, topk_group=c.topk_group,
                          routed_scaling_factor=c.routed_scaling_factor, dtype=dtype, rngs=rngs),
                   Experts(c.n_routed_experts, L, c.moe_intermediate_size, ungated(c.mlp_hidden_act), gated=False,
                           dtype=dtype, rngs=rngs),
                   shared=GatedMLP(D, c.moe_shared_expert_intermediate_size, c.mlp_hidden_act, use_bias=c.mlp_bias,
                                   gated=False, dtype=dtype, rngs=rngs),
                   shared_name="shared_experts", latent=latent)

    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> Block:
        return Block(self.make_norm(self.config.hidden_size, dtype=dtype, rngs=rngs),
                     self.make_mixer(index, dtype=dtype, rngs=rngs), self.config.layer_kinds[index])

    def cache_layout(self) -> list[KVLayer | StateLayer | None]:
        c = self.config
        full = KVLayer(c.kv_heads, c.head_size, c.head_size)
        return [layer.mixer.state_layout() if kind == "linear_attention" else full if kind == "full_attention"
                else None for kind, layer in zip(c.layer_kinds, self.model.layers)]

    def make_mtp(self, *, dtype, rngs: nnx.Rngs) -> MtpStack:
        """Nemotron 3's MTP layer: its pattern's blocks between the input projection and `final_layernorm`.

        Raises:
            UnsupportedArchitecture: no MTP layer, more than one (the published forward runs one), or a pattern
                without exactly one attention block or with a Mamba2 one (whose state would have to follow each
                draft).
        """
        c = self.config
        if not c.num_nextn_predict_layers:
            raise UnsupportedArchitecture("this nemotron_h config declares no multi-token-prediction layers "
                                          "(num_nextn_predict_layers)")
        if c.num_nextn_predict_layers > 1:
            refuse("num_nextn_predict_layers", c.num_nextn_predict_layers, "is not implemented: NemotronH's "
                   "published MTP forward runs one layer")
        kinds = c.mtp_layer_kinds
        if kinds.count("full_attention") != 1 or "linear_attention" in kinds:
            refuse("mtp_hybrid_override_pattern", list(kinds), "is not implemented: the MTP layer needs exactly "
                   "one attention block ('*') and no Mamba2 ('M')")
        D = c.hidden_size
        blocks = [Block(self.make_norm(D, dtype=dtype, rngs=rngs), self.make_mixer(0, kind=kind, dtype=dtype,
                                                                                   rngs=rngs), kind)
                  for kind in kinds]
        return MtpStack([MtpLayer(MtpBlocks(blocks), self.make_norm, D, post_norm=True, dtype=dtype, rngs=rngs)])

    def mtp_cache_layout(self) -> list[KVLayer]:
        c = self.config
        return [KVLayer(c.kv_heads, c.head_size, c.head_size)] * self.mtp_layers


# --- checkpoint layout ---------------------------------------------------------------------------------------

def mamba_shape(config, width: int) -> tuple[int, int, int, int, int]:
    """(N, H, G, Z, W) of the Mamba2 mixers of a config with the `mamba_*` keys Granite 4, Bamba and Falcon-H1 share:
    `width` channels in `mamba_n_heads` heads of `mamba_d_head` (or, 'auto', their share).

    Raises:
        UnsupportedArchitecture: heads that do not fill that width, or groups that do not divide them.
    """
    N = config.mamba_n_heads
    H = width // N if config.mamba_d_head == "auto" else config.mamba_d_head
    if H * N != width:
        refuse("mamba_d_head", config.mamba_d_head, f"times mamba_n_heads={N} is not the Mamba2 width {width}")
    if N % config.mamba_n_groups:
        refuse("mamba_n_groups", config.mamba_n_groups, f"does not divide mamba_n_heads={N}")
    return N, H, config.mamba_n_groups, config.mamba_d_state, config.mamba_d_conv


def mamba2_source(path: str, shape: tuple[int, ...], mamba_shape: tuple[int, int, int, int, int], *,
                  prefix: str = "mixer") -> Source | None:
    """The Source of a `layers.mamba2.Mamba2Mixer` parameter whose HF layout differs (None for the others, which
    follow HF's plain names): the parts of the fused `<prefix>.in_proj` [z | x | B | C | dt] rows (2 N H + 2 G Z + N,
    its bias likewise), of `<prefix>.conv1d`'s weight [x | B | C channels, 1, W] and bias, and the gated norm's weight
    [N H] as [N, H].

    Args:
        path: the runtime parameter, e.g. `model.layers.0.mixer.in_proj_x.kernel`.
        shape: its runtime shape.
        mamba_shape: (N, H, G, Z, W) of the mixer.
        prefix: HF's name of the mixer in its layer (`mixer`; Falcon-H1's `mamba`).
    """
    m = re.fullmatch(rf"(.*\.{prefix})\.(?:in_proj_(\w+)\.(kernel|bias)|conv_(\w)(_bias)?|norm\.weight)", path)
    if not m:
        return None
    base, proj, kind, conv, conv_bias = m.groups()
    N, H, G, Z, W = mamba_shape
    if proj is None and conv is None:
        return Source((f"{base}.norm.weight",), lambda a, s: a[0].reshape(s), ((N * H,),))
    names, sizes = (PARTS, dict(z=N * H, x=N * H, B=G * Z, C=G * Z, dt=N)) if proj else \
        ("xBC", dict(x=N * H, B=G * Z, C=G * Z))
    part = proj or conv
    start = sum(sizes[p] for p in names[:names.index(part)])
    size, total = sizes[part], sum(sizes.values())
    tensor = f"{base}.in_proj" if proj else f"{base}.conv1d"
    if kind == "bias" or conv_bias:
        return Source((f"{tensor}.bias",), lambda a, s: a[0][start:start + size].reshape(s), ((total,),))
    hf_shape = (total, math.prod(shape) // size) if proj else (total, 1, W)
    return Source((f"{tensor}.weight",),
                  lambda a, s: np.ascontiguousarray(a[0][start:start + size]).reshape(s), (hf_shape,))


# The runtime's names -> the checkpoint's (NVIDIA's, which transformers' save_pretrained writes back).
NAMES = {"model.embed_tokens.": "backbone.embeddings.", "model.norm.": "backbone.norm_f.", "model.": "backbone."}


def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict) -> Source:
    """NVIDIA's names (`backbone.`, `embeddings`, `norm_f`), the Mamba2 mixers' fused tensors split, and the experts
    stacked from one Linear each (`experts.<e>.up_proj.weight`). The MTP layer's blocks are NVIDIA's flat
    `mtp.layers.{j}`, the first holding enorm, hnorm and eh_proj, the last `final_layernorm`."""
    mtp = re.fullmatch(r"mtp\.layers\.0\.(?:mtp_block\.layers\.(\d+)\.(.*)|post_norm\.(.*)|(.*))", path)
    if mtp:
        block, rest, post, own = mtp.groups()
        path = (f"mtp.layers.{block}.{rest}" if block is not None else
                f"mtp.layers.{len(config.mtp_layer_kinds) - 1}.final_layernorm.{post}" if post is not None else
                f"mtp.layers.0.{own}")
    src = (mamba2_source(path, shape, config.mamba_shape) or per_expert_source(path, shape)
           or default_source(path, shape, metadata))
    return src.renamed(lambda n: next((new + n[len(old):] for old, new in NAMES.items() if n.startswith(old)), n))


DROPPED = {r"mtp\..*": "multi-token prediction layers, used only for speculative decoding (converted without them)"}

FAMILY = Family(model_types=("nemotron_h",), config=Config, model=Model, dropped=DROPPED, hf_source=hf_source,
                mtp=lambda c: r"mtp\..*" if c.num_nextn_predict_layers else None)
