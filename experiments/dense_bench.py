"""Decode-size dense projections on one GPU: XLA's GEMM against the Pallas kernel of kernels/dense, at every weight
shape of the decode step (backbone projections, shared expert, router, tower), beside the HBM roofline.

For each distinct (N, K) weight and each row count M: the time of one y = x @ w^T, as a jitted fori_loop over R x L
calls with L distinct weights (together larger than the 50 MB L2, so each call streams its weight from HBM); the
rows pass an optimization barrier with the loop index, so no call is hoisted out of the loop. Host clock around
block_until_ready, median of repeats after a warm-up call. Correctness: each Pallas configuration against the
reference on fresh random inputs, relative max error. The per-step totals weight each shape by its count in one
decode step of the model.

    python experiments/dense_bench.py --out DIR [--rows 32 128 256] [--sweep [--sweep-rows 1]] [--preset full]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from collections import Counter
from datetime import datetime, timezone

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from drama3_jax.config import preset  # noqa: E402
from drama3_jax.model import Drama3Model  # noqa: E402
from drama3_jax.nn import FusedLinear, Linear  # noqa: E402
from experiments.common import command_line, log, save_json  # noqa: E402
from kernels.dense import tuning  # noqa: E402
from kernels.dense.pallas_triton import check_shapes, linear_pallas_triton  # noqa: E402
from kernels.dense.reference import linear_reference  # noqa: E402

HBM_BPS = 4.2e12  # measured device-to-device copy on the H200 (../shared/docs/h200-baselines.md)
L2_BYTES = 50 * 2**20


def step_shapes(cfg, fused: bool = True) -> Counter:
    """(N, K) -> uses in one decode step: the weight of every Linear / FusedLinear of the model (each runs once per
    step), in the layout the server runs (`fused`: Drama3Model.fuse_projections) or the checkpoint's; not the
    lm_head's full vocabulary (the step reads the semantic band only)."""
    def build():
        model = Drama3Model(cfg, dtype=jnp.bfloat16)
        if fused:
            model.fuse_projections()
        return model

    uses = Counter()
    for path, module in nnx.iter_modules(nnx.eval_shape(build)):
        if isinstance(module, (Linear, FusedLinear)) and path[0] != "lm_head":
            uses[tuple(module.weight.shape)] += 1
    return uses


