"""Tiny configurations per model family, built with random weights by transformers for the parity tests.

Each entry: name -> (HF model_type, config overrides, batch_invariant). `batch_invariant=False` marks RoPE
variants whose frequencies depend on the longest sequence in the call (HF's `dynamic` and `longrope`), where a
padded batch legitimately differs from one-prompt-at-a-time; those are compared prompt by prompt.
"""

from dataclasses import dataclass

# initializer_range: HF's default 0.02 leaves attention nearly uniform at this width (the scores' spread is about
# hidden_size * initializer_range^2), where RoPE, soft-caps and softmax scales barely move the logits; 0.15 gives
# scores of order 1 (tests/mutations.py checks that each feature shows).
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, initializer_range=0.15)

NO_DENSE = {k: v for k, v in TINY.items() if k != "intermediate_size"}  # MoE-only families: no such key
NO_RMS = {k: v for k, v in TINY.items() if k != "rms_norm_eps"}  # LayerNorm families: layer_norm_eps instead

FAMILIES = {
    "llama": ("llama", dict(TINY), True),
    "llama_tied_bias_headdim": ("llama", dict(TINY, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                                              head_dim=32), True),
    "llama_mqa_linear": ("llama", dict(TINY, num_key_value_heads=1,
                                       rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                        "rope_theta": 10000.0}), True),
    # Dynamic NTK stretches the base only past max_position_embeddings: the two longer prompts go past it.
    "llama_dynamic": ("llama", dict(TINY, max_position_embeddings=16,
                                    rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                     "rope_theta": 10000.0}), False),
    "llama_yarn": ("llama", dict(TINY, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                        "original_max_position_embeddings": 32}), True),
    "llama3_rope": ("llama", dict(TINY, rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 16}), True),
    "llama_longrope": ("llama", dict(TINY, max_position_embeddings=64,
                                     rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                      "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0],
                                                      "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
                                                      "original_max_position_embeddings": 16}), False),
    "mistral": ("mistral", dict(TINY, sliding_window=8), True),
    # Layer 0 slides (window 8, shorter than the longer prompts), layer 1 attends fully. HF's Ministral needs head_dim.
    "ministral": ("ministral", dict(TINY, head_dim=16, sliding_window=8,
                                    layer_types=["sliding_attention", "full_attention"]), True),
    # No layer_types: HF's default makes every layer slide; a wider head, the legacy rope_theta key, tied embeddings.
    "ministral_default": ("ministral", dict(TINY, head_dim=32, sliding_window=8, rope_theta=1000000.0,
                                            tie_word_embeddings=True), True),
    # EXAONE's own keys (num_layers, layer_norm_epsilon, activation_function) and legacy llama3 rope_scaling; the
    # checkpoint is saved under EXAONE's tensor names (transformer.h.*.attn.attention.*, ln_1, c_fc_0...).
    "exaone": ("exaone", dict({k: v for k, v in TINY.items() if k not in ("num_hidden_layers", "rms_norm_eps")},
                              num_layers=2, layer_norm_epsilon=1e-5, activation_function="silu", embed_dropout=0.0,
                              rope_theta=1000000.0,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}), True),
    # HF's default RoPE (theta 5e5, ExaoneConfig's default_theta), biases on every projection, tied embeddings.
    "exaone_bias_tied": ("exaone", dict(TINY, head_dim=32, attention_bias=True, mlp_bias=True,
                                        tie_word_embeddings=True), True),
    # Layer 0 full attention, layer 1 sliding (max_window_layers=1).
    "qwen2": ("qwen2", dict(TINY, use_sliding_window=True, sliding_window=8, max_window_layers=1), True),
    "qwen3": ("qwen3", dict(TINY, head_dim=32), True),
    # Layer 0 dense (mlp_only_layers), layer 1 sparse with the gated shared expert; top-2 not renormalized.
    "qwen2_moe": ("qwen2_moe", dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, mlp_only_layers=[0]), True),
    "qwen3_moe": ("qwen3_moe", dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True), True),
    "mixtral": ("mixtral", dict(TINY, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
                                sliding_window=8), True),
    "gemma": ("gemma", dict(TINY, head_dim=32), True),
    # Small soft-caps so that tanh is far from linear on these logits.
    "gemma2": ("gemma2", dict(TINY, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
                              attn_logit_softcapping=2.0, final_logit_softcapping=3.0), True),
    "gemma3_text": ("gemma3_text", dict(TINY, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
                                        layer_types=["sliding_attention", "full_attention"],
                                        final_logit_softcapping=3.0,
                                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                            "rope_theta": 1000000.0},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 10000.0}}), True),
    # Gemma 4, 4 layers sliding/global: the last two share the first two's keys and values (KV sharing) and have
    # MLPs twice as wide; global layers of their own head shape (H 32, one kv head whose keys are also the values)
    # rotated by proportional RoPE; per-layer inputs; the final soft-cap.
    "gemma4": ("gemma4_text", dict(TINY, num_hidden_layers=4, head_dim=16, global_head_dim=32,
                                   num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
                                   layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
                                   use_double_wide_mlp=True, hidden_size_per_layer_input=8,
                                   vocab_size_per_layer_input=256, final_logit_softcapping=3.0), True),
    # Gemma 4's MoE layers (routed experts beside the dense MLP), no per-layer inputs, separate v_proj, untied.
    "gemma4_moe": ("gemma4_text", dict(TINY, head_dim=16, global_head_dim=32, sliding_window=8,
                                       layer_types=["sliding_attention", "full_attention"],
                                       hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4,
                                       top_k_experts=2, moe_intermediate_size=32, tie_word_embeddings=False), True),
    "phi3": ("phi3", dict(TINY, partial_rotary_factor=0.5, sliding_window=8), True),
    "phi3_longrope": ("phi3", dict(TINY, max_position_embeddings=64, original_max_position_embeddings=16,
                                   rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                    "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0],
                                                    "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]}),
                      False),
    "olmo2": ("olmo2", dict(TINY), True),
    # 3 layers: one dense (first_k_dense_replace), two MoE; YaRN with mscale_all_dim scales the softmax.
    "deepseek_v3": ("deepseek_v3", dict(TINY, num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8,
                                        num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=32,
                                        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                                        n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=1,
                                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                         "original_max_position_embeddings": 32, "mscale": 1.0,
                                                         "mscale_all_dim": 1.0, "beta_fast": 32.0,
                                                         "beta_slow": 1.0}), True),
    # No q low-rank (a plain q_proj), RoPE dims not interleaved, weights not renormalized.
    "deepseek_v3_plain_q": ("deepseek_v3", dict(TINY, num_key_value_heads=4, n_routed_experts=4,
                                                num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=None,
                                                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                                v_head_dim=16, n_group=2, topk_group=1, first_k_dense_replace=1,
                                                n_shared_experts=2, rope_interleave=False, norm_topk_prob=False,
                                                routed_scaling_factor=1.5), True),
    # 3 layers: one dense, two MoE with softmax scores limited to the best of 2 groups (a group's score: its best
    # expert's; more experts per token than groups kept, or the limit never binds), weights scaled, not
    # renormalized; a low-rank query; YaRN with mscale_all_dim in the softmax scale.
    "deepseek_v2": ("deepseek_v2", dict(TINY, num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8,
                                        num_experts_per_tok=3, moe_intermediate_size=32, q_lora_rank=32,
                                        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                                        topk_method="group_limited_greedy", n_group=2, topk_group=1,
                                        first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.0,
                                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                         "original_max_position_embeddings": 32, "mscale": 0.707,
                                                         "mscale_all_dim": 0.707, "beta_fast": 32.0,
                                                         "beta_slow": 1.0}), True),
    # V2-Lite's shape: a plain q_proj, greedy top-k over all experts, MoE from layer 0 with two shared experts;
    # attention and MLP biases.
    "deepseek_v2_lite": ("deepseek_v2", dict(TINY, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=32, q_lora_rank=None, kv_lora_rank=16,
                                             qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
                                             topk_method="greedy", n_shared_experts=2, attention_bias=True,
                                             mlp_bias=True, routed_scaling_factor=1.5), True),
    # A SwiGLU limit that these activations reach, so that the clamp shows.
    "gpt_oss": ("gpt_oss", dict(TINY, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=16,
                                sliding_window=8, swiglu_limit=1.5,
                                rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 150000.0,
                                                 "original_max_position_embeddings": 32, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "truncate": False}), True),
    # Layer 1 has no RoPE (interval 2) and, with use_sliding_window, a window.
    "smollm3": ("smollm3", dict(TINY, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=8), True),
    "granite": ("granite", dict(TINY, embedding_multiplier=12.0, attention_multiplier=0.1, residual_multiplier=0.22,
                                logits_scaling=8.0), True),
    # q/k norms over all heads, half the head dims rotated (rotary_dim), biased sigmoid routing; MiniMax's own keys.
    "minimax_m2": ("minimax_m2", dict(TINY, intermediate_size=32, head_dim=16, rotary_dim=8, num_local_experts=4,
                                      num_experts_per_tok=2, use_qk_norm=True, qk_norm_type="per_layer",
                                      scoring_func="sigmoid", use_routing_bias=True, shared_intermediate_size=0,
                                      attn_type_list=[1, 1], num_mtp_modules=1), True),
    # Every dim rotated, top-3 of 8 experts, tied embeddings.
    "minimax_m2_full_rotary": ("minimax_m2", dict(TINY, intermediate_size=32, head_dim=16, num_local_experts=8,
                                                  num_experts_per_tok=3, tie_word_embeddings=True,
                                                  rope_theta=10000.0), True),
    # MiniMax-M3's text model, 3 layers: block-sparse attention in layers 0 and 2 (blocks of 4 positions, the best 3
    # per query and KV group, the query's own block and the one before it always kept; the longer prompts and their
    # continuations span up to 8 blocks), full attention in layer 1; layer 0's MLP dense, layers 1 and 2 MoE (top-2
    # of 4 experts, a shared expert). Per-head (1 + weight) q/k norms, half of each head rotated.
    # Qwen4-Exp: linear attention with per-layer embeddings on layers 1 and 3 (n-grams up to 3, hashed into prime
    # tables of 1000-odd rows, split into 3 checkpoint pieces), its eos (27) inside prompts 1 and 2 so that n-grams
    # restart there; indexed attention over blocks of 4 with a budget of 2 blocks (prompts of 5 to 20 tokens: the
    # choice leaves blocks out); 3 gated-residual streams; MoE with a gated shared expert; partial RoPE. Four indexer
    # heads: a block scores exactly 0 only when all of them score it negative, and among equal scores which block
    # transformers keeps is the order of torch.topk's ties (day0jax keeps the first).
    "qwen4_exp": ("qwen4_exp_text", dict(NO_DENSE, num_hidden_layers=3, head_dim=16, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=24,
                                         layer_types=["linear_attention", "indexed_attention", "linear_attention"],
                                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                         linear_value_head_dim=16, indexer_n_heads=4, indexer_kv_heads=1,
                                         indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
                                         hc_count=3, hc_lowrank=16, ple_layer_ids=[1, 3], ple_embed_dim=32,
                                         heads_per_ngram=2, ngram_vocab_size_base=1000,
                                         make_ngram_vocab_size_divisible_by=8, split_ngram_parts=3, eos_token_id=27,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.5}), True),
    "minimax_m3": ("minimax_m3_vl_text", dict(TINY, num_hidden_layers=3, head_dim=16, intermediate_size=32,
                                              dense_intermediate_size=48, shared_intermediate_size=24,
                                              num_local_experts=4, num_experts_per_tok=2, routed_scaling_factor=1.5,
                                              index_n_heads=2, index_head_dim=16, index_block_size=4,
                                              index_topk_blocks=3, index_local_blocks=2,
                                              layer_types=["minimax_m3_sparse", "full_attention", "minimax_m3_sparse"],
                                              mlp_layer_types=["dense", "sparse", "sparse"],
                                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                               "partial_rotary_factor": 0.5}), True),
    # Every layer block-sparse and MoE (HF's default mlp_layer_types), one KV head and one indexer head, blocks of 3
    # (prompt lengths and their continuations end inside a block), top-2 with only the query's own block forced;
    # indexer heads wider than the rotated dims (the tail not rotated), every head dim rotated with HF's default
    # theta, tied embeddings.
    "minimax_m3_mqa": ("minimax_m3_vl_text", dict(TINY, num_key_value_heads=1, head_dim=16, intermediate_size=32,
                                                  shared_intermediate_size=16, num_local_experts=4,
                                                  num_experts_per_tok=2, index_n_heads=1, index_head_dim=24,
                                                  index_block_size=3, index_topk_blocks=2, index_local_blocks=1,
                                                  layer_types=["minimax_m3_sparse"] * 2,
                                                  tie_word_embeddings=True), True),
    # 3 layers: one dense, two MoE with grouped routing (4 groups of 2, best 2), scaled weights, shared expert;
    # q/k/v biases, per-head q/k norms, half the head dims rotated (HF's default).
    "glm4_moe": ("glm4_moe", dict(TINY, num_hidden_layers=3, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                                  moe_intermediate_size=32, n_group=4, topk_group=2, first_k_dense_replace=1,
                                  routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True), True),
    # MoE from layer 0, no biases or q/k norms, weights not renormalized, two shared experts, a quarter rotated.
    "glm4_moe_plain": ("glm4_moe", dict(TINY, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=32, first_k_dense_replace=0, norm_topk_prob=False,
                                        n_shared_experts=2, partial_rotary_factor=0.25, num_nextn_predict_layers=0),
                       True),
    # 3 layers: one dense, two MoE (grouped sigmoid routing, 4 groups of 2, best 2, score bias, renormalized,
    # scaled, a shared expert); per-head q/k norms, biases, and the last layer sliding (from max_window_layers on).
    "dots1": ("dots1", dict(TINY, num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2,
                            first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                            attention_bias=True, sliding_window=8, max_window_layers=2), True),
    # HF's default pattern over 4 layers (3 sliding, then full); YaRN on the full layer only, another theta on the
    # sliding ones.
    "olmo3": ("olmo3", dict(TINY, num_hidden_layers=4, sliding_window=8,
                            rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0,
                                                                "rope_theta": 10000.0, "attention_factor": 1.2,
                                                                "original_max_position_embeddings": 32},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}),
              True),
    # layer_types given, biases on q/k/v/o, tied embeddings; the top-level rope_theta reaches the full layer only.
    "olmo3_bias": ("olmo3", dict(TINY, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                                 attention_bias=True, tie_word_embeddings=True, rope_theta=10000.0), True),
    # q/k/v biases (HF's default), an o_proj bias of its own, MLP biases.
    "seed_oss": ("seed_oss", dict(TINY, head_dim=16, attention_out_bias=True, mlp_bias=True), True),
    # HF's default pattern over 4 layers: 3 sliding layers with RoPE, then a full-attention layer without positions.
    "exaone4": ("exaone4", dict(TINY, num_hidden_layers=4, sliding_window=8, sliding_window_pattern=4,
                                rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0,
                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 16}), True),
    # No window: every layer full attention with RoPE.
    "exaone4_global": ("exaone4", dict(TINY, sliding_window=None, layer_types=["full_attention"] * 2,
                                       tie_word_embeddings=True), True),
    # Interleaved RoPE pairs; biases on every projection.
    "ernie4_5": ("ernie4_5", dict(TINY, head_dim=16, use_bias=True, rope_theta=100.0), True),
    "ernie4_5_tied": ("ernie4_5", dict(TINY, head_dim=32, num_key_value_heads=1, tie_word_embeddings=True), True),
    # Layer 0 dense, 1 and 2 MoE (start 1, end -1: the last); top-2 of 4 chosen by score + routing bias, two shared
    # experts, biases everywhere (lm_head's too).
    "ernie4_5_moe": ("ernie4_5_moe", dict(TINY, num_hidden_layers=3, moe_num_experts=4, moe_k=2,
                                          moe_intermediate_size=32, moe_num_shared_experts=2, use_bias=True,
                                          tie_word_embeddings=False, rope_theta=100.0), True),
    # Only layer 1 is an MoE (interval 2 from 0, end 1); top-3, no shared experts, tied embeddings.
    "ernie4_5_moe_interval": ("ernie4_5_moe", dict(TINY, num_hidden_layers=3, moe_num_experts=4, moe_k=3,
                                                   moe_intermediate_size=32, moe_num_shared_experts=0,
                                                   moe_layer_start_index=0, moe_layer_end_index=1, moe_layer_interval=2,
                                                   tie_word_embeddings=True), True),
    # q/k norms after RoPE; "dynamic" RoPE with an alpha (a fixed stretch of the base); biases.
    "hunyuan_v1_dense": ("hunyuan_v1_dense", dict(TINY, head_dim=16, attention_bias=True,
                                                  rope_parameters={"rope_type": "dynamic", "alpha": 50.0,
                                                                   "factor": 1.0, "rope_theta": 100.0}), True),
    # An MoE on every layer: top-2 then top-3 of 4 experts (a per-layer moe_topk), always renormalized, beside the
    # shared MLP; the dense family's q/k norms after RoPE and alpha RoPE, biases.
    "hunyuan_v1_moe": ("hunyuan_v1_moe", dict(TINY, head_dim=16, num_experts=4, moe_topk=[2, 3], attention_bias=True,
                                              rope_parameters={"rope_type": "dynamic", "alpha": 50.0,
                                                               "factor": 1.0, "rope_theta": 100.0}), True),
    # One moe_topk for every layer, top-1 (a weight of exactly 1), plain RoPE, tied embeddings.
    "hunyuan_v1_moe_top1": ("hunyuan_v1_moe", dict(TINY, head_dim=16, num_experts=4, moe_topk=1, rope_theta=1000.0,
                                                   tie_word_embeddings=True), True),
    # 3 layers MoE, dense, MoE (mlp_layer_types, not HF's default): sigmoid scores, top-2 of 8 chosen with the
    # routing bias, renormalized, times router_scaling_factor (HF's default), beside two shared experts as one MLP;
    # per-head q/k norms before RoPE; biases on attention, the dense MLP and the shared experts.
    "hy_v3": ("hy_v3", dict(TINY, num_hidden_layers=3, head_dim=16, mlp_layer_types=["sparse", "dense", "sparse"],
                            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=2,
                            attention_bias=True, mlp_bias=True,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), True),
    # HF's defaults: the first layer dense, its RoPE base (11158840), one shared expert; top-3 of 4 with another
    # routed scale, the shared experts added in the model's dtype, tied embeddings.
    "hy_v3_default": ("hy_v3", dict(TINY, head_dim=16, num_experts=4, num_experts_per_tok=3, moe_intermediate_size=32,
                                    router_scaling_factor=0.5, enable_moe_fp32_combine=False,
                                    tie_word_embeddings=True), True),
    # Interleaved RoPE on half the head dims (HF's default), fused gate/up, four norms a layer, q/k/v biases.
    "glm4": ("glm4", dict(TINY, head_dim=16, rope_theta=100.0), True),
    # A quarter of the dims rotated, no biases, tied embeddings.
    "glm4_quarter_rotary": ("glm4", dict(TINY, head_dim=16, partial_rotary_factor=0.25, attention_bias=False,
                                         tie_word_embeddings=True), True),
    # Ungated ReLU-squared MLP, YaRN; the second with biases everywhere and SiLU.
    "arcee": ("arcee", dict(TINY, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                   "original_max_position_embeddings": 32}), True),
    "arcee_bias_silu": ("arcee", dict(TINY, hidden_act="silu", attention_bias=True, mlp_bias=True, head_dim=32),
                        True),
    # Hybrid linear attention. Layer 0 Gated DeltaNet (2 key heads serving 4 value heads) with a dense MLP
    # (mlp_only_layers), layer 1 gated full attention with partial RoPE and an MoE with a gated shared expert.
    "qwen3_next": ("qwen3_next", dict(TINY, head_dim=16, full_attention_interval=2, linear_num_key_heads=2,
                                      linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=48, mlp_only_layers=[0]), True),
    # Separate linear-attention projections; key and value head dims differ.
    "qwen3_5": ("qwen3_5_text", dict(TINY, head_dim=16, layer_types=["linear_attention", "full_attention"],
                                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                     linear_value_head_dim=16), True),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict({k: v for k, v in TINY.items() if k != "intermediate_size"},
                                             head_dim=16, full_attention_interval=2, linear_num_key_heads=2,
                                             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=48), True),
    # Kimi Linear, 3 layers: Kimi Delta Attention (2 heads x 16, a decay per key channel, the short convolution)
    # around an MLA layer without RoPE; layer 0's MLP dense (first_k_dense_replace), then MoE: sigmoid scores with
    # the score bias in 4 groups of 2 (best 2), top-2 scaled, a shared expert.
    "kimi_linear": ("kimi_linear", dict(TINY, num_hidden_layers=3, num_key_value_heads=4,
                                        layer_types=["linear_attention", "full_attention", "linear_attention"],
                                        linear_num_heads=2, linear_head_dim=16, kv_lora_rank=16, qk_nope_head_dim=8,
                                        qk_rope_head_dim=8, v_head_dim=12, num_experts=8, num_experts_per_token=2,
                                        moe_intermediate_size=32, num_expert_group=4, topk_group=2,
                                        first_k_dense_replace=1, routed_scaling_factor=2.0),
                    True),
    # LFM2, 3 layers: gated short convolutions (width 3, with biases: conv_bias) around a full-attention layer with
    # per-head q/k norms; the MLPs sized by HF's rule (2/3 of 120, times 1.5, rounded up to a multiple of 32: 128).
    "lfm2": ("lfm2", dict({k: v for k, v in TINY.items() if k != "rms_norm_eps"}, norm_eps=1e-5, num_hidden_layers=3,
                          layer_types=["conv", "full_attention", "conv"], conv_bias=True, intermediate_size=120,
                          block_ffn_dim_multiplier=1.5, block_multiple_of=32), True),
    # LFM2-MoE, LFM2's 3 layers: layer 0's MLP dense (num_dense_layers), then sigmoid top-2 of 4 experts chosen with
    # the routing bias, renormalized, times 2.
    "lfm2_moe": ("lfm2_moe", dict({k: v for k, v in TINY.items() if k != "rms_norm_eps"}, norm_eps=1e-5,
                                  num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                                  num_dense_layers=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                  routed_scaling_factor=2.0), True),
    # LFM3, 4 layers: short convolutions (width 7), a sliding layer (window 8, plain RoPE) and a full one
    # (proportional RoPE over half of each head), both with the per-head sigmoid gate on their output; sandwich
    # norms.
    "lfm3": ("lfm3", dict(TINY, num_hidden_layers=4, head_dim=16, sliding_window=8,
                          layer_types=["conv", "sliding_attention", "conv", "full_attention"]), True),
    # Layer 0: RoPE (interleaved pairs) with L2 q/k norms, attention in chunks of 8 positions, a dense MLP; layer 1:
    # global without positions, queries scaled by a temperature that grows every 4 positions, and an MoE (sigmoid
    # top-2 of 4 experts scaling the experts' inputs, a shared expert).
    "llama4": ("llama4_text", dict(TINY, intermediate_size=32, intermediate_size_mlp=128, head_dim=16,
                                   attention_chunk_size=8, no_rope_layer_interval=2, interleave_moe_layer_step=2,
                                   num_local_experts=4, num_experts_per_tok=2, floor_scale=4, attn_scale=0.5), True),
    # Maverick-like: no q/k norms, biases, top-1 MoE in every layer; layers given (layer 0 global, layer 1 chunked
    # with Llama 3 RoPE), tied embeddings.
    "llama4_bias_top1": ("llama4_text", dict(TINY, intermediate_size=32, intermediate_size_mlp=128, head_dim=16,
                                             attention_chunk_size=8, no_rope_layers=[0, 1], use_qk_norm=False,
                                             attention_bias=True, num_local_experts=4, num_experts_per_tok=1,
                                             floor_scale=2, attn_scale=0.3, tie_word_embeddings=True,
                                             rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                                              "rope_theta": 500000.0, "low_freq_factor": 1.0,
                                                              "high_freq_factor": 4.0,
                                                              "original_max_position_embeddings": 16}), True),
    # 3 layers: a dense one (num_dense_layers), then MoE (sigmoid scores, top-2 of 8 chosen with the routing bias,
    # weights times route_scale, a shared expert); sliding layers with RoPE around a full-attention layer without
    # positions; per-head q/k norms, the output gate, four norms a layer.
    "afmoe": ("afmoe", dict(TINY, num_hidden_layers=3, head_dim=16, global_attn_every_n_layers=2, sliding_window=8,
                            num_dense_layers=1, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                            num_shared_experts=1, route_scale=2.5), True),
    # muP input scaling, biases, tied embeddings; MoE from layer 0 with two shared experts; layer_types given.
    "afmoe_mup": ("afmoe", dict(TINY, head_dim=16, layer_types=["full_attention", "sliding_attention"],
                                sliding_window=8, mup_enabled=True, attention_bias=True, tie_word_embeddings=True,
                                num_dense_layers=0, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                num_shared_experts=2), True),
    # Laguna, 3 layers sliding/full/sliding: 4, 8 and 2 query heads over the same 2 kv heads; one softplus gate per
    # head; HF's default RoPEs (the full layer rotates half of each head, theta 5e5); layer 0 dense, then MoE
    # (sigmoid scores, top-2 of 8 chosen with the routing bias, renormalized, a shared expert).
    "laguna": ("laguna", dict(TINY, num_hidden_layers=3, head_dim=16, num_attention_heads_per_layer=[4, 8, 2],
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                              sliding_window=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=48), True),
    # A softplus gate per element; MoE in every layer (mlp_layer_types) with soft-capped router logits (tanh bends
    # at this cap) and the routed scale; YaRN over half of each head on the full layer; biases, tied embeddings.
    "laguna_element": ("laguna", dict(TINY, head_dim=16, num_attention_heads_per_layer=[2, 4], gating="per-element",
                                      layer_types=["full_attention", "sliding_attention"], sliding_window=8,
                                      mlp_layer_types=["sparse", "sparse"], num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                      moe_router_logit_softcapping=1.0, moe_routed_scaling_factor=2.5,
                                      attention_bias=True, tie_word_embeddings=True,
                                      rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 500000.0,
                                                                          "factor": 4.0, "partial_rotary_factor": 0.5,
                                                                          "original_max_position_embeddings": 32},
                                                       "sliding_attention": {"rope_type": "default",
                                                                             "rope_theta": 10000.0}}), True),
    # 3 layers: one dense, two MoE with softmax scores routed in groups (4 groups of 2, best 2), scaled weights, a
    # shared expert; YaRN whose mscale_all_dim scales the softmax, and a query temperature that grows every 8
    # positions (llama_4_scaling_beta over original_max_position_embeddings).
    "mistral4": ("mistral4", dict(TINY, num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8,
                                  num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=16,
                                  qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=12, n_group=4, topk_group=2,
                                  first_k_dense_replace=1, routed_scaling_factor=2.0,
                                  rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 100.0,
                                                   "original_max_position_embeddings": 8, "beta_fast": 32.0,
                                                   "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                                                   "llama_4_scaling_beta": 0.5}), True),
    # HF's default rope_parameters; a plain q_proj, RoPE dims not interleaved, biases, tied embeddings, MoE from
    # layer 0 with weights not renormalized and two shared experts.
    "mistral4_plain_q": ("mistral4", dict(TINY, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=32, q_lora_rank=None, kv_lora_rank=16,
                                          qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
                                          rope_interleave=False, norm_topk_prob=False, n_shared_experts=2,
                                          attention_bias=True, tie_word_embeddings=True), True),
    # Sparse attention: top-8 keys per query, so the longer prompts and the generated tokens attend over a subset.
    # 16 indexer heads: with few, relu leaves several keys at exactly 0 and the top-k cut falls inside such ties,
    # where any order is right but the choice differs from transformers'.
    "deepseek_v32": ("deepseek_v32", dict(TINY, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=16,
                                          qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_group=2,
                                          topk_group=1, first_k_dense_replace=1, n_shared_experts=1, index_topk=8,
                                          index_head_dim=16, index_n_heads=16), True),
    # GLM-5: the indexer rotates interleaved pairs; layer 2 is "shared" (index_topk_freq=2): no indexer of its own,
    # it attends over the keys layer 1 picked.
    "glm_moe_dsa": ("glm_moe_dsa", dict(TINY, num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=4,
                                        num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=32,
                                        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                                        first_k_dense_replace=1, n_shared_experts=1, index_topk=8, index_head_dim=16,
                                        index_n_heads=16, index_topk_freq=2), True),
    # Mistral Large 4, 5 layers (rope / indexer / KV): 0 RoPE, own; 1 NoPE, own; 2 RoPE, its own latent but the top-k
    # layer 1 picked ("shared"); 3 RoPE, layer 0's latent with an indexer of its own ("reuse_but_indexer"); 4 NoPE,
    # layer 1's latent and layer 3's top-k (plain reuse). Layer 0 dense, then MoE (softmax scores in 4 groups of 2,
    # best 2, scaled). HF's default YaRN, top-8 of 16 indexer heads (see deepseek_v32), a soft-cap that bends these
    # logits.
    "mistral_large4": ("mistral_large4_text", dict(TINY, num_hidden_layers=5, num_key_value_heads=4, kv_lora_rank=16,
                                                   qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                                                   n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                   n_group=4, topk_group=2, routed_scaling_factor=2.0, index_topk=8,
                                                   index_head_dim=16, index_n_heads=16, no_rope_layers=[1, 0, 1, 1, 0],
                                                   kv_source_layers=[0, 1, 2, 0, 1],
                                                   indexer_types=["full", "full", "shared", "full", "shared"],
                                                   final_logit_softcapping=2.0), True),
    # HF's derivations: every second layer NoPE (no_rope_layer_interval), layer 2 "shared" (index_topk_freq), no KV
    # sharing, two dense layers (first_k_dense_replace); YaRN whose mscale_all_dim scales the softmax, biases on the
    # latent and output projections, two shared experts, tied embeddings.
    "mistral_large4_derived": ("mistral_large4_text", dict(TINY, num_hidden_layers=4, num_key_value_heads=4,
                                                           kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                                           v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
                                                           moe_intermediate_size=32, n_shared_experts=2,
                                                           first_k_dense_replace=2, index_topk=8, index_head_dim=16,
                                                           index_n_heads=16, no_rope_layer_interval=2,
                                                           index_topk_freq=2, attention_bias=True,
                                                           tie_word_embeddings=True, final_logit_softcapping=3.0,
                                                           rope_parameters={"rope_type": "yarn", "rope_theta": 100.0,
                                                                            "factor": 4.0, "mscale": 1.0,
                                                                            "mscale_all_dim": 0.5,
                                                                            "original_max_position_embeddings": 8}),
                               True),
    # NemotronH, 4 layers (HF's default kinds): Mamba2 (8 heads x 8 in 2 groups, state 16, chunks of 8 so the prompts
    # cross chunk boundaries, the convolution's bias), a latent MoE (sigmoid scores with the score bias in 4 groups of
    # 2, best 2, top-2 scaled; ungated ReLU-squared experts in a 24-dim latent space; a shared MLP), attention without
    # positions, a ReLU-squared MLP. Larger weights (initializer_range) so that the router and attention are not
    # uniform.
    "nemotron_h": ("nemotron_h", dict({k: v for k, v in TINY.items() if k not in ("num_hidden_layers", "rms_norm_eps")},
                                      layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
                                      layer_norm_epsilon=1e-5, head_dim=16, mamba_num_heads=8, mamba_head_dim=8,
                                      n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=8, n_routed_experts=8,
                                      num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=32,
                                      moe_shared_expert_intermediate_size=48, moe_latent_size=24,
                                      routed_scaling_factor=2.0, initializer_range=0.1), True),
    # Granite 4, 3 layers: Mamba2 (4 heads x 32 from mamba_expand 2, one group, state 16, chunks of 8), attention with
    # RoPE, Mamba2; each followed by a top-2 MoE (softmax over the chosen logits) beside the shared SwiGLU MLP; the muP
    # multipliers (embeddings, attention scale, residual branches, logits). Legacy layer kinds, as IBM writes them.
    "granitemoehybrid": ("granitemoehybrid", dict(TINY, num_hidden_layers=3,
                                                  layer_types=["mamba", "attention", "mamba"],
                                                  position_embedding_type="rope", num_local_experts=4,
                                                  num_experts_per_tok=2, intermediate_size=32,
                                                  shared_intermediate_size=48, mamba_n_heads=4, mamba_n_groups=1,
                                                  mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=8,
                                                  embedding_multiplier=6.0, attention_multiplier=0.2,
                                                  residual_multiplier=0.4, logits_scaling=3.0,
                                                  initializer_range=0.1), True),
    # Bamba, 3 layers: Mamba2 (4 heads x 32 in 2 groups, state 16, chunks of 8, the gated norm over each group, dt
    # clipped to [0.001, 0.5]: the clip bites) around one attention layer (`attn_layer_indices`) with RoPE over half
    # of each head, HF's default for Bamba.
    "bamba": ("bamba", dict(TINY, num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=4, mamba_n_groups=2,
                            mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=8, time_step_limit=[0.001, 0.5],
                            initializer_range=0.1), True),
    # Falcon-H1, 2 layers each running Mamba2 (4 heads x 16 in 2 groups, state 16, chunks of 8, the gated norm after the
    # scan and before the gate) and attention with RoPE side by side; every muP multiplier away from 1.
    "falcon_h1": ("falcon_h1", dict(TINY, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_n_groups=2,
                                    mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=8, mamba_rms_norm=True,
                                    mamba_norm_before_gate=True, embedding_multiplier=3.0, lm_head_multiplier=0.5,
                                    mlp_multipliers=[0.8, 1.3], key_multiplier=0.7, attention_in_multiplier=1.2,
                                    attention_out_multiplier=0.9, ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.7],
                                    ssm_in_multiplier=1.3, ssm_out_multiplier=0.6, initializer_range=0.1), True),
    # MiMo-V2-Flash, HF's default kinds over 3 layers: full attention with a dense MLP, then two sliding layers (window
    # 8) with twice the kv heads and sinks, and MoEs (sigmoid scores with the score bias in 4 groups of 2, best 2,
    # top-2 scaled, no shared expert); queries and keys of 24 dims, values of 16 scaled by 0.6; a RoPE per kind (the
    # full layers' over HF's default 0.334 of the head, the sliding ones' over half, with another theta). Larger
    # weights (initializer_range) so that the router and the sinks matter.
    "mimo_v2_flash": ("mimo_v2_flash", dict(TINY, num_hidden_layers=3, num_key_value_heads=1, head_dim=24,
                                            v_head_dim=16, sliding_window=8, attention_value_scale=0.6,
                                            n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                                            moe_intermediate_size=32, routed_scaling_factor=2.0,
                                            initializer_range=0.1,
                                            rope_parameters={"full_attention": {"rope_type": "default",
                                                                                "rope_theta": 50000.0},
                                                             "sliding_attention": {"rope_type": "default",
                                                                                   "rope_theta": 100.0,
                                                                                   "partial_rotary_factor": 0.5}}),
                      True),
    # Step-3.7's language model in its multimodal checkpoint (a one-layer vision tower, dropped), 3 layers: full,
    # sliding (window 8, 8 query heads against the full layers' 4) and full attention, each with (1 + w) q/k norms, a
    # sigmoid gate per head and scores scaled by query_pre_attn_scalar; a RoPE per kind (the full layers' over half of
    # each head); layer 0 a dense MLP, then MoEs (sigmoid scores chosen with the score bias, renormalized, times 2)
    # beside a shared expert; clamps after the activation small enough to bite, per layer (0: none). Larger weights
    # (initializer_range) so that the gates, the router and the clamps matter.
    "step3p7": ("step3p7", dict(
        text_config=dict(TINY, num_hidden_layers=3, head_dim=16, sliding_window=8, num_sliding_attention_heads=8,
                         layer_types=["full_attention", "sliding_attention", "full_attention"],
                         mlp_layer_types=["dense", "sparse", "sparse"], n_routed_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=32, share_expert_dim=48, moe_router_scaling_factor=2.0,
                         query_pre_attn_scalar=24, swiglu_limits=[0, 0.5, 0.8], swiglu_limits_shared=[0.6, 0, 0.7],
                         initializer_range=0.06,
                         rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                             "partial_rotary_factor": 0.5},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)),
                True),
    # DeepSeek-V4, 4 layers (attention / MoE): 0 sliding (window 8) / hash-routed; 1 CSA (entries of 4 overlapping
    # windows of 8, an 8-head lightning indexer keeping the top 2, so the longer prompts drop entries) / hash-routed;
    # 2 HCA (entries of 8) / sqrt(softplus) top-2 with the score bias; 3 CSA / top-2. Four residual streams mixed by
    # Sinkhorn-projected hyper-connections, the grouped low-rank output projection (2 groups), sinks, a quarter of
    # each head rotated (interleaved pairs), YaRN on the compressed branch, clamps small enough to bite. Larger
    # weights (initializer_range) so that the streams' mixing, the router and the sinks matter. Eight indexer heads:
    # with four, a query's scores of two entries both came out exactly 0 (every head's relu zero), a tie whose order
    # in the top-k is each implementation's own.
    "deepseek_v4": ("deepseek_v4", dict({k: v for k, v in TINY.items() if k != "intermediate_size"},
                                        num_hidden_layers=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32,
                                        layer_types=["sliding_attention", "compressed_sparse_attention",
                                                     "heavily_compressed_attention", "compressed_sparse_attention"],
                                        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
                                        compress_rates={"compressed_sparse_attention": 4,
                                                        "heavily_compressed_attention": 8},
                                        sliding_window=8, n_routed_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=32, routed_scaling_factor=1.5, hc_mult=4,
                                        hc_sinkhorn_iters=20, o_groups=2, o_lora_rank=16, index_n_heads=8,
                                        index_head_dim=16, index_topk=2, partial_rotary_factor=0.25,
                                        swiglu_limit=0.5, compress_rope_theta=1000.0, initializer_range=0.1,
                                        rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 32}), True),
    # HY-V4, 5 layers: four residual streams joined by plain hyper-connections (post x hc_magnitude 1.5), layer 0
    # dense then MoE (sigmoid top-2 of 8 with the score bias, one shared expert, clamps small enough to bite); sparse
    # MLA with sinks and a sigmoid output gate, top-8 keys per query (the longer prompts attend over a subset), the
    # indexer rotating the interleaved tail of its heads; layers 2 and 4 "shared" reuse the top-k of layers 1 and 3.
    # 16 indexer heads, as deepseek_v32 (relu ties). YaRN scales the softmax by its mscale.
    "hy_v4": ("hy_v4", dict(TINY, num_hidden_layers=5, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                            routed_scaling_factor=2.5, mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse"],
                            indexer_types=["full", "full", "shared", "full", "shared"], index_topk=8,
                            index_head_dim=16, index_n_heads=16, hc_mult=4, hc_magnitude=1.5, hc_eps=1e-6,
                            learnable_sink_init=0.5, swiglu_limit=0.5, initializer_range=0.1,
                            rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                             "original_max_position_embeddings": 32, "mscale_all_dim": 1.0}), True),
    # GLM-5-Next's language model in its multimodal checkpoint (a one-layer vision tower, dropped), 3 layers: Kimi
    # Delta Attention (2 heads x 16, the forget gate bounded below by -5) then two NoPE MLA layers over the blocks of
    # 4 keys a pooled indexer keeps (the best 2 complete blocks a query sees whole plus its own incomplete one: the
    # longer prompts and their continuations span up to 8 blocks), layer 2 reusing layer 1's choice ("shared");
    # layer 0's MLP dense, then MoE (sigmoid scores with the score bias in 2 groups of 2, best 1, top-2 scaled, a
    # shared expert); four residual streams mixed by Sinkhorn-projected hyper-connections and averaged at the end;
    # SwiGLU clamps small enough to bite. Eight indexer heads (relu ties, as deepseek_v4).
    "glm5_next": ("glm5_next", dict(
        text_config=dict(TINY, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                         qk_nope_head_dim=16, v_head_dim=12, moe_intermediate_size=32, n_routed_experts=4,
                         num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=1.5,
                         layer_types=["linear_attention", "indexed_attention", "indexed_attention"],
                         indexer_types=["full", "full", "shared"], mlp_layer_types=["dense", "sparse", "sparse"],
                         linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4, linear_lower_bound=-5.0,
                         index_kpool=4, index_topk=8, index_head_dim=16, index_n_heads=8, hc_mult=4,
                         hc_sinkhorn_iters=20, swiglu_limit=0.5, initializer_range=0.1),
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                           projection_intermediate_size=64, patch_size=14, image_size=28)), True),
    # HY-V4's other choices: two streams, biases on q_a_proj, kv_a_proj_with_mqa and o_proj, tied embeddings, two
    # shared experts, top-k weights not renormalized, the legacy rope_theta key (plain RoPE), and HF's default layer
    # lists for 6 layers, which transformers writes into config.json (layer 0 dense; indexers full on layers 0, 1 and
    # 5, so layers 2-4 all reuse layer 1's top-k; tests/test_hy_v4_ops.py checks our derivation of the defaults).
    "hy_v4_bias_tied": ("hy_v4", dict(TINY, num_hidden_layers=6, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
                                      qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, n_shared_experts=2, index_topk=8, index_head_dim=16,
                                      index_n_heads=16, hc_mult=2, attention_bias=True, tie_word_embeddings=True,
                                      norm_topk_prob=False, rope_theta=1000.0), True),
    # Cohere: parallel blocks under one bias-free LayerNorm, interleaved RoPE, per-head LayerNorm q/k norms, biases,
    # a logit scale far from 1, tied embeddings (HF's default).
    "cohere": ("cohere", dict(NO_RMS, layer_norm_eps=1e-5, use_qk_norm=True, attention_bias=True, logit_scale=0.25,
                              rope_theta=10000.0), True),
    # Sliding layers (window 8, shorter than the longer prompts) with RoPE, full ones without positions;
    # 3 layers: HF derives layer_types from sliding_window_pattern=3 (two sliding, then one full) and writes them.
    "cohere2": ("cohere2", dict(NO_RMS, num_hidden_layers=3, layer_norm_eps=1e-5, sliding_window=8,
                                sliding_window_pattern=3, logit_scale=0.25, attention_bias=True), True),
    # An MoE in every layer (each expert intermediate_size wide), top-2 of 4 not renormalized; q, k and v clamped
    # at 0.5, inside their spread; biases on the projections.
    "olmoe": ("olmoe", dict(TINY, intermediate_size=32, num_experts=4, num_experts_per_tok=2, clip_qkv=0.5,
                            attention_bias=True), True),
    # LayerNorms with bias, the ungated GELU (tanh) MLP and projections with biases, every layer sliding (window 8),
    # tied embeddings (HF's default).
    "starcoder2": ("starcoder2", dict(NO_RMS, norm_epsilon=1e-5, sliding_window=8, use_bias=True,
                                      hidden_act="gelu_pytorch_tanh"), True),
}

