"""Decode attention on one GPU: the length-aware Pallas flash-decoding kernel vs the whole-cache jnp reference (jit).

Drama 3 full-attention shapes (10 backbone layers + 13 tower layers per frame): Hq 16, Hkv 2, D 256, bf16 KV cache
[B, 4100, 2, 256]; one query per stream (decode), through kernels.attention.api.attention (backend "pallas_triton"
vs "reference"). Streams B = 1, 32, 128, 256; kv lengths (a) all 512, (b) uniform random 256..1536, (c) all 4100.
Kernel tuning variants (CONFIGS) are timed per shape; the best is reported next to the default.

Timing: a jitted fori_loop (traced trip count, one compile per variant and B) runs rounds of P calls, each on its
own cache pair (P <= 16, chosen so a round touches >= 128 MB at length 512, so the caches are not L2-resident, as in
the model where each layer has its own cache; only B = 1 at length 512 touches less, 17 MB per round), the output of
one call being the next call's query (a dependency chain, no extra ops). Host clock around block_until_ready after a
compile/warm-up call and a calibration run; time per call = median over repeats / (rounds * P); a call is the whole
api call (kernel + split merge). Roofline: the bytes the call needs, sum_b kv_len_b * Hkv * D * 2 (k, v) * 2 B + q
and out, at 4.2 TB/s (the reference reads the whole cache).
Correctness on the device: every variant vs the reference (max |o - ref| / max |ref|) on ragged lengths incl. 0, 1,
block edges, the full cache and past it.

  python experiments/attention_bench.py --out DIR [--budget S] [--streams 1,32,128,256]
  python experiments/attention_bench.py --smoke --out DIR   (tiny shapes, Pallas interpret mode on CPU)
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.common import command_line, guard, log, save_json  # noqa: E402

HBM_BPS = 4.2e12
HQ, HKV, D, L = 16, 2, 256, 4100
STREAMS = [128, 32, 256, 1]                 # target first
PATTERNS = ["512", "rand256-1536", "4100"]
ROUND_BYTES = 128e6                         # bytes one round of P calls touches at the shortest pattern (> L2)
MAX_P, MAX_POOL_BYTES = 16, 24e9            # P calls per round (bounds the compile if XLA compiles each call)
MIN_LOOP_S, REPS = 0.03, 5
# variant name -> kernel kwargs (the first = pallas_triton.TUNING)
CONFIGS = {
    "default": {},
    "bk32_s3": {"block_k": 32, "num_stages": 3, "max_splits": 32},
    "bk64_s3_2x": {"num_stages": 3, "target_programs": 1056, "max_splits": 32},
    "bk128_w8": {"block_k": 128, "num_warps": 8},
    "bk64_w8_half": {"num_warps": 8, "target_programs": 264},
}
KEXTRA = {}  # {"interpret": True} in --smoke
R = {"meta": {}, "check": [], "results": [], "errors": []}
T0 = time.time()


def save(out):
    save_json(R, os.path.join(out, "attention_bench.json"))


def lengths(np, pattern, B, seed=0):
    if pattern == "rand256-1536":
        return np.minimum(np.random.default_rng(seed).integers(256, 1537, B), L).astype(np.int32)
    return np.full(B, min(int(pattern), L), np.int32)


def needed_bytes(kv_len, B):
    return int(sum(int(n) for n in kv_len)) * HKV * D * 2 * 2 + 2 * B * HQ * D * 2


def attn_fn(jax, impl):
    """q [B, Hq, D], caches, kv_len -> [B, Hq, D] through the public api (decode: q_pos = kv_len - 1)."""
    from kernels.attention import api
    backend, kw = ("reference", {}) if impl == "reference" else ("pallas_triton", {**CONFIGS[impl], **KEXTRA})

    def f(q, k, v, kv_len):
        return api.attention(q[:, None], k, v, (kv_len - 1)[:, None], kv_len, scale=D ** -0.5, backend=backend,
                             **kw)[:, 0]
    return f


def make_caches(jax, jnp, B, P, seed):
    ks = jax.random.split(jax.random.PRNGKey(seed), 2 * P)
    shape = (B, L, HKV, D)
    return tuple((jax.random.normal(ks[2 * i], shape, jnp.bfloat16), jax.random.normal(ks[2 * i + 1], shape,
                                                                                       jnp.bfloat16))
                 for i in range(P))


# ------------------------------------------------------------------------------------------------ phases
def phase_check(jax, jnp, np):
    """Every variant vs the reference on the device: B = 12 ragged lengths incl. 0, 1, 63, 64, 65, the full cache and
    past it, and B = 128 random lengths 256..1536."""
    ks = jax.random.split(jax.random.PRNGKey(1), 2)
    edge = np.array([0, 1, 63, 64, 65, 127, 512, 1000, L - 1, L, L + 50, 300], np.int32)
    for B, kv in ((len(edge), edge), (128, lengths(np, "rand256-1536", 128, seed=5))):
        (k, v), = make_caches(jax, jnp, B, 1, seed=B)
        q = jax.random.normal(ks[0], (B, HQ, D), jnp.bfloat16)
        kvj = jnp.asarray(kv)
        ref = np.asarray(jax.jit(attn_fn(jax, "reference"))(q, k, v, kvj).astype(jnp.float32))
        for impl in CONFIGS:
            def run():
                o = np.asarray(jax.jit(attn_fn(jax, impl))(q, k, v, kvj).astype(jnp.float32))
                row = dict(B=B, impl=impl, max_rel_err=float(np.abs(o - ref).max() / np.abs(ref).max()),
                           finite=bool(np.isfinite(o).all()), zero_rows_exact=bool((o[kv <= 0] == 0).all()))
                R["check"].append(row)
                log("check", row)
            guard(R["errors"], f"check B={B} {impl}", run)


def phase_time(jax, jnp, np, args):
    streams = [int(s) for s in args.streams.split(",")]
    for B in streams:
        touched = needed_bytes(lengths(np, PATTERNS[0], B), B)
        pair = 2 * B * L * HKV * D * 2
        P = int(max(1, min(MAX_P, math.ceil(ROUND_BYTES / touched), MAX_POOL_BYTES // pair)))
        caches = make_caches(jax, jnp, B, P, seed=B)
        q0 = jax.random.normal(jax.random.PRNGKey(7), (B, HQ, D), jnp.bfloat16)
        log(f"B={B}: {P} cache pairs ({P * pair / 1e9:.2f} GB)")
        for impl in ["reference"] + list(CONFIGS):
            if time.time() - T0 > args.budget:
                R["errors"].append(f"B={B} {impl} skipped: budget")
                continue

            def run():
                f = attn_fn(jax, impl)

                def body(_, q, cs, kv):
                    for k, v in cs:
                        q = f(q, k, v, kv)
                    return q
                loop = jax.jit(lambda q, cs, kv, n: jax.lax.fori_loop(0, n, functools.partial(body, cs=cs, kv=kv), q))
                t_c = time.time()
                for pattern in PATTERNS:
                    kv_np = lengths(np, pattern, B)
                    kv = jnp.asarray(kv_np)
                    jax.block_until_ready(loop(q0, caches, kv, 1))           # compile (once) + warm-up
                    t = time.perf_counter()
                    jax.block_until_ready(loop(q0, caches, kv, 1))
                    n = max(1, math.ceil(MIN_LOOP_S / max(time.perf_counter() - t, 1e-6)))
                    ts = []
                    for _ in range(args.reps):
                        t = time.perf_counter()
                        jax.block_until_ready(loop(q0, caches, kv, n))
                        ts.append((time.perf_counter() - t) / (n * P))
                    s = statistics.median(ts)
                    nb = needed_bytes(kv_np, B)
                    row = dict(streams=B, lengths=pattern, impl=impl, kwargs=CONFIGS.get(impl), us=s * 1e6,
                               us_min=min(ts) * 1e6, bytes_needed=nb, roofline_us=nb / HBM_BPS * 1e6,
                               frac_roofline=nb / HBM_BPS / s, TBps_effective=nb / s / 1e12, pairs=P, rounds=n)
                    R["results"].append(row)
                    log(f"B={B:3d} {pattern:13s} {impl:13s} {s * 1e6:9.1f} us  roofline {nb / HBM_BPS * 1e6:8.1f} us"
                        f"  {100 * row['frac_roofline']:5.1f}%")
                R["meta"].setdefault("compile_and_time_s", {})[f"{B}/{impl}"] = round(time.time() - t_c, 1)
                save(args.out)
            guard(R["errors"], f"time B={B} {impl}", run)
        caches = None  # free this B's pool before the next


# ------------------------------------------------------------------------------------------------ report
def report(out):
    m = R["meta"]
    lines = [f"# Decode attention on {m.get('device', '?')}", "", f"- command: `{m.get('command')}`",
             f"- date: {m.get('date')}; jax {m.get('jax')}; shapes Hq {HQ}, Hkv {HKV}, D {D}, cache rows {L}, bf16",
             f"- roofline: needed bytes (visible k/v rows + q/out) at {HBM_BPS / 1e12:.1f} TB/s; kernel default "
             f"tuning {m.get('tuning')}", ""]
    if R["check"]:
        lines += ["## Correctness on the device (max |o - ref| / max |ref|)", "",
                  "| B | variant | max rel err | finite | zero rows exact |", "|---|---|---|---|---|"]
        lines += [f"| {r['B']} | {r['impl']} | {r['max_rel_err']:.2e} | {r['finite']} | {r['zero_rows_exact']} |"
                  for r in R["check"]]
        lines.append("")
    if R["errors"]:
        lines += ["## Errors", ""] + [f"- {e[:400]}" for e in R["errors"]] + [""]
    rows = {}
    for r in R["results"]:
        rows.setdefault((r["streams"], r["lengths"]), {})[r["impl"]] = r
    if rows:
        lines += ["## Per layer call (us); best kernel variant of those timed", "",
                  "| streams | kv lengths | reference | kernel default | best kernel (variant) | speedup vs ref | "
                  "best % of roofline | roofline |", "|---|---|---|---|---|---|---|---|"]
        for (B, pat), d in sorted(rows.items(), key=lambda x: (x[0][0], PATTERNS.index(x[0][1]))):
            ref = d.get("reference")
            ks = [r for n, r in d.items() if n != "reference"]
            best = min(ks, key=lambda r: r["us"]) if ks else None
            dflt = d.get("default")
            cell = lambda r: f"{r['us']:.1f}" if r else "-"
            lines.append(f"| {B} | {pat} | {cell(ref)} | {cell(dflt)} | "
                         + (f"{best['us']:.1f} ({best['impl']})" if best else "-") + " | "
                         + (f"{ref['us'] / best['us']:.1f}x" if ref and best else "-") + " | "
                         + (f"{100 * best['frac_roofline']:.0f}%" if best else "-") + " | "
                         + f"{next(iter(d.values()))['roofline_us']:.1f} |")
        lines.append("")
    text = "\n".join(lines)
    with open(os.path.join(out, "attention_bench.md"), "w") as f:
        f.write(text)
    return text


def main():
    global HQ, HKV, D, L, STREAMS, PATTERNS, ROUND_BYTES, MAX_P, MIN_LOOP_S, CONFIGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="experiments/results")
    ap.add_argument("--streams", default=None, help="comma-separated stream counts (default 128,32,256,1)")
    ap.add_argument("--budget", type=float, default=200.0, help="timing configs are skipped after this many s")
    ap.add_argument("--reps", type=int, default=REPS)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, Pallas interpret mode (script check on CPU)")
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        HQ, HKV, D, L = 4, 2, 32, 200
        STREAMS, PATTERNS, ROUND_BYTES, MAX_P, MIN_LOOP_S = [2], ["64", "rand256-1536", "200"], 1, 2, 0.0
        CONFIGS = {"default": {"block_k": 32}, "bk16_s3": {"block_k": 16, "num_stages": 3}}
        KEXTRA["interpret"] = True
        args.reps = 1
    args.streams = args.streams or ",".join(map(str, STREAMS))
    os.makedirs(args.out, exist_ok=True)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import warnings
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from kernels.attention import pallas_triton
    d = jax.devices()[0]
    R["meta"] = dict(command=command_line(args.out),
                     date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     device=d.device_kind, platform=d.platform, jax=jax.__version__, hbm_roofline_Bps=HBM_BPS,
                     shapes=dict(Hq=HQ, Hkv=HKV, D=D, L=L), tuning=pallas_triton.TUNING, configs=CONFIGS)
    log("device", d.device_kind)
    guard(R["errors"], "check", phase_check, jax, jnp, np)
    save(args.out)
    guard(R["errors"], "time", phase_time, jax, jnp, np, args)
    save(args.out)
    print(report(args.out))


if __name__ == "__main__":
    main()
