"""Filtered sampling (temperature / top-k / top-p, Gumbel-max) for the main token (with RAS) and the codebook heads."""
from kernels.sampling.api import keep_mask, sample_filtered, sample_main

__all__ = ["keep_mask", "sample_filtered", "sample_main"]