def parity_engine():
    """The engine the families' parity tests load with: one decode batch size (4, padded rows included). The default
    buckets compile a decode program for each of 1, 2 and 4 rows as the prompts join one by one, most of a tiny
    model's test time; other batch sizes are the engine tests' subject, not the families'."""
    from day0jax.engine.config import EngineConfig  # imported late: the reference venv reads this file too

    return EngineConfig(max_num_seqs=4, batch_buckets=(4,))


# Prompts (token ids) of different lengths; the longest crosses the sliding window and the small contexts above.
PROMPTS = [[1, 17, 42, 5, 99], [1] + [(7 * i + 3) % 250 + 3 for i in range(16)],
           [1] + [(13 * i + 11) % 250 + 3 for i in range(19)]]
GENERATE = 12


# --- vision-language families (tests/test_multimodal.py): tiny towers over tiny language models ------------------

IMAGE_TOKEN = 250  # the image placeholder id of every tiny vision-language config
CLIP_TOWER = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=2, image_size=28, patch_size=14, projection_dim=16)
SIGLIP_TOWER = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, image_size=32, patch_size=8)
CLIP_PROCESSOR = dict(image_processor_type="CLIPImageProcessor", do_resize=True, size={"shortest_edge": 28},
                      resample=3, do_center_crop=True, crop_size={"height": 28, "width": 28}, do_rescale=True,
                      rescale_factor=1 / 255, do_normalize=True, image_mean=[0.48145466, 0.4578275, 0.40821073],
                      image_std=[0.26862954, 0.26130258, 0.27577711], do_convert_rgb=True)
