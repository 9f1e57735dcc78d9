"""Weights: the checkpoint format, the loader, HF config reading, the embedded default model and the tokenizer."""
