"""A tiny random Llama with the real SmolLM2 tokenizer and chat template, for fast server tests.

Written as a Hugging Face folder (config.json, model.safetensors, tokenizer files) with numpy only, then
converted like any checkpoint. The tokenizer comes from the embedded default model (converted on first use).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=64,
              intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
              bos_token_id=1, eos_token_id=2, pad_token_id=2, dtype="float32")


def write_tiny_chat_checkpoint(root: Path, config: dict = CONFIG, seed: int = 0, chat_template: str | None = None,
                               name: str = "tiny-chat") -> Path:
    """Writes and converts the tiny model under `root` (with `chat_template` instead of SmolLM2's, if given);
    returns the day0jax checkpoint folder."""
    from safetensors.numpy import save_file

    from convert import convert_checkpoint
    from day0jax.weights.default_model import default_checkpoint

    root = Path(root)
    hf = root / f"{name}-hf"
    hf.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    D, F, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    N, K = config["num_attention_heads"], config["num_key_value_heads"]
    H = D // N

    def w(*shape, scale=None):
        return (rng.standard_normal(shape) * (scale or shape[-1] ** -0.5)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(V, D, scale=1.0), "model.norm.weight": np.ones(D, np.float32)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(N * H, D), p + "self_attn.k_proj.weight": w(K * H, D),
            p + "self_attn.v_proj.weight": w(K * H, D), p + "self_attn.o_proj.weight": w(D, N * H),
            p + "mlp.gate_proj.weight": w(F, D), p + "mlp.up_proj.weight": w(F, D), p + "mlp.down_proj.weight": w(D, F),
            p + "input_layernorm.weight": np.ones(D, np.float32),
            p + "post_attention_layernorm.weight": np.ones(D, np.float32)})
    save_file(tensors, str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps(config))
    source = default_checkpoint(progress=False)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / file, hf / file)
    if chat_template is not None:
        (hf / "chat_template.jinja").write_text(chat_template)
    dst = root / name
    convert_checkpoint(hf, dst, progress=False)
    return dst
