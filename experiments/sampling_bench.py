"""All 10 samplings of a Drama 3 decode step on one GPU: sort-free Pallas kernels vs the sort-based reference (jit).

One decode step samples, per stream: the main token over 4,097 candidates (band 4096 + EOS; T, top-p 0.9 keeping the
crossing token, RAS over a 16-row window) and 9 codebook heads over 4,096 (top-k 30, standard top-p 0.9). Logits are
fp32 (as the model hands them over). Per-request keys are folded with the frame index and the draw id: by one fused
XLA op for all 11 draws (drama3_jax.sampling.draw_keys), or, in per_head, the frame by XLA and the draw ids in the
kernels.

Variants (streams B = 1, 32, 128, 256):
  reference   kernels/sampling/reference.py under jax.jit (sort + searchsorted filters, full-row Gumbel noise)
  batched     main kernel (B programs) + one head kernel launch over the 9B head rows (2 launches)
  per_head    main kernel + 9 head-kernel launches of B rows each, as frame_step issues them (10 launches; through
              drama3_jax.sampling: one XLA op for the frame keys, the kernels fold each draw id in; each head's
              logits a separate [B, 4096] array, as the tower's head projections produce them)
  per_head_xla_keys  the same launches with the draw keys derived by XLA first (one fused op), as before
  keys_only   the key derivation alone (included in batched and per_head_xla_keys)
plus, at B = 128, tuning variants of the batched kernels (num_warps, candidate cap).

Phases (--phases): "time" (the loop timing above) and "profile": device time per kernel from a profiler trace of
single jitted steps (GPU kernel durations, no launch gaps), for per_head and batched and the per-head tuning variants
at --profile-streams; kernels are grouped as main (sample_main_ras), heads (sample_filtered) and other (the key
derivation), with the median duration of one launch of each.

Timing: a jitted fori_loop runs N steps; each step samples NSETS independent input sets (separate buffers, so the
logits read per loop iteration exceed the 50 MB L2 at B >= 128) with the frame index advancing; host clock around
block_until_ready after a compile + warm-up call; time per step = median over repeats / (N * NSETS). Roofline: the
fp32 logits read once, B * (4097 + 9 * 4096) * 4 bytes at 4.2 TB/s. Correctness on the device: every kernel
variant's samples are compared with the reference's on the same inputs and keys (mismatch counts recorded), and the
kernel paths taken are counted.

Compilation is done in a thread pool before timing (Triton compiles are slow and single-threaded).

  python experiments/sampling_bench.py --out DIR [--budget S] [--streams 1,32,128,256]
  python experiments/sampling_bench.py --cpu-smoke --out DIR   (interpret mode, tiny, for CI-less sanity checks)
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.common import command_line, log, save_json  # noqa: E402

HBM_BPS = 4.2e12
BAND, V_HEAD, HEADS, WINDOW = 4096, 4096, 9, 16
SEM_START, EOS = 151678, 151645
NSETS = 4
R = {"meta": {}, "results": [], "tuning": [], "checks": [], "errors": []}
T0 = time.time()


def save(out):
    save_json(R, os.path.join(out, "sampling_bench.json"))


def logit_bytes(B):
    return B * ((BAND + 1) + HEADS * V_HEAD) * 4


def make_inputs(jax, jnp, np, B, seed):
    """One input set: main logits [B, 4097] (flat-ish, sigma 2.5: top-p 0.9 keeps ~500 tokens), head logits
    [B, 9, 4096] (sigma 2), per-request params/keys, RAS window."""
    rng = np.random.default_rng(seed)
    main = (rng.normal(size=(B, BAND + 1)) * 2.5).astype(np.float32)
    heads = (rng.normal(size=(B, HEADS, V_HEAD)) * 2.0).astype(np.float32)
    recent = rng.integers(SEM_START, SEM_START + BAND, (B, WINDOW)).astype(np.int32)
    return with_head_rows(dict(
        main=jnp.asarray(main), heads=jnp.asarray(heads), recent=jnp.asarray(recent),
        temperature=jnp.asarray(rng.uniform(0.7, 1.0, B), jnp.float32),
        top_p=jnp.full((B,), 0.9, jnp.float32), top_k=jnp.zeros((B,), jnp.int32),
        req=jnp.stack([jax.random.PRNGKey(int(s)) for s in rng.integers(0, 2 ** 31, B)]).astype(jnp.uint32)))


def with_head_rows(inp):
    """inp plus "head_rows": the 9 heads' logits as separate contiguous [B, V] arrays, as the tower's head projections
    deliver them to frame_step (slicing [B, 9, V] inside the step would add 9 strided copies the model never runs)."""
    return dict(inp, head_rows=tuple(inp["heads"][:, h] for h in range(HEADS)))


def make_hard_inputs(jax, jnp, np, B, seed):
    """Check-only inputs that reach every kernel path: main rows flat (sigma 1: band threshold), peaked with the
    top-16 tokens in the RAS window (RAS re-draws), tied (logits on a 0.25 grid), top-k 200 (32-step search); head
    rows alternating plain and tied (0.5 grid)."""
    rng = np.random.default_rng(seed)
    inp = make_inputs(jax, jnp, np, B, seed)
    r = np.arange(B) % 4
    main = rng.normal(size=(B, BAND + 1)) * np.where(r == 0, 1.0, np.where(r == 1, 5.0, 2.5))[:, None]
    main[r == 2] = np.round(main[r == 2] * 2) / 4
    recent = np.asarray(inp["recent"]).copy()
    top16 = np.argsort(-main[:, :BAND], axis=1)[:, :WINDOW]
    recent[r == 1] = SEM_START + top16[r == 1]
    heads = rng.normal(size=(B, HEADS, V_HEAD)) * 2.0
    heads[:, 1::2] = np.round(heads[:, 1::2] * 2) / 2
    inp.update(main=jnp.asarray(main, jnp.float32), heads=jnp.asarray(heads, jnp.float32),
               recent=jnp.asarray(recent), top_k=jnp.asarray(np.where(r == 3, 200, 0), jnp.int32),
               top_p=jnp.asarray(rng.choice([0.9, 0.95, 0.7, 1.0], B), jnp.float32))
    return with_head_rows(inp)


def after(keys, prev):
    """keys [B, 2], made to depend on the previous draw's ids [B] (+ min(id, 0) = + 0: ids are >= 0, which XLA cannot
    know): in the model each head's logits come from the tower fed with the previous draw, so the launches run one
    after another. Without this, the graph's data dependencies alone (CONCURRENT command-buffer scheduling,
    drama3_jax/xla_flags.py) let the 10 independent launches overlap on the GPU and every launch's profiled duration
    grows."""
    return keys + prev.clip(max=0).astype(keys.dtype)[:, None]


def build(jax, jnp, variant, **kw):
    """step(inp, frame) -> (main ids [B], head codes [B, 9]) for one variant."""
    from drama3_jax import sampling as S
    from kernels.sampling import api

    def keys_all(req, frame):
        # all 11 draw keys of the step in one op: [B, 11, 2]
        return jax.vmap(lambda k: jax.vmap(lambda d: jax.random.fold_in(jax.random.fold_in(k, frame), d))(
            jnp.arange(2 + HEADS)))(req)

    backend = "reference" if variant == "reference" else "pallas_triton"

    def chained_heads(main, draw):
        """[B, HEADS] codes, head h drawn by draw(h, previous ids) after the main token and heads 0 .. h - 1."""
        codes, prev = [], main
        for h in range(HEADS):
            prev = draw(h, prev)
            codes.append(prev)
        return jnp.stack(codes, axis=1)

    def model_step(inp, frame):   # as frame_step calls them: the frame's keys, the draw ids folded in the kernels
        B = inp["main"].shape[0]
        fkeys = S.frame_keys(inp["req"], jnp.full((B,), frame, jnp.int32))
        T, P, K = inp["temperature"], inp["top_p"], inp["top_k"]
        main = S.sample_main(fkeys, inp["main"], T, P, K, inp["recent"], semantic_start=SEM_START, eos_token_id=EOS,
                             backend=backend, **kw.get("main", {}))
        return main, chained_heads(main, lambda h, prev: S.sample_head(
            after(fkeys, prev), h, inp["head_rows"][h], T, P, K, backend=backend, **kw.get("rows", {})))

    if variant == "per_head":
        return model_step

    def step(inp, frame):
        B = inp["main"].shape[0]
        ks = keys_all(inp["req"], frame)
        if variant == "keys_only":
            return ks[:, 0, 0].astype(jnp.int32), ks[:, 2:, 1].astype(jnp.int32)
        T, P, K = inp["temperature"], inp["top_p"], inp["top_k"]
        main = api.sample_main(ks[:, 0], ks[:, 1], inp["main"], T, P, K, inp["recent"], semantic_start=SEM_START,
                               eos_token_id=EOS, ras_temperature=S.RAS_TEMPERATURE, ras_top_k=S.RAS_TOP_K,
                               ras_top_p=S.RAS_TOP_P, backend=backend, **kw.get("main", {}))
        hk = S.head_top_k(K)
        if variant == "batched":     # else "per_head_xla_keys": per-head launches, keys derived by XLA first
            rep = lambda a: jnp.repeat(a, HEADS, axis=0)
            codes = api.sample_filtered(ks[:, 2:].reshape(B * HEADS, 2), inp["heads"].reshape(B * HEADS, V_HEAD),
                                        rep(T), rep(P), rep(hk), keep_crossing=False, backend=backend,
                                        **kw.get("rows", {})).reshape(B, HEADS)
        else:
            codes = chained_heads(main, lambda h, prev: api.sample_filtered(
                after(ks[:, 2 + h], prev), inp["head_rows"][h], T, P, hk, keep_crossing=False, backend=backend,
                **kw.get("rows", {})))
        return main, codes

    return step


def loop_fn(jax, jnp, step, n):
    def body(i, carry):
        acc, sets = carry
        for s, inp in enumerate(sets):
            main, codes = step(inp, i * NSETS + s)
            acc = acc + jnp.sum(main) + jnp.sum(codes)
        return acc, sets

    return jax.jit(lambda sets: jax.lax.fori_loop(0, n, body, (jnp.int32(0), sets))[0])


def time_compiled(jax, compiled, sets, n, reps):
    jax.block_until_ready(compiled(sets))        # warm-up
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(compiled(sets))
        ts.append((time.perf_counter() - t) / (n * NSETS))
    return statistics.median(ts), min(ts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=150.0, help="stop starting new work after this many seconds")
    ap.add_argument("--streams", default="1,32,128,256")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--threads", type=int, default=12)
    ap.add_argument("--phases", default="time", help="comma list of: time, profile")
    ap.add_argument("--profile-streams", default="128")
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--profile-variants", default=None,
                    help="comma-separated names of PROFILE_VARIANTS to profile (default: all)")
    args = ap.parse_args(argv)
    phases = set(args.phases.split(","))
    os.makedirs(args.out, exist_ok=True)
    if args.cpu_smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels.sampling import pallas_triton

    d = jax.devices()[0]
    R["meta"] = dict(command=command_line(args.out),
                     date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     device=d.device_kind, platform=d.platform, jax=jax.__version__, hbm_roofline_Bps=HBM_BPS,
                     tuning=pallas_triton.TUNING, nsets=NSETS,
                     inputs="main N(0, 2.5^2) x 4097, heads N(0, 2^2) x 4096 fp32; T ~ U(0.7, 1); top-p 0.9; "
                            "main top-k 0; heads top-k 30; random RAS windows")
    streams = [int(s) for s in args.streams.split(",")]
    smoke_kw = {"main": {"interpret": True}, "rows": {"interpret": True}} if args.cpu_smoke else {}
    if args.cpu_smoke:
        streams = [2]

    # ---- jobs: (name, B, variant, kw, n), in priority order (B = 128 first, tuning last)
    jobs = []
    order_B = sorted(streams, key=lambda B: (B != 128, -B)) if "time" in phases else []
    for B in order_B:
        n_ref = max(2, min(20, 2000 // max(B, 1)))
        n_k = 2 if args.cpu_smoke else 50
        jobs += [("reference", B, "reference", {}, 1 if args.cpu_smoke else n_ref),
                 ("batched", B, "batched", smoke_kw, n_k),
                 ("per_head", B, "per_head", smoke_kw, n_k),
                 ("keys_only", B, "keys_only", {}, n_k)]
    if 128 in order_B and not args.cpu_smoke:
        for name, kw in [("batched rows_w8", {"rows": {"num_warps": 8}}),
                         ("batched rows_w8 main_w16", {"rows": {"num_warps": 8}, "main": {"num_warps": 16}}),
                         ("batched rows_w16 main_w16", {"rows": {"num_warps": 16}, "main": {"num_warps": 16}}),
                         ("batched rows_c32", {"rows": {"cand": 32}})]:
            jobs.append((name, 128, "batched", kw, 50))
    B_chk = 128 if 128 in streams else streams[0]

    sets_by_B = {B: tuple(make_inputs(jax, jnp, np, B, seed=1000 * B + s) for s in range(NSETS)) for B in streams}
    one = lambda B: sets_by_B[B][0]

    # ---- compile everything in a thread pool; time each job as soon as it is ready, in priority order
    def compile_loop(j):
        name, B, variant, kw, n = j
        t = time.time()
        c = loop_fn(jax, jnp, build(jax, jnp, variant, **kw), n).lower(sets_by_B[B]).compile()
        return c, time.time() - t

    def compile_step(variant, kw, B):
        t = time.time()
        c = jax.jit(build(jax, jnp, variant, **kw)).lower(one(B), 3).compile()
        return c, time.time() - t

    log(f"device {d.device_kind}; {len(jobs)} timing jobs; compiling with {args.threads} threads")
    ex = cf.ThreadPoolExecutor(args.threads)
    chk_futs = {v: ex.submit(compile_step, v, smoke_kw if v != "reference" else {}, B_chk)
                for v in ("reference", "batched", "per_head")}
    def paths_fn(inp):   # which kernel path each row takes (fresh keys)
        B = inp["main"].shape[0]
        ks = jnp.stack([jax.random.PRNGKey(i) for i in range(B)]).astype(jnp.uint32)
        _, pm = pallas_triton.sample_main_triton(ks, ks, inp["main"], inp["temperature"], inp["top_p"], inp["top_k"],
                                                 inp["recent"], semantic_start=SEM_START, eos_token_id=EOS,
                                                 ras_temperature=1.0, ras_top_k=30, ras_top_p=0.95, return_path=True,
                                                 **smoke_kw.get("main", {}))
        _, ph = pallas_triton.sample_filtered_triton(
            jnp.repeat(ks, HEADS, 0), inp["heads"].reshape(B * HEADS, V_HEAD), jnp.repeat(inp["temperature"], HEADS),
            jnp.full((B * HEADS,), 0.9, jnp.float32), jnp.full((B * HEADS,), 30, jnp.int32), keep_crossing=False,
            return_path=True, **smoke_kw.get("rows", {}))
        return pm, ph

    paths_fut = ex.submit(lambda: (jax.jit(paths_fn).lower(one(B_chk)).compile(), 0.0))
    futs = [(j, ex.submit(compile_loop, j)) for j in jobs]
    left = lambda: args.budget - (time.time() - T0)

    # correctness on the device: kernel vs reference samples, same inputs and keys, B_chk streams, 8 steps
    try:
        cref, s1 = chk_futs["reference"].result(timeout=max(1.0, left()))
        for variant in ("batched", "per_head"):
            cker, s2 = chk_futs[variant].result(timeout=max(1.0, left()))
            log(f"check steps compiled ({s1:.1f}s, {s2:.1f}s)")
            bad_m = bad_h = rows = 0
            for inp in sets_by_B[B_chk] + (make_hard_inputs(jax, jnp, np, B_chk, 77),):
                for frame in (3, 977):
                    rm, rh = cref(inp, frame)
                    km, kh = cker(inp, frame)
                    bad_m += int(np.sum(np.asarray(rm) != np.asarray(km)))
                    bad_h += int(np.sum(np.asarray(rh) != np.asarray(kh)))
                    rows += B_chk
            R["checks"].append(dict(B=B_chk, variant=variant, rows_main=rows, rows_heads=rows * HEADS,
                                    mismatch_main=bad_m, mismatch_heads=bad_h))
            log("check", R["checks"][-1])
        pfn = paths_fut.result(timeout=max(1.0, left()))[0]
        for label, inp in (("timing inputs", one(B_chk)), ("hard inputs", make_hard_inputs(jax, jnp, np, B_chk, 77))):
            pm, ph = pfn(inp)
            pm, ph = np.asarray(pm), np.asarray(ph)
            R.setdefault("paths", []).append(dict(inputs=label, B=B_chk, main_first={int(k): int(v) for k, v in zip(*np.unique(pm & 3, return_counts=True))},
                          main_ras={int(k): int(v) for k, v in zip(*np.unique(pm >> 2, return_counts=True))},
                          main_ras_ran=int(((pm >> 2) & 1).sum()),
                          heads={int(k): int(v) for k, v in zip(*np.unique(ph, return_counts=True))}))
            log("paths", R["paths"][-1])
    except Exception as e:
        R["errors"].append(f"check: {type(e).__name__}: {str(e)[:1500]}")
        log("ERROR check", type(e).__name__, str(e)[:800])
    save(args.out)

    if "profile" in phases:
        profile_phase(jax, jnp, np, args, ex, smoke_kw, left)
    for j, fu in futs:
        name, B, variant, kw, n = j
        if left() <= 0:
            R["errors"].append(f"budget reached before timing {name} B={B}")
            continue
        try:
            c, secs = fu.result(timeout=max(1.0, left()))
            med, mn = time_compiled(jax, c, sets_by_B[B], n, 2 if args.cpu_smoke else 5)
            rec = dict(name=name, B=B, us=med * 1e6, us_min=mn * 1e6, iters=n * NSETS, compile_s=secs,
                       roofline_us=logit_bytes(B) / HBM_BPS * 1e6)
            (R["tuning"] if name not in ("reference", "batched", "per_head", "keys_only") else R["results"]).append(rec)
            log(f"{name:28s} B={B:4d} {med * 1e6:9.1f} us (min {mn * 1e6:.1f}; compile {secs:.1f}s)")
        except Exception as e:
            job_failed(f"{name} B={B}", e)
        save(args.out)
    save(args.out)
    write_md(args.out)
    print_table()
    sys.stdout.flush()
    os._exit(0)   # do not wait for compiles still running past the budget


def job_failed(label: str, e: Exception):
    """Record why a job gave no figure (the budget ran out while it compiled, or an error) and go on."""
    if isinstance(e, cf.TimeoutError):
        R["errors"].append(f"budget reached while compiling {label}")
    else:
        R["errors"].append(f"{label}: {type(e).__name__}: {str(e)[:1500]}")
        log("ERROR", label, type(e).__name__, str(e)[:800])


PROFILE_VARIANTS = [   # (name, variant, kernel kwargs): per-head launch shape tunings of the head kernel
    ("per_head", "per_head", {}),
    ("batched", "batched", {}),
    ("per_head_xla_keys", "per_head_xla_keys", {}),
    ("per_head rows_w4", "per_head", {"rows": {"num_warps": 4}}),
    ("per_head rows_w16", "per_head", {"rows": {"num_warps": 16}}),
    ("per_head rows_g128", "per_head", {"rows": {"groups": 128}}),   # the default above 132 rows (one_wave_rows_max)
    ("per_head rows_w16,g64", "per_head", {"rows": {"num_warps": 16, "groups": 64}}),
    ("per_head rows_c32", "per_head", {"rows": {"cand": 32}}),
    ("per_head main_w8", "per_head", {"main": {"num_warps": 8}}),
    ("per_head main_c128", "per_head", {"main": {"cand": 128}}),   # the main candidate cap before 2026-12-03
    # the full-row paths' noise for the kept tokens only, compacted (TUNING's noise_cap: main 512 by default since
    # 2026-12-06, heads 0)
    ("per_head noise_kept", "per_head", {"main": {"noise_cap": 512}, "rows": {"noise_cap": 256}}),
    ("batched noise_kept", "batched", {"main": {"noise_cap": 512}, "rows": {"noise_cap": 256}}),
    # without the value bisection that raises a loose top-k bound (TUNING's k_bisect; the kernels before 2026-12-06)
    ("per_head k_bisect0", "per_head", {"main": {"k_bisect": 0}, "rows": {"k_bisect": 0}}),
    ("batched k_bisect0", "batched", {"main": {"k_bisect": 0}, "rows": {"k_bisect": 0}}),
    # the main token's top-p bracket from 3 / 7 independent mass reductions a pass (TUNING's p_ways; 2 = bisection)
    ("per_head main_split4", "per_head", {"main": {"p_ways": 4}}),
    ("per_head main_split8", "per_head", {"main": {"p_ways": 8}}),
]


def kernel_group(name: str) -> str:
    return "main" if "sample_main" in name else "heads" if "sample_filtered" in name else "other"


def profile_phase(jax, jnp, np, args, ex, smoke_kw, left):
    """Device time per kernel group of one step (us), from a profiler trace of --profile-steps jitted steps."""
    from experiments.decode_profile import gpu_kernel_events, kernel_names_from_hlo, op_names_from_hlo

    streams = [2] if args.cpu_smoke else [int(b) for b in args.profile_streams.split(",")]
    variants = PROFILE_VARIANTS[:3] if args.cpu_smoke else PROFILE_VARIANTS
    if args.profile_variants:
        keep = args.profile_variants.split(",")
        variants = [v for v in PROFILE_VARIANTS if v[0] in keep]
    n = 2 if args.cpu_smoke else args.profile_steps
    todo = []
    for B in streams:
        inp = make_inputs(jax, jnp, np, B, seed=5000 + B)
        for name, variant, kw in (variants if B == 128 else variants[:3]):   # tunings at 128 streams only
            kw = {k: {**smoke_kw.get(k, {}), **kw.get(k, {})} for k in ("main", "rows")}
            fn = jax.jit(build(jax, jnp, variant, **kw))
            todo.append((name, B, inp, ex.submit(lambda f=fn, i=inp: f.lower(i, 0).compile())))
    for name, B, inp, fut in todo:
        if left() <= 0:
            R["errors"].append(f"budget reached before profiling {name} B={B}")
            continue
        try:
            step = fut.result(timeout=max(1.0, left()))
            for f in range(3):
                jax.block_until_ready(step(inp, f))
            trace_dir = os.path.join(args.out, "trace", f"{name.replace(' ', '_')}_{B}")
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                for f in range(n):
                    out = step(inp, 3 + f)
                jax.block_until_ready(out)
            hlo = step.as_text()
            names, kernels = op_names_from_hlo(hlo), kernel_names_from_hlo(hlo)
            durs = {}
            for e in gpu_kernel_events(trace_dir):
                scope = names.get(e.get("args", {}).get("hlo_op", ""), "") + " " + kernels.get(e["name"], "")
                durs.setdefault(kernel_group(e["name"] + " " + scope), []).append(e["dur"])
            rec = dict(name=name, B=B, steps=n, total_us=sum(map(sum, durs.values())) / n)
            for g, d in durs.items():
                rec[g] = dict(us_per_step=sum(d) / n, launches_per_step=len(d) / n,
                              median_launch_us=float(np.median(d)))
            R.setdefault("profile", []).append(rec)
            log(f"profile {name:22s} B={B:4d} total {rec['total_us']:7.1f} us/step  " + "  ".join(
                f"{g} {v['us_per_step']:.1f} ({v['launches_per_step']:.0f} x {v['median_launch_us']:.1f})"
                for g, v in rec.items() if isinstance(v, dict)))
        except Exception as e:
            job_failed(f"profile {name} B={B}", e)
        save(args.out)


def _table_rows():
    by = {(r["name"], r["B"]): r for r in R["results"]}
    out = []
    for B in sorted({r["B"] for r in R["results"]}):
        ref = by.get(("reference", B))
        row = dict(B=B, roofline=logit_bytes(B) / HBM_BPS * 1e6)
        for k in ("reference", "batched", "per_head", "keys_only"):
            row[k] = by[(k, B)]["us"] if (k, B) in by else None
        for k in ("batched", "per_head"):
            row[k + "_x"] = (ref["us"] / row[k]) if ref and row[k] else None
        out.append(row)
    return out


def _f(x, fmt="{:.1f}"):
    return "-" if x is None else fmt.format(x)


def write_md(out):
    m = R["meta"]
    lines = [f"# Sampling: all 10 samplings of a decode step ({m.get('device')}, {m.get('date')})", "",
             f"Command: `{m.get('command')}`; jax {m.get('jax')}. Inputs: {m.get('inputs')}.", "",
             "| streams | reference (jit, sort) µs | kernels batched (2 launches) µs | speed-up | "
             "kernels per head (10 launches) µs | speed-up | key derivation alone µs | roofline µs |",
             "|---|---|---|---|---|---|---|---|"]
    for r in _table_rows():
        lines.append(f"| {r['B']} | {_f(r['reference'])} | {_f(r['batched'])} | {_f(r['batched_x'], '{:.0f}x')} | "
                     f"{_f(r['per_head'])} | {_f(r['per_head_x'], '{:.0f}x')} | {_f(r['keys_only'])} | "
                     f"{_f(r['roofline'])} |")
    if R["tuning"]:
        lines += ["", "Tuning variants (B = 128, batched):", "", "| variant | µs |", "|---|---|"]
        lines += [f"| {t['name']} | {t['us']:.1f} |" for t in R["tuning"]]
    if R.get("profile"):
        lines += ["", "Device time per step from a profiler trace (GPU kernel durations; us per step, launches x "
                      "median us per launch):", "", "| variant | streams | total | main | heads | other |",
                  "|---|---|---|---|---|---|"]
        cell = lambda v: "-" if v is None else (f"{v['us_per_step']:.1f} ({v['launches_per_step']:.0f} x "
                                                f"{v['median_launch_us']:.1f})")
        lines += [f"| {p['name']} | {p['B']} | {p['total_us']:.1f} | {cell(p.get('main'))} | {cell(p.get('heads'))} | "
                  f"{cell(p.get('other'))} |" for p in R["profile"]]
    if R.get("checks"):
        lines += ["", "Device check, kernel vs reference samples on the same inputs and keys (the 4 timing sets + one "
                      "set built to reach every path, 2 frames each):", ""]
        lines += [f"- {c['variant']} B={c['B']}: main {c['mismatch_main']}/{c['rows_main']} mismatches, heads "
                  f"{c['mismatch_heads']}/{c['rows_heads']}" for c in R["checks"]]
    if R.get("paths"):
        lines += ["", "Kernel paths taken (0 candidates, 1 full row without a 32-step search, 2 full row with one; "
                      "main_ras: flags >> 2, 0 = no RAS draw, 1 + 2 * path = RAS draw on that path):", ""]
        lines += [f"- {p}" for p in R["paths"]]
    if R["errors"]:
        lines += ["", "Errors:", ""] + [f"- {e[:300]}" for e in R["errors"]]
    with open(os.path.join(out, "sampling_bench.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def print_table():
    print("\nstreams | reference us | batched us (x) | per_head us (x) | keys us | roofline us")
    for r in _table_rows():
        print(f"{r['B']:7d} | {_f(r['reference']):>12s} | {_f(r['batched']):>8s} ({_f(r['batched_x'], '{:.0f}x')}) | "
              f"{_f(r['per_head']):>8s} ({_f(r['per_head_x'], '{:.0f}x')}) | {_f(r['keys_only']):>7s} | "
              f"{_f(r['roofline'])}")
    for t in R["tuning"]:
        print(f"  tuning {t['name']}: {t['us']:.1f} us")
    for p in R.get("profile", []):
        print(f"  profile {p['name']} B={p['B']}: {p['total_us']:.1f} us/step (" + ", ".join(
            f"{g} {p[g]['us_per_step']:.1f}" for g in ("main", "heads", "other") if g in p) + ")")
    for c in R.get("checks", []):
        print(f"  check {c['variant']} B={c['B']}: main {c['mismatch_main']}/{c['rows_main']}, heads "
              f"{c['mismatch_heads']}/{c['rows_heads']} mismatches")
    if R["errors"]:
        print(f"  {len(R['errors'])} errors (see json)")


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
