"""Block-size tables for the Pallas MoE backends, as data. Keyed by the number of (token, slot) pairs M = T * k.

Each table is a list of (max_pairs, config) rows, first row whose max_pairs >= M wins; the last row is the default.
Values were chosen for Drama 3 shapes (H 2048, I 512, E 256, top-8) on the H200; see experiments/results/moe_*.md.
Decode (M <= 2048): weight-bandwidth bound, small row blocks and narrow N tiles so that ~8..252 touched experts still
give >= 2 programs per SM. Prefill: tensor-core bound, 64..128-row blocks.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TritonMoeConfig:
    """block_m: rows per block (every expert's rows are padded to it); gu_*: gate+up GEMM tile (N over I, K over H);
    dn_*: down GEMM tile (N over H, K over I); warps/stages per kernel (Triton num_warps / num_stages);
    swap_ab: compute W . x^T (weights on the MMA's M side, the layout tokamax uses for small row counts);
    gu_f16: with FP8 weights, run the gate/up GEMM in f16 (FP8 -> f16 is a single convert on sm90)."""

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


# (max_pairs M, config)
TRITON_TABLE: list[tuple[int, dict]] = [
    (64, dict(block_m=16, gu_block_n=32, gu_block_k=128, dn_block_n=64, dn_block_k=128, gu_warps=4, gu_stages=4,
              dn_warps=4, dn_stages=4)),
    (2048, dict(block_m=16, gu_block_n=64, gu_block_k=128, dn_block_n=128, dn_block_k=128, gu_warps=4, gu_stages=4,
                dn_warps=4, dn_stages=4)),
    (16384, dict(block_m=64, gu_block_n=128, gu_block_k=64, dn_block_n=128, dn_block_k=64, gu_warps=8, gu_stages=3,
                 dn_warps=4, dn_stages=3)),
    (1 << 62, dict(block_m=128, gu_block_n=128, gu_block_k=64, dn_block_n=128, dn_block_k=64, gu_warps=8,
                   gu_stages=3, dn_warps=8, dn_stages=3)),
]


def pick(table: list[tuple[int, dict]], num_pairs: int, cls=TritonMoeConfig):
    for max_pairs, cfg in table:
        if num_pairs <= max_pairs:
            return cls(**cfg)
    return cls(**table[-1][1])
