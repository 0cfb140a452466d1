"""Residual add + RMSNorm (+ the MoE input's FP8 group quantisation) as one launch; plain-jnp RMSNorm reference."""
