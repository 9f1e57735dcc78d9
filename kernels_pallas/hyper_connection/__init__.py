"""Hyper-connections: the residual stream widened to n streams, collapsed into each block's input and the block's
output spread back over them (DeepSeek-V4's manifold-constrained form, HY-V4's plain form)."""
