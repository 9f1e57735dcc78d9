"""LFM2 (Liquid AI): gated short convolutions (`layers.short_conv`: a fixed state per sequence, like linear
attention's) in most layers, GQA with per-head q/k RMSNorm in the rest, SwiGLU MLPs sized by HF's `block_*` rule,
and the final norm named `embedding_norm`. HF reference: transformers/models/lfm2/modeling_lfm2.py.

The base of LFM2-MoE (lfm2_moe.py) and LFM3 (lfm3.py). The layers are the runtime's own blocks under other names:
`operator_norm` / `ffn_norm` around the mixer and `feed_forward` (w1, w3, w2), attention's `out_proj` and
`q_layernorm` / `k_layernorm`; `hf_source` renames, and reshapes the convolution weight [D, 1, W] to [D, W].
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

from flax import nnx

from day0jax.core.cache_layout import KVLayer, StateLayer
from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.mlp import GatedMLP
from day0jax.layers.norms import RMSNorm
from day0jax.layers.short_conv import ShortConv
from day0jax.models import llama
from day0jax.models.base import DecoderLayer, HFConfig
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class HybridConfig(HFConfig):
    """The keys LFM2, LFM2-MoE and LFM3 share (with LFM2's defaults), each layer's kind and the convolution's checks.
    `KINDS`: the layer kinds the family's HF model builds."""

    KINDS: ClassVar[tuple[str, ...]] = ("conv", "full_attention")
    DEFAULT_THETA = 1000000.0
    # Not a config key: LFM's MLPs are SwiGLU by construction (a config.json naming one is refused as unknown).
    hidden_act: ClassVar[str] = "silu"
    vocab_size: int = 65536
    hidden_size: int = 2560
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    # Not in HF's config class, but its attention and RoPE read it when config.json has it.
    head_dim: int | None = None
    max_position_embeddings: int = 128000
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    rope_parameters: dict | None = None
    conv_bias: bool = False
    conv_L_cache: int = 3
    layer_types: list | None = None

    @classmethod
    def from_hf(cls, hf: dict, *, strict: bool = True):
        # HF's LFM configs read an alias over the current key when config.json gives both; `from_hf` alone would
        # keep the current one.
        shadowed = {field for alias, field in cls.ALIASES.items() if alias in hf}
        config = super().from_hf({k: v for k, v in hf.items() if k not in shadowed}, strict=strict)
        config._check_derived("layer_kinds")  # also where `__post_init__` cannot tell (see there)
        return config

    def __post_init__(self):
        super().__post_init__()
        # HF's default LFM2-MoE config has no layer kinds (its model cannot be built from it): that default stays
        # constructible here, and `from_hf` refuses a config.json without them.
        if self.layer_types is not None or self.default_layer_types() is not None:
            self._check_derived("layer_kinds")
        self._refuse_if("conv_L_cache", lambda w: w < 2, "is not implemented (a convolution without past inputs)")

    def default_layer_types(self) -> list[str] | None:
        """The layer kinds HF derives when `layer_types` is None (None: HF's model cannot be built)."""
        return None

    @cached_property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's kind: `layer_types`, else HF's default.

        Raises:
            UnsupportedArchitecture: no kinds, too few, or a kind HF's model does not build.
        """
        L = self.num_hidden_layers
        kinds = self.layer_types if self.layer_types is not None else self.default_layer_types()
        if kinds is None:
            refuse("layer_types", None, f"is required: HF's {self.model_type} model reads each layer's kind there")
        if len(kinds) < L:
            refuse("layer_types", kinds, f"has {len(kinds)} entries for num_hidden_layers={L}")
        for kind in kinds:
            if kind not in self.KINDS:
                refuse("layer_types", kind, f"is not implemented (known: {', '.join(self.KINDS)})")
        return tuple(kinds[:L])

    def _refuse_partial_rope(self, params: dict) -> None:
        # HF's LFM rotates q and k with cos/sin of the full head size: a partial default RoPE fails there.
        factor = params.get("partial_rotary_factor", 1.0)
        if factor != 1.0 and params["rope_type"] != "proportional":
            refuse("rope_parameters.partial_rotary_factor", factor,
                   f"is not implemented for rope_type={params['rope_type']!r} (HF's LFM rotates every dim)")


@dataclass(frozen=True, eq=False)
class Config(HybridConfig):
    # Names of Liquid's own configs that HF's config reads in place of the current ones, as these aliases do.
    ALIASES = {"block_ff_dim": "intermediate_size", "tie_embedding": "tie_word_embeddings"}
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    block_multiple_of: int = 256
    block_ffn_dim_multiplier: float | None = 1.0
    block_auto_adjust_ff_dim: bool = True
    full_attn_idxs: list | None = None
    # Keys of Liquid's config.json that HF does not read: accepted only with the values HF's math matches. The
    # first six restate other keys, the next two name what HF always does, the init ones only shape training.
    block_dim: int | None = None
    conv_dim: int | None = None
    conv_dim_out: int | None = None
    num_heads: int | None = None
    block_norm_eps: float | None = None
    theta: float | None = None
    block_use_swiglu: bool = True
    use_pos_enc: bool = True
    block_use_xavier_init: bool | None = None
    conv_use_xavier_init: bool | None = None
    block_mlp_init_scale: float | None = None
    block_out_init_scale: float | None = None
    model_type: str = "lfm2"

    def __post_init__(self):
        super().__post_init__()
        self._refuse_partial_rope(self.rope)
        self._check_derived("mlp_size")
        restated = {"block_dim": ("hidden_size", self.hidden_size), "conv_dim": ("hidden_size", self.hidden_size),
                    "conv_dim_out": ("hidden_size", self.hidden_size),
                    "num_heads": ("num_attention_heads", self.num_attention_heads),
                    "block_norm_eps": ("norm_eps", self.norm_eps), "theta": ("the RoPE theta", self.rope["rope_theta"])}
        for key, (name, used) in restated.items():
            self._refuse_if(key, lambda v: v is not None and v != used,
                            f"differs from {name}={used!r}, which HF reads instead: the checkpoint is ambiguous")
        self._refuse_if("block_use_swiglu", lambda v: not v, "is not implemented (HF's LFM2 MLP is SwiGLU)")
        self._refuse_if("use_pos_enc", lambda v: not v, "is not implemented (HF's LFM2 always rotates)")

    def default_layer_types(self) -> list[str]:
        """Attention at `full_attn_idxs`, convolutions elsewhere; attention everywhere when that is None too."""
        full = range(self.num_hidden_layers) if self.full_attn_idxs is None else self.full_attn_idxs
        return ["full_attention" if i in full else "conv" for i in range(self.num_hidden_layers)]

    @cached_property
    def mlp_size(self) -> int:
        """The MLPs' width, HF's `Lfm2MLP` rule: with `block_auto_adjust_ff_dim`, 2/3 of intermediate_size, times
        `block_ffn_dim_multiplier` and rounded up to `block_multiple_of` when the multiplier is set."""
        F = self.intermediate_size
        if self.block_auto_adjust_ff_dim:
            F = int(2 * F / 3)
            if self.block_ffn_dim_multiplier is not None:
                if self.block_multiple_of <= 0:
                    refuse("block_multiple_of", self.block_multiple_of, "must be positive")
                F = int(self.block_ffn_dim_multiplier * F)
                F = self.block_multiple_of * ((F + self.block_multiple_of - 1) // self.block_multiple_of)
        return F


class Model(llama.LlamaLike):
    """LFM2: Llama's layers with a short convolution or attention as the token mixer."""

    def make_norm(self, dim: int, *, dtype, rngs: nnx.Rngs) -> RMSNorm:
        return RMSNorm(dim, self.config.norm_eps, dtype=dtype, rngs=rngs)

    def attention_kwargs(self, index: int) -> dict:
        return dict(rope=self.rope, qk_norm_eps=self.config.norm_eps)

    def make_mlp(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        c = self.config
        return GatedMLP(c.hidden_size, c.mlp_size, c.hidden_act, dtype=dtype, rngs=rngs)

    def make_mixer(self, index: int, *, dtype, rngs: nnx.Rngs) -> tuple[nnx.Module, str]:
        """Layer `index`'s token mixer and HF's name for it."""
        c = self.config
        if c.layer_kinds[index] == "conv":
            return ShortConv(hidden_size=c.hidden_size, kernel_size=c.conv_L_cache, use_bias=c.conv_bias, dtype=dtype,
                             rngs=rngs), "conv"
        return self.make_attention(index, dtype=dtype, rngs=rngs), "self_attn"

    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        D = self.config.hidden_size
        mixer, name = self.make_mixer(index, dtype=dtype, rngs=rngs)
        return DecoderLayer(mixer, self.make_mlp(index, dtype=dtype, rngs=rngs),
                            self.make_norm(D, dtype=dtype, rngs=rngs), self.make_norm(D, dtype=dtype, rngs=rngs),
                            mixer_name=name)

    def cache_layout(self) -> list[KVLayer | StateLayer]:
        c = self.config
        full = KVLayer(c.kv_heads, c.head_size, c.head_size)
        return [layer.mixer.state_layout() if kind == "conv" else full
                for kind, layer in zip(c.layer_kinds, self.model.layers)]


# --- checkpoint layout ---------------------------------------------------------------------------------------

# Runtime name -> HF's, for every family of the three (LFM3's sandwich norms: `lfm3.NORMS`).
NAMES = {"input_layernorm": "operator_norm", "post_attention_layernorm": "ffn_norm", "mlp": "feed_forward",
         "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# LFM2's attention (not LFM3's, which has Qwen3's names).
ATTENTION_NAMES = {"o_proj": "out_proj", "q_norm": "q_layernorm", "k_norm": "k_layernorm"}


def renamer(names: dict[str, str]):
    """A function from a runtime path to HF's: each dotted part renamed by `names`, and the final norm
    `model.norm` as `model.embedding_norm`."""
    def rename(path: str) -> str:
        if path.startswith("model.norm."):
            return "model.embedding_norm." + path[len("model.norm."):]
        return ".".join(names.get(part, part) for part in path.split("."))
    return rename


def conv_source(path: str, shape: tuple[int, ...]) -> Source | None:
    """The convolution weight [D, W] from HF's `conv.conv.weight` [D, 1, W]; None for other paths."""
    if not re.fullmatch(r".*\.conv\.conv\.weight", path):
        return None
    return Source((path,), lambda arrays, s: arrays[0].reshape(s), ((shape[0], 1, shape[1]),))


def hf_source(config: Any, path: str, shape: tuple[int, ...], metadata: dict) -> Source:
    src = conv_source(path, shape) or default_source(path, shape, metadata)
    return src.renamed(renamer({**NAMES, **ATTENTION_NAMES}))


FAMILY = Family(model_types=("lfm2",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS, hf_source=hf_source)