def sweep_configs(n: int, k: int, m: int) -> list[tuning.DenseConfig]:
    """Candidate configurations whose grid is between half a wave and eight waves of 132 SMs."""
    out = []
    for bn in (16, 32, 64):
        for split in (1, 2, 4, 8):
            for stages in (3, 4):
                cfg = tuning.DenseConfig(block_n=bn, block_k=128, split_k=split, num_stages=stages,
                                         swap_ab=m <= 64)
                try:
                    check_shapes(m, n, k, cfg)
                except ValueError:
                    continue
                if 64 <= (n // bn) * split <= 1056:
                    out.append(cfg)
    return out


def build_timer(fn, m, n, k, *, seed, min_calls=64):
    """Compile a loop of calls of fn(x, w) over L distinct weights; returns (compiled, args, calls)."""
    wbytes = n * k * 2
    n_w = max(2, min(32, math.ceil(4 * L2_BYTES / wbytes)))
    keys = jax.random.split(jax.random.key(seed), n_w + 1)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    ws = [(jax.random.normal(kk, (n, k), jnp.float32) * k ** -0.5).astype(jnp.bfloat16) for kk in keys[1:]]
    R = max(1, min_calls // n_w)

    def run(x, ws):
        def body(i, ys):
            xb, _ = jax.lax.optimization_barrier((x, i))
            return tuple(fn(xb, w) for w in ws)

        return jax.lax.fori_loop(0, R, body, tuple(jnp.zeros((m, n), jnp.bfloat16) for _ in ws))

    t0 = time.perf_counter()
    compiled = jax.jit(run).lower(x, ws).compile()
    return compiled, (x, ws), R * n_w, time.perf_counter() - t0


def time_it(compiled, args, calls, reps) -> dict:
    jax.block_until_ready(compiled(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        ts.append((time.perf_counter() - t0) / calls)
    return dict(ms=1e3 * statistics.median(ts), ms_min=1e3 * min(ts))


def rel_err(cfg, m, n, k, seed) -> float:
    k1, k2 = jax.random.split(jax.random.key(seed + 7))
    x = jax.random.normal(k1, (m, k), jnp.bfloat16)
    w = (jax.random.normal(k2, (n, k), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
    ref = linear_reference(x, w).astype(jnp.float32)
    got = linear_pallas_triton(x, w, config=cfg).astype(jnp.float32)
    return float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="full", choices=["full", "tiny"])
    ap.add_argument("--rows", type=int, nargs="*", default=[32, 128, 256], help="row counts of the main table")
    ap.add_argument("--sweep", action="store_true", help="also time the candidate configurations (at --sweep-rows)")
    ap.add_argument("--sweep-rows", type=int, default=128, help="row count of the sweep (1: one stream)")
    ap.add_argument("--unfused", action="store_true",
                    help="the checkpoint's projection shapes instead of the fused ones the server runs")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=math.inf, help="stop sweeping after this many seconds")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    cfg = preset(args.preset)
    uses = step_shapes(cfg, fused=not args.unfused)
    res = dict(command=command_line(args.out), date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               device=jax.devices()[0].device_kind, jax=jax.__version__, preset=args.preset,
               timing=__doc__.split("\n\n")[1].replace("\n", " "), hbm_bytes_per_s=HBM_BPS, rows=[], sweep=[])
    for m in args.rows:
        for (n, k), count in sorted(uses.items(), key=lambda kv: -kv[0][0] * kv[0][1]):
            roof = (n * k + m * k + m * n) * 2 / HBM_BPS * 1e3
            row = dict(M=m, N=n, K=k, uses_per_step=count, roofline_ms=roof)
            comp, a, calls, cs = build_timer(linear_reference, m, n, k, seed=n + k)
            row["xla"] = time_it(comp, a, calls, args.reps)
            table_cfg = tuning.pick(n, k)
            try:
                check_shapes(m, n, k, table_cfg)
            except ValueError as e:
                row["pallas"] = dict(skipped=str(e))
            else:
                fn = lambda x, w: linear_pallas_triton(x, w, config=table_cfg)  # noqa: E731
                comp, a, calls, cs = build_timer(fn, m, n, k, seed=n + k)
                row["pallas"] = dict(time_it(comp, a, calls, args.reps), config=dataclasses.asdict(table_cfg),
                                     rel_err=rel_err(table_cfg, m, n, k, n + k))
            res["rows"].append(row)
            p = row["pallas"].get("ms")
            log(f"M={m} N={n} K={k}: xla {row['xla']['ms']:.4f} ms, pallas {p if p is None else round(p, 4)} ms, "
                f"roofline {roof:.4f} ms")
            save_json(res, os.path.join(args.out, "dense_bench.json"))
    if args.sweep:
        m = args.sweep_rows
        for (n, k) in sorted(uses, key=lambda nk: -nk[0] * nk[1]):
            for c in sweep_configs(n, k, m):
                if time.perf_counter() - t_start > args.budget_s:
                    break
                fn = lambda x, w, c=c: linear_pallas_triton(x, w, config=c)  # noqa: E731
                comp, a, calls, cs = build_timer(fn, m, n, k, seed=n + k)
                res["sweep"].append(dict(M=m, N=n, K=k, config=dataclasses.asdict(c),
                                         **time_it(comp, a, calls, args.reps), rel_err=rel_err(c, m, n, k, n + k)))
            save_json(res, os.path.join(args.out, "dense_bench.json"))
    with open(os.path.join(args.out, "dense_bench.md"), "w") as fh:
        fh.write(markdown(res))
    print(markdown(res))
    return res


def markdown(res) -> str:
    out = [f"# Decode-size dense projections ({res['device']}, jax {res['jax']}, {res['date']})", "",
           f"Command: `{res['command']}`. {res['timing']}", "",
           "| M | N | K | uses/step | XLA ms | Pallas ms | roofline ms | XLA % | Pallas % | Pallas rel err | config |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    totals = {}
    for r in res["rows"]:
        p = r["pallas"]
        pm = p.get("ms")
        best = min(r["xla"]["ms"], pm) if pm is not None else r["xla"]["ms"]
        t = totals.setdefault(r["M"], [0.0, 0.0, 0.0])
        t[0] += r["uses_per_step"] * r["xla"]["ms"]
        t[1] += r["uses_per_step"] * best
        t[2] += r["uses_per_step"] * r["roofline_ms"]
        cfg = p.get("config")
        cs = "-" if cfg is None else f"bn{cfg['block_n']} split{cfg['split_k']} s{cfg['num_stages']}"
        out.append(f"| {r['M']} | {r['N']} | {r['K']} | {r['uses_per_step']} | {r['xla']['ms']:.4f} | "
                   + (f"{pm:.4f}" if pm is not None else "-") + f" | {r['roofline_ms']:.4f} | "
                   f"{100 * r['roofline_ms'] / r['xla']['ms']:.0f}% | "
                   + (f"{100 * r['roofline_ms'] / pm:.0f}%" if pm is not None else "-") + " | "
                   + (f"{p['rel_err']:.1e}" if pm is not None else "-") + f" | {cs} |")
    out += ["", "Per decode step (each shape times its uses; 'best' takes the faster of the two per shape):", "",
            "| M | XLA ms/step | best ms/step | roofline ms/step |", "|---|---|---|---|"]
    out += [f"| {m} | {a:.3f} | {b:.3f} | {c:.3f} |" for m, (a, b, c) in totals.items()]
    if res["sweep"]:
        out += ["", f"Sweep at M = {res['sweep'][0]['M']} (ms):", "", "| N | K | config | ms | rel err |",
                "|---|---|---|---|---|"]
        for s in sorted(res["sweep"], key=lambda s: (-s["N"] * s["K"], s["ms"])):
            c = s["config"]
            out.append(f"| {s['N']} | {s['K']} | bn{c['block_n']} split{c['split_k']} s{c['num_stages']}"
                       f"{' swap' if c['swap_ab'] else ''} | {s['ms']:.4f} | {s['rel_err']:.1e} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
