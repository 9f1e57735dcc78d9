"""Reference computations with Hugging Face transformers, run in the reference venv (.venv-ref, Python 3.11).

The day0jax runtime never imports torch; tests call this script as a subprocess with a JSON list of jobs and
read back the files it writes. One call per test session amortizes torch's import.

Jobs (each a dict with "op"):
  tiny_hf      {family, config, seed, out, multimodal?}: a tiny random model saved with save_pretrained
               (safetensors); with multimodal, the image-text-to-text model (vision tower included); for a
               text model that transformers runs only inside its multimodal one, see TEXT_IN_MULTIMODAL.
  fp8_hf       {config, seed, out, block}: a tiny llama whose linear weights are FP8 e4m3 with block scales
               (`weight_scale_inv`), plus OUT.reference.safetensors holding the exact float32 dequantization.
  tiny_gguf    {config, seed, out, types}: a tiny llama GGUF with a SentencePiece-style BPE vocabulary and
               its linear weights in the given GGML types (random bytes for the K-quants, which gguf-py
               cannot quantize).
  from_gguf    {gguf, out}: load a GGUF with transformers and save_pretrained it (safetensors + tokenizer).
  run          {model, prompts, generate, out}: float32 logits of each prompt, and greedy continuations.
  rope_tables  {config, starts, length, out}: cos and sin [length, head_dim] of a Llama with this config's RoPE at
               positions start..start+length-1, one call per start in order.
  mxfp4_dequantize {model, out}: every `X_blocks`/`X_scales` pair of the HF folder MODEL dequantized by transformers'
               MXFP4 dequantizer (integrations/mxfp4.py, float32): `X` [E, in, out], as gpt-oss's experts use it.
  nvfp4_dequantize {model, out}: every compressed-tensors NVFP4 weight of the HF folder MODEL (`X.weight_packed`,
               `X.weight_scale`, `X.weight_global_scale`) dequantized by compressed-tensors' own unpacking and
               `dequantize`, in float32: `X.weight` [O, I].
  state        {model, out}: the float32 state dict transformers loads (dequantized for GGUF).
  tokenize     {model, texts, chats, out}: token ids of each text and of each chat with the chat template.
  hidden       {model, prompts, out, dtype?}: per prompt i, `hidden_{i}` [L+1, T, D] (output_hidden_states: the
               embeddings, each layer's output, the last one after the final norm) and `logits_{i}` [T, V], float32.
  gdn          {inputs, out, family}: transformers' own torch functions of linear-attention layers on the arrays of
               the INPUTS .npz (layouts as day0jax's: [B, T, heads, dim], conv x [B, T, C], weight [C, W], states
               [B, heads, Hk, Hv] and [B, W - 1, C]); family 'qwen3_next' (per-head decay, q/k repeated to the
               value heads) or 'kimi_linear' (per-channel decay). Writes to OUT, float32: from q, k, v, g, beta
               [, state] `chunk_out`, `chunk_state`, `recurrent_out`, `recurrent_state`; from x, weight
               `conv_out` (causal_conv1d_fn, SiLU); from x_step, conv_state, weight `step_out`, `step_state`
               (causal_conv1d_update, SiLU).
  mtp          {family, config, seed, out, prompts, reference}: a tiny random model saved like `tiny_hf`, plus one
               multi-token-prediction layer in the checkpoint's own layout (DeepSeek-V3's, DeepSeek-V3.2's and
               GLM-5's `model.layers.{L}.` with enorm, hnorm, eh_proj, shared_head and its copies of the embedding
               and head, the decoder layer an MoE with its own indexer where the family has one; Qwen3-Next's
               `mtp.`; ERNIE 4.5 MoE's `mtp_block.0` and its norms and projection; DeepSeek-V4's `mtp.0.` over
               the hyper-connected streams; HY-V4's `model.mtp_layers.0.`, a decoder layer without them; MiniMax-M3's
               `model.mtp.layers.0.` around its `transformer_layer`), random;
               REFERENCE.npz gets per prompt `logits_{i}` [T - 1, V] float64: at each position p < T - 1, the MTP
               layer on the model's final hidden state at p and the embedding of token p + 1, its decoder layer
               transformers' own (float64), the rest written out here; for ERNIE 4.5 MoE the whole MTP layer
               transformers' own (`MtpModel.from_pretrained`, reading the checkpoint).
  mamba2       {inputs, out}: transformers' own torch functions of Mamba2 layers (NemotronH's module; Falcon-H1's and
               Granite 4's are the same code) on the arrays of the INPUTS .npz, layouts as day0jax's: x [B, T, N, H],
               dt [B, T, N], A, D, dt_bias [N], b, c [B, T, G, Z], state [B, N, H, Z], `chunk` and `limit` [2].
               Writes `chunk_out`, `chunk_state` (mamba2_chunk_scan from the state) and `step_out`, `step_state`
               (mamba2_selective_state_update on token 0 from the state); with y, z [B, T, I] and norm_weight [I],
               `gated_norm` (NemotronH's gate-then-norm over `norm_groups` groups) and `norm_gated` (Falcon-H1's
               norm-before-gate).
  deepseek_v4_ops {config, seed, attention, out}: transformers' own DeepSeek-V4 modules, built from `config` with
               random weights (seed): a hyper-connection and the hyper head on random streams, the HCA and the CSA
               compressor (with its indexer) on random hidden states without a cache; and eager_attention_forward
               with sinks on the ATTENTION .npz (q [B, T, N, H], k [B, T, H] the window's keys, entries [B, C, H],
               indices [B, T, Kt] (-1: none), sinks [N], window, ratio), masked as the CSA layer masks it. Writes
               every module's weights under its own prefix (`hc.`, `head.`, `hca.`, `csa.`) and its inputs and outputs.
  hy_v4_ops    {config, seed, attention, out}: transformers' own HY-V4 modules, built from `config` with random
               weights (seed): the plain hyper-connection (`hc.`) and the hyper head (`head.`) on random streams, the
               streams after a random block output as the decoder layer spreads it (`expanded`); and
               eager_attention_forward with sinks on the ATTENTION .npz (q [B, T, N, H], k [B, T, H], v [B, T, Hv],
               indices [B, T, Kt], sinks [N], scale), masked as HYV4Attention masks it (causal, then the keys not
               chosen): `attention` [B, T, N, Hv].
  minimax_m3_ops {config, seed, attention, out}: transformers' own MiniMax-M3 lightning indexer, built from `config`
               with random weights (seed), on random hidden states at positions 0..T-1 without a cache: its rotated
               queries `iq` [B, T, I, Di] and keys `ik` [B, T, Di] (captured at its norms, rotated as it rotates
               them), `block_indices` [B, I, T, topk] (-1: none) and, through build_block_mask, eager_attention_forward
               on the ATTENTION .npz (q [B, T, N, H], k, v [B, T, K, H]): `attention` [B, T, N, H].
  glm5_next_ops {config, seed, out}: transformers' own GLM-5-Next pooled indexer (Glm5NextTextIndexer), built from
               `config` (a text config) with random weights (seed), on random hidden states and low-rank queries at
               positions 0..T-1 without a cache: its queries `iq` [B, T, I, Di], head weights `weights` [B, T, I],
               keys `ik` [B, T, Di], pooling logits `gate` [B, T, Di], `ape` [kpool, Di], and the token indices it
               returns, `topk_indices` [B, T, W] (-1: none).
  qwen4_exp_ops {config, seed, tokens, out}: transformers' own Qwen4-Exp modules, built from `config` (a
               qwen4_exp_text config) with random weights (seed): the gated residual (`gr.`: on random streams
               `streams` [B, T, n D], the block's input `gr_input`, `gr_post`) and the final mixer (`mixer.`,
               `mixer_out`); the QSA indexer (`ix.`) on random hidden states `ix_x` at 0..T-1 under the causal mask:
               its rotated queries `ix_q` [B, T, I, Di], raw keys `ix_k` [B, T, Di] and `ix_selected` [B, T, T] bool;
               and the n-gram ids of the second PLE layer's embedding on the TOKENS list of rows: `ngram_ids`.
  parse_tools  {cases: [{family, text, tools}], out}: transformers' response parser (the fallback response template
               of each `family`, e.g. qwen3_5 or gemma4) on each generated `text`; OUT is a JSON list of
               {content, reasoning, calls: [[name, arguments]]}.
  peft_train   {model, adapter, batches: [{tokens, mask}], optimizer, lrs, weight_decay, out}: the PEFT adapter
               folder ADAPTER on the HF model, trainable, one torch.optim step per batch (AdamW with betas 0.9, 0.999,
               eps 1e-8, or plain SGD; decay `weight_decay`; step i at learning rate lrs[i]), the loss transformers'
               own with `labels` the tokens where mask is 1, else -100. Writes `losses` [steps], `grad.{name}` (the
               first step's gradients) and `param.{name}` (the adapter after the last step), names as PEFT saves them.
  full_grads   {model, batch: {tokens, mask}, out}: the loss (`labels` as in peft_train) and `grad.{name}` of every
               parameter of the HF model (named_parameters: a tied table once).
  peft_logits  {model, adapter, prompts, out}: float32 logits `logits_{i}` [T, V] of each prompt with the PEFT
               adapter folder ADAPTER loaded on the HF model (`PeftModel.from_pretrained`).
  peft_make    {model, adapters: [{folder, r, alpha, targets, seed}], prompts, generate, out}: each adapter made by
               PEFT itself (`get_peft_model` with LoraConfig(r, lora_alpha, target_modules), lora_B then drawn
               N(0, 0.1^2) from `seed` so that it changes the model) and saved to FOLDER (`save_pretrained`); then,
               loaded back, each prompt's float32 logits `{k}.logits_{i}` and `generate` greedy tokens
               `{k}.generated_{i}` (no EOS stop) for adapter k.
  train_rows   {model, rows, out}: each jsonl training row (messages, prompt/completion or text) as transformers'
               tokenizer gives it: [ids, offset], the chat template without a generation prompt, the offset the
               length of the prompt rendered with one (0 for text rows, whose ids are `tokenizer(text)` plus EOS
               unless they end with it).
  render_chat  {cases: [{model, messages, tools?, kwargs?}], out}: the chat template of the tokenizer folder `model`
               applied to `messages` with a generation prompt (`apply_chat_template(..., tokenize=False, **kwargs)`);
               OUT is a JSON list of the rendered texts.
"""