SIGLIP_PROCESSOR = dict(image_processor_type="SiglipImageProcessor", do_resize=True, size={"height": 32, "width": 32},
                        resample=3, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
                        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
GEMMA3_PROCESSOR = dict(image_processor_type="Gemma3ImageProcessor", do_resize=True, size={"height": 32, "width": 32},
                        resample=2, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
                        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], do_convert_rgb=True,
                        do_pan_and_scan=False)
BOI, EOI = 248, 249  # Gemma 3's begin- and end-of-image tokens around the image tokens (Qwen-VL: vision start, end)
# Qwen-VL: 4-pixel patches merged 2x2, images resized to 8-pixel multiples between 16 and 48 pixels square.
QWEN_VL_PROCESSOR = dict(image_processor_type="Qwen2VLImageProcessor", patch_size=4, temporal_patch_size=2,
                         merge_size=2, size={"shortest_edge": 16 * 16, "longest_edge": 48 * 48},
                         image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
QWEN_VL_TOWER = dict(model_type="qwen3_vl_vision", depth=3, hidden_size=32, intermediate_size=64, num_heads=2,
                     patch_size=4, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64,
                     num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
# Kimi K2.5: 4-pixel patches at the image's own size within 64 patches (10 a side), padded to 8-pixel multiples;
# MoonViT's 4 x 4 position table resampled bicubically to each grid, heads of 16 turned by the 2-D rotary, 2x2
# blocks merged. Larger weights (initializer_range) so that attention, and with it the rotary, varies by patch.
KIMI_PROCESSOR = dict(image_processor_type="Kimi_K25ImageProcessor", patch_size=4, merge_size=2, max_patches=64,
                      size={"max_height": 10, "max_width": 10}, resample=3, image_mean=[0.5, 0.5, 0.5],
                      image_std=[0.5, 0.5, 0.5])
MOONVIT_TOWER = dict(model_type="kimi_k25_vision", patch_size=4, pos_emb_height=4, pos_emb_width=4, pos_emb_time=4,
                     num_attention_heads=2, num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                     merge_kernel_size=[2, 2], initializer_range=0.2)
PIXTRAL_PROCESSOR = dict(image_processor_type="PixtralImageProcessor", patch_size={"height": 8, "width": 8},
                         size={"longest_edge": 48}, resample=3)
PIXTRAL_TOWER = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, patch_size=4, image_size=48, hidden_act="gelu", initializer_range=0.2)
GEMMA4_TOWER = dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, patch_size=4, pooling_kernel_size=2,
                    position_embedding_size=64, standardize=True, initializer_range=0.2)
