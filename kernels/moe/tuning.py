"""Block-size tables for the Pallas MoE backends, as data. Keyed by weight dtype ("w8a8": FP8 weights and activations),
then by the number of (token, slot) pairs M = T * k: a list of (max_pairs, config) rows, the first row whose
max_pairs >= M wins.

Values were measured for Drama 3 shapes (H 2048, I 512, E 256, top-8) on the H200; see experiments/results/moe_*.md.
Decode (M <= 2048, T <= 256): weight-bandwidth bound, 16-row blocks and narrow N tiles so that ~8..256 touched experts
still give several programs per SM. Prefill: tensor-core bound, 64..128-row blocks.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TritonMoeConfig:
    """block_m: rows per block (every expert's rows are padded to it); gu_*: gate+up GEMM tile (N over I, K over H);
    dn_*: down GEMM tile (N over H, K over I); warps/stages per kernel (Triton num_warps / num_stages);
    swap_ab: compute W . x^T (weights on the MMA's M side, the layout tokamax uses for small row counts);
    gu_f16: with FP8 weights, run the gate/up GEMM in f16 (FP8 -> f16 is a single convert on sm90);
    prequant: W8A8 only, quantise the activations outside the K loops (x once before gate/up, the SwiGLU output in the
    gate/up epilogue, so gu_block_n must be 128) instead of per tile in registers."""

    block_m: int
    gu_block_n: int
    gu_block_k: int
    dn_block_n: int
    dn_block_k: int
    gu_warps: int = 4
    gu_stages: int = 4
    dn_warps: int = 4
    dn_stages: int = 4
    swap_ab: bool = False
    gu_f16: bool = False
    prequant: bool = False


# {weights dtype: [(max_pairs M, config), ...]}. Winners of the same-run sweep on the H200 (2026-11-30,
# experiments/results/moe_bench.md "Sweep"): at decode T=128 the FP8 f16-gate/up variant (0.293 ms) beat plain (0.304),
# swap-AB (0.367) and swap-AB+f16 (0.328); at prefill T=8192 plain beat every swap-AB/f16 variant for both dtypes
# (FP8: 2.05 ms block_m 64 vs 2.21 f16, 2.79 swap-AB+f16; bf16: 1.20 ms vs 1.50 swap-AB). An earlier run's sweep chose
# the decode tile sizes (T=1 and T=128) and the prefill block_m per dtype (experiments/results/moe_bench_run1.md).
# bf16 with 128x128 tiles and 4 stages does not fit in shared memory (278 KB > 227 KB).
_DECODE_BF16 = dict(block_m=16, gu_block_n=64, gu_block_k=128, dn_block_n=128, dn_block_k=128, gu_warps=4, gu_stages=4,
                    dn_warps=4, dn_stages=4)
TRITON_TABLE: dict[str, list[tuple[int, dict]]] = {
    "fp8": [
        # f16 gate/up with 3 stages: 0.2862 ms per layer at T=128, against 0.2982 with 4 stages and 0.2940 with the
        # previous row (down N tiles of 32, 2 warps) (H200, 2026-12-01, the one-knob sweep of experiments/moe_bench.py
        # in experiments/results/moe_w8a8_2026-12-01; every variant checked against the reference on the device)
        (2048, dict(_DECODE_BF16, gu_f16=True, gu_stages=3)),
        (1 << 62, dict(block_m=64, gu_block_n=128, gu_block_k=64, dn_block_n=128, dn_block_k=64, gu_warps=4,
                       gu_stages=4, dn_warps=4, dn_stages=4)),
    ],
    # W8A8 (act_fp8): K tiles must be 128 (one activation scale group). Both rows quantise outside the K loops
    # (prequant) and run e4m3 wgmma (kernels/triton_fp8.py). H200, 2026-12-01, experiments/results/moe_fp8_wgmma_2026-12-01
    # (every variant checked against the reference on the device): decode 0.2320 ms per layer at T=128 in the sweep,
    # 0.2349 in the bench (80% of the FP8 roofline), against 0.2430 with in-kernel quantisation; prefill 8 warps, 1.127
    # ms at T=8192 (366 TFLOP/s) against 1.245 with 4 warps, 1.652 in-kernel, 1.981 for W8A16.
    "w8a8": [
        (2048, dict(block_m=16, gu_block_n=128, gu_block_k=128, dn_block_n=128, dn_block_k=128, gu_warps=4,
                    gu_stages=4, dn_warps=4, dn_stages=4, prequant=True)),
        (1 << 62, dict(block_m=64, gu_block_n=128, gu_block_k=128, dn_block_n=128, dn_block_k=128, gu_warps=8,
                       gu_stages=3, dn_warps=8, dn_stages=3, prequant=True)),
    ],
    "bf16": [
        (2048, _DECODE_BF16),
        (1 << 62, dict(block_m=128, gu_block_n=128, gu_block_k=64, dn_block_n=128, dn_block_k=64, gu_warps=8,
                       gu_stages=3, dn_warps=8, dn_stages=3)),
    ],
}


def pick(table: dict[str, list[tuple[int, dict]]], num_pairs: int, fp8: bool, act_fp8: bool = False,
         cls=TritonMoeConfig):
    rows = table["w8a8" if act_fp8 else "fp8" if fp8 else "bf16"]
    for max_pairs, cfg in rows:
        if num_pairs <= max_pairs:
            return cls(**cfg)
    return cls(**rows[-1][1])
