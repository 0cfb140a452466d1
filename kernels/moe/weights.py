"""The routed-expert weight container shared by every MoE backend."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """Stacked expert weights in the checkpoint's [out, in] orientation.

    gate, up [E, I, H]; down [E, H, I]: bf16, or float8_e4m3fn with fp32 `*_scale` [E, ceil(out/b0), ceil(in/b1)]
    (W = fp8 * scale per block, the checkpoint's `weight_scale_inv`). Scales are None for bf16 weights."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array
    gate_scale: jax.Array | None = None
    up_scale: jax.Array | None = None
    down_scale: jax.Array | None = None
    block: tuple[int, int] = dataclasses.field(default=(128, 128), metadata=dict(static=True))

    @property
    def is_fp8(self) -> bool:
        return self.gate.dtype == jnp.float8_e4m3fn

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]
