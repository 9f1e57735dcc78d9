"""A tiny random Llama with the real SmolLM2 tokenizer and chat template, for fast server tests, and a tiny
LLaVA around it for images.

Written as a Hugging Face folder (config.json, model.safetensors, tokenizer files) with numpy only, then
converted like any checkpoint. The tokenizer comes from the embedded default model (converted on first use).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from families import CLIP_PROCESSOR

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
    from day0jax.default_model import default_checkpoint

    root = Path(root)
    hf = root / f"{name}-hf"
    hf.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    def w(*shape, scale=None):
        return (rng.standard_normal(shape) * (scale or shape[-1] ** -0.5)).astype(np.float32)

    save_file(_llama_tensors(config, w), str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps(config))
    source = default_checkpoint(progress=False)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / file, hf / file)
    if chat_template is not None:
        (hf / "chat_template.jinja").write_text(chat_template)
    dst = root / name
    convert_checkpoint(hf, dst, progress=False)
    return dst


def write_tiny_adapter(folder: Path, config: dict = CONFIG, rank: int = 4, alpha: float = 8.0, seed: int = 1,
                       targets=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")) -> Path:
    """A PEFT LoRA folder for the tiny Llama, written with numpy as PEFT lays it out: A [r, in] as PEFT initialises
    it, B random (N(0, 0.5^2)) so that it changes what the model generates."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    d, f = config["hidden_size"], config["intermediate_size"]
    dims = {"q_proj": (d, d), "k_proj": (d, config["num_key_value_heads"] * head_dim),
            "v_proj": (d, config["num_key_value_heads"] * head_dim), "o_proj": (d, d), "gate_proj": (d, f),
            "up_proj": (d, f), "down_proj": (f, d)}
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name in targets:
            where = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{where}.{name}"
            n_in, n_out = dims[name]
            bound = 1 / np.sqrt(n_in)
            tensors[f"{prefix}.lora_A.weight"] = rng.uniform(-bound, bound, (rank, n_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (0.5 * rng.standard_normal((n_out, rank))).astype(np.float32)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
        "target_modules": list(targets), "bias": "none", "base_model_name_or_path": "tiny-chat"}))
    return folder


def _llama_tensors(config: dict, w) -> dict[str, np.ndarray]:
    """A Llama's HF tensors (`model.*`, embeddings tied), random from `w(*shape, scale=None)`, norms at one."""
    D, F, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    N, K = config["num_attention_heads"], config["num_key_value_heads"]
    H = D // N
    tensors = {"model.embed_tokens.weight": w(V, D, scale=1.0), "model.norm.weight": np.ones(D, np.float32)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(N * H, D), p + "self_attn.k_proj.weight": w(K * H, D),
            p + "self_attn.v_proj.weight": w(K * H, D), p + "self_attn.o_proj.weight": w(D, N * H),
            p + "mlp.gate_proj.weight": w(F, D), p + "mlp.up_proj.weight": w(F, D), p + "mlp.down_proj.weight": w(D, F),
            p + "input_layernorm.weight": np.ones(D, np.float32),
            p + "post_attention_layernorm.weight": np.ones(D, np.float32)})
    return tensors


# --- a tiny LLaVA: a CLIP tower and a projector in front of the tiny Llama ----------------------------------------

