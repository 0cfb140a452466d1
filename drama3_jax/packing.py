"""Packed prefill: several prompts end to end on one row axis, so the row-wise layers compute no padding.

A prefill of P right-padded prompts as a [P, T] batch spends every row-wise layer (projections, MLPs, routed
experts, the tower) on P x T rows, most of them padding when the prompts are shorter than T. Packed, the prompts lie
end to end on a [1, N] row axis (N a compiled bucket, padding only at its end), and only the sequence mixers see
them per prompt: attention gathers its inputs from the packed rows into per-prompt lanes [P, T] and its output back
(two gathers of one layer's activations); the causal conv and the gated delta rule address each prompt's rows in
place by its first row (`offsets`) and length. The caches that come out are the same [P, ...] per-prompt caches as a
batched prefill's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Packing:
    """unpack [P, T] int32: the packed row holding row t of prompt p, N (out of range: a zero row) past its length;
    pack [N] int32: p * T + t for the packed row of (p, t), P * T (out of range) for the padding rows."""

    unpack: jax.Array
    pack: jax.Array

    @property
    def num_seqs(self) -> int:
        return self.unpack.shape[0]

    @property
    def seq_len(self) -> int:
        return self.unpack.shape[1]

    @property
    def offsets(self) -> jax.Array:
        """[P] int32: each prompt's first packed row (N for an empty lane)."""
        return self.unpack[:, 0]

    def to_seqs(self, x: jax.Array) -> jax.Array:
        """[1, N, ...] packed rows -> [P, T, ...] per-prompt lanes, zeros past each prompt's length."""
        return jnp.take(x[0], self.unpack, axis=0, mode="fill", fill_value=0)

    def to_rows(self, y: jax.Array) -> jax.Array:
        """[P, T, ...] per-prompt lanes -> [1, N, ...] packed rows, zeros in the padding rows."""
        flat = y.reshape((self.num_seqs * self.seq_len,) + y.shape[2:])
        return jnp.take(flat, self.pack, axis=0, mode="fill", fill_value=0)[None]

    def valid(self) -> jax.Array:
        """[1, N] bool: the packed rows that hold a prompt row."""
        return (self.pack < self.num_seqs * self.seq_len)[None]


def pack_layout(lengths, num_rows: int, num_seqs: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host side: prompts of `lengths` (each <= seq_len, at most num_seqs, summing to <= num_rows) packed in order.
    Returns (offsets [P] of each prompt's first packed row, unpack [P, T], pack [N]) as int32 numpy arrays; lanes past
    len(lengths) are empty."""
    lengths = np.asarray(lengths, np.int64)
    if len(lengths) > num_seqs or lengths.sum() > num_rows or (lengths > seq_len).any():
        raise ValueError(f"{len(lengths)} prompts of {lengths.tolist()} rows do not pack into {num_rows} rows of "
                         f"{num_seqs} lanes of {seq_len}")
    offsets = np.zeros(num_seqs, np.int64)
    offsets[1:len(lengths)] = np.cumsum(lengths)[:-1]
    lens = np.zeros(num_seqs, np.int64)
    lens[:len(lengths)] = lengths
    t = np.arange(seq_len)[None, :]
    unpack = np.where(t < lens[:, None], offsets[:, None] + t, num_rows)
    pack = np.full(num_rows, num_seqs * seq_len, np.int64)
    for p in range(len(lengths)):
        pack[offsets[p]:offsets[p] + lens[p]] = p * seq_len + np.arange(lens[p])
    return offsets.astype(np.int32), unpack.astype(np.int32), pack.astype(np.int32)