import json
import os
import re
import sys

import numpy as np
import torch

torch.set_num_threads(max(1, os.cpu_count() or 1))


def _causal_lm(config):
    """AutoModelForCausalLM, first given the config's own `*ForCausalLM` class where transformers leaves the model
    type out of that auto mapping (Mistral 4); AutoModelForImageTextToText for a multimodal model that has no such
    class (Mistral Large 4)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if type(config) not in AutoModelForCausalLM._model_mapping:
        own = getattr(transformers, type(config).__name__.removesuffix("Config") + "ForCausalLM", None)
        # A multimodal config whose `*ForCausalLM` is its text model's (MiniMax-M3): that class cannot take it.
        if own is None or "text_config" in getattr(config, "sub_configs", {}):
            return AutoModelForImageTextToText
        AutoModelForCausalLM.register(type(config), own, exist_ok=True)
    return AutoModelForCausalLM


# Text models that transformers runs only inside their multimodal model (there is no `*ForCausalLM` for them): model
# type -> (the multimodal model type, a one-layer vision tower that text never reaches, the vision tensors' name
# prefixes). Their tiny checkpoint is the multimodal one saved without those tensors, under the text config; the
# reference runs it in the multimodal model again.
TEXT_IN_MULTIMODAL = {
    "mistral_large4_text": ("mistral_large4", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                   num_attention_heads=2, head_dim=16, image_size=28, patch_size=14),
                            ("vision_encoder.", "patch_merger.", "pre_mm_projector_norm.", "vision_language_adapter.")),
}


def _multimodal_config(text_config):
    from transformers import AutoConfig

    outer, vision, _ = TEXT_IN_MULTIMODAL[text_config.model_type]
    return AutoConfig.for_model(outer, text_config=text_config.to_dict(), vision_config=vision,
                                tie_word_embeddings=text_config.tie_word_embeddings)


def _keep_language_model(folder, text_config):
    """The multimodal checkpoint saved in `folder` as its language model alone (TEXT_IN_MULTIMODAL)."""
    from safetensors.torch import load_file, save_file

    vision = TEXT_IN_MULTIMODAL[text_config.model_type][2]
    for path in [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors")]:
        save_file({k: v for k, v in load_file(path).items() if not k.startswith(vision)}, path,
                  metadata={"format": "pt"})
    text_config.save_pretrained(folder)


def _load(model, what="model"):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    if model.endswith(".gguf"):
        kwargs = {"gguf_file": os.path.basename(model)}
        model = os.path.dirname(model)
    if what == "tokenizer":
        return AutoTokenizer.from_pretrained(model, **kwargs)
    config = None if kwargs else AutoConfig.from_pretrained(model)
    if config is not None and config.model_type in TEXT_IN_MULTIMODAL:
        from transformers import AutoModelForImageTextToText

        kwargs["config"] = _multimodal_config(config)
        auto = AutoModelForImageTextToText
    else:
        auto = AutoModelForCausalLM if kwargs else _causal_lm(config)
    m = auto.from_pretrained(model, dtype=torch.float32, **kwargs)
    return m.eval()


# Saved tensors that stay constant on purpose, each with why (`_check_randomized`): none so far. A pattern here must
# name a tensor that the family's own code fixes, so that random values would test nothing the model computes.
CONSTANT_ALLOWED: dict[str, str] = {}


def _constants(model) -> dict[str, float]:
    """name -> value of every floating tensor in the state dict (what save_pretrained writes) whose elements are all
    equal: HF initializes norms, biases, gates, sinks, routing biases and the like to such constants."""
    return {name: float(t.flatten()[0]) for name, t in model.state_dict().items()
            if t.is_floating_point() and t.numel() and bool((t == t.flatten()[0]).all())}


def _randomize(model, config, initial: dict[str, float]):
    """Random values for what HF initializes to a constant (`initial`, from `_constants`), so that the parity tests
    exercise it: first the tensors whose meaning asks for a particular spread, then any other such tensor, as its
    constant plus N(0, 0.1)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias") or "sinks" in name:
                p.normal_(0.0 if name.endswith(".bias") else 1.0, 0.1)
        for name, b in model.named_buffers():  # DeepSeek's routing bias is a buffer, zero at init
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
            elif name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale, 1 at init
                b.normal_(1.0, 0.1)
            elif name.endswith("feed_forward.expert_bias"):  # LFM2-MoE's routing bias, zero at init
                b.normal_(0.0, 0.1)
            elif name.endswith("gate.tid2eid"):  # DeepSeek-V4's token -> experts table, zero at init
                b.copy_(torch.stack([torch.randperm(config.n_routed_experts)[:b.shape[1]] for _ in range(len(b))]))
        # AFMoE's and Laguna's routing biases are parameters, zero at init; AFMoE's router too.
        for name, p in model.named_parameters():
            if name.endswith(("expert_bias", "e_score_correction_bias")):
                p.normal_(0.0, 0.1)
            elif name.endswith(("router.scale", "per_expert_scale")):  # Gemma 4's router scales, 1 at init
                p.normal_(1.0, 0.1)
            elif name.endswith("router.gate.weight") and not p.any():
                p.normal_(0.0, config.initializer_range)
            elif re.search(r"\.(mixer|mamba)\.(A_log|D|dt_bias)$", name):  # Mamba2's per-head constants at init
                p.normal_(1.0 if name.endswith(".D") else 0.0, 0.5)
            # Hyper-connections' biases (0, or one constant) and scales (1, or 0.01) at init (DeepSeek-V4, HY-V4).
            elif re.search(r"(attn_hc|ffn_hc)\.(base|scale)$|hc_head\.hc_(base|scale)$", name):
                p.normal_(1.0 if name.endswith("scale") else 0.0, 0.5)
            elif name.endswith("position_bias"):  # DeepSeek-V4's compressors' per-offset gate bias, 0 at init
                p.normal_(0.0, 0.5)
            elif name.endswith("mm_input_projection_weight"):  # Gemma 3's image projection, 0 at init
                p.normal_(0.0, 0.2)
            elif name.endswith("rotary_emb.alpha"):  # Mistral Large 4's learned RoPE frequency factors, 0 at init
                p.normal_(0.0, 0.5)
            # Mistral Large 4's per-head query scale scale * log(p + 1) + bias: scale 0 and bias 1 at init.
            elif name.endswith("softmax_scaling.scale"):
                p.normal_(0.0, 0.3)
            elif name.endswith("softmax_scaling.bias"):
                p.normal_(1.0, 0.2)
        # Anything else HF made constant (gpt-oss's expert biases, Qwen3-Next's dt_bias...): its constant plus noise.
        for name, t in model.state_dict().items():
            if name in initial and bool((t == initial[name]).all()) and not _allowed(name):
                t.add_(torch.randn_like(t) * 0.1)
        # The rows HF zeroes for padding_idx: the forward pass reads them as any token's, and a zero row makes a
        # generated pad token's hidden state 0 (in sparse attention, an indexer whose scores all tie).
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None:
                m.weight[m.padding_idx].normal_(0.0, float(m.weight.std()))


def _allowed(name: str) -> bool:
    return any(re.search(pattern, name) for pattern in CONSTANT_ALLOWED)


def _check_randomized(folder: str) -> None:
    """Raises if a saved tensor of more than one element is constant, or has a row of zeros, unless
    `CONSTANT_ALLOWED` names it."""
    from safetensors.torch import load_file

    for path in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        for name, t in load_file(os.path.join(folder, path)).items():
            if not t.is_floating_point() or t.numel() < 2 or _allowed(name):
                continue
            flat = t.flatten()
            if bool((flat == flat[0]).all()):
                raise AssertionError(f"tiny checkpoint tensor {name} {list(t.shape)} is constant ({flat[0]}): "
                                     "randomize it in _randomize, or allow it in CONSTANT_ALLOWED with the reason")
            if t.ndim > 1 and bool((t.flatten(1) == 0).all(1).any()):
                raise AssertionError(f"tiny checkpoint tensor {name} {list(t.shape)} has a row of zeros: randomize it "
                                     "in _randomize, or allow it in CONSTANT_ALLOWED with the reason")


def tiny_hf(job):
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.manual_seed(job.get("seed", 0))
    config = AutoConfig.for_model(job["family"], **job["config"])
    text_only = config.model_type in TEXT_IN_MULTIMODAL
    auto = AutoModelForImageTextToText if job.get("multimodal") or text_only else _causal_lm(config)
    model = auto.from_config(_multimodal_config(config) if text_only else config, dtype=torch.float32)
    initial = _constants(model)
    _randomize(model, config, initial)
    if job.get("dtype") == "bfloat16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(job["out"])
    if text_only:
        _keep_language_model(job["out"], config)
    _check_randomized(job["out"])


