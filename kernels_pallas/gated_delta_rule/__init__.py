"""Gated delta-rule linear attention (Qwen3-Next, Kimi Linear's per-channel variant)."""
