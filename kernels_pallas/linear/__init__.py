"""Linear maps with float weights (y = x W^T), one weight or several of the same input in one call."""