IMAGE_TOKEN = "<image>"
VISION_TOWER = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, image_size=28, patch_size=14)
# SmolLM2's <|im_start|> format with image parts as "<image>", and Hermes-style tools (so that requests with both
# images and tools render through one template).
VISION_TEMPLATE = """{%- if tools %}<|im_start|>system
Call functions like this: <tool_call>
{"name": "f", "arguments": {}}
</tool_call>
<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools><|im_end|>
{% endif %}{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.content is string %}{{ message.content }}{% elif message.content %}{% for part in message.content %}
{%- if part.type == "image" %}<image>{% elif part.type == "text" %}{{ part.text }}{% endif %}{% endfor %}{% endif %}
<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def write_tiny_vision_checkpoint(root: Path, text_config: dict = CONFIG, vision_config: dict = VISION_TOWER,
                                 seed: int = 0, name: str = "tiny-vision") -> Path:
    """Writes and converts a tiny random LLaVA under `root`: a CLIP tower (the second-to-last layer's patches, 4
    per 28x28 image), a projector and the tiny Llama, with SmolLM2's tokenizer plus an "<image>" special token (the
    image placeholder), a chat template that shows image parts as "<image>", and CLIP's image preprocessing.

    Returns:
        The day0jax checkpoint folder.
    """
    from safetensors.numpy import save_file

    from convert import convert_checkpoint
    from day0jax.default_model import default_checkpoint

    root = Path(root)
    hf = root / f"{name}-hf"
    hf.mkdir(parents=True, exist_ok=True)
    source = default_checkpoint(progress=False)
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    image_id = 1 + max(max(tokenizer["model"]["vocab"].values()), max(t["id"] for t in tokenizer["added_tokens"]))
    tokenizer["added_tokens"].append({"id": image_id, "content": IMAGE_TOKEN, "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": True})
    (hf / "tokenizer.json").write_text(json.dumps(tokenizer))
    shutil.copy(source / "tokenizer_config.json", hf / "tokenizer_config.json")
    (hf / "chat_template.jinja").write_text(VISION_TEMPLATE)
    (hf / "preprocessor_config.json").write_text(json.dumps(CLIP_PROCESSOR))

    text = dict(text_config, vocab_size=image_id + 1)
    rng = np.random.default_rng(seed)
    D, Dv, Fv = text["hidden_size"], vision_config["hidden_size"], vision_config["intermediate_size"]
    P, S = vision_config["patch_size"], vision_config["image_size"]

    def w(*shape, scale=None):
        return (rng.standard_normal(shape) * (scale or shape[-1] ** -0.5)).astype(np.float32)

    tensors = {"language_model." + k: v for k, v in _llama_tensors(text, w).items()}
    v = "vision_tower.vision_model."
    # The projector's output is scaled up so that image features weigh like token embeddings (scale 1): the tiny
    # model's output then depends on its images.
    tensors.update({
        v + "embeddings.patch_embedding.weight": w(Dv, 3, P, P, scale=(3 * P * P) ** -0.5),
        v + "embeddings.class_embedding": w(Dv, scale=1.0),
        v + "embeddings.position_embedding.weight": w((S // P) ** 2 + 1, Dv, scale=1.0),
        "multi_modal_projector.linear_1.weight": w(D, Dv), "multi_modal_projector.linear_1.bias": w(D, scale=0.1),
        "multi_modal_projector.linear_2.weight": w(D, D, scale=4 * D ** -0.5),
        "multi_modal_projector.linear_2.bias": w(D, scale=0.1)})
    norms = ["pre_layrnorm", "post_layernorm"]
    for i in range(vision_config["num_hidden_layers"]):
        p = f"encoder.layers.{i}."
        norms += [p + "layer_norm1", p + "layer_norm2"]
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            tensors[f"{v}{p}self_attn.{proj}.weight"] = w(Dv, Dv)
            tensors[f"{v}{p}self_attn.{proj}.bias"] = w(Dv, scale=0.1)
        tensors.update({v + p + "mlp.fc1.weight": w(Fv, Dv), v + p + "mlp.fc1.bias": w(Fv, scale=0.1),
                        v + p + "mlp.fc2.weight": w(Dv, Fv), v + p + "mlp.fc2.bias": w(Dv, scale=0.1)})
    for norm in norms:
        tensors[f"{v}{norm}.weight"] = np.ones(Dv, np.float32)
        tensors[f"{v}{norm}.bias"] = np.zeros(Dv, np.float32)
    save_file(tensors, str(hf / "model.safetensors"))
    config = dict(model_type="llava", architectures=["LlavaForConditionalGeneration"], text_config=text,
                  vision_config=vision_config, image_token_index=image_id, vision_feature_layer=-2,
                  vision_feature_select_strategy="default", projector_hidden_act="gelu",
                  tie_word_embeddings=text["tie_word_embeddings"])
    (hf / "config.json").write_text(json.dumps(config))
    # As LLaVA checkpoints name their end-of-sequence token: in generation_config.json, not the outer config.
    (hf / "generation_config.json").write_text(json.dumps({k: text[k] for k in ("bos_token_id", "eos_token_id",
                                                                                "pad_token_id")}))
    dst = root / name
    convert_checkpoint(hf, dst, progress=False)
    return dst


# --- reasoning models: SmolLM2's tokenizer with the markup of reasoning templates ----------------------------------

# As the families' tokenizers hold them: Qwen's <think> and tool-call tags and MiniMax's tool-call tags are added
# tokens decoded as text; harmony's (gpt-oss), Gemma 4's and Mistral's markers are special tokens.
REASONING_TOKENS = [(t, False) for t in ("<think>", "</think>", "<tool_call>", "</tool_call>", "<minimax:tool_call>",
                                         "</minimax:tool_call>")] + \
    [(t, True) for t in ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
                         "<|call|>", "<|channel>", "<channel|>", "[THINK]", "[/THINK]")]


def write_reasoning_tokenizer(folder: Path, chat_template: str | None = None) -> Path:
    """Writes SmolLM2's tokenizer plus REASONING_TOKENS (and `chat_template`, if given) into `folder`; returns it."""
    from day0jax.default_model import default_checkpoint

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    source = default_checkpoint(progress=False)
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    first = 1 + max(max(tokenizer["model"]["vocab"].values()), max(t["id"] for t in tokenizer["added_tokens"]))
    for i, (content, special) in enumerate(REASONING_TOKENS):
        tokenizer["added_tokens"].append({"id": first + i, "content": content, "single_word": False, "lstrip": False,
                                          "rstrip": False, "normalized": False, "special": special})
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    shutil.copy(source / "tokenizer_config.json", folder / "tokenizer_config.json")
    if chat_template is not None:
        (folder / "chat_template.jinja").write_text(chat_template)
    return folder


