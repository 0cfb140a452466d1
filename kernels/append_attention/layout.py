"""Where q, the output gate, k and v sit in one row of a fused attention projection."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """Column layout of a fused q / gate / k / v projection row, in units of `head_dim` columns ("chunks"): query
    head i is chunk `q0 + i * q_step`, its output gate chunk `gate0 + i * gate_step`, kv head j's k chunk `k0 + j` and
    v chunk `v0 + j`. Drama 3's backbone `q_proj` interleaves [q_i | gate_i] per head (q_step = gate_step = 2,
    gate0 = 1); the tower's `wqkv` holds [all q | all gates | k | v] (steps 1)."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    q0: int
    q_step: int
    gate0: int
    gate_step: int
    k0: int
    v0: int

    def __post_init__(self):
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_q_heads} query heads do not group over {self.num_kv_heads} kv heads")

    @property
    def chunks(self) -> int:
        """The fewest chunks a row must hold."""
        return 1 + max(self.q0 + (self.num_q_heads - 1) * self.q_step,
                       self.gate0 + (self.num_q_heads - 1) * self.gate_step,
                       self.k0 + self.num_kv_heads - 1, self.v0 + self.num_kv_heads - 1)

    def q_chunks(self) -> slice:
        return slice(self.q0, self.q0 + self.num_q_heads * self.q_step, self.q_step)

    def gate_chunks(self) -> slice:
        return slice(self.gate0, self.gate0 + self.num_q_heads * self.gate_step, self.gate_step)

    def k_chunks(self) -> slice:
        return slice(self.k0, self.k0 + self.num_kv_heads)

    def v_chunks(self) -> slice:
        return slice(self.v0, self.v0 + self.num_kv_heads)
