"""Block configurations of the decode-size dense kernel, as data. `pick` chooses by the weight's (N, K).

A decode step multiplies 128-256 rows by a weight read once from HBM: the kernel is bound by the weight bytes, so the
grid has to cover the 132 SMs (N // block_n * split_k programs of about one wave or more) with K tiles deep enough to
keep loads in flight. Rows are keyed by the smallest N they apply to; the first matching row wins.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DenseConfig:
    block_n: int = 32
    block_k: int = 128
    split_k: int = 1  # K halves (or quarters, ...) run as separate programs; partial sums added in fp32 after
    num_warps: int = 4
    num_stages: int = 4
    swap_ab: bool = False  # weight tile as the MMA's M side ([block_n, rows] accumulator): for few rows


# (min N, config): wide projections split N only; narrow ones also split K so the grid still fills the GPU
TABLE: tuple[tuple[int, DenseConfig], ...] = (
    (4096, DenseConfig(block_n=32, block_k=128, split_k=1)),
    (2048, DenseConfig(block_n=32, block_k=128, split_k=2)),
    (512, DenseConfig(block_n=32, block_k=128, split_k=8)),
    (0, DenseConfig(block_n=16, block_k=128, split_k=8)),
)


def pick(n: int, k: int, table=None) -> DenseConfig:
    """The first row of `table` (default TABLE) whose min N is at most n, with split_k reduced until it divides K
    into block_k tiles."""
    cfg = next(c for lo, c in (TABLE if table is None else table) if n >= lo)
    split = cfg.split_k
    while split > 1 and k % (split * cfg.block_k):
        split //= 2
    return dataclasses.replace(cfg, split_k=split)
