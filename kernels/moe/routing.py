"""Token -> expert grouping for the grouped-GEMM backends: a static-shape block schedule, computed in XLA.

The (token, slot) pairs of a layer (M = T * k of them) are ordered by expert. Every expert's run of pairs is cut into
row blocks of `block_m`; a block never spans two experts (the vLLM `moe_align_block_size` idea, without materialising a
padded copy). The number of blocks depends on the routing, so the schedule is sized for the worst case

    num_blocks = floor((M + min(E, M) * (block_m - 1)) / block_m)

(every non-empty expert wastes at most block_m - 1 rows), and blocks past the used ones carry expert -1 and are skipped
by the kernels. Shapes depend only on (T, k, E, block_m): no recompilation per batch composition, no host sync.

The expert order of the pairs is the stable sort of the pairs by expert. At decode sizes (M <= `RANK_MAX_PAIRS`) it
is a counting sort: each pair's rank among the pairs of its expert from a [M, M] compare-and-count that XLA fuses
into one kernel, then one scatter (the argsort it replaced took 10.5 us per layer at M = 1,024 on the H200,
experiments/results/decode_profile_fused_2026-12-01/). Above it (prefill) it is a counting sort too (the default,
`LARGE_ORDER = "count"`): an exclusive cumsum over tokens of the [T, E + 1] per-token expert counts plus each pair's
offset among equal ids of its own token. In a 3,072-row prefill call on the H200 that took the call from 71.55 to
68.40 ms (medians of 5) against the stable argsort of the M keys (`"argsort"`, 480 sort kernels;
experiments/results/ab_2026-12-04/). For at most `routing_triton.MAX_PAIRS` pairs the Pallas MoE backend runs this
whole schedule as one Pallas program instead (kernels/moe/routing_triton.py), with the same outputs; this module is
its reference.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockSchedule:
    """Work list of the grouped GEMMs.

    order [M + block_m] int32: pair indices (t * k + j) sorted by expert (stable), then block_m padding entries (values
      >= M), so that a block's rows can be read as one slice without running past the end.
    block_expert [nb] int32: expert of each row block, -1 for unused blocks.
    block_row0 [nb] int32: index into `order` of the block's first row.
    block_rows [nb] int32: valid rows in the block (1..block_m; 0 for unused blocks).
    """

    order: jax.Array
    block_expert: jax.Array
    block_row0: jax.Array
    block_rows: jax.Array
    block_m: int = dataclasses.field(metadata=dict(static=True))

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


RANK_MAX_PAIRS = 2048  # the [M, M] compare stays a few MB; above it (prefill) it would not
LARGE_ORDER = "count"  # above RANK_MAX_PAIRS: "count" (the cumsum counting sort) or "argsort" (a stable argsort)


def max_row_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst-case number of `block_m` row blocks over all routings of `num_pairs` pairs to `num_experts` experts."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def expert_block_schedule(topk_ids: jax.Array, num_experts: int, block_m: int) -> BlockSchedule:
    """Block schedule for topk_ids [T, k] (int, values in [0, E]; E = routed nowhere: the pair is in no block, and
    sorts after every routed one). All shapes static."""
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    m = flat.shape[0]
    nb = max_row_blocks(m, num_experts, block_m)
    # histogram as a compare-reduce (one fused kernel; no atomics contending on 256 bins)
    counts = jnp.sum(flat[None, :] == jnp.arange(num_experts, dtype=jnp.int32)[:, None], axis=1, dtype=jnp.int32)
    start = jnp.cumsum(counts) - counts  # first sorted row of each expert
    order = _expert_order(topk_ids.astype(jnp.int32), start, num_experts, block_m)
    nblk = (counts + block_m - 1) // block_m
    blk_end = jnp.cumsum(nblk)
    blk_start = blk_end - nblk
    b = jnp.arange(nb, dtype=jnp.int32)
    # expert of block b = number of experts whose blocks all end at or before b
    e = jnp.sum(blk_end[None, :] <= b[:, None], axis=1, dtype=jnp.int32)
    used = e < num_experts
    ec = jnp.minimum(e, num_experts - 1)
    off = (b - blk_start[ec]) * block_m
    rows = jnp.clip(counts[ec] - off, 0, block_m)
    return BlockSchedule(
        order=order,
        block_expert=jnp.where(used, ec, -1),
        block_row0=jnp.where(used, start[ec] + off, 0),
        block_rows=jnp.where(used, rows, 0),
        block_m=block_m,
    )


def _expert_order(ids: jax.Array, start: jax.Array, num_experts: int, block_m: int) -> jax.Array:
    """Pair indices [M + block_m] stably sorted by expert, then the block_m padding indices M..M+block_m-1.
    ids [T, k] expert ids in [0, E] (pair t * k + j); start [E] first sorted row of each expert (pairs with id E come
    after them all)."""
    T, k = ids.shape
    m, flat = T * k, ids.reshape(-1)
    if m > RANK_MAX_PAIRS and LARGE_ORDER == "argsort":
        # sort block_m sentinel keys (= E) along, so `order` comes out already padded (one op, no extra copy)
        keys = jnp.concatenate([flat, jnp.full((block_m,), num_experts, jnp.int32)])
        return jnp.argsort(keys, stable=True).astype(jnp.int32)
    p = jnp.arange(m, dtype=jnp.int32)
    routed = jnp.sum(flat < num_experts, dtype=jnp.int32)
    start = jnp.concatenate([start, routed[None]])  # id E: after every routed pair
    if m > RANK_MAX_PAIRS:
        # earlier pairs of the same id = those of earlier tokens (exclusive cumsum over tokens of the per-token counts)
        # + those earlier in the pair's own token (ids repeat within a token only for E, or in tests)
        per_token = jnp.sum(ids[:, :, None] == jnp.arange(num_experts + 1, dtype=jnp.int32), axis=1,
                            dtype=jnp.int32)                                                   # [T, E + 1]
        before = jnp.cumsum(per_token, axis=0, dtype=jnp.int32) - per_token
        j = jnp.arange(k, dtype=jnp.int32)
        in_token = jnp.sum((ids[:, None, :] == ids[:, :, None]) & (j[None, None, :] < j[None, :, None]), axis=2,
                           dtype=jnp.int32)                                                   # [T, k]
        earlier = (jnp.take_along_axis(before, ids, axis=1) + in_token).reshape(-1)
    else:
        earlier = jnp.sum((flat[None, :] == flat[:, None]) & (p[None, :] < p[:, None]), axis=1, dtype=jnp.int32)
    pos = start[flat] + earlier  # sorted row of each pair: a permutation of [0, M), so scattering into
    # arange(M + block_m) leaves exactly the padding indices M.. in the tail
    return jnp.arange(m + block_m, dtype=jnp.int32).at[pos].set(p, unique_indices=True)
