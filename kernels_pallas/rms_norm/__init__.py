"""RMSNorm with the residual add fused in."""
