"""What a threshold search's reductions compile to in a Pallas (Triton) kernel for the H200, on a CPU machine.

The sampling kernels' top-p bound is a bisection: one masked mass sum over the row's tile per halving, each a
CTA-wide reduction. A multi-way search (P pivots a pass, log2(P) halvings) would need fewer passes if P sums cost
about one. This compiles three 4-pass searches over the main-token tile ([32, 128] fp32 per program, 16 warps, as
kernels/sampling TUNING["main"]) through kernels/sampling/compile_check.py and counts what each pass costs in the PTX:

  scalar   one masked sum a pass (the kernels' bisection)
  vector   P masked sums a pass as one [P, 32, 128] reduction (P a power of two, as Triton's tensor sizes must be;
           the P-th pivot is the bracket's upper end, so a pass is log2(P) halvings)
  split    the same log2(P) halvings from P - 1 separate scalar reductions a pass

  python experiments/triton_reduction_cost.py --out DIR [--pivots 4 8 16]

Reported per variant: registers, spilled bytes, shared memory, bar.sync and shfl.sync instructions in the kernel
(static counts of one program's code; the loop body is in it once). Static code, not time: the device decides.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.common import command_line, log, save_json  # noqa: E402
from kernels.h200_lowering import capture_ttir  # noqa: E402
from kernels.sampling.compile_check import compile_ptx  # noqa: E402

R, G, ROWS, WARPS, PASSES = 32, 128, 128, 16, 4
f32 = jnp.float32


def search_kernel(variant: str, pivots: int):
    """A kernel of PASSES dependent search passes over one row's [R, G] tile (one program per row)."""
    def kern(x_ref, lo_ref, out_ref):
        row = pl.program_id(0)
        r = jax.lax.broadcasted_iota(jnp.int32, (R, G), 0)
        g = jax.lax.broadcasted_iota(jnp.int32, (R, G), 1)
        z = plt.load(x_ref.at[row, r * G + g])
        e = jnp.exp(z)
        frac = (jax.lax.broadcasted_iota(jnp.int32, (pivots,), 0) + 1).astype(f32)

        def step(_, lo):
            if variant == "scalar":
                return jnp.where(jnp.sum(jnp.where(z >= lo, e, 0.0)) > 1.0, lo + 0.5, lo - 0.25)
            piv = lo + frac
            if variant == "vector":
                mass = jnp.sum(jnp.where(z[None] >= piv[:, None, None], e[None], 0.0), axis=(1, 2))
                return jnp.max(jnp.where(mass > 1.0, piv, lo))
            best = lo
            for j in range(pivots - 1):
                p = lo + float(j + 1)
                best = jnp.where(jnp.sum(jnp.where(z >= p, e, 0.0)) > 1.0, jnp.maximum(best, p), best)
            return best

        out_ref[row] = jax.lax.fori_loop(0, PASSES, step, lo_ref[row])

    return lambda x, lo: pl.pallas_call(kern, grid=(ROWS,), out_shape=jax.ShapeDtypeStruct((ROWS,), f32),
                                        compiler_params=plt.CompilerParams(num_warps=WARPS, num_stages=1))(x, lo)


def measure(variant: str, pivots: int) -> dict:
    sd = jax.ShapeDtypeStruct
    ttir = capture_ttir(search_kernel(variant, pivots), sd((ROWS, R * G), f32), sd((ROWS,), f32))
    counts = {k: v for k, v in compile_ptx(ttir, WARPS).items() if not k.startswith("div_")}
    return dict(variant=variant, pivots=pivots, halvings_per_pass=max(1, pivots.bit_length() - 1), **counts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--pivots", type=int, nargs="+", default=[4, 8, 16],
                    help="ways a pass splits the bracket in the vector / split variants (powers of two)")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    rows = [measure("scalar", 1)] + [measure(v, p) for p in a.pivots for v in ("vector", "split")]
    for row in rows:
        log(row)
    save_json({"command": command_line(a.out), "jax": jax.__version__, "tile": [R, G], "num_warps": WARPS,
               "passes": PASSES, "rows": rows}, os.path.join(a.out, "triton_reduction_cost.json"))
    lines = [f"# Search-pass reductions in Pallas-Triton PTX (sm_90, compiled on a CPU; jax {jax.__version__})", "",
             f"`{command_line(a.out)}`: {PASSES} passes over a [{R}, {G}] fp32 tile, {WARPS} warps. Static counts "
             "of one program's code (each pass's body appears once).", "",
             "| variant | pivots a pass | halvings a pass | registers | spill bytes | bar.sync | shfl.sync |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['variant']} | {r['pivots']} | {r['halvings_per_pass']} | {r['registers']} | "
              f"{r['spill_bytes']} | {r['bar_sync']} | {r['shfl_sync']} |" for r in rows]
    with open(os.path.join(a.out, "triton_reduction_cost.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[-len(rows) - 2:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
