"""Gated DeltaNet (gated delta rule) kernels: chunked prefill and fused single-step decode."""
from kernels.gdn.api import gdn_decode_step, gdn_prefill

__all__ = ["gdn_prefill", "gdn_decode_step"]
