"""Where a codebook-head sampling launch spends its time: timing-only ablations of the head kernel at 128 rows.

A head launch (kernels/sampling/pallas_triton.py, `sample_filtered_triton`, 128 rows of 4,096 logits, top-k 30,
top-p 0.9) is one program per row in one wave, so its duration is one program's latency. Each variant below removes
one stage by replacing the helper that implements it with a cheap stand-in while the kernel is traced (the samples
are then wrong: these variants are for timing only), so the drop against "kernel" is that stage's share of the
latency. "floor" is a separate minimal kernel over the same tile (load, one row max, store): the launch and the
row's load. Every variant runs the 9 launches of a decode step chained on each other's ids, as the tower issues them.

  kernel          the production launch
  keys_prefolded  the draw id folded by XLA beforehand (no in-kernel threefry fold)
  no_noise        Gumbel noise of the candidates replaced by a cheap function of the index (no threefry)
  plain_div       x / T by Triton's approximate division instead of the inline div.rn.f32
  no_compaction   the candidates' compaction (prefix counts, scatter, barriers, reload) replaced by the group maxima
  no_mass_above   the [C, C] pairwise top-p masses replaced by the candidates' own probabilities
  all_stubbed     all five stand-ins: what is left is the inline reductions (max, sum, group ranks, counts, ranks,
                  argmax), the launch and the load
  warps_4/16      the production kernel at 4 / 16 warps per program
  floor           load + one max + store

Device time per launch from a profiler trace (median over --steps steps x 9 launches).

  python experiments/sampling_latency.py --out DIR [--rows 128] [--steps 20]
  python experiments/sampling_latency.py --out DIR --cpu-smoke     (interpret mode, tiny)
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.common import command_line, log, patched, save_json  # noqa: E402

HEADS, V = 9, 4096
TOP_K, TOP_P = 30, 0.9


def stand_ins(jnp, PT):
    """name -> {helper name in pallas_triton: cheap stand-in}."""
    f32, i32 = jnp.float32, jnp.int32

    def gumbel_cheap(k0, k1, idx):
        return (idx & 7).astype(f32) * 0.01 + (k0 & 1).astype(f32)

    def div_plain(x, t, interpret):
        return x / t

    def compact_cheap(mask, n, zv, idx, *, C, **_):
        cz = jnp.max(jnp.where(mask, zv, -jnp.inf), axis=0)          # [G] = [C] in the one-wave geometry
        c = jnp.arange(cz.shape[0], dtype=i32)
        return cz, c, c < n

    def mass_above_cheap(cz, cp, base, crossing):
        return base + cp

    subs = {"no_noise": {"gumbel_at": gumbel_cheap}, "plain_div": {"_div_rn": div_plain},
            "no_compaction": {"_compact": compact_cheap}, "no_mass_above": {"_mass_above": mass_above_cheap}}
    subs["all_stubbed"] = {k: v for d in subs.values() for k, v in d.items()}
    return subs


def floor_launch(jax, jnp, pl, plt, logits, interpret):
    """Minimal kernel over the head kernel's tile: load the row as [N / 64, 64], its max, store: int32 [B]."""
    B, N = logits.shape
    G = 64

    def kern(x_ref, o_ref):
        row = pl.program_id(0)
        idx = jax.lax.broadcasted_iota(jnp.int32, (N // G, G), 0) * G + jax.lax.broadcasted_iota(
            jnp.int32, (N // G, G), 1)
        x = plt.load(x_ref.at[row, idx])
        o_ref[row] = jnp.max(x).astype(jnp.int32)

    return pl.pallas_call(kern, grid=(B,), out_shape=jax.ShapeDtypeStruct((B,), jnp.int32),
                          compiler_params=plt.CompilerParams(num_warps=8, num_stages=1), interpret=interpret,
                          name="sample_floor")(logits)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.cpu_smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    from experiments.decode_profile import gpu_kernel_events, kernel_names_from_hlo, op_names_from_hlo
    from experiments.sampling_bench import after
    from kernels.sampling import pallas_triton as PT
    from kernels.sampling.reference import fold_draw

    B = 2 if args.cpu_smoke else args.rows
    steps = 2 if args.cpu_smoke else args.steps
    interp = args.cpu_smoke
    d = jax.devices()[0]
    R = dict(meta=dict(command=command_line(args.out), device=d.device_kind, jax=jax.__version__, rows=B,
                       date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       tuning=PT.TUNING["rows"], inputs=f"N(0, 2^2) x {V} fp32, T ~ U(0.7, 1), top-k {TOP_K}, "
                                                        f"top-p {TOP_P}"), results=[])
    rng = np.random.default_rng(0)
    heads = tuple(jnp.asarray(rng.normal(size=(B, V)) * 2.0, jnp.float32) for _ in range(HEADS))
    T = jnp.asarray(rng.uniform(0.7, 1.0, B), jnp.float32)
    P, K = jnp.full((B,), TOP_P, jnp.float32), jnp.full((B,), TOP_K, jnp.int32)
    keys = jnp.asarray(rng.integers(0, 2 ** 32, (B, 2), dtype=np.uint64).astype(np.uint32))

    def step_fn(launch):
        """9 launches, each keyed on the previous one's ids (sampling_bench.after), as the tower chains them."""
        def step(heads, keys):
            prev, out = jnp.zeros((B,), jnp.int32), []
            for h in range(HEADS):
                prev = launch(h, heads[h], after(keys, prev))
                out.append(prev)
            return jnp.stack(out, 1)
        return jax.jit(step)

    def head(h, x, k, **kw):
        return PT.sample_filtered_triton(k, x, T, P, K, keep_crossing=False, draw=2 + h, interpret=interp, **kw)

    variants = {"kernel": (head, {}),
                "keys_prefolded": (lambda h, x, k: PT.sample_filtered_triton(
                    fold_draw(k, 2 + h), x, T, P, K, keep_crossing=False, interpret=interp), {}),
                "warps_4": (lambda h, x, k: head(h, x, k, num_warps=4), {}),
                "warps_16": (lambda h, x, k: head(h, x, k, num_warps=16), {}),
                "floor": (lambda h, x, k: floor_launch(jax, jnp, pl, plt, x, interp) + k[:, 0].astype(jnp.int32) * 0,
                          {})}
    variants.update({name: (head, subs) for name, subs in stand_ins(jnp, PT).items()})

    lowered = {}
    for name, (launch, subs) in variants.items():     # tracing reads the patched helpers: one at a time
        with patched([(PT.__name__, k, None, v) for k, v in subs.items()]):
            lowered[name] = step_fn(launch).lower(heads, keys)
    with cf.ThreadPoolExecutor(args.threads) as ex:
        compiled = dict(zip(lowered, ex.map(lambda lw: lw.compile(), lowered.values())))
    log(f"compiled {len(compiled)} variants")

    for name, step in compiled.items():
        for _ in range(3):
            jax.block_until_ready(step(heads, keys))
        trace_dir = os.path.join(args.out, "trace", name)
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(steps):
                out = step(heads, keys)
            jax.block_until_ready(out)
        hlo = step.as_text()
        names, kernels = op_names_from_hlo(hlo), kernel_names_from_hlo(hlo)
        scope = lambda e: e["name"] + " " + names.get(e.get("args", {}).get("hlo_op", ""), "") + " " + kernels.get(
            e["name"], "")
        durs = [float(e["dur"]) for e in gpu_kernel_events(trace_dir) if "sample_" in scope(e)]
        rec = dict(name=name, launches=len(durs), median_launch_us=statistics.median(durs) if durs else None,
                   per_step_us=sum(durs) / steps if durs else None)
        R["results"].append(rec)
        log(rec)
        save_json(R, os.path.join(args.out, "sampling_latency.json"))

    base = next(r["median_launch_us"] for r in R["results"] if r["name"] == "kernel") or 0.0
    lines = [f"# Head sampling launch latency at {B} rows ({R['meta']['device']}, {R['meta']['date']})", "",
             f"`{R['meta']['command']}`", "", "| variant | median launch us | vs kernel | per step (9 launches) us |",
             "|---|---|---|---|"]
    for r in R["results"]:
        m = r["median_launch_us"]
        lines.append(f"| {r['name']} | {m:.2f} | {m - base:+.2f} | {r['per_step_us']:.1f} |" if m else
                     f"| {r['name']} | - | - | - |")
    with open(os.path.join(args.out, "sampling_latency.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
