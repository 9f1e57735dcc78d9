"""The learned gated compressor of compressed attention: each window of m tokens' key-value projections pooled
into one entry by a softmax over its tokens (DeepSeek-V4's CSA and HCA)."""
