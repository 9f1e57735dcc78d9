"""Causal multi-head attention over a batch of (possibly ragged) sequences: GQA/MQA, windows, soft-cap, sinks."""