def write_scripted_checkpoint(root: Path, chat_template: str, script: dict[str, str], seed: int = 0,
                              name: str = "tiny-reasoning") -> Path:
    """Writes and converts a tiny Llama whose greedy output follows `script` (token -> next token, each a single
    token of the reasoning tokenizer): the layers add nothing to the residual (their output projections are zero),
    so the last position holds its token's embedding, and the untied LM head scores only the scripted successor of
    each token (every other token's logit is exactly 0, so a grammar's choice among them is the lowest id).

    Returns:
        The day0jax checkpoint folder.
    """
    from safetensors.numpy import save_file

    from convert import convert_checkpoint
    from day0jax.weights.tokenizer import Tokenizer

    root = Path(root)
    hf = write_reasoning_tokenizer(root / f"{name}-hf", chat_template)
    tokenizer = Tokenizer(hf)
    config = dict(CONFIG, vocab_size=tokenizer.vocab_size, tie_word_embeddings=False, max_position_embeddings=512)
    rng = np.random.default_rng(seed)

    def w(*shape, scale=None):
        return (rng.standard_normal(shape) * (scale or shape[-1] ** -0.5)).astype(np.float32)

    tensors = _llama_tensors(config, w)
    for key in tensors:
        if key.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[key] = np.zeros_like(tensors[key])
    embed = tensors["model.embed_tokens.weight"]
    head = np.zeros_like(embed)
    for token, successor in script.items():
        (x,), (y,) = tokenizer.encode(token, add_special_tokens=False), tokenizer.encode(successor,
                                                                                          add_special_tokens=False)
        head[y] += 10.0 * embed[x] / np.linalg.norm(embed[x])
    tensors["lm_head.weight"] = head
    save_file(tensors, str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps(config))
    dst = root / name
    convert_checkpoint(hf, dst, progress=False)
    return dst


# --- the vision-language families on SmolLM2's tokenizer: tiny random models built by transformers ----------------

