"""The depthwise causal convolution over time with its carried state (linear attention's and LFM's short
convolutions, Mamba2's)."""
