"""Decoder blocks whose norms sit elsewhere than Llama's pre-norms (`models.base.DecoderLayer`). HF names kept:
here `post_attention_layernorm` normalizes the attention *output*, where in Llama it is the norm before the MLP."""

from __future__ import annotations

from flax import nnx

from kernels_pallas.calls import OpCall


class SandwichDecoderLayer(nnx.Module):
    """Gemma 2/3: x + post_attention_layernorm(attn(input_layernorm(x))), then
    x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x))). The token mixer is `self_attn`, or
    `mixer_name` where HF names it otherwise (LFM3's `conv`)."""

    def __init__(self, self_attn: nnx.Module, mlp: nnx.Module, *, input_layernorm, post_attention_layernorm,
                 pre_feedforward_layernorm, post_feedforward_layernorm, mixer_name: str = "self_attn"):
        setattr(self, mixer_name, self_attn)
        self.mixer_name, self.mlp = mixer_name, mlp
        self.input_layernorm, self.post_attention_layernorm = input_layernorm, post_attention_layernorm
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = (pre_feedforward_layernorm,
                                                                           post_feedforward_layernorm)

    @property
    def mixer(self) -> nnx.Module:
        return getattr(self, self.mixer_name)

    def __call__(self, x, positions, rope_tables, cache=None):
        h, cache = self.mixer(self.input_layernorm(x), positions, rope_tables, cache)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), cache

    def op_calls(self) -> list[OpCall]:
        norms = (self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
                 self.post_feedforward_layernorm)
        return self.mixer.op_calls() + self.mlp.op_calls() + [c for n in norms for c in n.op_calls()]


class PostNormDecoderLayer(nnx.Module):
    """OLMo 2: no pre-norms; x + post_attention_layernorm(attn(x)), then x + post_feedforward_layernorm(mlp(x))."""

    def __init__(self, self_attn: nnx.Module, mlp: nnx.Module, *, post_attention_layernorm,
                 post_feedforward_layernorm):
        self.self_attn, self.mlp = self_attn, mlp
        self.post_attention_layernorm, self.post_feedforward_layernorm = (post_attention_layernorm,
                                                                          post_feedforward_layernorm)

    def __call__(self, x, positions, rope_tables, cache=None):
        h, cache = self.self_attn(x, positions, rope_tables, cache)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(x)), cache

    def op_calls(self) -> list[OpCall]:
        norms = (self.post_attention_layernorm, self.post_feedforward_layernorm)
        return self.self_attn.op_calls() + self.mlp.op_calls() + [c for n in norms for c in n.op_calls()]


class ParallelDecoderLayer(nnx.Module):
    """Cohere, GPT-J style: one norm feeds attention and the MLP side by side; x + attn(n) + mlp(n), n =
    input_layernorm(x)."""

    def __init__(self, self_attn: nnx.Module, mlp: nnx.Module, *, input_layernorm):
        self.self_attn, self.mlp, self.input_layernorm = self_attn, mlp, input_layernorm

    def __call__(self, x, positions, rope_tables, cache=None):
        h = self.input_layernorm(x)
        a, cache = self.self_attn(h, positions, rope_tables, cache)
        return x + a + self.mlp(h), cache

    def op_calls(self) -> list[OpCall]:
        return self.self_attn.op_calls() + self.mlp.op_calls() + self.input_layernorm.op_calls()
