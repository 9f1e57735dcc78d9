"""DeepSeek-V3.2: DeepSeek-V3 (deepseek_v3.py) with DeepSeek sparse attention in every layer: a lightning indexer
picks each query's top `index_topk` keys and MLA attends over those only (`layers/sparse_mla.py`).
HF reference: transformers/models/deepseek_v32/modeling_deepseek_v32.py."""

from __future__ import annotations

from dataclasses import dataclass

from flax import nnx

from day0jax.core.cache_layout import KVLayer
from day0jax.core.hf_config import refuse
from day0jax.layers.sparse_mla import Indexer, SparseMLAttention
from day0jax.models import deepseek_v3, llama
from day0jax.models.base import nextn_tensors
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(deepseek_v3.Config):
    max_position_embeddings: int = 163840
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 64
    mlp_layer_types: list | None = None  # "dense" or "sparse" per layer (None: dense for first_k_dense_replace)
    layer_types: list | None = None  # every layer "indexed_attention"
    mlp_bias: bool = False  # declared by HF's config, never read by its model
    model_type: str = "deepseek_v32"

    def __post_init__(self):
        super().__post_init__()
        self._refuse_if("q_lora_rank", lambda r: r is None, "must be set: sparse attention reads the low-rank query")
        self._refuse_if("index_head_dim", lambda d: d < self.qk_rope_head_dim,
                        f"is smaller than qk_rope_head_dim={self.qk_rope_head_dim}")
        for kind in self.layer_types or ():
            if kind != "indexed_attention":
                refuse("layer_types", kind, "is not implemented (only 'indexed_attention')")
        for kind in self.mlp_layer_types or ():
            if kind not in ("dense", "sparse"):
                refuse("mlp_layer_types", kind, "is not implemented (known: dense, sparse)")

    def is_sparse(self, index: int) -> bool:
        """Whether layer `index` is an MoE: `mlp_layer_types`, else after the first `first_k_dense_replace` (as the
        multi-token-prediction layers after the last one are: MoE, as in DeepSeek-V3)."""
        if self.mlp_layer_types is not None and index < len(self.mlp_layer_types):
            return self.mlp_layer_types[index] == "sparse"
        return index >= self.first_k_dense_replace


class Model(deepseek_v3.Model):
    # GLM-5's indexer rotates interleaved pairs; DeepSeek-V3.2's the half-split layout.
    INDEXER_ROPE_INTERLEAVE = False

    def has_indexer(self, index: int) -> bool:
        return True

    def make_attention(self, index: int, *, dtype, rngs: nnx.Rngs) -> SparseMLAttention:
        c = self.config
        indexer = None if not self.has_indexer(index) else Indexer(
            hidden_size=c.hidden_size, q_lora_rank=c.q_lora_rank, n_heads=c.index_n_heads, head_dim=c.index_head_dim,
            rope_dim=c.qk_rope_head_dim, rope_interleave=self.INDEXER_ROPE_INTERLEAVE, dtype=dtype, rngs=rngs)
        # HF rotates the main attention's interleaved pairs whatever `rope_interleave` says.
        return SparseMLAttention(indexer=indexer, topk=c.index_topk, hidden_size=c.hidden_size,
                                 num_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank,
                                 kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                                 qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, rope=self.rope,
                                 rope_interleave=True, scale=c.softmax_scale, eps=1e-6, use_bias=c.attention_bias,
                                 dtype=dtype, rngs=rngs)

    def cache_layout(self) -> list[KVLayer]:
        c = self.config
        d = c.kv_lora_rank + c.qk_rope_head_dim
        return [KVLayer(1, d, d, index_dim=c.index_head_dim if self.has_indexer(i) else 0)
                for i in range(c.num_hidden_layers)]


FAMILY = Family(model_types=("deepseek_v32",), config=Config, model=Model, dropped=llama.ROPE_BUFFERS,
                dropped_for=deepseek_v3.dropped, hf_source=deepseek_v3.hf_source,
                mtp=lambda c: nextn_tensors(c, c.num_nextn_predict_layers))
