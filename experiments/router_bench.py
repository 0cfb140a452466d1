"""MoE router top-k on the GPU: the Pallas kernel (kernels/router) against `lax.top_k` + softmax, same run.

    python experiments/router_bench.py --out DIR [--rows 128 3072] [--iters 200]

Per row count N (E 256, k 8, fp32 logits): the kernel's ids must equal the reference's and its weights match to
1e-6; then each backend runs `--iters` times in one jitted fori_loop (the logits perturbed by the previous result so
nothing is hoisted), timed by a host clock around block_until_ready after a warm-up call; time per call = the median of
5 repeats / iters. Writes DIR/router_bench.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.common import command_line  # noqa: E402
from kernels.router.api import router_topk  # noqa: E402

E, K = 256, 8


def timed(backend: str, x, iters: int) -> float:
    def body(_, x):
        ids, w = router_topk(x, K, backend=backend)
        return x + 1e-6 * w[:, :1] + 1e-9 * ids[:, :1]  # depends on the result: the call is not hoisted

    run = jax.jit(lambda x: jax.lax.fori_loop(0, iters, body, x))
    jax.block_until_ready(run(x))
    times = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(run(x))
        times.append((time.perf_counter() - t) / iters)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[128, 3072])
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for n in args.rows:
        x = jax.random.normal(jax.random.PRNGKey(n), (n, E), jnp.float32) * 2.0
        (ki, kw), (ri, rw) = (jax.jit(lambda x, b=b: router_topk(x, K, backend=b))(x)
                              for b in ("pallas_triton", "reference"))
        row = {"rows": n, "ids_equal": bool(np.array_equal(np.asarray(ki), np.asarray(ri))),
               "weights_max_abs_err": float(jnp.max(jnp.abs(kw - rw)))}
        for b in ("pallas_triton", "reference"):
            row[f"{b}_us"] = 1e6 * timed(b, x, args.iters)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"command": command_line(args.out), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "E": E, "k": K, "rows": rows}
    with open(os.path.join(args.out, "router_bench.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"\n{'rows':>6} {'ids ok':>6} {'w err':>9} {'kernel us':>10} {'lax.top_k us':>13}")
    for r in rows:
        print(f"{r['rows']:>6} {str(r['ids_equal']):>6} {r['weights_max_abs_err']:>9.1e} {r['pallas_triton_us']:>10.2f} "
              f"{r['reference_us']:>13.2f}")
    return result


if __name__ == "__main__":
    main()
