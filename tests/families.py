"""Tiny configurations per model family, built with random weights by transformers for the parity tests.

Each entry: name -> (HF model_type, config overrides, batch_invariant). `batch_invariant=False` marks RoPE
variants whose frequencies depend on the longest sequence in the call (HF's `dynamic` and `longrope`), where a
padded batch legitimately differs from one-prompt-at-a-time; those are compared prompt by prompt.
"""

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)

FAMILIES = {
    "llama": ("llama", dict(TINY), True),
    "llama_tied_bias_headdim": ("llama", dict(TINY, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                                              head_dim=32), True),
    "llama_mqa_linear": ("llama", dict(TINY, num_key_value_heads=1,
                                       rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                        "rope_theta": 10000.0}), True),
    "llama_dynamic": ("llama", dict(TINY, max_position_embeddings=24,
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
    "gpt_oss": ("gpt_oss", dict(TINY, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=16,
                                sliding_window=8,
                                rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 150000.0,
                                                 "original_max_position_embeddings": 32, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "truncate": False}), True),
    # Layer 1 has no RoPE (interval 2) and, with use_sliding_window, a window.
    "smollm3": ("smollm3", dict(TINY, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=8), True),
    "granite": ("granite", dict(TINY, embedding_multiplier=12.0, attention_multiplier=0.1, residual_multiplier=0.22,
                                logits_scaling=8.0), True),
}

# Prompts (token ids) of different lengths; the longest crosses the sliding window and the small contexts above.
PROMPTS = [[1, 17, 42, 5, 99], [1] + [(7 * i + 3) % 250 + 3 for i in range(16)],
           [1] + [(13 * i + 11) % 250 + 3 for i in range(19)]]
GENERATE = 12
