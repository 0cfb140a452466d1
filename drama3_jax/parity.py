"""Teacher-forced logits for numerical parity checks (a stable interface other tools rely on).

    python -m drama3_jax.parity --checkpoint ORBAX_DIR --rows ROWS.npy --out OUT.npz [--dtype float32|bfloat16]

ROWS.npy: int32 [T, 1+K] frame rows (text rows [token, 0, ..., 0], audio rows [semantic_start + c0, c0, ..., c9]).
OUT.npz:
  main_logits  float32 [T-1, band+1]: logits of the main token of row t+1 from rows 0..t (the semantic band in order,
               then EOS);
  head_logits  float32 [T-1, K-1, band]: logits of codebook i+1 of row t+1 given that row's c0..ci as the tower's
               labels; NaN where row t+1 is not semantic.
Every size comes from the checkpoint's config.json. Default compute dtype float32 (weights upcast).
"""

from __future__ import annotations

import argparse
import sys

import jax.numpy as jnp
import numpy as np
from flax import nnx

from drama3_jax.model import Drama3Model


@nnx.jit(static_argnames=("max_len",))
def _teacher(model, rows, lengths, max_len):
    hidden, heads, _ = model.teacher_forced(rows, lengths, max_len, compute_heads=True)
    return model.main_logits(hidden[:, :-1]), heads


def teacher_forced_logits(model: Drama3Model, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """rows [T, 1+K] -> (main_logits [T-1, band+1], head_logits [T-1, K-1, band] with NaN for non-semantic rows)."""
    cfg = model.cfg
    rows = np.asarray(rows, np.int32)
    if rows.ndim != 2 or rows.shape[1] != cfg.row_width or rows.shape[0] < 2:
        raise ValueError(f"rows must be int [T >= 2, {cfg.row_width}], got {rows.shape}")
    T = rows.shape[0]
    max_len = max(64, 1 << (T - 1).bit_length())
    padded = np.zeros((1, max_len, cfg.row_width), np.int32)
    padded[0, :T] = rows
    main, heads = _teacher(model, jnp.asarray(padded), jnp.asarray([T], jnp.int32), max_len)
    main = np.asarray(main, np.float32)[0, :T - 1]
    heads = np.array(heads, np.float32)[0, :T - 1]
    sem = (rows[1:, 0] >= cfg.semantic_start_token_id) & (rows[1:, 0] <= cfg.semantic_end_token_id)
    heads[~sem] = np.nan
    return main, heads


def main(argv=None) -> int:
    import drama3_jax

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--rows", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    model = drama3_jax.load_talker(args.checkpoint, dtype=jnp.dtype(args.dtype))
    main_logits, head_logits = teacher_forced_logits(model, np.load(args.rows))
    np.savez(args.out, main_logits=main_logits, head_logits=head_logits)
    print(f"wrote main_logits {main_logits.shape} and head_logits {head_logits.shape} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