GEMMA4_PROCESSOR = dict(image_processor_type="Gemma4ImageProcessor", patch_size=4, max_soft_tokens=70,
                        pooling_kernel_size=2)
# LFM2-VL: SigLIP2 NaFlex with an 8 x 8 position table resized to each grid, 4-pixel patches, images resized to
# between 4 and 16 tokens of 2x2 patches; past twice the most pixels (about 45 x 45), split into 2 to 4 tiles of
# 16 pixels and a thumbnail.
SIGLIP2_TOWER = dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, patch_size=4, num_patches=64, vision_use_head=False)
LFM2_VL_PROCESSOR = dict(image_processor_type="Lfm2VlImageProcessor", encoder_patch_size=4, downsample_factor=2,
                         min_image_tokens=4, max_image_tokens=16, tile_size=16, max_tiles=4, max_pixels_tolerance=2.0,
                         do_convert_rgb=True)


@dataclass(frozen=True)
class VLCase:
    model_type: str
    config: dict
    processor: dict
    per_image: int | None  # tokens per image; None: as many as its merged patches (`image_tokens`)
    around: tuple[list[int], list[int]] = ([], [])  # tokens before and after each image's tokens
    merge: int = 2  # a token per merge x merge patches of the processor's grid (images of their own size)
    row_ends: tuple[int, int] | None = None  # the tokens ending each row of an image's tokens, and the last one


