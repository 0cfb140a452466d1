"""Smoke run of the full-size random-weight talker on one GPU: weight memory, build time, chunked prefill, and a few
decode frames (backbone + tower + sampling) with the chosen kernel backends. Prints as it goes (partial results
survive a time-out) and writes JSON to --out.

    python experiments/full_smoke.py --out DIR [--slots 8] [--kernels auto|reference]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from drama3_jax.backbone import Backends
from drama3_jax.config import full_config
from drama3_jax.generate import Prefiller, RequestSampling, frame_step
from drama3_jax.random_init import random_talker
from drama3_jax.sampling import SamplingParams
from experiments.common import command_line, log, save_json

R: dict = {"device": str(jax.devices()[0]), "jax": jax.__version__}


def note(out, **kw):
    R.update(kw)
    log(kw)
    save_json(R, os.path.join(out, "full_smoke.json"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--kernels", default="auto", choices=["auto", "reference"])
    args = ap.parse_args()
    R["command"] = command_line(args.out)
    cfg = full_config()
    backends = Backends.auto() if args.kernels == "auto" else Backends()
    t = time.time()
    talker = random_talker(cfg, 0)
    jax.block_until_ready(nnx.state(talker))
    n_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(talker)))
    note(args.out, build_s=round(time.time() - t, 1), weights_gib=round(n_bytes / 2**30, 2), kernels=args.kernels)
    B, C, K = args.slots, 64, cfg.row_width
    rows = np.zeros((B, C, K), np.int32)
    rows[..., 0] = np.random.default_rng(0).integers(0, 1000, (B, C))
    lengths = np.full((B,), 48, np.int32)
    prefill = Prefiller(talker, max_len=256, chunk=C, backends=backends)
    t = time.time()
    state = prefill(rows, lengths, RequestSampling.make([SamplingParams()] * B, list(range(B))))
    jax.block_until_ready(state.h)
    note(args.out, prefill_first_call_s=round(time.time() - t, 1))
    graphdef, params = nnx.split(talker)
    step = jax.jit(lambda p, s: frame_step(nnx.merge(graphdef, p), s, backends), donate_argnums=(1,))
    t = time.time()
    row, state = step(params, state)
    jax.block_until_ready(row)
    note(args.out, decode_first_call_s=round(time.time() - t, 1))
    times = []
    for _ in range(10):
        t = time.time()
        row, state = step(params, state)
        jax.block_until_ready(row)
        times.append(time.time() - t)
    note(args.out, decode_step_ms_median=round(1e3 * float(np.median(times)), 2), slots=B,
         main_tokens=np.asarray(row[:, 0]).tolist())


if __name__ == "__main__":
    main()
