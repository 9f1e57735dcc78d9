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
}

# Prompts (token ids) of different lengths; the longest crosses the sliding window and the small contexts above.
PROMPTS = [[1, 17, 42, 5, 99], [1] + [(7 * i + 3) % 250 + 3 for i in range(16)],
           [1] + [(13 * i + 11) % 250 + 3 for i in range(19)]]
GENERATE = 12