def fp8_hf(job):
    from safetensors.torch import load_file, save_file

    tiny_hf(dict(job, family="llama"))
    block = job.get("block", [128, 128])
    path = os.path.join(job["out"], "model.safetensors")
    tensors = load_file(path)
    out, reference = {}, {}
    for name, w in tensors.items():
        if w.ndim == 2 and name.endswith("proj.weight"):
            rows, cols = w.shape
            br, bc = block
            scale = torch.zeros((-(-rows // br), -(-cols // bc)))
            q = torch.zeros_like(w, dtype=torch.float8_e4m3fn)
            for i in range(scale.shape[0]):
                for j in range(scale.shape[1]):
                    tile = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
                    s = tile.abs().max().clamp(min=1e-12) / 448.0
                    scale[i, j] = s
                    q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (tile / s).to(torch.float8_e4m3fn)
            out[name], out[name + "_scale_inv"] = q, scale
            # DeepSeek-V3's dequantization: every (br, bc) block times its scale, in float32.
            full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]
            reference[name] = q.to(torch.float32) * full
        else:
            out[name] = w
            reference[name] = w
    save_file(out, path, metadata={"format": "pt"})
    save_file(reference, job["out"] + ".reference.safetensors")  # beside the folder: not part of the model
    cfg_path = os.path.join(job["out"], "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": block}
    json.dump(cfg, open(cfg_path, "w"), indent=2)


def _sentencepiece_vocab(size):
    import io

    import sentencepiece as spm

    text = ("The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away, there lived a "
            "king who loved numbers like 12345 and code like def f(x): return x * 2.\n") * 50
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text.splitlines()), model_writer=buf,
                                   model_type="bpe", vocab_size=size, byte_fallback=True,
                                   character_coverage=1.0, add_dummy_prefix=True, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1)
    return tokens, scores, types


def tiny_gguf(job):
    import gguf

    rng = np.random.default_rng(job.get("seed", 0))
    c = job["config"]
    tokens, scores, types = _sentencepiece_vocab(c.get("sp_vocab", 320))
    D, F, L, N, K = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["num_attention_heads"], \
        c["num_key_value_heads"]
    H, V = D // N, len(tokens)
    w = gguf.GGUFWriter(job["out"], "llama")
    w.add_block_count(L)
    w.add_context_length(c.get("max_position_embeddings", 256))
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(N)
    w.add_head_count_kv(K)
    w.add_rope_freq_base(c.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(H)
    w.add_vocab_size(V)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template("{% for m in messages %}<s>[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %}"
                        "{% if add_generation_prompt %}<s>[assistant]{% endif %}")
    qtypes = [getattr(gguf.GGMLQuantizationType, t) for t in job["types"]]
    counter = iter(range(10 ** 6))

    def add(name, shape, norm=False):
        # shape in numpy order [rows, cols]; GGUF stores rows of `cols` elements
        if norm:
            w.add_tensor(name, rng.normal(1.0, 0.1, shape).astype(np.float32))
            return
        qt = qtypes[next(counter) % len(qtypes)]
        data = rng.normal(0, 0.05, shape).astype(np.float32)
        if qt in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K, gguf.GGMLQuantizationType.Q6_K,
                  gguf.GGMLQuantizationType.Q3_K, gguf.GGMLQuantizationType.Q2_K):
            block, size = gguf.GGML_QUANT_SIZES[qt]
            raw = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
            d = rng.uniform(0.001, 0.004, raw.shape[:2]).astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
            if qt in (gguf.GGMLQuantizationType.Q6_K, gguf.GGMLQuantizationType.Q3_K):
                raw[..., -2:] = d  # Q6_K and Q3_K keep their scale at the end of the block
            elif qt == gguf.GGMLQuantizationType.Q2_K:
                raw[..., -4:-2] = d  # Q2_K ends with d, then dmin
                raw[..., -2:] = d
            else:
                raw[..., 0:2] = d
                raw[..., 2:4] = d  # dmin
            w.add_tensor(name, raw.reshape(shape[0], -1), raw_dtype=qt)  # byte rows
        elif qt in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(name, data.astype(np.float16 if qt == gguf.GGMLQuantizationType.F16 else np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qt), raw_dtype=qt)

    add("token_embd.weight", (V, D))
    for i in range(L):
        add(f"blk.{i}.attn_norm.weight", (D,), norm=True)
        add(f"blk.{i}.ffn_norm.weight", (D,), norm=True)
        add(f"blk.{i}.attn_q.weight", (N * H, D))
        add(f"blk.{i}.attn_k.weight", (K * H, D))
        add(f"blk.{i}.attn_v.weight", (K * H, D))
        add(f"blk.{i}.attn_output.weight", (D, N * H))
        add(f"blk.{i}.ffn_gate.weight", (F, D))
        add(f"blk.{i}.ffn_up.weight", (F, D))
        add(f"blk.{i}.ffn_down.weight", (D, F))
    add("output_norm.weight", (D,), norm=True)
    add("output.weight", (V, D))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def from_gguf(job):
    import copy

    from transformers import AutoModelForCausalLM

    src = _load(job["gguf"])
    # A model loaded from GGUF refuses save_pretrained; the same weights in a plain model of the same config save.
    config = copy.deepcopy(src.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(src.state_dict())
    model.save_pretrained(job["out"])
    _load(job["gguf"], "tokenizer").save_pretrained(job["out"])


def _fresh_dynamic_rope(model):
    """A model's dynamic RoPE as loaded: transformers' keeps the frequencies of the longest sequence it has seen
    (down to the original ones only for a sequence shorter than the original context), so one prompt's result would
    depend on the prompts before it; day0jax's, as a new model's, depends on the prompt alone."""
    for m in model.modules():
        if "dynamic" in str(getattr(m, "rope_type", "")) and hasattr(m, "original_inv_freq"):
            m.register_buffer("inv_freq", m.original_inv_freq.clone(), persistent=False)
            m.max_seq_len_cached = m.original_max_seq_len


def run(job):
    model = _load(job["model"])
    result = {}
    with torch.no_grad():
        for i, prompt in enumerate(job["prompts"]):
            ids = torch.tensor([prompt])
            _fresh_dynamic_rope(model)
            result[f"logits_{i}"] = model(ids).logits[0].float().numpy()
            _fresh_dynamic_rope(model)
            if job.get("generate"):
                out = model.generate(ids, max_new_tokens=job["generate"], do_sample=False, min_new_tokens=0,
                                     eos_token_id=None if job.get("ignore_eos", True) else model.config.eos_token_id,
                                     pad_token_id=0)
                result[f"generated_{i}"] = out[0, len(prompt):].numpy()
    np.savez(job["out"], **result)


def rope_tables(job):
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = AutoConfig.for_model("llama", **job["config"])
    rope = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)  # only its dtype and device are read
    result = {}
    for i, start in enumerate(job["starts"]):  # one call per span, in order: dynamic NTK keeps state across calls
        cos, sin = rope(x, torch.arange(start, start + job["length"])[None])
        result[f"cos_{i}"], result[f"sin_{i}"] = cos[0].numpy(), sin[0].numpy()
    np.savez(job["out"], **result)


def state(job):
    model = _load(job["model"])
    np.savez(job["out"], **{k: v.float().numpy() for k, v in model.state_dict().items()})


def tokenize(job):
    tok = _load(job["model"], "tokenizer")
    out = {"texts": [tok(t).input_ids for t in job.get("texts", [])],
           "decoded": [tok.decode(tok(t).input_ids) for t in job.get("texts", [])],
           "chats": [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
                     for m in job.get("chats", [])],
           "chat_texts": [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
                          for m in job.get("chats", [])]}
    json.dump(out, open(job["out"], "w"))


def hidden(job):
    from transformers import AutoConfig

    dtype = getattr(torch, job.get("dtype", "float32"))
    model = _causal_lm(AutoConfig.from_pretrained(job["model"])).from_pretrained(job["model"], dtype=dtype).eval()
    result = {}
    with torch.no_grad():
        for i, prompt in enumerate(job["prompts"]):
            out = model(torch.tensor([prompt]), output_hidden_states=True)
            result[f"hidden_{i}"] = torch.stack([h[0] for h in out.hidden_states]).float().numpy()
            result[f"logits_{i}"] = out.logits[0].float().numpy()
    np.savez(job["out"], **result)


