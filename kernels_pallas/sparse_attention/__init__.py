"""Indexed sparse attention (DeepSeek-V3.2 / GLM-5 style): an indexer picks the top-k keys per query, attention
runs over those only."""
