"""Routed-expert (MoE) layer benchmark on one GPU: our Pallas kernels vs lax.ragged_dot, tokamax and the reference.

Drama 3 shapes: H 2048, I 512, E 256, top-8. Decode T = 1..256 (time + achieved HBM bandwidth of the touched experts),
prefill T = 2048..16384 (time + TFLOP/s). Every backend computes the whole layer: token grouping, gate+up, SwiGLU,
down, router-weighted combine. Weights rotate over L distinct layers so that decode does not measure the L2 cache.

Timing: a jitted fori_loop chains the layer R x L times (x <- 3 * layer(x), same routing), timed with a host clock
around block_until_ready after a warm-up call; per-layer time = median over repeats / (R x L). Dispatch overhead is
amortised over R x L layer calls; the 3x rescale fuses into each backend's last op.

  python experiments/moe_bench.py --out DIR [--phases correct,sweep,bench] [--budget SECONDS]

Writes DIR/moe_bench.json (all numbers, command, date, device), DIR/moe_bench.md and DIR/moe_bench.png.
`--report-only DIR/moe_bench.json` re-renders the Markdown/PNG from a JSON.
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
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.common import command_line  # noqa: E402

H, I, E, K = 2048, 512, 256, 8
DECODE_T = [1, 8, 32, 64, 128, 256]
PREFILL_T = [2048, 8192, 16384]
HBM_BPS = 4.2e12  # measured device-to-device copy, h200-baselines.md
PEAK_FLOPS = 780e12  # measured XLA bf16 GEMM
REF_MAX_T = 256
W8A8 = "pallas_triton_w8a8"  # our kernels with FP8 activations (FP8 weights only)
OURS = ("pallas_triton", W8A8)
# Decode-regime tile variants swept against the table default (16-row blocks; gate/up N 64 / K 128; down N 128 /
# K 128; 4 warps, 4 stages). Down has only I/128 = 4 K steps per program, so its occupancy knobs come first.
DECODE_TILE_VARIANTS = {
    "dn_bn64": dict(dn_block_n=64),
    "dn_bn64,dn_w2": dict(dn_block_n=64, dn_warps=2),
    "dn_bn32,dn_w2": dict(dn_block_n=32, dn_warps=2),
    "dn_s2": dict(dn_stages=2),
    "dn_w8": dict(dn_warps=8),
    "gu_s3": dict(gu_stages=3),
    "gu_s6": dict(gu_stages=6),
    "gu_bn32,gu_w2": dict(gu_block_n=32, gu_warps=2),
    "gu_w8": dict(gu_warps=8),
    # few pairs (T = 1..8: 8..64 pairs on as many experts): narrow tiles on both GEMMs for more programs per expert
    "narrow32,w2": dict(gu_block_n=32, gu_warps=2, dn_block_n=32, dn_warps=2),
    "narrow16,w1": dict(gu_block_n=16, gu_warps=1, dn_block_n=16, dn_warps=1),
}  # the dense-gather reference materialises [T, k, 3, 512, 2048] weights
W8A8_DECODE_VARIANTS = {  # one knob at a time around its decode base (the FP8 decode tiles, K 128)
    "dn_bn64,dn_w4": dict(dn_block_n=64, dn_warps=4),
    "dn_bn128,dn_w4": dict(dn_block_n=128, dn_warps=4),
    "gu_bn128": dict(gu_block_n=128),
    "gu_bn32,gu_w2": dict(gu_block_n=32, gu_warps=2),
    # one stream (8 pairs): the table's prequant row gives gate/up only I/128 = 4 programs per expert, 32 in all (15.8
    # us per layer on an H100 for 16.8 MB of weights, experiments/results/decode_2026-12-07_h100/); 16-column tiles
    # give 256
    "gu_bn16,gu_w1": dict(gu_block_n=16, gu_warps=1),
    "gu_s3": dict(gu_stages=3),
    "gu_s6": dict(gu_stages=6),
    "gu_w8": dict(gu_warps=8),
    # quantisation outside the K loops (kernels/moe/pallas_triton.py, prequant): gate/up N tiles of 128
    "prequant": dict(gu_block_n=128, prequant=True),
    "prequant,dn_bn128,dn_w4": dict(gu_block_n=128, dn_block_n=128, dn_warps=4, prequant=True),
}
W8A8_PREFILL_VARIANTS = {  # around the prefill base (64-row blocks, 128 x 128 tiles, 4 warps, 3 stages)
    "bm128,w8": dict(block_m=128, gu_warps=8, dn_warps=8),
    "s4": dict(gu_stages=4, dn_stages=4),
    "prequant": dict(prequant=True),
    "prequant,w8": dict(prequant=True, gu_warps=8, dn_warps=8),
    "prequant,bm128,w8": dict(prequant=True, block_m=128, gu_warps=8, dn_warps=8),
    "prequant,s4": dict(prequant=True, gu_stages=4, dn_stages=4),
    "prequant,s2": dict(prequant=True, gu_stages=2, dn_stages=2),
    # packed prefill calls of 2-4k rows: ~100 pairs per expert, one 128-row block or three of 32
    "prequant,bm128,w8,s4": dict(prequant=True, block_m=128, gu_warps=8, dn_warps=8, gu_stages=4, dn_stages=4),
    "prequant,bm32": dict(prequant=True, block_m=32),
    # one 128-row block per expert (so its weights stream once, where two 64-row blocks stream them twice) without
    # the register spills of "prequant,bm128,w8" (208 B in gate/up by ptxas -v for sm_90a at T=3072, through
    # kernels/h200_lowering.py on a CPU): 64-wide gate/up N tiles, in-kernel activation quantisation (prequant needs
    # 128-wide ones); ptxas: gate/up 182 registers, no spill; down 212 (128-wide N) or 157 (64-wide), no spill
    "bm128,gu_bn64,w8": dict(block_m=128, gu_block_n=64, gu_warps=8, dn_warps=8),
    "bm128,gu_bn64,w8,dn_bn64": dict(block_m=128, gu_block_n=64, gu_warps=8, dn_block_n=64, dn_warps=8),
    # the same with 2 stages (82 KB of shared memory each; ptxas: 175 / 222 registers, no spill)
    "bm128,gu_bn64,w8,s2": dict(block_m=128, gu_block_n=64, gu_warps=8, dn_warps=8, gu_stages=2, dn_stages=2),
}


def layer_flops(T):
    return 2.0 * T * K * 3 * H * I


def expert_bytes(dtype_bytes, with_scales):
    b = 3 * H * I * dtype_bytes
    if with_scales:
        b += 3 * (H // 128) * (I // 128) * 4
    return b


# ----------------------------------------------------------------------------------------------------------- setup
def build_weights(jax, jnp, n_layers, seed=0):
    from kernels.moe.testing import quantize_fp8_blocks
    from kernels.moe.weights import ExpertWeights

    out_bf16, out_fp8 = [], []
    for layer in range(n_layers):
        key = jax.random.PRNGKey(seed + layer)

        @jax.jit
        def make(key):
            ks = jax.random.split(key, 6)
            g = jax.random.normal(ks[0], (E, I, H), jnp.float32) / math.sqrt(H)
            u = jax.random.normal(ks[1], (E, I, H), jnp.float32) / math.sqrt(H)
            d = jax.random.normal(ks[2], (E, H, I), jnp.float32) / math.sqrt(I)
            bf = ExpertWeights(g.astype(jnp.bfloat16), u.astype(jnp.bfloat16), d.astype(jnp.bfloat16))
            (gq, gs), (uq, us), (dq, ds) = (quantize_fp8_blocks(a, k) for a, k in zip((g, u, d), ks[3:]))
            return bf, ExpertWeights(gq, uq, dq, gs, us, ds)

        bf, f8 = make(key)
        out_bf16.append(bf)
        out_fp8.append(f8)
    return out_bf16, out_fp8


def routing(jax, jnp, T, seed):
    from kernels.moe.testing import random_routing

    ids, w = random_routing(jax.random.PRNGKey(1000 + seed), T, E, K)
    x = jax.random.normal(jax.random.PRNGKey(2000 + seed), (T, H), jnp.float32).astype(jnp.bfloat16)
    return x, ids, w


# ------------------------------------------------------------------------------------------------- tokamax baseline
def tokamax_weights(jax, jnp, w, fp8):
    """tokamax layouts: gate+up fused along N. bf16: [E, K, N] (its default layout, materialised once here).
    fp8: qvalue kept in the checkpoint's [E, N, K] (its quant kernel transposes back: `mk,enk->mn`), per-channel
    scales [E, K/128, N] expanded from the 128x128 block scales (exactly equal values)."""
    if not fp8:
        gu = jnp.concatenate([w.gate, w.up], axis=1).swapaxes(1, 2)  # [E, H, 2I]
        dn = w.down.swapaxes(1, 2)  # [E, I, H]
        return dict(gu=gu, dn=dn)

    def chan(s, n):  # [E, n/128, k/128] -> [E, k/128, n]; f16: its sm90 quant kernel upcasts the weights to the
        # scale dtype, and this ptxas converts e4m3 only to f16 ("no support for converting f8E4M3FN to bf16")
        return jnp.repeat(s.swapaxes(1, 2), 128, axis=2)[:, :, :n].astype(jnp.float16)

    gu_q = jnp.concatenate([w.gate, w.up], axis=1)  # [E, 2I, H]
    gu_s = jnp.concatenate([chan(w.gate_scale, I), chan(w.up_scale, I)], axis=2)  # [E, H/128, 2I]
    return dict(gu_q=gu_q, gu_s=gu_s, dn_q=w.down, dn_s=chan(w.down_scale, H))


def make_tokamax_layer(jax, jnp, fp8, cfg_gu=None, cfg_dn=None):
    import qwix
    from tokamax._src.ops.ragged_dot import api as tapi

    on_gpu = jax.default_backend() == "gpu"
    impl = tapi.IMPLEMENTATIONS.get("mosaic_gpu")

    def op(cfg):
        if not on_gpu:
            return "xla"  # CPU smoke test of the plumbing only
        return impl if cfg is None else impl.replace(config=cfg)

    def layer(x, ids, tw, tw_w):
        T = x.shape[0]
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        inv = jnp.argsort(order)
        gs = jnp.bincount(flat, length=E).astype(jnp.int32)
        xs = x[order // K]
        if fp8:
            rhs_gu = qwix.QArray(qvalue=tw_w["gu_q"].mT, scale=tw_w["gu_s"], qtype=jnp.float8_e4m3fn)
            rhs_dn = qwix.QArray(qvalue=tw_w["dn_q"].mT, scale=tw_w["dn_s"], qtype=jnp.float8_e4m3fn)
        else:
            rhs_gu, rhs_dn = tw_w["gu"], tw_w["dn"]
        cdt = jnp.float16 if fp8 else jnp.bfloat16  # FP8 weights: f16 activations to match the f16-upcast weights
        h = tapi.ragged_dot(xs.astype(cdt), rhs_gu, gs, preferred_element_type=jnp.bfloat16,
                            implementation=[op(cfg_gu)])
        hf = h.astype(jnp.float32)
        act = (jax.nn.silu(hf[:, :I]) * hf[:, I:]).astype(cdt)
        y = tapi.ragged_dot(act, rhs_dn, gs, preferred_element_type=jnp.bfloat16, implementation=[op(cfg_dn)])
        y = y[inv].astype(jnp.float32).reshape(T, K, H)
        return jnp.sum(y * tw[..., None], axis=1).astype(x.dtype)

    return layer


def tk_config(bm, bn, bk, stages, fp8):
    from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu_common import Config as TC

    return TC(block_m=bm, block_n=bn, block_k=bk, num_stages=stages, split_k=1, persistent=fp8)


# ------------------------------------------------------------------------------------------------------------ timing
def build_timer(jax, jnp, layer, x, ids, tw, ws, *, calls):
    """Compile the timed program: `ws` distinct weight sets rotate (calls >= len(ws) uses all of them), R rounds."""
    ws = ws[: max(1, min(len(ws), calls))]
    R = max(1, calls // len(ws))

    def run(x, ids, tw, ws):
        def body(_, x):
            for w in ws:
                x = (layer(x, ids, tw, w).astype(jnp.float32) * 3.0).astype(jnp.bfloat16)
            return x

        return jax.lax.fori_loop(0, R, body, x)

    t0 = time.perf_counter()
    compiled = jax.jit(run).lower(x, ids, tw, ws).compile()
    return dict(fn=compiled, args=(x, ids, tw, ws), n=R * len(ws), compile_s=time.perf_counter() - t0)


def time_compiled(b, reps):
    """Median seconds per layer call, after one warm-up call."""
    fn, args = b["fn"], b["args"]
    fn(*args).block_until_ready()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        ts.append((time.perf_counter() - t0) / b["n"])
    return dict(ms=1e3 * statistics.median(ts), ms_min=1e3 * min(ts), ms_max=1e3 * max(ts), reps=reps,
                calls=b["n"], compile_s=b["compile_s"])


# ---------------------------------------------------------------------------------------------------------- phases
class Runner:
    def __init__(self, args):
        import jax
        import jax.numpy as jnp

        self.jax, self.jnp, self.args = jax, jnp, args
        self.t_start = time.time()
        self.res = dict(
            command=command_line(args.out),
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            device=str(jax.devices()[0].device_kind),
            jax=jax.__version__,
            shapes=dict(H=H, I=I, E=E, top_k=K),
            roofline=dict(hbm_bytes_per_s=HBM_BPS, bf16_flops=PEAK_FLOPS),
            timing="jitted fori_loop over R x L chained layer calls (L distinct weight sets), host clock around "
                   "block_until_ready, median of repeats after a warm-up/compile call",
            ceilings={}, correctness=[], sweep=[], bench=[], errors=[],
        )

    def left(self):
        return self.args.budget - (time.time() - self.t_start)

    def save(self):
        os.makedirs(self.args.out, exist_ok=True)
        with open(os.path.join(self.args.out, "moe_bench.json"), "w") as f:
            json.dump(self.res, f, indent=1)

    def err(self, what, e):
        msg = f"{what}: {type(e).__name__}: {str(e)[:600]}"
        print("ERROR", msg, flush=True)
        if self.args.verbose:
            traceback.print_exc()
        self.res["errors"].append(msg)

    def setup(self):
        jax, jnp = self.jax, self.jnp
        t0 = time.time()
        self.w_bf16, self.w_fp8 = build_weights(jax, jnp, self.args.layers)
        jax.block_until_ready((self.w_bf16, self.w_fp8))
        print(f"weights ready ({self.args.layers} layers) in {time.time() - t0:.1f}s", flush=True)
        self.tk = {}
        try:
            import tokamax  # noqa: F401

            self.tk = {False: [tokamax_weights(jax, jnp, w, False) for w in self.w_bf16],
                       True: [tokamax_weights(jax, jnp, w, True) for w in self.w_fp8]}
            jax.block_until_ready(self.tk)
            self.res["tokamax"] = tokamax.__version__
        except Exception as e:  # noqa: BLE001
            self.err("tokamax setup", e)

    def ceilings(self):
        """Device ceilings, timed like the layers (a jitted loop of chained ops, median of repeats)."""
        jax, jnp = self.jax, self.jnp

        def loop_time(f, x, n):
            g = jax.jit(lambda x: jax.lax.fori_loop(0, n, lambda i, x: f(x), x))
            g(x).block_until_ready()
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                g(x).block_until_ready()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts) / n

        a = jax.random.normal(jax.random.PRNGKey(0), (1 << 28,), jnp.float32)  # 1 GiB
        t = loop_time(lambda a: a * 1.0000001, a, 20)
        self.res["ceilings"]["copy_TBps_read_plus_write"] = 2 * a.nbytes / t / 1e12
        del a
        n = 8192
        b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.bfloat16) / math.sqrt(n)
        t = loop_time(lambda c: c @ b, b, 10)
        self.res["ceilings"]["bf16_gemm_8192_TFLOPs"] = 2 * n ** 3 / t / 1e12
        print("ceilings", self.res["ceilings"], flush=True)

    # backends -----------------------------------------------------------------------------------------------------
    def layer_fn(self, name, fp8, cfg=None):
        from kernels.moe.pallas_triton import moe_experts_pallas_triton
        from kernels.moe.reference import moe_experts_reference
        from kernels.moe.xla_ragged_dot import moe_experts_ragged_dot

        if name in OURS:
            act_fp8 = name == W8A8
            return lambda x, i, t, w: moe_experts_pallas_triton(x, i, t, w, config=cfg, act_fp8=act_fp8), None
        if name == "xla_ragged_dot":
            return moe_experts_ragged_dot, None
        if name == "reference":
            return moe_experts_reference, None
        if name == "tokamax":
            cg, cd = cfg if cfg is not None else (None, None)
            return make_tokamax_layer(self.jax, self.jnp, fp8, cg, cd), self.tk[fp8][: self.args.tokamax_layers]
        raise ValueError(name)

    def weights(self, fp8):
        return self.w_fp8 if fp8 else self.w_bf16

    def calls_reps(self, name, T):
        if name == "xla_ragged_dot" and T >= 2048:
            return 1, 3
        if name == "reference":
            return (4, 5) if T <= 64 else (2, 3)
        if T <= 256:
            return 32, 7
        return 8, 5

    def prepare(self, spec):
        """spec: dict(name, fp8, T, cfg=None, extra={}) -> compiled timer + metadata."""
        name, fp8, T, cfg = spec["name"], spec["fp8"], spec["T"], spec.get("cfg")
        x, ids, tw = routing(self.jax, self.jnp, T, 0)
        fn, ws = self.layer_fn(name, fp8, cfg)
        ws = ws if ws is not None else self.weights(fp8)
        calls, _ = self.calls_reps(name, T)
        b = build_timer(self.jax, self.jnp, fn, x, ids, tw, ws, calls=calls)
        b["touched"] = int(self.jnp.unique(ids).shape[0])
        return b

    def compile_all(self, specs):
        """Compile every spec's program, several at a time (XLA/Triton/Mosaic compiles run in C++ threads); a spec
        that fails in a thread is retried alone before it is reported."""
        from concurrent.futures import ThreadPoolExecutor

        t0 = time.time()
        with ThreadPoolExecutor(max(1, self.args.compile_workers)) as ex:
            futs = [ex.submit(self.prepare, sp) for sp in specs]
        built = []
        for sp, f in zip(specs, futs):
            try:
                built.append((sp, f.result()))
            except Exception:  # noqa: BLE001
                try:
                    built.append((sp, self.prepare(sp)))
                except Exception as ex2:  # noqa: BLE001
                    self.err(f"compile {sp['name']} fp8={sp['fp8']} T={sp['T']} {sp.get('extra', '')}", ex2)
        print(f"compiled {len(built)}/{len(specs)} programs in {time.time() - t0:.1f}s", flush=True)
        return built

    def measure_many(self, specs, record, tag):
        out = []
        for sp, b in self.compile_all(specs):
            if self.left() < 8:
                print("budget exhausted; stopping", flush=True)
                break
            name, fp8, T, cfg = sp["name"], sp["fp8"], sp["T"], sp.get("cfg")
            try:
                r = time_compiled(b, self.calls_reps(name, T)[1])
            except Exception as ex:  # noqa: BLE001
                self.err(f"{tag} {name} fp8={fp8} T={T} {sp.get('extra', '')}", ex)
                continue
            touched = b["touched"]
            b.clear()  # free the executable
            r.update(self.metrics(name, fp8, T, r["ms"], touched))
            if cfg is not None and name in OURS:
                r["config"] = repr(cfg)
            r.update(sp.get("extra", {}))
            record.append(r)
            out.append(r)
            self.save()
            print(f"{tag} {name:15s} {'fp8' if fp8 else 'bf16'} T={T:6d}: {r['ms']:.4f} ms "
                  f"({r['achieved_TBps']:.2f} TB/s, {r['TFLOPs']:.1f} TF/s, {r['pct_of_fp8_roofline']:.0f}% of "
                  f"roofline) compile {r['compile_s']:.1f}s {sp.get('extra', '')}", flush=True)
        return out

    def metrics(self, name, fp8, T, ms, touched):
        fp8_bytes = touched * expert_bytes(1, True) + 2 * T * H * 2
        own_bytes = touched * expert_bytes(1 if fp8 else 2, fp8) + 2 * T * H * 2
        s = ms * 1e-3
        roof = max(fp8_bytes / HBM_BPS, layer_flops(T) / PEAK_FLOPS)
        return dict(backend=name, weights="fp8" if fp8 else "bf16", T=T, touched_experts=touched,
                    weight_bytes=own_bytes, fp8_bytes=fp8_bytes, achieved_TBps=own_bytes / s / 1e12,
                    fp8_roofline_ms=1e3 * roof, pct_of_fp8_roofline=100 * roof / s,
                    TFLOPs=layer_flops(T) / s / 1e12, pct_of_bf16_peak=100 * layer_flops(T) / s / PEAK_FLOPS)

    def phase_correct(self):
        """Every backend vs the dense reference at decode T=8 (64 pairs: the one-program schedule) and T=128 (all
        tokens); ours also at prefill T=2048 (first 64 tokens: rows are independent). Each program runs twice on the
        same inputs: outputs must be identical."""
        from concurrent.futures import ThreadPoolExecutor

        jax, jnp = self.jax, self.jnp
        from kernels.moe.reference import moe_experts_reference
        from kernels.moe.testing import rel_err

        jobs = []
        for T in (8, 128, 2048):
            x, ids, tw = routing(jax, jnp, T, seed=7)
            for fp8 in (True, False):
                for name in self.backends(include_ref=False):
                    if (name not in OURS and T > 128) or (name == W8A8 and not fp8):
                        continue
                    fn, ws = self.layer_fn(name, fp8)
                    wb = ws[0] if ws is not None else self.weights(fp8)[0]
                    jobs.append((name, fp8, T, fn, (x, ids, tw, wb)))

        def comp(job):
            return jax.jit(job[3]).lower(*job[4]).compile()

        with ThreadPoolExecutor(max(1, self.args.compile_workers)) as ex:
            futs = [ex.submit(comp, j) for j in jobs]
        refs = {}
        for (name, fp8, T, fn, args), fut in zip(jobs, futs):
            try:
                try:
                    c = fut.result()
                except Exception:  # noqa: BLE001
                    c = comp((name, fp8, T, fn, args))
                x, ids, tw, _ = args
                n = T if T <= 128 else 64
                w = self.weights(fp8)[0]
                for a8 in {False, name == W8A8}:
                    if (T, fp8, a8) not in refs:
                        refs[(T, fp8, a8)] = jax.jit(functools.partial(moe_experts_reference, act_fp8=a8))(
                            x[:n], ids[:n], tw[:n], w)
                out, again = c(*args), c(*args)
                e = rel_err(out[:n], refs[(T, fp8, name == W8A8)])
                e_a16 = rel_err(out[:n], refs[(T, fp8, False)])  # W8A8: its distance from the checkpoint's math
                finite = bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
                det = bool(jnp.array_equal(out, again))
                self.res["correctness"].append(dict(backend=name, weights="fp8" if fp8 else "bf16", T=T,
                                                    rows_checked=n, rel_err=e, rel_err_vs_bf16_activations=e_a16,
                                                    all_finite=finite, deterministic=det))
                print(f"correct {name:15s} {'fp8' if fp8 else 'bf16'} T={T}: rel_err={e:.2e} (vs bf16 activations "
                      f"{e_a16:.2e}) finite={finite} deterministic={det}", flush=True)
            except Exception as ex:  # noqa: BLE001
                self.err(f"correct {name} fp8={fp8} T={T}", ex)
        self.save()

    def backends(self, include_ref=True):
        names = list(self.args.backends.split(","))
        if not include_ref and "reference" in names:
            names.remove("reference")
        if "tokamax" in names and not self.tk:
            names.remove("tokamax")
        return names

    # Variants of our kernel measured in this run; the bench then uses, per regime (decode T <= 256, prefill), the
    # fastest variant of this run's sweep (the tuning table in kernels/moe/tuning.py records the winners).
    def our_variants(self, fp8, decode, name="pallas_triton"):
        from kernels.moe.tuning import TritonMoeConfig as C

        if name == W8A8:  # K tiles fixed at 128 (the activation scale group)
            base = dict(block_m=16, gu_block_n=64, gu_block_k=128, dn_block_n=32, dn_block_k=128, dn_warps=2) \
                if decode else dict(block_m=64, gu_block_n=128, gu_block_k=128, dn_block_n=128, dn_block_k=128,
                                    gu_stages=3, dn_stages=3)
            if decode:
                return {"plain": C(**base), "swap_ab": C(**base, swap_ab=True),
                        **{v: C(**dict(base, **kw)) for v, kw in W8A8_DECODE_VARIANTS.items()}}
            return {"plain": C(**base), **{v: C(**dict(base, **kw)) for v, kw in W8A8_PREFILL_VARIANTS.items()}}
        if decode:
            base = dict(block_m=16, gu_block_n=64, gu_block_k=128, dn_block_n=128, dn_block_k=128)
        elif fp8:
            base = dict(block_m=64, gu_block_n=128, gu_block_k=64, dn_block_n=128, dn_block_k=64)
        else:
            base = dict(block_m=128, gu_block_n=128, gu_block_k=64, dn_block_n=128, dn_block_k=64, gu_warps=8,
                        gu_stages=3, dn_warps=8, dn_stages=3)
        out = {"plain": C(**base), "swap_ab": C(**base, swap_ab=True)}
        if fp8:
            out["f16"] = C(**base, gu_f16=True)
            out["swap_ab+f16"] = C(**base, swap_ab=True, gu_f16=True)
        if decode:
            out["swap_ab,bn128"] = C(**dict(base, gu_block_n=128), swap_ab=True, gu_f16=fp8)
            # tile/occupancy variants of the decode default (FP8: f16 gate/up), one knob at a time
            for vname, kw in DECODE_TILE_VARIANTS.items():
                out[vname] = C(**dict(base, **kw), gu_f16=fp8)
        return out

    def phase_sweep(self):
        sweep_T = [int(t) for t in self.args.sweep_T.split(",")]
        specs = []
        for T in sweep_T:
            for fp8 in [w == "fp8" for w in self.args.sweep_weights.split(",")]:
                for name in [n for n in OURS if n in self.backends() and (fp8 or n != W8A8)]:
                    for vname, cfg in self.our_variants(fp8, T <= 256, name).items():
                        if self.args.sweep_variants and vname not in self.args.sweep_variants.split(";"):
                            continue
                        specs.append(dict(name=name, fp8=fp8, T=T, cfg=cfg, extra=dict(variant=vname)))
        # tokamax: bf16 configs were swept in an earlier run on this machine (see tokamax_best_cfg); FP8 (f16
        # compute, see tokamax_weights) allows only block_n=64: its default vs one alternative per regime.
        if self.tk and "tokamax" in self.backends():
            tk_cands = {True: [(64, 64, 128, 2), (32, 64, 128, 4)], False: [(64, 64, 128, 2), (128, 64, 128, 3)]}
            for T in sweep_T:
                for c in tk_cands[T <= 256]:
                    cc = tk_config(*c, True)
                    specs.append(dict(name="tokamax", fp8=True, T=T, cfg=(cc, cc), extra=dict(tk_cfg=list(c))))
        self.measure_many(specs, self.res["sweep"], "sweep")
        self.check_variants([sp for sp in specs if sp["name"] in OURS])

    def check_variants(self, specs):
        """Each swept variant once more, against the dense reference on the same inputs (rel_err lands in the
        variant's sweep row; above REF_MAX_T tokens, on the first 64 tokens' outputs): a tile choice enters the
        tuning table only if it is also right on the GPU."""
        from concurrent.futures import ThreadPoolExecutor

        from kernels.moe.reference import moe_experts_reference
        from kernels.moe.testing import rel_err

        jax = self.jax

        def comp(sp):
            x, ids, tw = routing(jax, self.jnp, sp["T"], seed=7)
            fn, _ = self.layer_fn(sp["name"], sp["fp8"], sp["cfg"])
            args = (x, ids, tw, self.weights(sp["fp8"])[0])
            return jax.jit(fn).lower(*args).compile(), args

        with ThreadPoolExecutor(max(1, self.args.compile_workers)) as ex:
            futs = [ex.submit(comp, sp) for sp in specs]
        refs = {}
        for sp, fut in zip(specs, futs):
            try:
                c, args = fut.result()
                key = (sp["T"], sp["fp8"], sp["name"] == W8A8)
                n = sp["T"] if sp["T"] <= REF_MAX_T else 64
                if key not in refs:
                    refs[key] = jax.jit(functools.partial(moe_experts_reference, act_fp8=key[2]))(
                        *(a[:n] for a in args[:3]), args[3])
                e = rel_err(c(*args)[:n], refs[key])
            except Exception as ex:  # noqa: BLE001
                self.err(f"check sweep variant {sp['extra']} fp8={sp['fp8']} T={sp['T']}", ex)
                continue
            for r in self.res["sweep"]:
                if (r["backend"], r["T"], r.get("variant")) == (sp["name"], sp["T"], sp["extra"]["variant"]) \
                        and r["weights"] == ("fp8" if sp["fp8"] else "bf16"):
                    r["rel_err"] = e
            print(f"check {sp['extra']['variant']:16s} {'fp8' if sp['fp8'] else 'bf16'} T={sp['T']}: rel_err={e:.2e}",
                  flush=True)
        self.save()

    def our_best_cfg(self, fp8, T, name="pallas_triton"):
        rows = [r for r in self.res["sweep"] if r["backend"] == name
                and r["weights"] == ("fp8" if fp8 else "bf16") and (r["T"] <= 256) == (T <= 256)]
        if not rows:
            return None, "table default"
        # the swept T of this regime nearest to T (in log scale), then its fastest variant
        near = min({r["T"] for r in rows}, key=lambda t: abs(math.log(t / T)))
        best = min((r for r in rows if r["T"] == near), key=lambda r: r["ms"])
        return self.our_variants(fp8, T <= 256, name)[best["variant"]], f"{best['variant']} (swept at T={near})"

    def tokamax_best_cfg(self, fp8, T):
        """bf16: the best of the earlier sweep on this machine (block_m 64, block_n 128, block_k 64, 4 stages, both
        regimes). FP8: the best of this run's sweep for the regime of T."""
        if not fp8:
            c = tk_config(64, 128, 64, 4, False)
            return (c, c), "block_m,n,k,stages=[64, 128, 64, 4]"
        rows = [r for r in self.res["sweep"] if r["backend"] == "tokamax" and r["weights"] == "fp8"
                and (r["T"] <= 256) == (T <= 256)]
        if not rows:
            return None, "default"
        best = min(rows, key=lambda r: r["ms"])
        c = tk_config(*best["tk_cfg"], True)
        return (c, c), "block_m,n,k,stages=%s (best of this run's sweep)" % best["tk_cfg"]

    def phase_bench(self):
        """Backend by backend (compile that backend's programs in parallel, then time them), in --backends order, so
        that running out of budget drops the last backends rather than a bit of each."""
        Ts = [int(t) for t in self.args.T.split(",")] if self.args.T else DECODE_T + PREFILL_T
        for name in self.backends():
            specs = []
            for fp8 in (True, False):
                for T in Ts:
                    if (name == "reference" and T > REF_MAX_T) or (name == W8A8 and not fp8):
                        continue
                    if name == "xla_ragged_dot" and (T > 8192 or (fp8 and T > 256)):
                        # XLA lowers ragged_dot to a dense [M, E*K] GEMM: at T=16384 its autotuner asks for 128 GiB
                        # (RESOURCE_EXHAUSTED on the H200, 2026-11-30). FP8 = the same plus a dequantisation of all
                        # 256 experts: decode shapes only.
                        continue
                    cfg, note = None, None
                    if name == "tokamax":
                        cfg, note = self.tokamax_best_cfg(fp8, T)
                    elif name in OURS:
                        cfg, note = self.our_best_cfg(fp8, T, name)
                    specs.append(dict(name=name, fp8=fp8, T=T, cfg=cfg, extra=dict(variant=note) if note else {}))
            if self.left() < 20:
                print(f"budget exhausted before {name}", flush=True)
                return
            self.measure_many(specs, self.res["bench"], "bench")