def gdn(job):
    import importlib

    mod = importlib.import_module(f"transformers.models.{job['family']}.modeling_{job['family']}")
    plain = lambda f: getattr(f, "__wrapped__", f)  # the torch code itself, not a hub or FLA kernel put in front
    if job["family"] == "qwen3_next":
        chunk, recurrent = mod.torch_chunk_gated_delta_rule, mod.torch_recurrent_gated_delta_rule
    else:
        chunk, recurrent = mod.chunk_kimi_delta_attention, mod.recurrent_kimi_delta_attention
    x = {k: torch.from_numpy(v) for k, v in np.load(job["inputs"]).items()}
    result = {}
    with torch.no_grad():
        if "q" in x:
            args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
            state = x.get("state")
            for name, fn in (("chunk", chunk), ("recurrent", recurrent)):
                out, final = plain(fn)(*args, initial_state=None if state is None else state.clone(),
                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
                result[f"{name}_out"], result[f"{name}_state"] = out.numpy(), final.numpy()
        if "x" in x:  # transformers' convolutions take [B, C, T]
            out = plain(mod.causal_conv1d_fn)(x["x"].transpose(1, 2), x["weight"], activation="silu")
            result["conv_out"] = out.transpose(1, 2).numpy()
        if "x_step" in x:
            state = x["conv_state"].transpose(1, 2).contiguous()  # updated in place
            out = plain(mod.causal_conv1d_update)(x["x_step"].transpose(1, 2), state, x["weight"],
                                                  activation="silu")
            result["step_out"], result["step_state"] = out.transpose(1, 2).numpy(), state.transpose(1, 2).numpy()
    np.savez(job["out"], **result)


# Families whose MTP layer is transformers' generic one (`modeling_layers.MtpModel`): the checkpoint names of its
# parts (`{i}`: the MTP layer's index, `{n}` the same past the last layer; the decoder layer's own tensors under
# `block`; `norms` and `copies` the post-norm and the copies of the embedding and head where the layer has them),
# and per MTP layer the main layer whose tensors fit the decoder layer HF's MTP config builds.
GENERIC_MTP = {
    "ernie4_5_moe": {"block": "model.mtp_block.{i}.", "enorm": "model.mtp_emb_norm.{i}.weight",
                     "hnorm": "model.mtp_hidden_norm.{i}.weight", "eh_proj": "model.mtp_linear_proj.{i}.weight",
                     "norms": (), "copies": {}, "like": [0]},
    "step3p7": {"block": "model.layers.{n}.", "enorm": "model.layers.{n}.enorm.weight",
                "hnorm": "model.layers.{n}.hnorm.weight", "eh_proj": "model.layers.{n}.eh_proj.weight",
                "norms": ("model.layers.{n}.shared_head.norm.weight",),
                "copies": {"model.layers.{n}.embed_tokens.weight": "model.embed_tokens.weight",
                           "model.layers.{n}.shared_head.head.weight": "lm_head.weight"}, "like": [2, 0]}}


def _generic_mtp(job):
    """The config's MTP layers (`num_nextn_predict_layers`, else one) saved in the family's layout (each decoder layer
    a copy of another random model's layer of the same kinds), then loaded and run by transformers' own
    `MtpModel.from_pretrained`; layer j > 0 chained on layer j - 1's output (`logits_{i}_{j}`)."""
    import tempfile

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig
    from transformers.modeling_layers import MtpModel

    tiny_hf(job)
    names = GENERIC_MTP[job["family"]]
    config = AutoConfig.for_model(job["family"], **job["config"]).get_text_config()
    L, D = config.num_hidden_layers, config.hidden_size
    count = getattr(config, "num_nextn_predict_layers", None) or 1
    offset = 0.0 if job["family"] == "step3p7" else 1.0  # Step-3.7's norms scale by (1 + w)
    with tempfile.TemporaryDirectory() as tmp:  # another random model, for the decoder layers' tensors
        tiny_hf(dict(job, out=tmp, seed=job.get("seed", 0) + 1))
        other = load_file(os.path.join(tmp, "model.safetensors"))
    torch.manual_seed(job.get("seed", 0) + 2)
    path = os.path.join(job["out"], "model.safetensors")
    tensors = load_file(path)
    for i in range(count):
        like = f"model.layers.{names['like'][i]}."
        tensors.update({names["block"].format(i=i, n=L + i) + k[len(like):]: v.clone() for k, v in other.items()
                        if k.startswith(like)})
        for norm in (names["enorm"], names["hnorm"], *names["norms"]):
            tensors[norm.format(i=i, n=L + i)] = torch.randn(D) * 0.1 + offset
        tensors[names["eh_proj"].format(i=i, n=L + i)] = torch.randn(D, 2 * D) * (2 * D) ** -0.5
        for copy, of in names["copies"].items():
            tensors[copy.format(i=i, n=L + i)] = tensors[of].clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})
    config_path = os.path.join(job["out"], "config.json")
    saved = json.load(open(config_path))
    text = saved.get("text_config", saved)
    text["num_nextn_predict_layers"] = count
    json.dump(saved, open(config_path, "w"), indent=1)

    model = _load(job["out"]).double()
    for c in (model.config, model.config.get_text_config()):
        c._attn_implementation = c._experts_implementation = "eager"
    # The head is the main model's (retied after loading), whose bias (ERNIE's use_bias) MtpModel's list of shared
    # tensors forgets. (A subclass would lose MtpModel's weight conversions, which are looked up by class name.)
    if "shared_head.bias" not in MtpModel._keys_to_ignore_on_load_missing:
        MtpModel._keys_to_ignore_on_load_missing = [*MtpModel._keys_to_ignore_on_load_missing, "shared_head.bias"]
    module = MtpModel.from_pretrained(model).double().eval()  # raises on any MTP tensor it cannot find
    np.savez(job["reference"], **_mtp_chain_logits(model, module, job["prompts"], count))


def _prompt_hidden(model, prompt: list[int]):
    """(ids [1, T + 1], T, the model's final hidden states at the first T positions [1, T, D]): what an MTP layer
    takes beside the tokens after those positions."""
    ids = torch.tensor([prompt])
    T = len(prompt) - 1
    return ids, T, model.get_decoder()(ids).last_hidden_state[:, :T]


def _mtp_chain_logits(model, module, prompts, count: int) -> dict:
    """`MtpModel` `module`'s logits over each prompt: `logits_{i}` of layer 0 on the model's final hidden states,
    `logits_{i}_{j}` of layer j > 0 chained on layer j - 1's output."""
    result = {}
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            ids, T, hidden = _prompt_hidden(model, prompt)
            h = module.forward_layer(0, hidden, torch.arange(T)[None], None, input_ids=ids[:, 1:])
            result[f"logits_{i}"] = module._project_to_logits(h)[0].numpy()
            for j in range(1, count):  # at position p, h of layer j - 1 there and token p + 1 + j
                n = T - j
                h = module.forward_layer(j, h[:, :n], torch.arange(n)[None], None, input_ids=ids[:, 1 + j:])
                result[f"logits_{i}_{j}"] = module._project_to_logits(h)[0].numpy()
    return result


# MiMo-V2-Flash's MTP layer, transformers' generic one (a sliding-attention decoder layer with a dense MLP, its own
# post-norm) stored under Xiaomi's names (`model.mtp.layers.{i}.`), which transformers does not read.
MIMO_MTP_NAMES = (("mtp_block.self_attn.sinks", "self_attn.attention_sink_bias"),
                  ("mtp_block.post_attention_layernorm.", "pre_mlp_layernorm."), ("mtp_block.", ""),
                  ("post_norm.", "final_layernorm."))


def _mimo_mtp(job):
    """The config's MTP layers (`num_nextn_predict_layers`, else one), built by transformers' own `MtpModel` around
    MiMo-V2-Flash's decoder layer (kinds: sliding attention, dense MLP), random, run in float64 (layer j > 0 chained on
    layer j - 1's output, `logits_{i}_{j}`), and saved in Xiaomi's layout."""
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpModel

    tiny_hf(job)
    count = job["config"].get("num_nextn_predict_layers") or 1
    model = _load(job["out"]).double()
    config = model.config
    config._attn_implementation = config._experts_implementation = "eager"
    config.num_mtp_layers, config.mtp_layer_types = count, ["sliding_attention"] * count
    config.mtp_mlp_layer_types = ["dense"] * count
    main = {k: v.clone() for k, v in model.state_dict().items()}
    module = MtpModel(model, count).double().eval()
    model.load_state_dict(main)  # whatever MtpModel's initialization did to the shared embedding and head
    D = config.hidden_size
    torch.manual_seed(job.get("seed", 0) + 1)
    tensors = load_file(os.path.join(job["out"], "model.safetensors"))
    with torch.no_grad():
        for name, p in module.layers.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape) * 0.1 + 1.0)
            elif name.endswith("eh_proj.weight"):
                p.copy_(torch.randn(p.shape) * (2 * D) ** -0.5)
            else:
                p.copy_(torch.randn(p.shape) * (0.5 if name.endswith("sinks") else 0.2))
            index, rest = name.split(".", 1)
            stored = next((new + rest[len(ours):] for ours, new in MIMO_MTP_NAMES if rest.startswith(ours)), rest)
            tensors[f"model.mtp.layers.{index}.{stored}"] = p.detach().float().clone().contiguous()
    result = _mtp_chain_logits(model, module, job["prompts"], count)
    save_file(tensors, os.path.join(job["out"], "model.safetensors"), metadata={"format": "pt"})
    config_path = os.path.join(job["out"], "config.json")
    saved = json.load(open(config_path))
    saved["num_nextn_predict_layers"] = count
    json.dump(saved, open(config_path, "w"), indent=1)
    np.savez(job["reference"], **result)


