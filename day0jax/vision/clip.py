"""CLIP and SigLIP vision towers: a ViT over square patches, with learned absolute positions and pre-norm layers.
HF reference: transformers/models/clip/modeling_clip.py (`CLIPVisionTransformer`) and
transformers/models/siglip/modeling_siglip.py (`SiglipVisionTransformer`): CLIP prepends a class token and norms the
embeddings (`pre_layrnorm`), SigLIP has neither but a bias on its patch projection."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.core import hf_config as config_lib
from day0jax.core.errors import UnsupportedArchitecture
from day0jax.core.hf_tensors import Source, same
from day0jax.layers.linear import Embedding, Linear, param
from day0jax.layers.mlp import activation
from day0jax.layers.norms import LayerNorm
from kernels_pallas.calls import OpCall

MODEL_TYPES = ("clip_vision_model", "siglip_vision_model")


@dataclass(frozen=True, eq=False)
class VisionConfig:
    """`CLIPVisionConfig` / `SiglipVisionConfig` keys (a vision-language config's `vision_config`)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    # CLIP's contrastive projection and SigLIP's pooling head: not on the path of the patch features.
    projection_dim: int | None = None
    vision_use_head: bool | None = None
    initializer_factor: float = 1.0
    model_type: str = "clip_vision_model"
    unknown_keys: tuple = ()

    @classmethod
    def from_hf(cls, hf: dict) -> "VisionConfig":
        """The tower's config from a `vision_config` dict.

        Raises:
            UnsupportedArchitecture: another tower (`model_type`), a key that may change the math, or an activation
                we do not have.
        """
        hf = dict(hf)
        hf.setdefault("model_type", "clip_vision_model")
        if hf["model_type"] not in MODEL_TYPES:
            raise UnsupportedArchitecture(f"vision_config model_type {hf['model_type']!r} is not implemented "
                                          f"(vision towers: {', '.join(MODEL_TYPES)})")
        if hf["model_type"] == "siglip_vision_model":
            hf.setdefault("hidden_act", "gelu_pytorch_tanh")
            hf.setdefault("layer_norm_eps", 1e-6)
            hf.setdefault("patch_size", 16)
        config = config_lib.from_hf(cls, hf)
        if config.unknown_keys:
            shown = ", ".join(f"{k}={hf[k]!r}" for k in config.unknown_keys)
            raise UnsupportedArchitecture(f"vision_config key(s) not implemented by the {config.model_type} tower: "
                                          f"{shown}")
        activation(config.hidden_act, "vision_config.hidden_act")
        if config.image_size % config.patch_size:
            raise UnsupportedArchitecture(f"vision_config image_size={config.image_size} is not a multiple of "
                                          f"patch_size={config.patch_size}")
        return config

    @property
    def has_class_token(self) -> bool:
        return self.model_type == "clip_vision_model"

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_positions(self) -> int:
        """Tokens per image leaving the tower: the patches, and CLIP's class token first."""
        return self.num_patches + self.has_class_token


class Embeddings(nnx.Module):
    """Pixels [B, C, H, W] -> [B, P (+1), D]: each patch through `patch_embedding` (HF's Conv2d with stride = kernel,
    a matmul over the patch's C x p x p values), then the class token and the learned positions."""

    def __init__(self, c: VisionConfig, *, dtype, rngs: nnx.Rngs):
        p, D = c.patch_size, c.hidden_size
        clip = c.has_class_token
        self.patch_embedding = Linear((c.num_channels, p, p), (D,), (None, None, None, "embed"), use_bias=not clip,
                                      dtype=dtype, rngs=rngs)
        self.class_embedding = param(rngs, (D,), ("embed",), dtype, 1.0) if clip else None
        self.position_embedding = Embedding(c.num_positions, D, dtype=dtype, rngs=rngs)
        self.patch_size = p

    def __call__(self, pixels: jax.Array) -> jax.Array:
        B, C, H, W = pixels.shape
        p = self.patch_size
        patches = pixels.reshape(B, C, H // p, p, W // p, p).transpose(0, 2, 4, 1, 3, 5)  # [B, h, w, C, p, p]
        x = self.patch_embedding(patches.reshape(B, (H // p) * (W // p), C, p, p))
        if self.class_embedding is not None:
            cls = jnp.broadcast_to(self.class_embedding[...], (B, 1, x.shape[-1])).astype(x.dtype)
            x = jnp.concatenate([cls, x], axis=1)
        return x + self.position_embedding.weight[...][None, :x.shape[1]]


class SelfAttention(nnx.Module):
    """Bidirectional multi-head attention over one image's tokens, with biases (HF: `self_attn`)."""

    def __init__(self, c: VisionConfig, *, dtype, rngs: nnx.Rngs):
        D, N = c.hidden_size, c.num_attention_heads
        H = D // N
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self, name, Linear((D,), (N, H), ("embed", "heads", "head_dim"), use_bias=True, dtype=dtype,
                                       rngs=rngs))
        self.out_proj = Linear((N, H), (D,), ("heads", "head_dim", "embed"), use_bias=True, dtype=dtype, rngs=rngs)
        self.scale = H ** -0.5

    @jax.named_scope("vision_attention")
    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [B, T, N, H]
        scores = jnp.einsum("btnh,bsnh->bnts", q, k).astype(jnp.float32) * self.scale
        weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return self.out_proj(jnp.einsum("bnts,bsnh->btnh", weights, v))


class MLP(nnx.Module):
    def __init__(self, c: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.fc1 = Linear((c.hidden_size,), (c.intermediate_size,), ("embed", "mlp"), use_bias=True, dtype=dtype,
                          rngs=rngs)
        self.fc2 = Linear((c.intermediate_size,), (c.hidden_size,), ("mlp", "embed"), use_bias=True, dtype=dtype,
                          rngs=rngs)
        self.act = activation(c.hidden_act, "vision_config.hidden_act")

    @jax.named_scope("vision_mlp")
    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nnx.Module):
    def __init__(self, c: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.layer_norm1 = LayerNorm(c.hidden_size, c.layer_norm_eps, dtype=dtype, rngs=rngs)
        self.self_attn = SelfAttention(c, dtype=dtype, rngs=rngs)
        self.layer_norm2 = LayerNorm(c.hidden_size, c.layer_norm_eps, dtype=dtype, rngs=rngs)
        self.mlp = MLP(c, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nnx.Module):
    def __init__(self, layers: list[EncoderLayer]):
        self.layers = nnx.List(layers)


class VisionTransformer(nnx.Module):
    """HF's `vision_model`: embeddings, (CLIP) `pre_layrnorm`, `encoder.layers`, and `post_layernorm` where the
    caller reads the last layer's output through it (Gemma 3, with `last_hidden_state`; LLaVA reads raw outputs).

    Args:
        config: the tower's config.
        num_layers: how many encoder layers to build: those after the deepest one read are never run, and the
            converter drops their tensors.
        post_layernorm: whether the tower has `post_layernorm` (for `last_hidden_state`).
    """

    def __init__(self, config: VisionConfig, *, num_layers: int | None = None, post_layernorm: bool = False,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.embeddings = Embeddings(c, dtype=dtype, rngs=rngs)
        self.pre_layrnorm = (LayerNorm(c.hidden_size, c.layer_norm_eps, dtype=dtype, rngs=rngs)
                             if c.has_class_token else None)
        n = c.num_hidden_layers if num_layers is None else num_layers
        self.encoder = Encoder([EncoderLayer(c, dtype=dtype, rngs=rngs) for _ in range(n)])
        self.post_layernorm = (LayerNorm(c.hidden_size, c.layer_norm_eps, dtype=dtype, rngs=rngs)
                               if post_layernorm else None)

    def __call__(self, pixels: jax.Array) -> list[jax.Array]:
        """pixels [B, C, H, W] -> the hidden states as HF's `output_hidden_states` reports them: the input of the
        first layer, then each built layer's output ([B, P (+1), D] each)."""
        x = self.embeddings(pixels)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        hidden = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            hidden.append(x)
        return hidden

    def last_hidden_state(self, pixels: jax.Array) -> jax.Array:
        """HF's `last_hidden_state`: the last layer's output through `post_layernorm`."""
        return self.post_layernorm(self(pixels)[-1])

    def op_calls(self) -> list[OpCall]:
        """Every built layer's operators (the same for each): attention and the MLP, in jax.numpy."""
        c = self.config
        return [OpCall.of("vision_attention", N=c.num_attention_heads, H=c.hidden_size // c.num_attention_heads,
                          T=c.num_positions),
                OpCall.of("mlp", D=c.hidden_size, F=c.intermediate_size, act=c.hidden_act, gated=False)]


def hf_source(path: str, shape: tuple[int, ...]) -> Source | None:
    """The Source of a parameter path inside the tower (`embeddings.patch_embedding.kernel`...) relative to HF's
    `vision_model.` prefix, where `core.hf_tensors.default_source` does not find it: the patch projection is HF's Conv2d weight
    [D, C, p, p] as it is (the kernel keeps that layout)."""
    if path == "embeddings.patch_embedding.kernel":
        return Source(("embeddings.patch_embedding.weight",), same, (shape,))
    return None


def num_layers_read(config: VisionConfig, feature_layers: list[int]) -> int:
    """The encoder layers to build so that every hidden-state index in `feature_layers` (HF's, negative from the
    end: -1 is the last layer's output, 0 the embeddings) is computed."""
    L = config.num_hidden_layers
    deepest = max(i % (L + 1) for i in feature_layers)
    return deepest