MULTIMODAL = {
    # CLIP, the second-to-last layer's patches (class token dropped), a Llama language model.
    "llava": VLCase("llava", dict(text_config=dict(TINY, model_type="llama"), vision_config=CLIP_TOWER,
                                  image_token_index=IMAGE_TOKEN), CLIP_PROCESSOR, 4),
    # SigLIP, two layers' hidden states concatenated, every token kept, no projector biases; a Qwen2 language model
    # with a sliding-window layer.
    "llava_siglip_qwen2": VLCase("llava", dict(
        text_config=dict(TINY, model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1),
        vision_config=SIGLIP_TOWER, image_token_index=IMAGE_TOKEN, vision_feature_layer=[-1, 1],
        vision_feature_select_strategy="full", multimodal_projector_bias=False,
        projector_hidden_act="gelu_pytorch_tanh"), SIGLIP_PROCESSOR, 16),
    # SigLIP's 16 patches pooled to 4 tokens; a sliding layer (window 8, shorter than the prompts) and a full one.
    "gemma3": VLCase("gemma3", dict(
        text_config=dict(TINY, model_type="gemma3_text", head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
                         layer_types=["sliding_attention", "full_attention"]),
        vision_config=SIGLIP_TOWER, mm_tokens_per_image=4, image_token_index=IMAGE_TOKEN, boi_token_index=BOI,
        eoi_token_index=EOI), GEMMA3_PROCESSOR, 4, ([BOI], [EOI])),
    # Images of their own size; 3-D RoPE positions in sections of 2, 3, 3 frequencies; DeepStack into layers 0-1.
    "qwen3_vl": VLCase("qwen3_vl", dict(
        text_config=dict(TINY, model_type="qwen3_vl_text", num_hidden_layers=3, head_dim=16,
                         max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}),
        vision_config=QWEN_VL_TOWER, image_token_id=IMAGE_TOKEN, video_token_id=251, vision_start_token_id=BOI,
        vision_end_token_id=EOI), QWEN_VL_PROCESSOR, None, ([BOI], [EOI])),
    # Qwen3.5: the same tower without DeepStack over the hybrid Gated DeltaNet / gated full attention model, whose
    # multimodal RoPE turns half the head dims.
    "qwen3_5": VLCase("qwen3_5", dict(
        text_config=dict(FAMILIES["qwen3_5"][1], model_type="qwen3_5_text", head_dim=32, partial_rotary_factor=0.5,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}),
        vision_config={k: v for k, v in QWEN_VL_TOWER.items() if k != "deepstack_visual_indexes"} | dict(
            model_type="qwen3_5_vision"),
        image_token_id=IMAGE_TOKEN, video_token_id=251, vision_start_token_id=BOI, vision_end_token_id=EOI),
        QWEN_VL_PROCESSOR, None, ([BOI], [EOI])),
    # Qwen3-VL-MoE: Qwen3-VL's tower and DeepStack over Qwen3-MoE layers (layer 0 dense, then softmax top-2 of 4
    # experts, fused as released: 2F = 96 differs from D = 64, so a transposed layout cannot pass for the right one).
    "qwen3_vl_moe": VLCase("qwen3_vl_moe", dict(
        text_config=dict(TINY, model_type="qwen3_vl_moe_text", num_hidden_layers=3, head_dim=16,
                         max_position_embeddings=512, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                         mlp_only_layers=[0], initializer_range=0.1,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}),
        vision_config=dict(QWEN_VL_TOWER, model_type="qwen3_vl_moe_vision"), image_token_id=IMAGE_TOKEN,
        video_token_id=251, vision_start_token_id=BOI, vision_end_token_id=EOI), QWEN_VL_PROCESSOR, None,
        ([BOI], [EOI])),
    # Mistral 3: Pixtral (2-D rotary over the patch grid, gated MLPs, RMSNorms) over Mistral with a sliding window;
    # 2x2 patches of 4 pixels merged (the processor's patches are the merged 8-pixel ones), rows of image tokens
    # ended by [IMG_BREAK] and [IMG_END]. Larger weights (initializer_range) so that attention varies by patch.
    "mistral3": VLCase("mistral3", dict(
        text_config=dict(TINY, model_type="mistral", sliding_window=8, initializer_range=0.1),
        vision_config=PIXTRAL_TOWER, image_token_index=IMAGE_TOKEN, spatial_merge_size=2, tie_word_embeddings=False,
        initializer_range=0.1), PIXTRAL_PROCESSOR, None, merge=1, row_ends=(BOI, EOI)),
    # On Ministral (sliding, then full attention), the tower's second-to-last hidden state (its last layer then
    # never runs), projector biases.
    "mistral3_ministral": VLCase("mistral3", dict(
        text_config=dict(FAMILIES["ministral"][1], model_type="ministral", initializer_range=0.1),
        vision_config=dict(PIXTRAL_TOWER, num_hidden_layers=3), image_token_index=IMAGE_TOKEN,
        vision_feature_layer=-2, multimodal_projector_bias=True, projector_hidden_act="gelu_pytorch_tanh",
        initializer_range=0.1), PIXTRAL_PROCESSOR, None, merge=1, row_ends=(BOI, EOI)),
    # Gemma 4: its tower (2-D rotary over column and row halves, q/k/v norms, one kv head for two, 2x2 pooling,
    # standardized) over the gemma4 text entry (KV sharing, per-layer inputs); an image's tokens attend both ways in
    # the sliding layers. The processor fills 70 soft tokens' patches (the fewest it takes).
    "gemma4": VLCase("gemma4", dict(
        text_config=dict(FAMILIES["gemma4"][1], model_type="gemma4_text", max_position_embeddings=512,
                         use_bidirectional_attention="vision"),
        vision_config=GEMMA4_TOWER, image_token_id=IMAGE_TOKEN, boi_token_id=BOI, eoi_token_id=EOI,
        video_token_id=251, audio_token_id=247, boa_token_id=246, eoa_token_index=245, initializer_range=0.1),
        GEMMA4_PROCESSOR, None, ([BOI], [EOI])),
    # LFM2-VL: SigLIP2 NaFlex, the pixel unshuffle and a LayerNorm'd two-layer projector over LFM2 (convolutions
    # beside attention).
    "lfm2_vl": VLCase("lfm2_vl", dict(
        text_config=dict(FAMILIES["lfm2"][1], model_type="lfm2", max_position_embeddings=512),
        vision_config=SIGLIP2_TOWER,
        image_token_id=IMAGE_TOKEN, projector_hidden_size=48, projector_hidden_act="gelu"),
        LFM2_VL_PROCESSOR, None, ([BOI], [EOI])),
    # Kimi K2.5: MoonViT over a DeepSeek-V3 language model (MLA; a dense layer, then sigmoid top-2 of 8 experts in
    # one group with a shared expert, as Kimi K2 routes), untied as published.
    "kimi_k25": VLCase("kimi_k25", dict(
        text_config=dict(FAMILIES["deepseek_v3"][1], num_hidden_layers=2, n_group=1, topk_group=1,
                         initializer_range=0.1, model_type="deepseek_v3"),
        vision_config=MOONVIT_TOWER, projection_hidden_size=32, image_token_id=IMAGE_TOKEN, video_token_id=251,
        vision_start_token_id=BOI, vision_end_token_id=EOI, tie_word_embeddings=False, initializer_range=0.1),
        KIMI_PROCESSOR, None, ([BOI], [EOI])),
}


def image_tokens(case: VLCase, image) -> int:
    """The number of placeholder tokens `image` (uint8 HxWx3) takes in `case`'s model."""
    if case.per_image is not None:
        return case.per_image
    from day0jax.vision.processors import image_processor

    grid = image_processor(case.processor).preprocess(image).grid_thw
    tiles = grid[3] * grid[4] * (grid[5] // case.merge) ** 2 if len(grid) == 6 else 0  # LFM2-VL's tiles
    return grid[0] * grid[1] * grid[2] // case.merge ** 2 + tiles


def image_placeholders(case: VLCase, image, token: int) -> list[int]:
    """`image`'s placeholder tokens in `case`'s model: `token` repeated, or row by row where each row ends with
    a token of its own (Mistral 3)."""
    if case.row_ends is None:
        return [token] * image_tokens(case, image)
    from day0jax.vision.processors import image_processor

    _, rows, cols = image_processor(case.processor).preprocess(image).grid_thw
    out = ([token] * cols + [case.row_ends[0]]) * rows
    return out[:-1] + [case.row_ends[1]]