def _nemotron_h_mtp(job):
    """Nemotron 3's MTP layer as NVIDIA publishes it (transformers does not run it; vLLM's `NemotronHMTP` does): the
    blocks of `mtp_hybrid_override_pattern` (transformers' own `NemotronHBlock`s, taken with their tensors from
    another random model of the config, at its first layer of each kind) between enorm, hnorm and eh_proj and
    `final_layernorm`, in float64, saved as NVIDIA's flat `mtp.layers.{j}`."""
    import tempfile

    from safetensors.torch import load_file, save_file

    tiny_hf(job)
    pattern = job["config"]["mtp_hybrid_override_pattern"]
    kinds = [{"*": "full_attention", "E": "moe", "-": "mlp"}[ch] for ch in pattern]
    like = [job["config"]["layers_block_type"].index(kind) for kind in kinds]
    with tempfile.TemporaryDirectory() as tmp:
        tiny_hf(dict(job, out=tmp, seed=job.get("seed", 0) + 1))
        other = _load(tmp).double().eval()
        tensors = {f"mtp.layers.{j}." + k[len(f"backbone.layers.{i}."):]: v
                   for j, i in enumerate(like) for k, v in load_file(os.path.join(tmp, "model.safetensors")).items()
                   if k.startswith(f"backbone.layers.{i}.")}
    model = _load(job["out"]).double().eval()
    for m in (model, other):
        m.config._attn_implementation = m.config._experts_implementation = "eager"
    blocks = [other.get_decoder().layers[i] for i in like]
    D, eps = model.config.hidden_size, model.config.layer_norm_epsilon
    torch.manual_seed(job.get("seed", 0) + 2)
    enorm, hnorm, final = (torch.randn(D, dtype=torch.float64) * 0.1 + 1.0 for _ in range(3))
    eh_proj = torch.randn(D, 2 * D, dtype=torch.float64) * (2 * D) ** -0.5
    tensors.update({"mtp.layers.0.enorm.weight": enorm, "mtp.layers.0.hnorm.weight": hnorm,
                    "mtp.layers.0.eh_proj.weight": eh_proj,
                    f"mtp.layers.{len(kinds) - 1}.final_layernorm.weight": final})
    rms = lambda x, w: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w  # noqa: E731
    result = {}
    with torch.no_grad():
        for i, prompt in enumerate(job["prompts"]):
            ids, T, hidden = _prompt_hidden(model, prompt)
            x = torch.cat([rms(model.get_input_embeddings()(ids[:, 1:]), enorm), rms(hidden, hnorm)], -1) @ eh_proj.T
            mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)[None, None]
            for block in blocks:
                x = block(x, attention_mask=mask, position_ids=torch.arange(T)[None])
            result[f"logits_{i}"] = (rms(x, final) @ model.lm_head.weight.T)[0].numpy()
    path = os.path.join(job["out"], "model.safetensors")
    save_file({**load_file(path), **{k: v.float().contiguous() for k, v in tensors.items()}}, path,
              metadata={"format": "pt"})
    config_path = os.path.join(job["out"], "config.json")
    saved = json.load(open(config_path))
    saved["num_nextn_predict_layers"] = 1
    saved["mtp_hybrid_override_pattern"] = job["config"]["mtp_hybrid_override_pattern"]
    json.dump(saved, open(config_path, "w"), indent=1)
    np.savez(job["reference"], **result)


def _flat_mtp_layer(job, like, prefix: str, block: str, offset: float, count_key: str, run):
    """One MTP layer as vLLM runs the flat DeepSeek-style layouts: enorm and hnorm over the next token's embedding and
    the model's final hidden state, eh_proj over the two, a decoder layer, then `final_layernorm` and the shared
    head; float64. The decoder layer is another random model's layer `like(config)` (transformers' own module,
    called as `run(layer, x, position_embeddings, mask, positions)`), saved under `prefix + block` with that layer's
    tensor names (less its hyper-connection weights, which an MTP layer does not have); the norms scale by
    (offset + weight)."""
    import tempfile

    from safetensors.torch import load_file, save_file

    tiny_hf(job)
    model = _load(job["out"]).double()
    config = model.config
    D, index = config.hidden_size, like(config)
    with tempfile.TemporaryDirectory() as tmp:  # another random model, for the decoder layer's tensors
        tiny_hf(dict(job, out=tmp, seed=job.get("seed", 0) + 1))
        other = _load(tmp).double()
        saved = load_file(os.path.join(tmp, "model.safetensors"))
    for c in (model.config, other.config):
        c._attn_implementation = c._experts_implementation = "eager"
    layer, source = other.model.layers[index], f"model.layers.{index}."
    path = os.path.join(job["out"], "model.safetensors")
    tensors = load_file(path)
    tensors.update({prefix + block + k[len(source):]: v.clone() for k, v in saved.items()
                    if k.startswith(source) and ".hc_pre." not in k})
    torch.manual_seed(job.get("seed", 0) + 2)
    own = {"enorm": torch.randn(D) * 0.1 + 1.0 - offset, "hnorm": torch.randn(D) * 0.1 + 1.0 - offset,
           "eh_proj": torch.randn(D, 2 * D) * (2 * D) ** -0.5, "final_layernorm": torch.randn(D) * 0.1 + 1.0 - offset}
    tensors.update({f"{prefix}{k}.weight": v.contiguous() for k, v in own.items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})
    config_path = os.path.join(job["out"], "config.json")
    saved_config = json.load(open(config_path))
    saved_config[count_key] = 1
    json.dump(saved_config, open(config_path, "w"), indent=1)

    own = {k: v.double() for k, v in own.items()}

    def rms(x, w):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + config.rms_norm_eps) * (offset + w)

    result = {}
    with torch.no_grad():
        for i, prompt in enumerate(job["prompts"]):
            ids, T, hidden = _prompt_hidden(model, prompt)
            embeds = model.model.embed_tokens(ids[:, 1:])
            x = torch.cat([rms(embeds, own["enorm"]), rms(hidden, own["hnorm"])], -1) @ own["eh_proj"].T
            positions = torch.arange(T)[None]
            mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)[None, None]
            y = run(layer, x, model.model.rotary_emb(x, positions), mask, positions)
            result[f"logits_{i}"] = (rms(y, own["final_layernorm"]) @ model.lm_head.weight.T)[0].numpy()
    np.savez(job["reference"], **result)


def _hy_v4_mtp(job):
    """HY-V4's MTP layer as vLLM's HY-V4 MTP runs it (transformers skips `model.mtp_layers`), under
    `model.mtp_layers.0.`: on the model's final hidden state (after the hyper head and the final norm), a decoder
    layer without hyper-connections, each block a pre-norm residual one around transformers' own HY-V4 attention (a
    sparse layer's, with an indexer of its own) and MoE."""

    def run(layer, x, position_embeddings, mask, positions):
        x = x + layer.self_attn(layer.input_layernorm(x), position_embeddings=position_embeddings,
                                attention_mask=mask, position_ids=positions)[0]
        return x + layer.mlp(layer.post_attention_layernorm(x))

    _flat_mtp_layer(job, lambda c: next(i for i in range(c.num_hidden_layers) if c.mlp_layer_types[i] == "sparse"
                                        and c.indexer_types[i] == "full"),
                    "model.mtp_layers.0.", "", 0.0, "num_nextn_predict_layers", run)


def _minimax_m3_mtp(job):
    """MiniMax-M3's MTP module as vLLM's MiniMax-M3 MTP runs it (transformers skips `model.mtp.layers`), under
    `model.mtp.layers.0.`: its `transformer_layer` transformers' own MiniMax-M3 decoder layer with block-sparse
    attention and an MoE; (1 + weight) norms."""

    def run(layer, x, position_embeddings, mask, positions):
        return layer(x, position_embeddings=position_embeddings, attention_mask=mask, position_ids=positions)

    _flat_mtp_layer(job, lambda c: next(i for i in range(c.num_hidden_layers) if c.layer_types[i] == "minimax_m3_sparse"
                                        and c.mlp_layer_types[i] == "sparse"),
                    "model.mtp.layers.0.", "transformer_layer.", 1.0, "num_mtp_modules", run)


def _deepseek_v4_mtp(job):
    """DeepSeek-V4's MTP layer as DeepSeek publishes it and vLLM runs it (transformers does not): the main model's
    last streams (before its hyper head) through hnorm and h_proj, plus e_proj(enorm(embedding)) of the next token in
    every stream, then transformers' own `DeepseekV4DecoderLayer` (sliding attention, scored MoE: taken with its
    tensors from another random model of the config with one more layer, that last one) and `DeepseekV4HyperHead`,
    then the head's norm and the shared output head; in float64, saved as DeepSeek's `mtp.0.`."""
    import tempfile

    from safetensors.torch import load_file, save_file
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

    tiny_hf(job)
    seed, config = job.get("seed", 0), job["config"]
    L = config["num_hidden_layers"]
    longer = dict(config, num_hidden_layers=L + 1, layer_types=[*config["layer_types"], "sliding_attention"],
                  mlp_layer_types=[*config["mlp_layer_types"], "moe"])
    with tempfile.TemporaryDirectory() as tmp:
        tiny_hf(dict(job, out=tmp, seed=seed + 1, config=longer))
        other = _load(tmp).double().eval()
        prefix = f"model.layers.{L}."
        tensors = {"mtp.0." + k[len(prefix):]: v for k, v in load_file(os.path.join(tmp, "model.safetensors")).items()
                   if k.startswith(prefix)}
    model = _load(job["out"]).double().eval()
    for m in (model, other):
        m.config._attn_implementation = m.config._experts_implementation = "eager"
    block = other.model.layers[L]
    D, n, eps = model.config.hidden_size, model.config.hc_mult, model.config.rms_norm_eps
    torch.manual_seed(seed + 2)
    enorm, hnorm, norm = (torch.randn(D, dtype=torch.float64) * 0.1 + 1.0 for _ in range(3))
    e_proj, h_proj = (torch.randn(D, D, dtype=torch.float64) * D ** -0.5 for _ in range(2))
    head = DeepseekV4HyperHead(model.config).double()
    with torch.no_grad():
        head.hc_fn.copy_(torch.randn(n, n * D, dtype=torch.float64) * (n * D) ** -0.5)
        head.hc_base.copy_(torch.randn(n, dtype=torch.float64) * 0.1)
        head.hc_scale.copy_(torch.randn(1, dtype=torch.float64) * 0.1 + 1.0)
    tensors.update({"mtp.0.enorm.weight": enorm, "mtp.0.hnorm.weight": hnorm, "mtp.0.norm.weight": norm,
                    "mtp.0.e_proj.weight": e_proj, "mtp.0.h_proj.weight": h_proj, "mtp.0.hc_head_fn": head.hc_fn,
                    "mtp.0.hc_head_base": head.hc_base, "mtp.0.hc_head_scale": head.hc_scale})
    rms = lambda x, w: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w  # noqa: E731
    streams = []
    model.model.hc_head.register_forward_hook(lambda module, inputs, output: streams.append(inputs[0]))
    result = {}
    with torch.no_grad():
        for i, prompt in enumerate(job["prompts"]):
            ids, T = torch.tensor([prompt]), len(prompt) - 1
            streams.clear()
            model(ids)
            x = (rms(model.model.embed_tokens(ids[:, 1:]), enorm) @ e_proj.T)[:, :, None]
            x = x + rms(streams[0][:, :T], hnorm) @ h_proj.T
            positions = torch.arange(T)[None]
            rope = {kind: model.model.rotary_emb(x[:, :, 0], position_ids=positions, layer_type=kind)
                    for kind in ("main", "compress")}
            mask = create_sliding_window_causal_mask(config=model.config, inputs_embeds=x[:, :, 0],
                                                     attention_mask=None, cache=None, position_ids=positions)
            y = block(x, input_ids=None, position_embeddings=rope, position_ids=positions, attention_mask=mask)
            result[f"logits_{i}"] = (rms(head(y), norm) @ model.lm_head.weight.T)[0].numpy()
    path = os.path.join(job["out"], "model.safetensors")
    save_file({**load_file(path), **{k: v.detach().float().contiguous() for k, v in tensors.items()}}, path,
              metadata={"format": "pt"})
    config_path = os.path.join(job["out"], "config.json")
    saved = json.load(open(config_path))
    saved["num_nextn_predict_layers"] = 1
    json.dump(saved, open(config_path, "w"), indent=1)
    np.savez(job["reference"], **result)


