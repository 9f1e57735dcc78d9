"""EXAONE 3.0 / 3.5: Llama (RMSNorm, RoPE, llama3-scaled in EXAONE 3.5, GQA, SwiGLU) under LG's own config keys
and tensor names. transformers runs it as `LlamaForCausalLM`, reading the old keys through
`ExaoneConfig.attribute_map` and renaming the tensors when it loads (and back when it saves).
HF reference: transformers/models/exaone/configuration_exaone.py, transformers/models/llama/modeling_llama.py and
the "exaone" entry of transformers/conversion_mapping.py."""

from __future__ import annotations

from dataclasses import dataclass

from day0jax.models import llama
from day0jax.models.contract import Family


@dataclass(frozen=True, eq=False)
class Config(llama.Config):
    # HF's attribute_map: EXAONE's config.json keeps these names, transformers writes the Llama ones.
    ALIASES = {"num_layers": "num_hidden_layers", "layer_norm_epsilon": "rms_norm_eps",
               "activation_function": "hidden_act"}
    DEFAULT_THETA = 500000.0
    vocab_size: int = 102400
    intermediate_size: int = 14336
    num_key_value_heads: int | None = 8
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    embed_dropout: float = 0.0  # training only: HF's Llama never reads it
    model_type: str = "exaone"


# EXAONE's tensor names -> HF Llama's (transformers' conversion mapping), each whole name by one pattern since the
# converter applies only the first that matches. Checkpoints already in Llama's names match none and stay as they are.
LAYER = r"^transformer\.h\.(\d+)\."
EXAONE_NAMES = (
    (r"^transformer\.wte\.", "model.embed_tokens."),
    (r"^transformer\.ln_f\.", "model.norm."),
    (LAYER + r"attn\.attention\.out_proj\.", r"model.layers.\1.self_attn.o_proj."),
    (LAYER + r"attn\.attention\.", r"model.layers.\1.self_attn."),
    (LAYER + r"ln_1\.", r"model.layers.\1.input_layernorm."),
    (LAYER + r"ln_2\.", r"model.layers.\1.post_attention_layernorm."),
    (LAYER + r"mlp\.c_fc_0\.", r"model.layers.\1.mlp.gate_proj."),
    (LAYER + r"mlp\.c_fc_1\.", r"model.layers.\1.mlp.up_proj."),
    (LAYER + r"mlp\.c_proj\.", r"model.layers.\1.mlp.down_proj."),
)

FAMILY = Family(model_types=("exaone",), config=Config, model=llama.Model, dropped=llama.ROPE_BUFFERS,
                renames=EXAONE_NAMES)
