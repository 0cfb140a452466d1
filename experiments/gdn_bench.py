"""Gated DeltaNet layer benchmark on one GPU: Pallas (Triton lowering) kernels vs the plain-jnp reference under jit
and flash-linear-attention's Triton kernels (fla-core, through PyTorch) on the same GPU in the same process.

Drama 3 GDN shapes: H_k 16, H_v 32, D_k = D_v 128, conv kernel 4, conv_dim 8192.
  decode : one token per stream for 1, 32, 128, 256 streams; fp32 and bf16 state pools; time per layer, achieved
           bandwidth vs the HBM roofline (fewest bytes: state read + write, conv state read + write, x in, o out).
  prefill: T = 256, 1024, 4096 at B = 1 and 8; time per layer vs the jnp chunked reference and FLA
           chunk_gated_delta_rule (use_qk_l2norm_in_kernel, initial state in, final state out, GVA 16 -> 32 heads).
  ablation: 500 decode steps with an fp32 vs a bf16 state pool (same random inputs), output error vs steps.

Timing (JAX): a jitted fori_loop chains N calls (state of call i feeds call i+1; pools donated), host clock around
block_until_ready after a compile/warm-up call; time per call = median over repeats / N. Decode rotates over enough
slot blocks of one pool (the slot indirection) that the state is not L2-resident (>= 256 MB touched per cycle).
Timing (torch/FLA): CUDA events around N eager calls (as h200-baselines.md) and around N CUDA-graph replays.

  python experiments/gdn_bench.py --out DIR [--phases check,decode,prefill,ablation,fla] [--quick] [--budget S]
  python experiments/gdn_bench.py --report-only DIR/gdn_bench.json   (re-render Markdown + PNG)
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.common import command_line, guard, log, save_json  # noqa: E402
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # leave room for torch/FLA in the same process

HK, HV, D, KC = 16, 32, 128, 4
CONV = 2 * HK * D + HV * D
HBM_BPS = 4.2e12      # device-to-device copy, h200-baselines.md (re-measured below)
PEAK_FLOPS = 780e12   # XLA bf16 GEMM, h200-baselines.md
STREAMS = [1, 32, 128, 256]
PREFILL = [(1, 1024), (1, 4096), (8, 1024), (1, 256), (8, 256), (8, 4096)]  # targets first
MAX_SLOT_BLOCKS = 128
KEXTRA = {}  # extra kwargs for every Pallas call ({"interpret": True} in --cpu-smoke)

# Variants: name -> backend kwargs (pallas_triton). The first of each list is the default (TUNING).
# Decode: runs of 2026-11-30 / 12-01 (results/gdn_bench.md, kernel_sweep_2026-12-01/, gdn_decode_tiles/) swept a
# per-key-head grid (since removed) and the "tiles" grid; 2026-12-02 (gdn_decode_split_2026-12-02/) the "split" pair.
# The default ("triton") runs on a v-major pool, the model's cache layout; the other variants name their layout
# ("vmajor") or are K-major.
def decode_variant(name: str) -> dict:
    """Backend kwargs of a decode variant name: [tiles_|split_][vmajor_]bv{N}_w{W}[_prep{P}] ("tiles" when no grid
    is named; "vmajor": the state transposed in the pool, [D_v, D_k], so the D_k reductions run along the contiguous
    axis; "prep": the split pair's prep-launch warps)."""
    parts = name.split("_")
    kw = {"grid": "split" if parts[0] == "split" else "tiles"}
    for p in parts:
        if p == "vmajor":
            kw["v_major"] = True
        for prefix, key in (("bv", "bv"), ("w", "num_warps"), ("prep", "prep_num_warps")):
            if p.startswith(prefix) and p[len(prefix):].isdigit():
                kw[key] = int(p[len(prefix):])
    return kw


DECODE_VARIANTS = {"triton": {"v_major": True}, "split_kmajor": {"grid": "split"}} | {n: decode_variant(n) for n in (
    "tiles_bv16_w1 tiles_bv32_w2 tiles_bv32_w4 tiles_bv64_w2 tiles_bv64_w4 tiles_bv64_w8 tiles_bv128_w8 "
    "vmajor_bv16_w1 vmajor_bv16_w2 vmajor_bv32_w1 vmajor_bv32_w2 vmajor_bv32_w4 vmajor_bv64_w2 vmajor_bv64_w4 "
    "vmajor_bv64_w8 vmajor_bv128_w8 "
    "split_bv16_w1 split_bv16_w2 split_bv32_w2 split_bv32_w4 split_bv64_w4 split_bv64_w4_prep1 split_bv64_w4_prep2 "
    "split_bv128_w8 split_vmajor_bv16_w1 split_vmajor_bv32_w1 split_vmajor_bv32_w2 split_vmajor_bv64_w2 "
    "split_vmajor_bv64_w4 split_vmajor_bv128_w4 split_vmajor_bv128_w8").split()}
PREFILL_VARIANTS = {"triton": {}, "triton_dyn": {"static_loop": False}, "triton_bv32": {"bv": 32},
                    "triton_inv8": {"inv_num_warps": 8},
                    # the inverse's forward substitution is a chain of reductions over 16 x 16 blocks: within one
                    # warp they need no shared-memory round trip
                    "triton_inv1": {"inv_num_warps": 1}, "triton_inv2": {"inv_num_warps": 2},
                    "triton_inv4": {"inv_num_warps": 4},
                    "triton_wu4": {"wu_num_warps": 4}, "triton_bv16": {"bv": 16},
                    # u stored in fp32 (the default before 2026-12-05)
                    "triton_u_f32": {"u_operand_dtype": False},
                    # the inverse's block dots exact on FMA units / in three tf32 passes (the default: one pass)
                    "triton_inv_f32": {"inv_dot": "float32"}, "triton_inv_tf32x3": {"inv_dot": "tf32x3"}}
PREFILL_CHECK_ONLY = {"triton_tf32": {"dot": "tf32"}}

R = {"meta": {}, "check": {}, "decode": [], "prefill": [], "ablation": {}, "fla": {}, "errors": []}
T0 = time.time()


def save(out):
    save_json(R, os.path.join(out, "gdn_bench.json"))


# ------------------------------------------------------------------------------------------------ byte / flop counts
def decode_bytes(B, state_bytes):
    return B * (2 * HV * D * D * state_bytes + 2 * (KC - 1) * CONV * 2 + CONV * 2 + HV * D * 4 + 2 * HV * 2)


def prefill_bytes(B, T):
    return B * (T * (2 * HK * D * 2 + HV * D * 2 + 2 * HV * 4 + HV * D * 4) + 2 * HV * D * D * 4)


def prefill_flops(B, T):
    """Chunked WY form, chunk 64, per value head and chunk: K K^T, Q K^T (64x64x128 each), w and u (64x64x128
    each), v_new = u - w S, o = q S + Aqk v_new, S update (64x128x128 x3, 64x64x128)."""
    c = 64
    per_chunk = 2 * (c * c * D * 2 + c * c * D * 2 + c * D * D * 3 + c * c * D)
    return B * HV * math.ceil(T / c) * per_chunk


# ------------------------------------------------------------------------------------------------ timing helpers
def jax_loop_time(jax, step, carry, n, reps=5, consts=()):
    """step(i, carry, consts) -> carry (consts: loop-invariant inputs, passed as arguments so that XLA does not
    constant-fold them). Returns (median seconds per step, min, carry)."""
    loop = jax.jit(lambda c, k: jax.lax.fori_loop(0, n, lambda i, cc: step(i, cc, k), c), donate_argnums=0)
    carry = loop(carry, consts)
    jax.block_until_ready(carry)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        carry = loop(carry, consts)
        jax.block_until_ready(carry)
        ts.append((time.perf_counter() - t) / n)
    return statistics.median(ts), min(ts), carry


def rel(np, a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ------------------------------------------------------------------------------------------------ inputs
def gates_params(jax, jnp, key):
    """Per-head decay spread from long memory (|g| ~ 1e-3) to fast forgetting (|g| ~ 1), as trained GDN heads."""
    A_log = jnp.linspace(math.log(1e-3), math.log(1.0), HV).astype(jnp.float32)
    dt_bias = jnp.zeros((HV,), jnp.float32)
    w = (jax.random.normal(key, (CONV, KC)) * 0.5).astype(jnp.bfloat16)
    return w, A_log, dt_bias


def prefill_inputs(jax, jnp, B, T, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    bf = jnp.bfloat16
    q = jax.random.normal(ks[0], (B, T, HK, D), bf)
    k = jax.random.normal(ks[1], (B, T, HK, D), bf)
    v = jax.random.normal(ks[2], (B, T, HV, D), bf)
    A_log = jnp.linspace(math.log(1e-3), math.log(1.0), HV)
    g = -jnp.exp(A_log) * jax.nn.softplus(jax.random.normal(ks[3], (B, T, HV)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, HV)))
    s0 = jax.random.normal(ks[5], (B, HV, D, D), jnp.float32) * 0.1
    return q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32), s0


# ------------------------------------------------------------------------------------------------ phases
def phase_meta(jax, jnp, args):
    d = jax.devices()[0]
    R["meta"] = dict(command=command_line(args.out),
                     date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     device=d.device_kind, platform=d.platform, jax=jax.__version__, hbm_roofline_Bps=HBM_BPS,
                     flops_roofline=PEAK_FLOPS, shapes=dict(H_k=HK, H_v=HV, D=D, conv_kernel=KC, conv_dim=CONV))
    from kernels.gdn import pallas_triton
    R["meta"]["tuning"] = pallas_triton.TUNING
    # ceiling: device-to-device read+write of 1 GiB fp32
    x = jnp.ones((256 * 1024 * 1024,), jnp.float32)
    t, _, _ = jax_loop_time(jax, lambda i, c, k: c * 1.0001, x, 20)
    R["meta"]["copy_Bps_measured"] = 2 * x.size * 4 / t
    log(f"device {d.device_kind}; copy {R['meta']['copy_Bps_measured'] / 1e12:.2f} TB/s")


def phase_check(jax, jnp, np, args):
    """Full-shape correctness of every variant on the GPU vs the reference (HIGHEST precision matmuls)."""
    from kernels.gdn import pallas_triton, reference
    # decode: pool of 24 slots, 16 streams at shuffled slots, fp32 and bf16 pools
    S, B = 24, 16
    ks = jax.random.split(jax.random.PRNGKey(11), 8)
    w, A_log, dt_bias = gates_params(jax, jnp, ks[0])
    x = jax.random.normal(ks[1], (B, CONV), jnp.bfloat16)
    a = jax.random.normal(ks[2], (B, HV), jnp.bfloat16)
    b = jax.random.normal(ks[3], (B, HV), jnp.bfloat16)
    conv = jax.random.normal(ks[4], (S, KC - 1, CONV), jnp.bfloat16)
    slots = jax.random.permutation(ks[5], S)[:B].astype(jnp.int32)
    others = np.setdiff1d(np.arange(S), np.asarray(slots))
    kw = dict(num_k_heads=HK, head_k_dim=D, head_v_dim=D, slots=slots)
    for sdt in (jnp.float32, jnp.bfloat16):
        ssm = (jax.random.normal(ks[6], (S, HV, D, D)) * 0.1).astype(sdt)
        # every timed decode variant is checked in fp32; the bf16 pool with the first three (default, heads, one more)
        dvars = DECODE_VARIANTS if sdt == jnp.float32 else {n: v for i, (n, v) in enumerate(DECODE_VARIANTS.items())
                                                             if i < 3}
        with jax.default_matmul_precision("highest"):
            o_r, c_r, s_r = jax.jit(lambda *A: reference.gdn_decode_step(*A, **kw))(x, a, b, conv, ssm, w, A_log,
                                                                                     dt_bias)
        ssm_np, conv_np = np.asarray(ssm.astype(jnp.float32)), np.asarray(conv.astype(jnp.float32))
        for name, vk in dvars.items():
            def run():
                f = jax.jit(lambda *A: pallas_triton.gdn_decode_step_triton(*A, **kw, **vk, **KEXTRA), donate_argnums=(3, 4))
                vt = (lambda t: jnp.swapaxes(t, -1, -2)) if vk.get("v_major") else jnp.array  # [D_v, D_k] pools; copies
                o, c1, s1 = f(x, a, b, jnp.array(conv), vt(ssm), w, A_log, dt_bias)
                s1 = vt(s1)
                s1f, c1f = np.asarray(s1.astype(jnp.float32)), np.asarray(c1.astype(jnp.float32))
                res = dict(o_rel=rel(np, o, o_r), state_rel=rel(np, s1f[np.asarray(slots)], s_r[slots].astype(
                    jnp.float32)), conv_exact=bool((c1f == np.asarray(c_r.astype(jnp.float32))).all()),
                    untouched_exact=bool((s1f[others] == ssm_np[others]).all() and
                                         (c1f[others] == conv_np[others]).all()),
                    nan=bool(np.isnan(np.asarray(o)).any()))
                R["check"][f"decode_{jnp.dtype(sdt).name}_{name}"] = res
                log("check decode", jnp.dtype(sdt).name, name, res)
            guard(R["errors"], f"check decode {name}", run)
    # prefill: ragged B=3 batch, T=300, lengths 300/131/1, initial state
    B, T = 3, 300
    q, k, v, g, beta, s0 = prefill_inputs(jax, jnp, B, T, seed=3)
    lengths = jnp.array([300, 131, 1], jnp.int32)
    with jax.default_matmul_precision("highest"):
        o_r, s_r = jax.jit(reference.gated_delta_recurrent)(q, k, v, g, beta, s0, lengths)
    o_r, s_r = np.asarray(o_r), np.asarray(s_r)
    pvars = {n: PREFILL_VARIANTS[n] for n in ("triton", "triton_dyn") if n in PREFILL_VARIANTS} | PREFILL_CHECK_ONLY
    if args.full_check or args.prefill_variants:
        pvars = PREFILL_VARIANTS | PREFILL_CHECK_ONLY
    for name, vk in pvars.items():
        def run():
            o, st = jax.jit(lambda *A: pallas_triton.gated_delta_chunk_prefill_triton(*A, **vk, **KEXTRA))(
                q, k, v, g, beta, s0, lengths)
            o = np.asarray(o)
            pad_zero = bool((o[1, 131:] == 0).all() and (o[2, 1:] == 0).all())
            res = dict(o_rel=rel(np, o, o_r), state_rel=rel(np, st, s_r), pad_zero=pad_zero,
                       nan=bool(np.isnan(o).any()))
            R["check"][f"prefill_{name}"] = res
            log("check prefill", name, res)
        guard(R["errors"], f"check prefill {name}", run)
    # the inverse's hard case: keys of a chunk nearly parallel, beta near 1, little decay, so I + A is close to the
    # all-ones lower triangle and the blocked inverse cancels large terms (the tf32 block dots' worst case)
    kc = jax.random.split(jax.random.PRNGKey(4), 3)
    k_par = (jax.random.normal(kc[0], (1, 1, HK, D)) + 0.05 * jax.random.normal(kc[1], k.shape)).astype(k.dtype)
    beta_hi, g_lo = jax.nn.sigmoid(3.0 + beta), g * 0.01
    with jax.default_matmul_precision("highest"):
        o_r, s_r = jax.jit(reference.gated_delta_recurrent)(q, k_par, v, g_lo, beta_hi, s0, lengths)
    for name in [n for n in ("triton", "triton_inv_f32", "triton_inv_tf32x3") if n in PREFILL_VARIANTS]:
        def run():
            vk = PREFILL_VARIANTS[name]
            o, st = jax.jit(lambda *A: pallas_triton.gated_delta_chunk_prefill_triton(*A, **vk, **KEXTRA))(
                q, k_par, v, g_lo, beta_hi, s0, lengths)
            res = dict(o_rel=rel(np, o, o_r), state_rel=rel(np, st, s_r), nan=bool(np.isnan(np.asarray(o)).any()))
            R["check"][f"prefill_parallel_keys_{name}"] = res
            log("check prefill, nearly parallel keys", name, res)
        guard(R["errors"], f"check prefill parallel keys {name}", run)


def phase_decode(jax, jnp, np, args):
    from kernels.gdn import pallas_triton, reference
    ks = jax.random.split(jax.random.PRNGKey(5), 6)
    w, A_log, dt_bias = gates_params(jax, jnp, ks[0])
    streams = [128] if args.quick else sorted(STREAMS, key=lambda b_: b_ != 128)
    plan = [(B, sdt, {"triton": DECODE_VARIANTS["triton"]} | ({"reference": None} if B in (1, 128) else {}))
            for B in streams for sdt in (jnp.float32, jnp.bfloat16)]
    plan += [(128, sdt, {n_: v_ for n_, v_ in DECODE_VARIANTS.items() if n_ != "triton"})
             for sdt in (jnp.float32, jnp.bfloat16) if 128 in streams]
    for B, sdt, variants in plan:
            sb = jnp.dtype(sdt).itemsize
            pool_bytes = B * HV * D * D * sb
            L = int(min(MAX_SLOT_BLOCKS, max(1, math.ceil(256e6 / pool_bytes))))  # slot blocks rotated per cycle
            n = max(L, 40 if B >= 128 else 100)
            n = L * math.ceil(n / L)
            x = jax.random.normal(ks[1], (B, CONV), jnp.bfloat16)
            a = jax.random.normal(ks[2], (B, HV), jnp.bfloat16)
            b = jax.random.normal(ks[3], (B, HV), jnp.bfloat16)
            nbytes = decode_bytes(B, sb)
            for name, vk in variants.items():
                if time.time() - T0 > args.decode_deadline:
                    R["errors"].append(f"decode B={B} {jnp.dtype(sdt).name} {name} skipped: time")
                    continue

                def run():
                    conv = jax.random.normal(ks[4], (L * B, KC - 1, CONV), jnp.bfloat16)
                    ssm = (jax.random.normal(ks[5], (L * B, HV, D, D)) * 0.1).astype(sdt)
                    o0 = jnp.zeros((B, HV, D), jnp.float32)
                    base = jnp.arange(B, dtype=jnp.int32)
                    if vk is None:
                        fn = lambda *A, slots: reference.gdn_decode_step(*A, num_k_heads=HK, head_k_dim=D,
                                                                         head_v_dim=D, slots=slots)
                    else:
                        fn = lambda *A, slots: pallas_triton.gdn_decode_step_triton(
                            *A, num_k_heads=HK, head_k_dim=D, head_v_dim=D, slots=slots, **vk, **KEXTRA)

                    def step(i, c, consts):
                        conv_p, ssm_p, o_acc = c
                        x_, a_, b_, w_, al_, dt_ = consts
                        slots = None if L == 1 else base + (i % L) * B
                        o, conv_p, ssm_p = fn(x_, a_, b_, conv_p, ssm_p, w_, al_, dt_, slots=slots)
                        return conv_p, ssm_p, o
                    t, tmin, _ = jax_loop_time(jax, step, (conv, ssm, o0), n, consts=(x, a, b, w, A_log, dt_bias))
                    row = dict(streams=B, state=jnp.dtype(sdt).name, impl=name, kwargs=vk, ms=t * 1e3,
                               ms_min=tmin * 1e3, slot_blocks=L, bytes=nbytes, roofline_ms=nbytes / HBM_BPS * 1e3,
                               TBps=nbytes / t / 1e12, frac_roofline=nbytes / HBM_BPS / t)
                    R["decode"].append(row)
                    save(args.out)
                    log(f"decode B={B:3d} {row['state']:8s} {name:16s} {t * 1e3:8.4f} ms  "
                        f"{row['TBps']:.2f} TB/s  {100 * row['frac_roofline']:.0f}% of roofline")
                guard(R["errors"], f"decode {B} {name}", run)


def phase_prefill(jax, jnp, np, args):
    """Default tuning (+ the jnp reference at the target shapes) over all shapes first, then the variants."""
    from kernels.gdn import pallas_triton, reference
    shapes = [(1, 1024), (1, 4096), (8, 1024)] if args.quick else PREFILL
    variant_shapes = ((1, 4096), (8, 1024))
    if args.prefill_shapes:
        shapes = variant_shapes = [tuple(int(n) for n in s_.split("x")) for s_ in args.prefill_shapes.split(",")]
    plan = [(B, T, "triton", {}) for B, T in shapes]
    if not args.no_reference:
        plan += [(B, T, "reference", None) for B, T in shapes if (B, T) in ((1, 1024), (1, 4096), (8, 1024))]
    plan += [(B, T, n_, v_) for B, T in variant_shapes for n_, v_ in PREFILL_VARIANTS.items()
             if n_ != "triton" and (B, T) in shapes]
    inputs = {}
    for B, T, name, vk in plan:
        if time.time() - T0 > args.prefill_deadline:
            R["errors"].append(f"prefill {B}x{T} {name} skipped: time")
            continue
        if (B, T) not in inputs:
            inputs.clear()
            inputs[(B, T)] = prefill_inputs(jax, jnp, B, T)
        q, k, v, g, beta, s0 = inputs[(B, T)]
        nbytes, fl = prefill_bytes(B, T), prefill_flops(B, T)
        roof = max(nbytes / HBM_BPS, fl / PEAK_FLOPS)

        def run():
            if vk is None:
                fn = lambda s, c: reference.gated_delta_chunked(*c, s)
            else:
                fn = lambda s, c: pallas_triton.gated_delta_chunk_prefill_triton(*c, s, **vk, **KEXTRA)
            n = 20 if B * T <= 8192 else 8
            if vk is None:
                n = max(2, n // 4)
            carry = (jnp.zeros((B, T, HV, D), jnp.float32), jnp.copy(s0))  # donated by the loop
            t, tmin, _ = jax_loop_time(jax, lambda i, c, cs: fn(c[1], cs), carry, n, consts=(q, k, v, g, beta))
            row = dict(B=B, T=T, impl=name, kwargs=vk, ms=t * 1e3, ms_min=tmin * 1e3, bytes=nbytes, flops=fl,
                       roofline_ms=roof * 1e3, Mtok_s=B * T / t / 1e6)
            R["prefill"].append(row)
            save(args.out)
            log(f"prefill B={B} T={T:5d} {name:12s} {t * 1e3:8.3f} ms  ({row['Mtok_s']:.1f} M tok/s, "
                f"roofline {roof * 1e3:.3f} ms)")
        guard(R["errors"], f"prefill {B}x{T} {name}", run)


def phase_profile(jax, jnp, np, args):
    """Device time per kernel of one prefill call (jax.profiler trace, 5 calls after a warm-up) for each variant at
    each --prefill-shapes shape, and FLA's kernels through torch.profiler at the same shapes when fla-core is
    installed (not in --cpu-smoke): where each implementation spends its time, launch by launch."""
    import tempfile
    from collections import defaultdict
    from experiments.decode_profile import gpu_kernel_events
    from kernels.gdn import pallas_triton
    shapes = [tuple(int(n) for n in s_.split("x")) for s_ in (args.prefill_shapes or "1x1024,1x4096,8x1024").split(",")]
    rows = R.setdefault("profile", [])
    n = 5

    def add_row(B, T, impl, per):  # per: {kernel name: ms per call}; the 16 largest are kept
        row = dict(B=B, T=T, impl=impl, total_ms=round(sum(per.values()), 4),
                   kernels_ms={k_: round(v_, 4) for k_, v_ in sorted(per.items(), key=lambda kv: -kv[1])[:16]})
        rows.append(row)
        save(args.out)
        log("profile", row)

    # every JAX trace first: once torch's profiler has run, JAX's trace gets no GPU events in this process
    for B, T in shapes:
        q, k, v, g, beta, s0 = prefill_inputs(jax, jnp, B, T)
        for name, vk in PREFILL_VARIANTS.items():
            def run():
                fn = jax.jit(lambda *c: pallas_triton.gated_delta_chunk_prefill_triton(*c, **vk, **KEXTRA))
                jax.block_until_ready(fn(q, k, v, g, beta, s0))
                d = tempfile.mkdtemp()
                with jax.profiler.trace(d, create_perfetto_trace=True):
                    for _ in range(n):
                        out = fn(q, k, v, g, beta, s0)
                    jax.block_until_ready(out)
                per = defaultdict(float)
                for e in gpu_kernel_events(d):
                    per[e["name"][:60]] += e["dur"] / 1e3 / n
                add_row(B, T, name, per)
            guard(R["errors"], f"profile {B}x{T} {name}", run)
    for B, T in ([] if args.cpu_smoke else shapes):
        q, k, v, g, beta, s0 = prefill_inputs(jax, jnp, B, T)

        def run_fla():
            import torch
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
            fast_autotune()
            t = lambda x: torch.from_dlpack(x)
            tq, tk, tv = (t(x).contiguous() for x in (q, k, v))
            tg, tb, ts0 = t(g).contiguous(), t(beta).to(torch.bfloat16).contiguous(), t(s0).clone()
            fn = lambda: chunk_gated_delta_rule(tq, tk, tv, tg, tb, initial_state=ts0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
            fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(n):
                    fn()
                torch.cuda.synchronize()
            per = defaultdict(float)
            for e in prof.key_averages():
                dt = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
                if dt and e.key and not e.key.startswith("ProfilerStep"):
                    per[e.key[:60]] += dt / 1e3 / n
            add_row(B, T, "fla_chunk", per)
        guard(R["errors"], f"profile {B}x{T} fla", run_fla)


def phase_ablation(jax, jnp, np, args):
    """500 decode steps, 16 streams, same random inputs, fp32 vs bf16 pool (both through the kernel) and the plain
    reference with an fp32 pool under HIGHEST precision as the truth."""
    from kernels.gdn import pallas_triton, reference
    B, N = 16, 500
    ks = jax.random.split(jax.random.PRNGKey(9), 4)
    w, A_log, dt_bias = gates_params(jax, jnp, ks[0])

    def run_steps(fn, sdt):
        conv = jnp.zeros((B, KC - 1, CONV), jnp.bfloat16)
        ssm = jnp.zeros((B, HV, D, D), sdt)

        def body(c, t):
            conv, ssm = c
            kk = jax.random.fold_in(ks[1], t)
            x = jax.random.normal(kk, (B, CONV), jnp.bfloat16)
            ab = jax.random.normal(jax.random.fold_in(kk, 1), (2, B, HV), jnp.bfloat16)
            o, conv, ssm = fn(x, ab[0], ab[1], conv, ssm, w, A_log, dt_bias, num_k_heads=HK, head_k_dim=D,
                              head_v_dim=D)
            return (conv, ssm), o
        (_, ssm), o = jax.jit(lambda: jax.lax.scan(body, (conv, ssm), jnp.arange(N)))()
        return np.asarray(o), np.asarray(ssm.astype(jnp.float32))

    with jax.default_matmul_precision("highest"):
        o_ref, s_ref = run_steps(reference.gdn_decode_step, jnp.float32)
    out = {}
    for sdt in (jnp.float32, jnp.bfloat16):
        o, s = run_steps(functools.partial(pallas_triton.gdn_decode_step_triton, **KEXTRA), sdt)
        err = [rel(np, o[t], o_ref[t]) for t in range(N)]
        out[jnp.dtype(sdt).name] = dict(
            o_rel_at={str(t): err[t - 1] for t in (1, 10, 100, 250, 500)}, o_rel_max=max(err),
            o_rel_mean=float(np.mean(err)), final_state_rel=rel(np, s, s_ref), curve=err[::5])
        log("ablation", jnp.dtype(sdt).name, {k_: v_ for k_, v_ in out[jnp.dtype(sdt).name].items() if k_ != "curve"})
    R["ablation"] = dict(streams=B, steps=N, truth="reference fp32 pool, HIGHEST matmul precision", **out)


def fast_autotune():
    """Make Triton's autotuner (FLA's kernels) benchmark each config briefly: same choice logic, far less time."""
    import triton
    import triton.testing as tt
    orig = tt.do_bench

    def quick(fn, warmup=25, rep=100, *a, **k):
        return orig(fn, 3, 10, *a, **k)
    tt.do_bench = quick
    return triton


def fla_warmup(args):
    """Run in a side process at start: compiles + autotunes FLA's kernels (Triton's disk cache keeps the binaries,
    so the timed phase later only re-benchmarks configs)."""
    fast_autotune()
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    dev = "cuda"
    for B, T in [(1, 1024)]:
        q = torch.randn(B, T, HK, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(B, T, HV, D, device=dev, dtype=torch.bfloat16)
        g = -torch.rand(B, T, HV, device=dev)
        be = torch.rand(B, T, HV, device=dev, dtype=torch.bfloat16)
        h0 = torch.randn(B, HV, D, D, device=dev)
        chunk_gated_delta_rule(q, q, v, g, be, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        fused_recurrent_gated_delta_rule(q[:, :1], q[:, :1], v[:, :1], g[:, :1], be[:, :1], initial_state=h0,
                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.cuda.synchronize()
    print("fla warm-up done", flush=True)


def phase_fla(jax, jnp, np, args):
    fast_autotune()
    import torch
    import fla
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from kernels.gdn import pallas_triton
    R["fla"]["version"] = getattr(fla, "__version__", "?")
    R["fla"]["torch"] = torch.__version__
    dev = "cuda"

    def t_events(fn, n=20, reps=5):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(n):
                fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) / n)
        return statistics.median(ts)

    def t_graph(fn, n=20, reps=5):
        st = torch.cuda.Stream()
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(st)
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            fn()
        return t_events(gr.replay, n, reps)

    def to_t(x):
        try:
            return torch.from_dlpack(x)  # zero-copy on the GPU
        except Exception:  # noqa: BLE001
            return torch.from_numpy(np.array(x.astype(jnp.float32))).to(dev)

    rows = []
    shapes = [(1, 1024), (1, 4096), (8, 1024)] + ([] if args.quick else [(1, 256), (8, 256), (8, 4096)])
    R["fla"]["prefill"] = rows
    R["fla"]["decode"] = []
    for B, T in shapes:
        if time.time() - T0 > args.fla_budget:
            R["errors"].append(f"FLA prefill {B}x{T} skipped: time")
            continue

        def run():
            q, k, v, g, beta, s0 = prefill_inputs(jax, jnp, B, T)
            tq, tk, tv = (to_t(x).to(torch.bfloat16).contiguous() for x in (q, k, v))
            tg, tb, ts0 = to_t(g).contiguous(), to_t(beta).to(torch.bfloat16).contiguous(), to_t(s0).clone()
            fn = lambda: chunk_gated_delta_rule(tq, tk, tv, tg, tb, initial_state=ts0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
            o_f, st_f = fn()
            row = dict(B=B, T=T, impl="fla_chunk", ms=t_events(fn))
            try:
                row["ms_graph"] = t_graph(fn)
            except Exception as e:  # noqa: BLE001
                row["graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            if (B, T) == (1, 1024):  # same inputs through our kernel and the reference
                from kernels.gdn import reference
                o_p, _ = jax.jit(pallas_triton.gated_delta_chunk_prefill_triton)(q, k, v, g, beta, s0)
                with jax.default_matmul_precision("highest"):
                    o_r, _ = jax.jit(reference.gated_delta_chunked)(q, k, v, g, beta.astype(jnp.bfloat16).astype(
                        jnp.float32), s0)
                o_fn = o_f.float().cpu().numpy()
                row["fla_vs_ref_rel"] = rel(np, o_fn, o_r)
                row["ours_vs_fla_rel"] = rel(np, o_p, o_fn)
            rows.append(row)
            save(args.out)
            log("fla prefill", row)
        guard(R["errors"], f"fla prefill {B}x{T}", run)
    rows = R["fla"]["decode"]
    for B in ([128] if args.quick else [128, 1, 32, 256]):
        if time.time() - T0 > args.fla_budget:
            R["errors"].append(f"FLA decode {B} skipped: time")
            continue

        def run():
            tq = torch.randn(B, 1, HK, D, device=dev, dtype=torch.bfloat16)
            tk = torch.randn(B, 1, HK, D, device=dev, dtype=torch.bfloat16)
            tv = torch.randn(B, 1, HV, D, device=dev, dtype=torch.bfloat16)
            tg = -torch.rand(B, 1, HV, device=dev)
            tb = torch.rand(B, 1, HV, device=dev, dtype=torch.bfloat16)
            h0 = torch.randn(B, HV, D, D, device=dev) * 0.1
            fn = lambda: fused_recurrent_gated_delta_rule(tq, tk, tv, tg, tb, initial_state=h0,
                                                          output_final_state=True, use_qk_l2norm_in_kernel=True)
            nbytes = B * (2 * HV * D * D * 4)
            row = dict(streams=B, state="float32", impl="fla_fused_recurrent", ms=t_events(fn, 50))
            try:
                row["ms_graph"] = t_graph(fn, 50)
            except Exception as e:  # noqa: BLE001
                row["graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            best = min(row["ms"], row.get("ms_graph", 1e9))
            row.update(bytes=nbytes, TBps=nbytes / (best * 1e-3) / 1e12, frac_roofline=nbytes / HBM_BPS / (best * 1e-3))
            rows.append(row)
            save(args.out)
            log("fla decode", row)
        guard(R["errors"], f"fla decode {B}", run)


# ------------------------------------------------------------------------------------------------ report
def report(out):
    m = R["meta"]
    L = [f"# Gated DeltaNet kernels on {m.get('device', '?')}", "",
         f"- command: `{m.get('command')}`", f"- date: {m.get('date')}; jax {m.get('jax')}; "
         f"FLA {R['fla'].get('version', '-')} / torch {R['fla'].get('torch', '-')}",
         f"- measured copy bandwidth {m.get('copy_Bps_measured', 0) / 1e12:.2f} TB/s; roofline uses "
         f"{HBM_BPS / 1e12:.1f} TB/s and {PEAK_FLOPS / 1e12:.0f} TFLOP/s", ""]
    if R["check"]:
        L += ["## Correctness on the GPU (full shapes; vs the reference with HIGHEST-precision matmuls)", "",
              "| case | result |", "|---|---|"]
        L += [f"| {k} | {json.dumps(v)} |" for k, v in R["check"].items()]
        L.append("")
    if R["decode"]:
        fla = {r["streams"]: r for r in R["fla"].get("decode", [])}
        L += ["## Decode: one token per stream, one GDN layer (conv + gates + norm + delta rule), state pool in place",
              "", "| streams | state | impl | ms / layer | TB/s | % of roofline | roofline ms |", "|---|---|---|---|---|---|---|"]
        for r in R["decode"]:
            L.append(f"| {r['streams']} | {r['state']} | {r['impl']} | {r['ms']:.4f} | {r['TBps']:.2f} | "
                     f"{100 * r['frac_roofline']:.0f}% | {r['roofline_ms']:.4f} |")
        for B, r in sorted(fla.items()):
            L.append(f"| {B} | float32 | FLA fused_recurrent (no conv; eager / graph) | {r['ms']:.4f} / "
                     f"{r.get('ms_graph', float('nan')):.4f} | {r['TBps']:.2f} | {100 * r['frac_roofline']:.0f}% | |")
        L.append("")
    if R["prefill"]:
        fla = {(r["B"], r["T"]): r for r in R["fla"].get("prefill", [])}
        L += ["## Prefill: one GDN layer (chunked delta rule incl. q/k L2 norm), initial state in, final state out", "",
              "| B | T | impl | ms / layer | M tok/s | roofline ms | vs FLA eager | vs FLA graph |",
              "|---|---|---|---|---|---|---|---|"]
        for r in R["prefill"]:
            f = fla.get((r["B"], r["T"]), {})
            sp = f"{f['ms'] / r['ms']:.2f}x" if "ms" in f else "-"
            sg = f"{f['ms_graph'] / r['ms']:.2f}x" if "ms_graph" in f else "-"
            L.append(f"| {r['B']} | {r['T']} | {r['impl']} | {r['ms']:.3f} | {r['Mtok_s']:.1f} | "
                     f"{r['roofline_ms']:.3f} | {sp} | {sg} |")
        for (B, T), f in sorted(fla.items()):
            extra = "; ".join(f"{k}={f[k]:.2e}" for k in ("fla_vs_ref_rel", "ours_vs_fla_rel") if k in f)
            L.append(f"| {B} | {T} | FLA chunk_gated_delta_rule (eager / graph) | {f['ms']:.3f} / "
                     f"{f.get('ms_graph', float('nan')):.3f} | {B * T / f['ms'] / 1e3:.1f} | | | {extra} |")
        L.append("")
    if R.get("profile"):
        L += ["## Prefill device time by kernel (ms per call; profiler trace, 5 calls)", "",
              "| B | T | impl | total | kernels (largest first) |", "|---|---|---|---|---|"]
        for r in R["profile"]:
            ks = "; ".join(f"{k} {v:.4f}" for k, v in list(r["kernels_ms"].items())[:8])
            L.append(f"| {r['B']} | {r['T']} | {r['impl']} | {r['total_ms']:.4f} | {ks} |")
        L.append("")
    if R["ablation"]:
        a = R["ablation"]
        L += [f"## fp32 vs bf16 state: {a['steps']}-step decode, {a['streams']} streams (truth: {a['truth']})", "",
              "| state | o rel err @1 | @10 | @100 | @250 | @500 | max | final state rel err |", "|---|---|---|---|---|---|---|---|"]
        for dt in ("float32", "bfloat16"):
            if dt in a:
                e = a[dt]["o_rel_at"]
                L.append(f"| {dt} | " + " | ".join(f"{e[s]:.2e}" for s in ("1", "10", "100", "250", "500")) +
                         f" | {a[dt]['o_rel_max']:.2e} | {a[dt]['final_state_rel']:.2e} |")
        L.append("")
    if R["errors"]:
        L += ["## Errors", ""] + [f"- {e[:400]}" for e in R["errors"]] + [""]
    with open(os.path.join(out, "gdn_bench.md"), "w") as f:
        f.write("\n".join(L))
    try:
        plot(out)
    except Exception as e:  # noqa: BLE001
        print("plot failed:", e)
    return "\n".join(L)


def plot(out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(17, 4.8))
    for sdt, ls in (("float32", "-"), ("bfloat16", "--")):
        for impl, c in (("triton", "C0"), ("reference", "C1")):
            rs = sorted((r for r in R["decode"] if r["state"] == sdt and r["impl"] == impl), key=lambda r: r["streams"])
            if rs:
                ax[0].plot([r["streams"] for r in rs], [r["ms"] for r in rs], ls, color=c, marker="o",
                           label=f"{impl} {sdt}")
        rs = sorted((r for r in R["decode"] if r["state"] == sdt and r["impl"] == "triton"), key=lambda r: r["streams"])
        if rs:
            ax[0].plot([r["streams"] for r in rs], [r["roofline_ms"] for r in rs], ls, color="k", lw=0.8,
                       label=f"roofline {sdt}")
    fr = sorted(R["fla"].get("decode", []), key=lambda r: r["streams"])
    if fr:
        ax[0].plot([r["streams"] for r in fr], [min(r["ms"], r.get("ms_graph", 1e9)) for r in fr], ":", color="C2",
                   marker="s", label="FLA fused_recurrent fp32")
    ax[0].set(xscale="log", yscale="log", xlabel="streams", ylabel="ms / layer", title="decode step")
    ax[0].legend(fontsize=7)
    for i, B in enumerate((1, 8)):
        a = ax[1 + i]
        for impl, c in (("triton", "C0"), ("reference", "C1")):
            rs = sorted((r for r in R["prefill"] if r["B"] == B and r["impl"] == impl), key=lambda r: r["T"])
            if rs:
                a.plot([r["T"] for r in rs], [r["ms"] for r in rs], color=c, marker="o", label=impl)
        fp = sorted((r for r in R["fla"].get("prefill", []) if r["B"] == B), key=lambda r: r["T"])
        if fp:
            a.plot([r["T"] for r in fp], [r["ms"] for r in fp], ":", color="C2", marker="s", label="FLA eager")
            if all("ms_graph" in r for r in fp):
                a.plot([r["T"] for r in fp], [r["ms_graph"] for r in fp], "--", color="C2", marker="s",
                       label="FLA CUDA graph")
        rs = sorted((r for r in R["prefill"] if r["B"] == B and r["impl"] == "triton"), key=lambda r: r["T"])
        if rs:
            a.plot([r["T"] for r in rs], [r["roofline_ms"] for r in rs], color="k", lw=0.8, label="roofline")
        a.set(xscale="log", yscale="log", xlabel="T", ylabel="ms / layer", title=f"prefill B={B}")
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "gdn_bench.png"), dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="experiments/results")
    ap.add_argument("--phases", default="check,prefill,decode,ablation,fla")
    ap.add_argument("--prefill-deadline", type=float, default=1e9, help="prefill configs skipped after (s)")
    ap.add_argument("--decode-deadline", type=float, default=1e9, help="decode configs skipped after (s)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--decode-variants", default=None,
                    help="comma-separated names of DECODE_VARIANTS to check and time (default: all)")
    ap.add_argument("--prefill-variants", default=None,
                    help="comma-separated names of PREFILL_VARIANTS to check and time (default: all)")
    ap.add_argument("--no-reference", action="store_true",
                    help="prefill: skip the jnp reference rows (a variant A/B on little device time)")
    ap.add_argument("--prefill-shapes", default=None,
                    help="comma-separated BxT prefill shapes (e.g. 8x384,1x4096); every variant runs at each")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds after which long phases stop early")
    ap.add_argument("--report-only", default=None)
    ap.add_argument("--fla-budget", type=float, default=1e9, help="FLA shapes are skipped after this time (s)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, Pallas interpret mode (script check)")
    ap.add_argument("--full-check", action="store_true", help="check every prefill variant on the GPU")
    ap.add_argument("--fla-warmup", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fla_warmup:
        fla_warmup(args)
        return
    if args.cpu_smoke:
        global HK, HV, D, CONV, STREAMS, PREFILL, MAX_SLOT_BLOCKS
        HK, HV, D = 1, 2, 32
        CONV = 2 * HK * D + HV * D
        STREAMS, PREFILL, MAX_SLOT_BLOCKS = [2], [(1, 130), (2, 64)], 2
        KEXTRA["interpret"] = True
    if args.decode_variants:
        keep = args.decode_variants.split(",")
        unknown = set(keep) - set(DECODE_VARIANTS)
        if unknown:
            raise SystemExit(f"unknown decode variants {sorted(unknown)}; known: {list(DECODE_VARIANTS)}")
        for name in [n for n in DECODE_VARIANTS if n not in keep and n != "triton"]:  # the default stays first
            del DECODE_VARIANTS[name]
    if args.prefill_variants:
        keep = args.prefill_variants.split(",")
        unknown = set(keep) - set(PREFILL_VARIANTS)
        if unknown:
            raise SystemExit(f"unknown prefill variants {sorted(unknown)}; known: {list(PREFILL_VARIANTS)}")
        for name in [n for n in PREFILL_VARIANTS if n not in keep and n != "triton"]:
            del PREFILL_VARIANTS[name]
    if args.report_only:
        R.update(json.load(open(args.report_only)))
        print(report(os.path.dirname(args.report_only)))
        return
    os.makedirs(args.out, exist_ok=True)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import warnings
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    phases = args.phases.split(",")
    warm = None
    if "fla" in phases and not args.cpu_smoke:  # compile/autotune FLA's Triton kernels in a side process meanwhile
        import subprocess
        warm = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--fla-warmup"],
                                stdout=open(os.path.join(args.out, "fla_warmup.txt"), "w"), stderr=subprocess.STDOUT)
    phase_meta(jax, jnp, args)
    table = {"check": phase_check, "decode": phase_decode, "prefill": phase_prefill, "ablation": phase_ablation,
             "fla": phase_fla, "profile": phase_profile}
    for p in phases:
        if time.time() - T0 > args.budget and p not in ("fla", "ablation"):
            R["errors"].append(f"phase {p} skipped: budget")
            continue
        if p == "fla" and warm is not None:  # FLA's compiles/autotuning ran in the side process meanwhile
            try:
                warm.wait(timeout=max(1.0, args.fla_budget - 20 - (time.time() - T0)))
            except Exception:  # noqa: BLE001
                warm.kill()
                R["errors"].append("FLA warm-up process killed (took too long)")
            log("fla warm-up rc", warm.returncode)
            warm = None
        log("phase", p)
        guard(R["errors"], f"phase {p}", table[p], jax, jnp, np, args)
        save(args.out)
    print(report(args.out))
    save(args.out)


if __name__ == "__main__":
    main()