def mtp(job):
    import copy
    import importlib

    from safetensors.torch import load_file, save_file

    if job["family"] in GENERIC_MTP:
        return _generic_mtp(job)
    if job["family"] == "mimo_v2_flash":
        return _mimo_mtp(job)
    if job["family"] == "nemotron_h":
        return _nemotron_h_mtp(job)
    if job["family"] == "deepseek_v4":
        return _deepseek_v4_mtp(job)
    if job["family"] == "hy_v4":
        return _hy_v4_mtp(job)
    if job["family"] == "minimax_m3_vl_text":
        return _minimax_m3_mtp(job)
    tiny_hf(job)
    family = job["family"]
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    model = _load(job["out"]).double()
    config = model.config
    # float64 needs the plain torch code paths (grouped matmuls take no doubles)
    config._attn_implementation = config._experts_implementation = "eager"
    L, D = config.num_hidden_layers, config.hidden_size
    torch.manual_seed(job.get("seed", 0) + 1)
    nextn = {"deepseek_v3": "DeepseekV3DecoderLayer", "deepseek_v32": "DeepseekV32DecoderLayer",
             "glm_moe_dsa": "GlmMoeDsaDecoderLayer", "hy_v3": "HYV3DecoderLayer"}
    # The norm before the head: DeepSeek's `shared_head.norm`; HY-V3's `final_layernorm` (vLLM's HY-V3 MTP layer).
    head_norm = "final_layernorm.weight" if family == "hy_v3" else "shared_head.norm.weight"
    deepseek = family in nextn  # stored as the layer after the last one
    own = copy.deepcopy(config)
    if deepseek:
        # Sparse-attention families read the layer's kind from per-layer lists: the MTP layer is an MoE with an
        # indexer of its own.
        if getattr(config, "mlp_layer_types", None) is not None:
            own.mlp_layer_types = list(config.mlp_layer_types[:L]) + ["sparse"]
        if getattr(config, "indexer_types", None) is not None:
            own.indexer_types = list(config.indexer_types[:L]) + ["full"]
        layer = getattr(mod, nextn[family])(own, layer_idx=L)
        prefix = f"model.layers.{L}."
    else:  # Qwen3-Next: a full-attention layer, its MLP as layer 0's (as vLLM builds it)
        own.layer_types = ["full_attention"] + list(config.layer_types[1:])
        layer = mod.Qwen3NextDecoderLayer(own, layer_idx=0)
        prefix = "mtp.layers.0."
    layer = layer.double()
    offset = 1.0 if not deepseek else 0.0  # Qwen3-Next's norms scale by (1 + weight)
    extra = {}
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name:
                p.normal_(1.0 - offset, 0.1)
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.2)
        for name, b in layer.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
        norm = lambda: torch.randn(D, dtype=torch.float64) * 0.1 + 1.0 - offset  # noqa: E731
        proj = torch.randn(D, 2 * D, dtype=torch.float64) * (2 * D) ** -0.5
        if deepseek:
            names = {"enorm.weight": norm(), "hnorm.weight": norm(), "eh_proj.weight": proj, head_norm: norm(),
                     "embed_tokens.weight": model.model.embed_tokens.weight.detach().clone(),
                     "shared_head.head.weight": model.lm_head.weight.detach().clone()}
            extra = {prefix + k: v for k, v in names.items()}
        else:
            extra = {"mtp.pre_fc_norm_embedding.weight": norm(), "mtp.pre_fc_norm_hidden.weight": norm(),
                     "mtp.fc.weight": proj, "mtp.norm.weight": norm()}
        for k, v in layer.state_dict().items():  # fused experts saved as save_pretrained saves them, one per expert
            if k.endswith("experts.gate_up_proj"):
                F = v.shape[1] // 2
                for e in range(v.shape[0]):
                    extra[f"{prefix}{k[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = v[e, :F].clone()
                    extra[f"{prefix}{k[:-len('gate_up_proj')]}{e}.up_proj.weight"] = v[e, F:].clone()
            elif k.endswith("experts.down_proj"):
                for e in range(v.shape[0]):
                    extra[f"{prefix}{k[:-len('down_proj')]}{e}.down_proj.weight"] = v[e].clone()
            else:
                extra[prefix + k] = v.detach().clone()
    path = os.path.join(job["out"], "model.safetensors")
    tensors = load_file(path)
    tensors.update({k: v.float().contiguous() for k, v in extra.items()})
    save_file(tensors, path, metadata={"format": "pt"})

    def rms(x, w):
        x = x.numpy()
        return torch.from_numpy(x / np.sqrt((x * x).mean(-1, keepdims=True) + config.rms_norm_eps)
                                * (w.numpy() + offset))

    result = {}
    with torch.no_grad():
        for i, prompt in enumerate(job["prompts"]):
            ids, T, hidden = _prompt_hidden(model, prompt)
            embeds = model.model.embed_tokens(ids[:, 1:])
            if deepseek:
                x = torch.cat([rms(embeds, extra[prefix + "enorm.weight"]),
                               rms(hidden, extra[prefix + "hnorm.weight"])], -1) @ extra[prefix + "eh_proj.weight"].T
            else:
                x = torch.cat([rms(embeds, extra["mtp.pre_fc_norm_embedding.weight"]),
                               rms(hidden, extra["mtp.pre_fc_norm_hidden.weight"])], -1) @ extra["mtp.fc.weight"].T
            positions = torch.arange(T)[None]
            mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)[None, None]
            y = layer(x, attention_mask=mask, position_ids=positions,
                      position_embeddings=model.model.rotary_emb(x, positions))
            y = y[0] if isinstance(y, tuple) else y
            y = rms(y, extra[prefix + head_norm] if deepseek else extra["mtp.norm.weight"])
            result[f"logits_{i}"] = (y @ model.lm_head.weight.T)[0].numpy()
    config_path = os.path.join(job["out"], "config.json")
    saved = json.load(open(config_path))
    saved["num_nextn_predict_layers" if deepseek else "mtp_num_hidden_layers"] = 1
    json.dump(saved, open(config_path, "w"), indent=1)
    np.savez(job["reference"], **result)


