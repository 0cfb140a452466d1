"""Snake, then a 1x1 conv (a matmul over channels), its bias and the residual add, as one op (the codec's residual
units' tail)."""
