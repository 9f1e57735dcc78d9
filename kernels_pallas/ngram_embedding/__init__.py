"""Hashed n-gram embeddings: each token's last n token ids hashed into prime-sized tables and looked up (Qwen4-Exp's
per-layer embeddings), with the n-gram context carried across prefill chunks and decode steps."""
