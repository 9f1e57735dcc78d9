"""GLM-5 (`glm_moe_dsa`): DeepSeek-V3.2's sparse MLA and MoE (deepseek_v32.py) with the indexer's RoPE on
interleaved pairs, and cross-layer top-k sharing: layers marked "shared" in `indexer_types` have no indexer and
attend over the keys the last "full" layer before them picked.
HF reference: transformers/models/glm_moe_dsa/modeling_glm_moe_dsa.py."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from day0jax.core.hf_config import refuse
from day0jax.models import deepseek_v32, llama
from day0jax.models.base import DecoderLayer, nextn_tensors
from day0jax.models.contract import Family

INDEXER_KINDS = {"F": "full", "S": "shared"}


@dataclass(frozen=True, eq=False)
class Config(deepseek_v32.Config):
    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: int | None = 64
    q_lora_rank: int | None = 2048
    v_head_dim: int = 256
    qk_nope_head_dim: int = 192
    n_group: int = 1
    topk_group: int = 1
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    index_n_heads: int = 32
    indexer_types: list | None = None  # "full" or "shared" per layer
    # When `indexer_types` is None HF derives it from these (a pattern string wins over freq/offset).
    index_topk_pattern: str | list | None = None
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 2
    model_type: str = "glm_moe_dsa"

    def __post_init__(self):
        super().__post_init__()
        self._check_derived("indexer_kinds")

    @cached_property
    def indexer_kinds(self) -> tuple[str, ...]:
        """Each layer's indexer: "full" (its own) or "shared" (the previous full layer's top-k), as HF derives it.

        Raises:
            UnsupportedArchitecture: an unknown kind, or a shared layer before any full one.
        """
        L = self.num_hidden_layers
        if self.indexer_types is not None:
            kinds = list(self.indexer_types)
        elif self.index_topk_pattern is not None:
            pattern = self.index_topk_pattern
            kinds = [INDEXER_KINDS.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
        else:
            freq, offset = max(self.index_topk_freq, 1), self.index_skip_topk_offset
            kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(L)]
        if len(kinds) < L:
            refuse("indexer_types", kinds, f"has {len(kinds)} entries for num_hidden_layers={L}")
        for kind in kinds[:L]:
            if kind not in ("full", "shared"):
                refuse("indexer_types", kind, "is not implemented (known: full, shared)")
        if kinds[0] != "full":
            refuse("indexer_types", kinds[0], "on the first layer: a shared layer needs a full one before it")
        return tuple(kinds[:L])


class TopKDecoderLayer(DecoderLayer):
    """A decoder layer that hands its sparse attention's top-k to the layers after it (`CausalLM._run`)."""

    carries = True

    def __call__(self, x, positions, rope_tables, cache=None, shared_topk=None):
        h, cache, topk = self.self_attn.run(self.input_layernorm(x), positions, rope_tables, cache, shared_topk)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache, topk


class Model(deepseek_v32.Model):
    INDEXER_ROPE_INTERLEAVE = True

    def has_indexer(self, index: int) -> bool:
        # The multi-token-prediction layers after the last one have their own indexer (as checkpoints store them).
        c = self.config
        return index >= c.num_hidden_layers or c.indexer_kinds[index] == "full"

    def make_layer(self, index: int, *, dtype, rngs) -> DecoderLayer:
        if index >= self.config.num_hidden_layers:  # an MTP layer: nothing to hand on, nothing received
            return super().make_layer(index, dtype=dtype, rngs=rngs)
        D = self.config.hidden_size
        return TopKDecoderLayer(self.make_attention(index, dtype=dtype, rngs=rngs),
                                self.make_mlp(index, dtype=dtype, rngs=rngs),
                                self.make_norm(D, dtype=dtype, rngs=rngs), self.make_norm(D, dtype=dtype, rngs=rngs))


FAMILY = Family(model_types=("glm_moe_dsa",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS,
                dropped_for=deepseek_v32.deepseek_v3.dropped, hf_source=deepseek_v32.deepseek_v3.hf_source,
                mtp=lambda c: nextn_tensors(c, c.num_nextn_predict_layers))
