"""Attention of one or a few new tokens per sequence against a paged KV cache (block tables)."""
