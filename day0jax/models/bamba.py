"""Bamba (IBM): Mamba2 mixers (`layers.mamba2`, gate-then-norm over groups) in most layers and Llama's GQA attention
in the layers `attn_layer_indices` names, each followed by a SwiGLU MLP; RoPE over half of each head (HF's
`BambaConfig` sets partial_rotary_factor 0.5 where `rope_parameters` gives none). HF reference:
transformers/models/bamba/modeling_bamba.py. HF names the MLP `feed_forward`, its norm `pre_ff_layernorm`, the mixer
`mamba` and the final norm `final_layernorm`; see `hf_source`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from flax import nnx

from day0jax.core.cache_layout import KVLayer, StateLayer
from day0jax.core.hf_config import refuse
from day0jax.core.hf_tensors import Source, default_source
from day0jax.layers.mamba2 import Mamba2Mixer
from day0jax.models import llama
from day0jax.models.base import DecoderLayer
from day0jax.models.contract import Family
from day0jax.models.nemotron_h import mamba2_source, mamba_shape


@dataclass(frozen=True, eq=False)
class Config(llama.Config):
    vocab_size: int = 128000
    intermediate_size: int = 14336
    num_key_value_heads: int | None = 8
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 262144
    attn_layer_indices: list | None = None  # the attention layers; every other layer is Mamba2 (None: all Mamba2)
    mamba_n_heads: int = 128
    mamba_d_head: int | str = "auto"
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: list | tuple | None = (0.0, float("inf"))
    z_loss_coefficient: float = 0.0  # training only
    num_logits_to_keep: int | None = 1  # generation's choice of which logits to compute, not the model's math
    model_type: str = "bamba"

    def __post_init__(self):
        self._check_heads()
        self._activation()
        self._check_derived("rope", "attention_layers", "mamba_shape")
        # The convolution runs hidden_act too, and only SiLU is implemented there.
        self._refuse_if("hidden_act", lambda a: a != "silu", "is not implemented for Mamba2 (only silu)")
        self._refuse_if("time_step_limit", lambda v: v is not None and (len(v) != 2 or not 0 <= v[0] <= v[1]),
                        "must be [low, high] with 0 <= low <= high")

    @cached_property
    def rope(self) -> dict:
        return self._rope(partial_rotary_factor=0.5)

    @cached_property
    def attention_layers(self) -> frozenset[int]:
        """The layers that attend (`attn_layer_indices`).

        Raises:
            UnsupportedArchitecture: an index outside the layers.
        """
        indices = frozenset(self.attn_layer_indices or ())
        for i in indices:
            if not 0 <= i < self.num_hidden_layers:
                refuse("attn_layer_indices", i, f"is not a layer index (num_hidden_layers={self.num_hidden_layers})")
        return indices

    @cached_property
    def mamba_shape(self) -> tuple[int, int, int, int, int]:
        """(N, H, G, Z, W) of the Mamba2 layers: mamba_expand * hidden_size channels in heads (`nemotron_h`)."""
        return mamba_shape(self, self.mamba_expand * self.hidden_size)


class Model(llama.Model):
    def make_layer(self, index: int, *, dtype, rngs: nnx.Rngs) -> DecoderLayer:
        c = self.config
        if index in c.attention_layers:
            return super().make_layer(index, dtype=dtype, rngs=rngs)
        N, H, G, Z, W = c.mamba_shape
        D = c.hidden_size
        limit = tuple(c.time_step_limit) if c.time_step_limit is not None else (0.0, float("inf"))
        mamba = Mamba2Mixer(hidden_size=D, num_heads=N, head_dim=H, n_groups=G, state_size=Z, conv_kernel=W,
                            chunk_size=c.mamba_chunk_size, eps=c.rms_norm_eps, norm="gate_then_norm",
                            use_bias=c.mamba_proj_bias, out_bias=c.mamba_proj_bias, conv_bias=c.mamba_conv_bias,
                            dt_limit=limit, dtype=dtype, rngs=rngs)
        return DecoderLayer(mamba, self.make_mlp(index, dtype=dtype, rngs=rngs),
                            self.make_norm(D, dtype=dtype, rngs=rngs), self.make_norm(D, dtype=dtype, rngs=rngs),
                            mixer_name="mamba")

    def cache_layout(self) -> list[KVLayer | StateLayer]:
        c = self.config
        full = KVLayer(c.kv_heads, c.head_size, c.head_size)
        return [full if i in c.attention_layers else layer.mixer.state_layout()
                for i, layer in enumerate(self.model.layers)]


# Runtime names -> Bamba's.
BAMBA_NAMES = ((r"\.mlp\.", ".feed_forward."), (r"\.post_attention_layernorm\.", ".pre_ff_layernorm."),
               (r"^model\.norm\.", "model.final_layernorm."))


def _bamba_name(name: str) -> str:
    for ours, theirs in BAMBA_NAMES:
        name = re.sub(ours, theirs, name)
    return name


def hf_source(config: Config, path: str, shape: tuple[int, ...], metadata: dict) -> Source | None:
    """The Mamba2 mixer's fused projections and convolution (`mamba2_source`), the MLP as `feed_forward`, its norm as
    `pre_ff_layernorm` and the final norm as `final_layernorm`; everything else under HF's plain names."""
    src = mamba2_source(path, shape, config.mamba_shape, prefix="mamba")
    if src is None and _bamba_name(path) != path:
        src = default_source(path, shape, metadata)
    return src and src.renamed(_bamba_name)


FAMILY = Family(model_types=("bamba",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS, hf_source=hf_source)