# Per family (a tests/families.py MULTIMODAL entry): its special tokens (the first is the image placeholder), the
# config keys that name them, and how its chat template shows an image part (as the family's released template does).
FAMILY_TOKENS = {
    "kimi_k25": (["<|media_pad|>", "<|media_begin|>", "<|media_content|>", "<|media_end|>"],
                 ["image_token_id"], "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"),
    "mistral3": (["[IMG]", "[IMG_BREAK]", "[IMG_END]"], ["image_token_index"], "[IMG]"),
    "gemma4": (["<|image|>", "<|image>", "<image|>", "<|video|>", "<|audio|>", "<|audio>", "<audio|>"],
               ["image_token_id", "boi_token_id", "eoi_token_id", "video_token_id", "audio_token_id", "boa_token_id",
                "eoa_token_index"], "<|image|>"),
    "lfm2_vl": (["<image>", "<|image_start|>", "<|image_end|>"], ["image_token_id"], "<image>"),
    "qwen3_vl_moe": (["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"],
                     ["image_token_id", "vision_start_token_id", "vision_end_token_id"],
                     "<|vision_start|><|image_pad|><|vision_end|>"),
}


def family_vision_template(image: str) -> str:
    """SmolLM2's <|im_start|> format, image parts written as `image`."""
    return VISION_TEMPLATE.replace("<image>", image)


def write_family_vision_checkpoints(root: Path, names: list[str], run_reference) -> dict[str, Path]:
    """Per family in `names`: a tiny random model of its MULTIMODAL config built by transformers (one reference
    subprocess for all), its vocabulary SmolLM2's plus the family's special tokens, SmolLM2's tokenizer with them, a
    chat template showing images as the family's does, its image processor; converted. Returns the day0jax
    checkpoint folders (each named "tiny-vision", under root/<name>)."""
    from convert import convert_checkpoint
    from day0jax.default_model import default_checkpoint
    from families import MULTIMODAL

    source = default_checkpoint(progress=False)
    base = json.loads((source / "tokenizer.json").read_text())
    first = 1 + max(max(base["model"]["vocab"].values()), max(t["id"] for t in base["added_tokens"]))
    jobs, folders = [], {}
    for name in names:
        case = MULTIMODAL[name]
        tokens, keys, _ = FAMILY_TOKENS[case.model_type]
        ids = {t: first + i for i, t in enumerate(tokens)}
        hf = Path(root) / name / "hf"
        text = dict(case.config["text_config"], vocab_size=first + len(tokens), bos_token_id=1, eos_token_id=2,
                    pad_token_id=2)
        if "vocab_size_per_layer_input" in text:  # Gemma 4's per-layer table covers every token too
            text["vocab_size_per_layer_input"] = text["vocab_size"]
        config = dict(case.config, text_config=text)
        config.update({k: ids[t] for k, t in zip(keys, tokens)})
        jobs.append({"op": "tiny_hf", "family": case.model_type, "config": config, "seed": 0, "out": str(hf)})
        folders[name] = (hf, tokens, ids)
    run_reference(jobs, Path(root))
    out = {}
    for name, (hf, tokens, ids) in folders.items():
        case = MULTIMODAL[name]
        tokenizer = json.loads(json.dumps(base))
        tokenizer["added_tokens"] += [{"id": ids[t], "content": t, "single_word": False, "lstrip": False,
                                       "rstrip": False, "normalized": False, "special": True} for t in tokens]
        (hf / "tokenizer.json").write_text(json.dumps(tokenizer))
        shutil.copy(source / "tokenizer_config.json", hf / "tokenizer_config.json")
        (hf / "chat_template.jinja").write_text(family_vision_template(FAMILY_TOKENS[case.model_type][2]))
        (hf / "preprocessor_config.json").write_text(json.dumps(case.processor))
        (hf / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2,
                                                               "pad_token_id": 2}))
        out[name] = convert_checkpoint(hf, Path(root) / name / "tiny-vision", progress=False).dst
    return out
