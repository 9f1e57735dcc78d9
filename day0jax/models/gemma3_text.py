"""Gemma 3 (text): Gemma 2's sandwich layers with RMSNorm on q and k instead of attention soft-capping, and a
separate RoPE for the sliding-window ("local") layers.

HF reference: transformers/models/gemma3/modeling_gemma3.py. RoPE comes per layer type: transformers 5 writes
`rope_parameters = {"full_attention": {...}, "sliding_attention": {...}}`; older configs give `rope_theta`
(+ `rope_scaling`) for the global layers and `rope_local_base_freq` for the local ones. HF's Gemma 3 does not
apply `attn_logit_softcapping` (its attention is called without it); neither do we, to give the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from day0jax.layers.rope import Rope, rope_parameters
from day0jax.models import gemma2, llama

MODEL_TYPES = ("gemma3_text",)
DROPPED = llama.DROPPED


@dataclass(frozen=True, eq=False)
class Config(gemma2.Config):
    ALIASES = {"_sliding_window_pattern": "sliding_window_pattern"}  # transformers 5 writes the private name
    vocab_size: int = 262208
    max_position_embeddings: int = 131072
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    rope_local_base_freq: float | None = None
    sliding_window_pattern: int = 6
    use_bidirectional_attention: bool | None = False
    model_type: str = "gemma3_text"

    def __post_init__(self):
        self._heads()
        self._activation("hidden_activation")
        self._refuse_if("use_bidirectional_attention", bool, "(non-causal attention) is not implemented")
        p = self.sliding_window_pattern
        self._set(layer_types=self._layer_types(
            ["sliding_attention" if (i + 1) % p else "full_attention" for i in range(self.num_hidden_layers)]))
        given = self.rope_parameters or {}
        if "full_attention" in given or "sliding_attention" in given:
            full, local = dict(given.get("full_attention") or {}), dict(given.get("sliding_attention") or {})
        else:  # the flat, older form: it scales the global layers only
            full, local = dict(given or self.rope_scaling or {}), {}
        full.setdefault("rope_theta", self.rope_theta if self.rope_theta is not None else 1_000_000.0)
        local.setdefault("rope_theta", self.rope_local_base_freq if self.rope_local_base_freq is not None else 10_000.0)
        kw = dict(max_position_embeddings=self.max_position_embeddings)
        self._set(rope=rope_parameters(full, None, None, **kw), local_rope=rope_parameters(local, None, None, **kw))


class Model(gemma2.Model):
    def make_ropes(self):
        c = self.config
        self.local_rope = Rope(c.local_rope, c.head_dim, c.max_position_embeddings)
        return [self.rope, self.local_rope]

    def attention_kwargs(self, index: int) -> dict:
        c = self.config
        local = c.layer_types[index] == "sliding_attention"
        return dict(rope=self.local_rope if local else self.rope, qkv_bias=c.attention_bias, o_bias=c.attention_bias,
                    sliding_window=c.sliding_window if local else None, scale=c.query_pre_attn_scalar ** -0.5,
                    qk_norm_eps=c.rms_norm_eps, qk_norm_offset=1.0)