def mamba2(job):
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1RMSNormGated
    from transformers.models.nemotron_h import modeling_nemotron_h as mod

    plain = lambda f: getattr(f, "__wrapped__", f)  # the torch code itself, not a hub or mamba_ssm kernel
    x = {k: torch.from_numpy(v) for k, v in np.load(job["inputs"]).items()}
    result = {}
    with torch.no_grad():
        if "x" in x:
            B, T, N, H = x["x"].shape
            G, Z = x["b"].shape[2:]
            chunk, limit = int(x["chunk"]), tuple(float(v) for v in x["limit"])
            out, final = plain(mod.mamba2_chunk_scan)(
                x["x"], x["dt"], x["A"], x["b"], x["c"], chunk_size=chunk, D=x["D"], dt_bias=x["dt_bias"],
                initial_states=x["state"].clone(), dt_softplus=True, dt_limit=limit, return_final_states=True)
            result["chunk_out"], result["chunk_state"] = out.numpy(), final.numpy()
            # As mamba2_scan_forward calls it for a decode step: per-head values expanded over the head dim.
            state = x["state"].clone()
            out = plain(mod.mamba2_selective_state_update)(
                state, x["x"][:, 0], x["dt"][:, :1].transpose(1, 2).expand(-1, -1, H),
                x["A"][:, None, None].expand(-1, H, Z), x["b"][:, 0], x["c"][:, 0], x["D"][:, None].expand(-1, H),
                z=None, dt_bias=x["dt_bias"][:, None].expand(-1, H), dt_softplus=True)
            result["step_out"], result["step_state"] = out.numpy(), state.numpy()
        if "y" in x:
            groups = int(x["norm_groups"])
            I = x["y"].shape[-1]
            norm = mod.NemotronHRMSNormGated(I, group_size=I // groups, eps=1e-5)
            norm.weight.copy_(x["norm_weight"])
            result["gated_norm"] = norm(x["y"], x["z"]).numpy()
            norm = FalconH1RMSNormGated(I, eps=1e-5, n_groups=groups, norm_before_gate=True)
            norm.weight.copy_(x["norm_weight"])
            result["norm_gated"] = norm(x["y"], x["z"]).numpy()
    np.savez(job["out"], **result)


def parse_tools(job):
    from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS
    from transformers.utils.chat_parsing.response_parser import parse_response

    templates = {family: t for families, t in _RESPONSE_TEMPLATE_FALLBACKS.items() for family in families}
    out = []
    for case in job["cases"]:
        template = templates[case["family"]]
        anchor = template["start_anchor"]
        message = parse_response(case["text"], template, prefix=anchor if isinstance(anchor, str) else anchor[0],
                                 tools=case["tools"])
        out.append({"content": message.get("content", ""), "reasoning": message.get("reasoning_content"),
                    "calls": [[c["function"]["name"], c["function"]["arguments"]]
                              for c in message.get("tool_calls") or []]})
    json.dump(out, open(job["out"], "w"))


def render_chat(job):
    tokenizers = {}
    out = []
    for case in job["cases"]:
        if case["model"] not in tokenizers:
            tokenizers[case["model"]] = _load(case["model"], "tokenizer")
        out.append(tokenizers[case["model"]].apply_chat_template(
            case["messages"], tools=case.get("tools"), tokenize=False, add_generation_prompt=True,
            **case.get("kwargs", {})))
    json.dump(out, open(job["out"], "w"))


def hy_v4_ops(job):
    from types import SimpleNamespace

    from transformers import AutoConfig
    from transformers.models.hy_v4 import modeling_hy_v4 as mod

    torch.manual_seed(job["seed"])
    config = AutoConfig.for_model("hy_v4", **job["config"])
    B, T, n, D = 2, 21, config.hc_mult, config.hidden_size
    out = {}

    def weights(prefix, module):
        for name, p in module.named_parameters():  # scales and biases that bend the sigmoids
            if name.endswith("scale"):
                p.normal_(1.0, 0.3)
            elif name.endswith("base"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 1.0 / np.sqrt(p.shape[-1]))
            out[f"{prefix}.{name}"] = p.numpy().copy()

    with torch.no_grad():
        hc, head = mod.HYV4HyperConnection(config), mod.HYV4HyperHead(config)
        weights("hc", hc)
        weights("head", head)
        x = torch.randn(B, T, n, D)
        post, collapsed = hc(x)
        y = torch.randn(B, T, D)  # a block's output, spread back as HYV4DecoderLayer does
        expanded = post.unsqueeze(-1) * y.unsqueeze(-2) + x
        out.update(streams=x.numpy(), block_out=y.numpy(), post=post.numpy(), collapsed=collapsed.numpy(),
                   expanded=expanded.numpy(), head=head(x).numpy())

        a = {k: torch.from_numpy(v) for k, v in np.load(job["attention"]).items()}
        q, k, v, indices = a["q"], a["k"], a["v"], a["indices"].long()
        Bq, Tq, N, _ = q.shape
        low = torch.finfo(torch.float32).min
        causal = torch.ones(Tq, Tq, dtype=torch.bool).tril()
        mask = torch.zeros(Bq, 1, Tq, Tq).masked_fill(~causal, low)
        index_mask = torch.ones(Bq, Tq, Tq, dtype=torch.bool).scatter(-1, indices, False).unsqueeze(1)
        mask = mask.masked_fill(index_mask, low)
        module = SimpleNamespace(num_key_value_groups=N, sinks=a["sinks"], training=False)
        attn, _ = mod.eager_attention_forward(module, q.transpose(1, 2), k[:, None], v[:, None], mask,
                                              scaling=float(a["scale"]))
        out["attention"] = attn.numpy()  # [B, T, N, Hv]
    np.savez(job["out"], **out)


def deepseek_v4_ops(job):
    from types import SimpleNamespace

    from transformers import AutoConfig
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mod

    torch.manual_seed(job["seed"])
    config = AutoConfig.for_model("deepseek_v4", **job["config"])
    B, T, n, D = 2, 21, config.hc_mult, config.hidden_size
    out = {}

    def weights(prefix, module):
        for name, p in module.named_parameters():  # norms near 1, biases and scales that bend the sigmoids
            if "norm" in name or name.endswith("scale"):
                p.normal_(1.0, 0.3)
            elif name.endswith(("base", "position_bias")):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 1.0 / np.sqrt(p.shape[-1]))
            out[f"{prefix}.{name}"] = p.numpy().copy()

    with torch.no_grad():
        hc, head = mod.DeepseekV4HyperConnection(config), mod.DeepseekV4HyperHead(config)
        weights("hc", hc)
        weights("head", head)
        x = torch.randn(B, T, n, D)
        post, comb, collapsed = hc(x)
        y = torch.randn(B, T, D)  # a block's output, spread back as the decoder layer does
        expanded = post.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x)
        out.update(streams=x.numpy(), block_out=y.numpy(), post=post.numpy(), comb=comb.numpy(),
                   collapsed=collapsed.numpy(), expanded=expanded.numpy(), head=head(x).numpy())

        h, q_resid = torch.randn(B, T, D), torch.randn(B, T, config.q_lora_rank)
        positions = torch.arange(T)[None].expand(B, -1)
        out.update(hidden=h.numpy(), q_resid=q_resid.numpy())
        for prefix, cls in (("hca", mod.DeepseekV4HCACompressor), ("csa", mod.DeepseekV4CSACompressor)):
            compressor = cls(config)
            weights(prefix, compressor)
            entries, bias = compressor(h, q_resid, positions, None, 0)
            out[f"{prefix}_entries"] = entries[:, 0].numpy()
            out[f"{prefix}_visible"] = (bias[:, 0] == 0).numpy()  # [B, T, C]: entries each query attends to

        a = {k: torch.from_numpy(v) for k, v in np.load(job["attention"]).items()}
        q, k, entries, indices = a["q"], a["k"], a["entries"], a["indices"].long()
        window, ratio = int(a["window"]), int(a["ratio"])
        Bq, Tq, N, _ = q.shape
        C = entries.shape[1]
        pos = torch.arange(Tq)
        sliding = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < window)
        mask = torch.zeros(Bq, 1, Tq, Tq).masked_fill(~sliding, float("-inf"))
        # The CSA compressor's block bias: 0 at the valid chosen entries a query may see, -inf elsewhere.
        threshold = (pos + 1) // ratio
        valid = (indices >= 0) & (indices < threshold[None, :, None])
        safe = torch.where(valid, indices, torch.full_like(indices, C))
        block = torch.full((Bq, 1, Tq, C + 1), float("-inf")).scatter_(-1, safe.unsqueeze(1), 0.0)[..., :C]
        kv = torch.cat([k, entries], dim=1)[:, None]
        module = SimpleNamespace(num_key_value_groups=N, sinks=a["sinks"], training=False)
        attn, _ = mod.eager_attention_forward(module, q.transpose(1, 2), kv, kv, torch.cat([mask, block], -1),
                                              scaling=float(a["scale"]))
        out["attention"] = attn.numpy()  # [B, T, N, H]
    np.savez(job["out"], **out)


def minimax_m3_ops(job):
    from types import SimpleNamespace

    from transformers import AutoConfig
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as mod

    torch.manual_seed(job["seed"])
    config = AutoConfig.for_model("minimax_m3_vl_text", **job["config"])
    config._attn_implementation = "eager"
    a = {k: torch.from_numpy(v) for k, v in np.load(job["attention"]).items()}
    q, k, v = a["q"], a["k"], a["v"]
    B, T, N, _ = q.shape
    out = {}
    with torch.no_grad():
        indexer = mod.MiniMaxM3VLIndexer(config, 0)
        for name, p in indexer.named_parameters():  # norms hold (1 + weight): spread around 0
            p.normal_(0.0, 0.3 if "norm" in name else 1.0 / np.sqrt(p.shape[-1]))
        x = torch.randn(B, T, config.hidden_size)
        position_ids = torch.arange(T)[None].expand(B, -1)
        cos, sin = mod.MiniMaxM3VLRotaryEmbedding(config)(x, position_ids)
        captured = {}
        indexer.q_norm.register_forward_hook(lambda m, i, o: captured.__setitem__("q", o))
        indexer.k_norm.register_forward_hook(lambda m, i, o: captured.__setitem__("k", o))
        block_indices = indexer(x, (cos, sin), None, position_ids)
        Di = config.index_head_dim
        iq, ik = mod.apply_rotary_pos_emb(captured["q"].transpose(1, 2), captured["k"].transpose(1, 2),
                                          cos[..., :Di], sin[..., :Di])
        causal = torch.zeros(B, 1, T, T).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(),
                                                      torch.finfo(torch.float32).min)
        mask = indexer.build_block_mask(block_indices, causal, T, torch.float32, x.device, position_ids)
        module = SimpleNamespace(num_key_value_groups=N // k.shape[2], training=False)
        attn, _ = mod.eager_attention_forward(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask,
                                              scaling=q.shape[-1] ** -0.5)
        out.update(x=x.numpy(), iq=iq.transpose(1, 2).numpy(), ik=ik[:, 0].numpy(),
                   block_indices=block_indices.numpy(), attention=attn.numpy())
    np.savez(job["out"], **out)


def glm5_next_ops(job):
    from transformers import AutoConfig
    from transformers.models.glm5_next import modeling_glm5_next as mod

    torch.manual_seed(job["seed"])
    config = AutoConfig.for_model("glm5_next_text", **job["config"])
    B, T = job["shape"]
    with torch.no_grad():
        indexer = mod.Glm5NextTextIndexer(config, 0)
        for name, p in indexer.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.3 if "norm" in name else 0.5)
        x = torch.randn(B, T, config.hidden_size)
        q_resid = torch.randn(B, T, config.q_lora_rank)
        indices = indexer(x, q_resid, torch.ones(B, T, dtype=torch.bool), None)
        I, Di = config.index_n_heads, config.index_head_dim
        out = dict(iq=indexer.wq_b(q_resid).view(B, T, I, Di).numpy(),
                   weights=(indexer.weights_proj(x) * I ** -0.5).numpy(), ik=indexer.k_norm(indexer.wk(x)).numpy(),
                   gate=torch.nn.functional.linear(x, indexer.index_kpool_compress_gate).numpy(),
                   ape=indexer.index_kpool_compress_ape.numpy(), topk_indices=indices.numpy())
    np.savez(job["out"], **out)