# ---------------------------------------------------------------------------------------------------------- report
def report(res, outdir):
    rows = res["bench"]
    key = lambda r: (r["backend"], r["weights"])
    series = {}
    for r in rows:
        series.setdefault(key(r), {})[r["T"]] = r
    Ts = sorted({r["T"] for r in rows})
    lines = [f"# MoE layer benchmark ({res['device']}, jax {res['jax']}, {res['date']})", "",
             f"Command: `{res['command']}`", "",
             f"Shapes H {H}, I {I}, E {E}, top-{K}; whole routed-expert layer (grouping, gate+up, SwiGLU, down, "
             f"combine). Timing: {res['timing']}.", "",
             f"Ceilings measured in this run: {json.dumps({k: round(v, 2) for k, v in res['ceilings'].items()})}. "
             f"Roofline used: max(FP8 bytes of the touched experts / {HBM_BPS / 1e12} TB/s, "
             f"flops / {PEAK_FLOPS / 1e12:.0f} TFLOP/s).", "",
             "## Time per layer (ms)", "",
             "| backend | weights | " + " | ".join(f"T={t}" for t in Ts) + " |",
             "|---|---|" + "---|" * len(Ts)]
    roof = {t: r["fp8_roofline_ms"] for r in rows for t in [r["T"]]}
    lines.append("| roofline (FP8 bytes / flops) | - | " + " | ".join(f"{roof[t]:.4f}" for t in Ts) + " |")
    for (b, wd), d in sorted(series.items()):
        lines.append(f"| {b} | {wd} | " + " | ".join(f"{d[t]['ms']:.4f}" if t in d else "-" for t in Ts) + " |")
    lines += ["", "Variant/config per row (ours: the fastest variant of this run's sweep for the regime; tokamax: its "
                  "best config):", ""]
    for (b, wd), d in sorted(series.items()):
        vs = sorted({(r.get("variant") or "-") for r in d.values()})
        lines.append(f"- {b} ({wd}): " + "; ".join(
            f"{v} at T in {sorted(t for t, r in d.items() if (r.get('variant') or '-') == v)}" for v in vs))
    if res.get("sweep"):
        lines += ["", "## Sweep (same run)", "", "| backend | weights | T | variant / config | ms | % of FP8 roofline "
                  "| rel. error vs reference |", "|---|---|---|---|---|---|---|"]
        for r in res["sweep"]:
            err = f"{r['rel_err']:.2e}" if "rel_err" in r else "-"
            lines.append(f"| {r['backend']} | {r['weights']} | {r['T']} "
                         f"| {r.get('variant') or r.get('tk_cfg') or r.get('config')} "
                         f"| {r['ms']:.4f} | {r['pct_of_fp8_roofline']:.0f}% | {err} |")
    lines += ["", "## Decode: achieved HBM bandwidth (TB/s, bytes of the touched experts in the weights' own dtype) "
                  "and % of the FP8 roofline", "",
              "| backend | weights | " + " | ".join(f"T={t}" for t in Ts if t <= 256) + " |",
              "|---|---|" + "---|" * len([t for t in Ts if t <= 256])]
    for (b, wd), d in sorted(series.items()):
        lines.append(f"| {b} | {wd} | " + " | ".join(
            f"{d[t]['achieved_TBps']:.2f} ({d[t]['pct_of_fp8_roofline']:.0f}%)" if t in d else "-"
            for t in Ts if t <= 256) + " |")
    lines += ["", "## Prefill: TFLOP/s (% of the 780 TFLOP/s bf16 peak)", "",
              "| backend | weights | " + " | ".join(f"T={t}" for t in Ts if t > 256) + " |",
              "|---|---|" + "---|" * len([t for t in Ts if t > 256])]
    for (b, wd), d in sorted(series.items()):
        lines.append(f"| {b} | {wd} | " + " | ".join(
            f"{d[t]['TFLOPs']:.0f} ({d[t]['pct_of_bf16_peak']:.0f}%)" if t in d else "-"
            for t in Ts if t > 256) + " |")
    if res.get("correctness"):
        lines += ["", "## Correctness on the device (vs the dense reference; W8A8 rows: the reference with the same "
                  "activation quantisation)", "",
                  "| backend | weights | T | rows | rel. error | vs bf16 activations | finite | same output twice |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in res["correctness"]:
            a16 = c.get("rel_err_vs_bf16_activations")
            lines.append(f"| {c['backend']} | {c['weights']} | {c['T']} | {c['rows_checked']} | {c['rel_err']:.2e} "
                         f"| {'-' if a16 is None else f'{a16:.2e}'} | {c['all_finite']} | {c.get('deterministic', '-')} |")
    if res.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {e}" for e in res["errors"]]
    md = "\n".join(lines) + "\n"
    with open(os.path.join(outdir, "moe_bench.md"), "w") as f:
        f.write(md)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 6))
        for (b, wd), d in sorted(series.items()):
            ts = sorted(d)
            ax.plot(ts, [d[t]["ms"] for t in ts], marker="o", label=f"{b} ({wd})",
                    linestyle="-" if wd == "fp8" else "--")
        ax.plot(Ts, [roof[t] for t in Ts], color="k", linewidth=2.5, label="roofline (FP8 bytes / 4.2 TB/s, flops)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens T (x top-8 rows)")
        ax.set_ylabel("ms per MoE layer")
        ax.set_title(f"Routed-expert layer, H2048 I512 E256 top-8, {res['device']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(outdir, "moe_bench.png"), dpi=110)
    except Exception as e:  # noqa: BLE001
        print("plot failed:", e)
    return md


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "experiments/results"))
    p.add_argument("--phases", default="correct,bench")
    p.add_argument("--backends", default="pallas_triton,pallas_triton_w8a8,xla_ragged_dot,tokamax,reference")
    p.add_argument("--T", default="")
    p.add_argument("--sweep-T", default="128,8192")
    p.add_argument("--sweep-weights", default="fp8,bf16", help="weight dtypes of the sweep")
    p.add_argument("--sweep-variants", default="", help="';'-separated variant names of ours to sweep (default: all)")
    p.add_argument("--compile-workers", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokamax-layers", type=int, default=2, help="its kernels compile per call site: fewer layers")
    p.add_argument("--budget", type=float, default=280.0)
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--report-only", default="")
    p.add_argument("--small", action="store_true", help="CPU smoke test: tiny shapes, interpret mode")
    args = p.parse_args()
    if args.small:
        global H, I, E, DECODE_T, PREFILL_T, REF_MAX_T
        H, I, E, DECODE_T, PREFILL_T, REF_MAX_T = 256, 128, 16, [1, 8], [32], 32
    if args.report_only:
        with open(args.report_only) as f:
            print(report(json.load(f), os.path.dirname(args.report_only)))
        return
    r = Runner(args)
    print(f"device {r.res['device']} jax {r.res['jax']}", flush=True)
    r.setup()
    if not args.small:
        r.ceilings()
    for ph in args.phases.split(","):
        if r.left() < 20:
            break
        t0 = time.time()
        getattr(r, f"phase_{ph}")()
        print(f"phase {ph} done in {time.time() - t0:.1f}s, {r.left():.0f}s left", flush=True)
    r.save()
    print(report(r.res, args.out))


if __name__ == "__main__":
    main()
