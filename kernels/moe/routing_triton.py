"""The expert block schedule of `kernels/moe/routing.py` as one Pallas (Triton) program, for few pairs.

At decode sizes the XLA schedule is a chain of small kernels (histogram, two cumsums, the rank count, a scatter, the
block bookkeeping), each a few microseconds of launch latency for a few hundred integers; with one stream (M = 8
pairs) that chain costs more than the expert GEMMs' own data. Here all of it runs in one program: a one-hot [M, E]
histogram, cumsums over E, each pair's rank among the earlier pairs of its expert, a scatter store of the pair order,
and the block -> expert map from a [nb, E] compare. Same outputs as `routing.expert_block_schedule`, bit for bit.
Triton tensors are powers of two, so pairs are padded with id E + 1 (after every real pair, so they land on their
own index in the order's padding tail) and blocks with masked stores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels.moe.routing import BlockSchedule, max_row_blocks

MAX_PAIRS = 64  # [M, E] and [nb, E] int32 tiles of at most 64 x 256 stay in registers


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _schedule_kernel(ids_ref, *refs, m, e, bm, nb, k, masked: bool):
    valid_ref, (order_ref, be_ref, r0_ref, nr_ref) = (refs[0] if masked else None), refs[-4:]
    mp, nbp = ids_ref.shape[0], _pow2(nb)
    ids = ids_ref[...]                                                     # [mp]; E: routed nowhere, E + 1: padding
    if valid_ref is not None:  # pairs of rows marked 0 are routed nowhere (read here: no XLA kernel in front)
        pair = jnp.arange(mp, dtype=jnp.int32)
        row_ok = plt.load(valid_ref.at[jnp.minimum(pair // k, valid_ref.shape[0] - 1)]) != 0
        ids = jnp.where(row_ok | (ids > e), ids, e)
    experts = jnp.arange(e, dtype=jnp.int32)
    hit = ids[:, None] == experts[None, :]                                # [mp, E]
    counts = jnp.sum(hit.astype(jnp.int32), axis=0)                       # [E]
    start = jnp.cumsum(counts) - counts                                   # first sorted row of each expert
    routed = jnp.sum(counts)
    p = jnp.arange(mp, dtype=jnp.int32)
    earlier_same = (ids[None, :] == ids[:, None]) & (p[None, :] < p[:, None])
    rank = jnp.sum(earlier_same.astype(jnp.int32), axis=1)
    first = jnp.sum(jnp.where(hit, start[None, :], 0), axis=1)           # start[id] of the routed pairs
    # routed nowhere: after every routed pair; padding pairs: after all m real pairs, i.e. on their own index
    first = jnp.where(ids == e, routed, jnp.where(ids > e, m, first))
    pos = first + rank
    tail = jnp.arange(_pow2(bm), dtype=jnp.int32)
    plt.store(order_ref.at[m + tail], m + tail, mask=tail < bm)         # the padding entries M..M+bm-1
    plt.store(order_ref.at[pos], p, mask=pos < m + bm)                  # then every pair on its sorted row
    nblk = (counts + bm - 1) // bm
    blk_end = jnp.cumsum(nblk)
    blk_start = blk_end - nblk
    b = jnp.arange(nbp, dtype=jnp.int32)
    eb = jnp.sum((blk_end[None, :] <= b[:, None]).astype(jnp.int32), axis=1)  # expert of block b
    used = eb < e
    at = experts[None, :] == jnp.minimum(eb, e - 1)[:, None]             # [nbp, E] one-hot of that expert
    pick = lambda v: jnp.sum(jnp.where(at, v[None, :], 0), axis=1)      # noqa: E731
    off = (b - pick(blk_start)) * bm
    rows = jnp.clip(pick(counts) - off, 0, bm)
    keep = b < nb
    plt.store(be_ref.at[b], jnp.where(used, jnp.minimum(eb, e - 1), -1), mask=keep)
    plt.store(r0_ref.at[b], jnp.where(used, pick(start) + off, 0), mask=keep)
    plt.store(nr_ref.at[b], jnp.where(used, rows, 0), mask=keep)


def expert_block_schedule_triton(topk_ids: jax.Array, num_experts: int, block_m: int, *, valid=None,
                                 interpret: bool = False) -> BlockSchedule:
    """`routing.expert_block_schedule` in one Pallas program; topk_ids [T, k] with T * k <= MAX_PAIRS. valid [T]
    (int or bool; None: every row): the pairs of rows with 0 are routed nowhere, as if their ids were E."""
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    m = flat.shape[0]
    if m > MAX_PAIRS:
        raise ValueError(f"{m} pairs: the one-program schedule takes at most {MAX_PAIRS}")
    nb = max_row_blocks(m, num_experts, block_m)
    mp = _pow2(m)
    ids = jnp.concatenate([flat, jnp.full((mp - m,), num_experts + 1, jnp.int32)]) if mp > m else flat
    i32 = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32)  # noqa: E731
    inputs = (ids,) if valid is None else (ids, valid.reshape(-1).astype(jnp.int32))
    order, be, r0, nr = pl.pallas_call(
        functools.partial(_schedule_kernel, m=m, e=num_experts, bm=block_m, nb=nb, k=topk_ids.shape[-1],
                          masked=valid is not None),
        out_shape=(i32(m + block_m), i32(nb), i32(nb), i32(nb)),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="moe_block_schedule",
    )(*inputs)
    return BlockSchedule(order=order, block_expert=be, block_row0=r0, block_rows=nr, block_m=block_m)