def qwen4_exp_ops(job):
    from transformers import AutoConfig
    from transformers.models.qwen4_exp import modeling_qwen4_exp as mod

    torch.manual_seed(job["seed"])
    config = AutoConfig.for_model("qwen4_exp_text", **job["config"])
    B, T, n, D = 2, 13, config.hc_count, config.hidden_size
    out = {}

    def weights(prefix, module):
        for name, p in module.named_parameters():  # norms hold (1 + weight): spread around 0
            p.normal_(0.0, 0.3 if "norm" in name else 1.0 / np.sqrt(p.shape[-1]))
            out[f"{prefix}.{name}"] = p.numpy().copy()

    with torch.no_grad():
        gr, mixer = mod.Qwen4ExpTextGatedResidual(config), mod.Qwen4ExpTextGatedResidual(config, use_combine=False)
        weights("gr", gr)
        weights("mixer", mixer)
        x = torch.randn(B, T, n * D)
        mixed, _, post = gr(x)
        out.update(streams=x.numpy(), gr_input=mixed.numpy(), gr_post=post.numpy(), mixer_out=mixer(x).numpy())

        indexer = mod.Qwen4ExpTextQSAIndexer(config, 0)
        weights("ix", indexer)
        h = torch.randn(B, T, D)
        position_ids = torch.arange(T)[None, None].expand(3, B, -1)
        cos, sin = mod.Qwen4ExpTextRotaryEmbedding(config)(h, position_ids)
        captured = {}
        select = indexer._select_tokens

        def capture(hidden, q, raw_keys, *args, **kwargs):
            captured.update(q=q, k=raw_keys)
            return select(hidden, q, raw_keys, *args, **kwargs)

        indexer._select_tokens = capture
        causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(B, 1, T, T)
        selected = indexer(h, (cos, sin), causal, None)
        out.update(ix_x=h.numpy(), ix_q=captured["q"].numpy(), ix_k=captured["k"].numpy(),
                   ix_selected=selected[:, 0].numpy())

        embedding = mod.Qwen4ExpTextNGramEmbedding(config, config.ple_embed_dim, 0, 1)
        ids = {}
        embedding.ngram_embedding.register_forward_hook(lambda m, i, o: ids.__setitem__("ids", i[0]))
        embedding(torch.tensor(job["tokens"]), None)
        out["ngram_ids"] = ids["ids"].numpy()
    np.savez(job["out"], **out)


def mxfp4_dequantize(job):
    from safetensors.numpy import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = {}
    for f in sorted(os.listdir(job["model"])):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(job["model"], f)))
    out = {}
    for name in tensors:
        if name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            w = convert_moe_packed_tensors(torch.from_numpy(tensors[name]), torch.from_numpy(tensors[base + "_scales"]),
                                           dtype=torch.float32)
            out[base] = w.numpy()
    np.savez(job["out"], **out)


def nvfp4_dequantize(job):
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(os.listdir(job["model"])):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(job["model"], f)))
    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True,
                            dynamic=False)
    out = {}
    for name in tensors:
        if name.endswith(".weight_packed"):
            base = name[: -len("_packed")]
            O, half = tensors[name].shape
            x = unpack_fp4_from_uint8(tensors[name], O, 2 * half, dtype=torch.float32)
            out[base] = dequantize(x_q=x, scale=tensors[base + "_scale"].to(torch.float32), args=args,
                                   global_scale=tensors[base + "_global_scale"], dtype=torch.float32).numpy()
    np.savez(job["out"], **out)


def _peft_name(name):
    """A trainable parameter's name in a PeftModel -> the name PEFT saves it under (no adapter name)."""
    return name.replace(".default.", ".")


def peft_train(job):
    from peft import PeftModel

    model = PeftModel.from_pretrained(_load(job["model"]), job["adapter"], is_trainable=True)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    wd = job.get("weight_decay", 0.0)
    if job["optimizer"] == "adamw":
        opt = torch.optim.AdamW(params, lr=job["lrs"][0], betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    else:
        opt = torch.optim.SGD(params, lr=job["lrs"][0], weight_decay=wd)
    out, losses = {}, []
    for i, batch in enumerate(job["batches"]):
        tokens = torch.tensor(batch["tokens"])
        labels = tokens.clone()
        labels[torch.tensor(batch["mask"]) == 0] = -100
        for group in opt.param_groups:
            group["lr"] = job["lrs"][i]
        opt.zero_grad()
        loss = model(input_ids=tokens, labels=labels).loss
        loss.backward()
        if i == 0:
            out.update({f"grad.{_peft_name(n)}": p.grad.detach().numpy().copy() for n, p in named})
        opt.step()
        losses.append(loss.item())
    out["losses"] = np.array(losses)
    out.update({f"param.{_peft_name(n)}": p.detach().numpy() for n, p in named})
    np.savez(job["out"], **out)


def full_grads(job):
    model = _load(job["model"])
    tokens = torch.tensor(job["batch"]["tokens"])
    labels = tokens.clone()
    labels[torch.tensor(job["batch"]["mask"]) == 0] = -100
    loss = model(input_ids=tokens, labels=labels).loss
    loss.backward()
    out = {f"grad.{n}": p.grad.detach().numpy() for n, p in model.named_parameters()}
    np.savez(job["out"], loss=np.array(loss.item()), **out)


def peft_logits(job):
    from peft import PeftModel

    model = PeftModel.from_pretrained(_load(job["model"]), job["adapter"]).eval()
    with torch.no_grad():
        out = {f"logits_{i}": model(input_ids=torch.tensor([p])).logits[0].float().numpy()
               for i, p in enumerate(job["prompts"])}
    np.savez(job["out"], **out)


def peft_make(job):
    from peft import LoraConfig, PeftModel, get_peft_model

    out = {}
    for k, spec in enumerate(job["adapters"]):
        torch.manual_seed(spec["seed"])
        model = get_peft_model(_load(job["model"]), LoraConfig(r=spec["r"], lora_alpha=spec["alpha"],
                                                               target_modules=spec["targets"], lora_dropout=0.0))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.1)
        model.save_pretrained(spec["folder"])
        model = PeftModel.from_pretrained(_load(job["model"]), spec["folder"]).eval()
        with torch.no_grad():
            for i, prompt in enumerate(job["prompts"]):
                ids = torch.tensor([prompt])
                out[f"{k}.logits_{i}"] = model(input_ids=ids).logits[0].float().numpy()
                gen = model.generate(input_ids=ids, max_new_tokens=job["generate"], do_sample=False,
                                     min_new_tokens=0, eos_token_id=None, pad_token_id=0)
                out[f"{k}.generated_{i}"] = gen[0, len(prompt):].numpy()
    np.savez(job["out"], **out)


def train_rows(job):
    tok = _load(job["model"], "tokenizer")

    def chat(messages, prompt, tools=None):
        kwargs = {"tools": tools} if tools else {}
        return list(tok.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True,
                                            return_dict=False, **kwargs))

    out = []
    for row in job["rows"]:
        if "messages" in row:
            m, tools = row["messages"], row.get("tools")
            out.append([chat(m, False, tools), len(chat(m[:-1], True, tools))])
        elif "prompt" in row:
            m = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]
            out.append([chat(m, False), len(chat(m[:1], True))])
        else:
            ids = list(tok(row["text"]).input_ids)
            if not ids or ids[-1] != tok.eos_token_id:
                ids.append(tok.eos_token_id)
            out.append([ids, 0])
    json.dump(out, open(job["out"], "w"))


def _op(name):
    """The job function `name`: defined here, or in one of the vision modules beside this script."""
    if name in globals():
        return globals()[name]
    import ref_multimodal
    import ref_preprocess
    import ref_vision

    for module in (ref_multimodal, ref_preprocess, ref_vision):
        if hasattr(module, name):
            return getattr(module, name)
    raise KeyError(f"unknown reference job {name!r}")


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    jobs = json.load(open(sys.argv[1]))
    for job in jobs:
        _op(job["op"])(job)
        print(f"done {job['op']} -> {job.get('out')}", flush=True)


if __name__ == "__main__":
    main()
