"""Prefill call time of the talker: what the serving engine pays per batch of admitted prompts.

    python experiments/prefill_timing.py --out DIR [--batch 1 4 8] [--chunk 512] [--variants default no_skip packed]
        [--preset full|tiny] [--calls 5] [--profile-calls 2]

Each variant runs the engine's `Prefiller` (fresh caches, `--chunk`-row chunks, bf16 GDN state, the engine's kernel
backends and fused projections) on batches of B prompts whose lengths are those of the benchmark's synthetic English
set (`serving.bench.dataset.synthetic`, seed 0, built into prompt rows by the server's own prompt builder); the rows'
contents are random. Timed: the whole call (chunk calls + the start state), synchronised, median of `--calls` after
one warm-up call, a new batch of prompts each call. Variants:
  default   the engine's backends (W8A8 experts, Pallas kernels, padding rows skipped by the MoE)
  no_skip   the same with Backends.moe_skip_padding off: padding rows go through the routed experts too
  packed    the engine's packed prefill (Prefiller.packed): up to B prompts of at most --chunk rows end to end in one
            call of the smallest of the engine's packed row counts that holds the first call's prompts (fewer
            prompts in a later call when they would not fit it)
  packed_xla_attention  packed, with XLA's attention for the prompt rows instead of the flash prefill kernel
            (attention backend "pallas_triton_decode")
  packed_by_layer  packed, run as one call per backbone layer (Prefiller by_layer: one compiled layer per type;
            its compile_s against packed's is the start-up saving per row count)
  packed_ref_router  packed, with lax.top_k + softmax for the router instead of the Pallas kernel (kernels/router)
  packed_argsort_order  packed, with the MoE's expert order from a stable argsort, not the cumsum counting sort
            (kernels/moe/routing.py LARGE_ORDER)
  packed_fp32_qkv  packed, with the GDN conv's q / k / v in fp32 (drama3_jax/backbone.py GDN_CONV_OUT_IN_MODEL_DTYPE)
The roofline of a call is the larger of (every weight read once) / 4.2 TB/s and (2 x active parameters x valid
rows) / 780 TFLOP/s; attention and the GDN recurrence are not counted. With --profile-calls N > 0, N more calls
run under the profiler: GPU kernel time per call by category (the decode profile's name scopes:
experiments/decode_profile.py), with the chunk module's kernels attributed and the rest (cache set-up, start
state) summed apart. For a per-kernel split on the H200, run with XLA_FLAGS=--xla_gpu_enable_command_buffer=.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from drama3_jax.backbone import Backends, default_moe_activations
from drama3_jax.config import preset
from drama3_jax.generate import Prefiller, RequestSampling
from drama3_jax.prompt import build_prompt
from drama3_jax.random_init import random_talker
from drama3_jax.sampling import SamplingParams
from drama3_jax.tokenizer import load_tokenizer, write_synthetic_tokenizer
from experiments.common import command_line, guard, log, patched, save_json
from experiments.decode_profile import profile_calls
from serving.bench.dataset import synthetic
from serving.engine import EngineConfig

HBM_BYTES_PER_S, FLOPS_PER_S = 4.2e12, 780e12


def variants(cfg) -> dict[str, Backends]:
    base = dataclasses.replace(Backends.auto(), moe_activations=default_moe_activations(cfg))
    return {"default": base, "no_skip": dataclasses.replace(base, moe_skip_padding=False), "packed": base,
            "packed_by_layer": base,
            "packed_xla_attention": dataclasses.replace(base, attention="pallas_triton_decode"),
            "packed_ref_router": dataclasses.replace(base, router="reference")}


# variants that are another variant with module tables patched while traced: name -> (base, experiments.common.patched
# patches)
PATCHES = {
    # the experts' pair order by a stable argsort instead of the cumsum counting sort (kernels/moe/routing.py)
    "packed_argsort_order": ("packed", [("kernels.moe.routing", "LARGE_ORDER", None, "argsort")]),
    # the GDN conv output (q, k, v) kept in fp32 (before drama3_jax/backbone.py GDN_CONV_OUT_IN_MODEL_DTYPE)
    "packed_fp32_qkv": ("packed", [("drama3_jax.backbone", "GDN_CONV_OUT_IN_MODEL_DTYPE", None, False)]),
}


def packed_call(lengths: np.ndarray, start: int, batch: int, max_rows: int, max_lanes: int) -> np.ndarray:
    """Up to `batch` prompts from lengths[start:] (cyclic), in order while they fit max_rows rows and max_lanes
    lanes, as the engine's admission picks them for its largest packed call."""
    lens = []
    for i in range(min(batch, max_lanes)):
        n = int(lengths[(start + i) % len(lengths)])
        if sum(lens) + n > max_rows:
            break
        lens.append(n)
    return np.array(lens, np.int64)


def prompt_lengths(cfg, n: int) -> np.ndarray:
    """Row counts of the first n prompts of the synthetic benchmark set, as the server builds them."""
    tmp = tempfile.mkdtemp(prefix="prefill-timing-")
    write_synthetic_tokenizer(tmp, cfg)
    tok = load_tokenizer(tmp, cfg)
    sizes = (cfg.band_size, cfg.tower.vocab_size)
    return np.array([len(build_prompt(tok, cfg, r.text, [(np.asarray(r.ref_audio_codes), r.ref_text)]))
                     for r in synthetic(n, 0, sizes)])


def active_params(model) -> tuple[float, float]:
    """(bytes of all weights, parameters used per token: the dense ones + top-k / E of the routed experts')."""
    cfg = model.cfg.text
    total_bytes, dense, experts = 0, 0, 0
    for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(model)):
        total_bytes += x.size * x.dtype.itemsize
        if "scale" in jax.tree_util.keystr(path):
            continue
        if "experts" in jax.tree_util.keystr(path) and "shared" not in jax.tree_util.keystr(path):
            experts += x.size
        else:
            dense += x.size
    return float(total_bytes), dense + experts * cfg.num_experts_per_tok / cfg.num_experts


def batch_rows(cfg, lengths: np.ndarray, chunk: int, rng) -> np.ndarray:
    """Random prompt rows [B, T, 1+K] (T: the longest length rounded up to the chunk), valid up to each length."""
    T = -(-int(lengths.max()) // chunk) * chunk
    rows = np.zeros((len(lengths), T, cfg.row_width), np.int32)
    rows[..., 0] = rng.integers(0, cfg.text.vocab_size, rows.shape[:2])
    rows[..., 1:] = rng.integers(0, cfg.tower.vocab_size, rows.shape[:2] + (cfg.row_width - 1,))
    return rows


def time_variant(model, cfg, backends, batch: int, chunk: int, lengths: np.ndarray, calls: int, max_len: int,
                 profile_n: int = 0, trace_dir: str = "", packed: bool = False,
                 lane_rows: int = EngineConfig.prefill_lane_rows, hlo_out: str | None = None, by_layer: bool = False):
    """batch prompts per call ([batch, chunk] calls), or with `packed` up to batch prompts per packed call of the
    engine's default buckets (EngineConfig.packed_buckets), a fixed bucket per run (the first call's)."""
    prefiller = Prefiller(model, max_len, chunk, backends, state_dtype=jnp.bfloat16, by_layer=by_layer)
    rng = np.random.default_rng(batch)
    buckets = EngineConfig(prefill_chunk=chunk, prefill_lane_rows=lane_rows).packed_buckets
    if packed:
        lengths = lengths[lengths <= chunk]  # longer prompts take the [batch, chunk] path in the engine
    N, lanes = 0, batch
    if packed:  # the bucket of the first call's prompts; later calls take what fits in it
        lens0 = packed_call(lengths, 0, batch, *buckets[-1])
        N, lanes = next((n, l) for n, l in buckets if n >= lens0.sum() and l >= len(lens0))
    sampling = RequestSampling.make([SamplingParams()] * lanes, list(range(lanes)))

    def make_call(i):
        if not packed:
            lens = lengths[(i * batch + np.arange(batch)) % len(lengths)]
            rows = batch_rows(cfg, lens, chunk, rng)
            return lens, lambda: prefiller(rows, lens, sampling)
        lens = packed_call(lengths, i * batch, batch, N, lanes)
        prompts = [row[:n_i] for row, n_i in zip(batch_rows(cfg, lens, chunk, rng), lens)]
        return lens, lambda: prefiller.packed(prompts, sampling, N, lanes)

    times, valid, prompts_per_call = [], [], []
    t = time.time()
    for i in range(calls + 1):
        lens, call = make_call(i)
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        if i == 0:
            compile_s = time.time() - t
            continue
        times.append(time.perf_counter() - t0)
        valid.append(int(lens.sum()))
        prompts_per_call.append(len(lens))
    padded = N if packed else batch * chunk * -(-int(lengths.max()) // chunk)
    out = {"ms": 1e3 * float(np.median(times)), "ms_min": 1e3 * min(times), "ms_max": 1e3 * max(times),
           "valid_rows": float(np.mean(valid)), "prompts": float(np.mean(prompts_per_call)), "padded_rows": padded,
           "packed_rows": N, "lanes": lanes, "compile_s": round(compile_s, 1)}
    if profile_n and not by_layer:  # the profile maps kernels to the one-call module's HLO
        _, call = make_call(0)
        hlo = prefiller.packed_hlo(N, lanes) if packed else prefiller.chunk_hlo(batch)
        out["profile"] = profile_calls(call, hlo, profile_n, trace_dir,
                                       module="prefill_packed_step" if packed else "prefill_step", hlo_out=hlo_out)
    return out


def write_markdown(R: dict, path: str):
    lines = [f"# Prefill call time ({R['preset']} talker, {R['device']}, jax {R['jax']}, {R['date']})", "",
             f"Command: `{R['command']}`  ",
             f"Prompt lengths: the synthetic set's first {R['prompts']} prompts, {R['length_min']}-{R['length_max']} "
             f"rows (mean {R['length_mean']:.0f}); {R['chunk']}-row chunks. Roofline: max(weights {R['weight_gb']:.1f} "
             f"GB / 4.2 TB/s, 2 x {R['active_params_b']:.2f} B active params x valid rows / 780 TFLOP/s).", "",
             "Packed: up to B prompts end to end in one call of the engine's packed row counts (rows computed = that "
             "count); else [B, chunk] calls.", "",
             "| variant | B | prompts per call | rows computed | ms per call (median) | min / max | ms per prompt | "
             "valid rows per call | valid rows/s | roofline ms | % of roofline | compile s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in R["rows"]:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['batch']} | {r['error']} | | | | | | | | | |")
            continue
        lines.append(f"| {r['variant']} | {r['batch']} | {r['prompts']:.1f} | {r['padded_rows']} | {r['ms']:.2f} | "
                     f"{r['ms_min']:.2f} / {r['ms_max']:.2f} | {r['ms'] / r['prompts']:.2f} | {r['valid_rows']:.0f} | "
                     f"{1e3 * r['valid_rows'] / r['ms']:,.0f} | {r['roofline_ms']:.2f} | "
                     f"{100 * r['roofline_ms'] / r['ms']:.0f}% | {r['compile_s']} |")
    profiled = [r for r in R["rows"] if "profile" in r]
    if profiled:
        cats = sorted({c for r in profiled for c in r["profile"]["kernel_ms_per_call"]})
        lines += ["", "GPU kernel ms per call by category (profiled calls; 'other modules': cache set-up and start "
                  "state):", "", "| variant | prompts | " + " | ".join(cats) + " | unattributed | other modules |",
                  "|---|---|" + "---|" * (len(cats) + 2)]
        for r in profiled:
            p = r["profile"]
            lines.append(f"| {r['variant']} | {r['batch']} | "
                         + " | ".join(f"{p['kernel_ms_per_call'].get(c, 0.0):.2f}" for c in cats)
                         + f" | {p['unattributed_ms_per_call']:.2f} | {p.get('other_modules_ms_per_call', 0.0):.2f} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="full")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--variants", nargs="+", default=["default", "no_skip", "packed"],
                    choices=["default", "no_skip", "packed", "packed_by_layer", "packed_xla_attention", "packed_ref_router"]
                    + sorted(PATCHES))
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--lane-rows", type=int, nargs="+", default=[EngineConfig.prefill_lane_rows],
                    help="packed variant: one row per value of the engine's prefill_lane_rows (lanes = rows // it)")
    ap.add_argument("--prompts", type=int, default=64, help="prompts of the synthetic set whose lengths are used")
    ap.add_argument("--max-len", type=int, default=1026, help="cache rows per prompt (the server's default)")
    ap.add_argument("--profile-calls", type=int, default=0, help="calls profiled after the timing (0: none)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    cfg = preset(args.preset)
    lengths = prompt_lengths(cfg, args.prompts)
    t = time.time()
    model = random_talker(cfg, 0).fuse_projections()
    weight_bytes, active = active_params(model)
    log(f"talker built in {time.time() - t:.1f} s: {weight_bytes / 2**30:.1f} GiB, {active / 1e9:.2f} B active params")
    R = {"command": command_line(args.out), "device": str(jax.devices()[0]), "jax": jax.__version__,
         "xla_flags": os.environ.get("XLA_FLAGS", ""),
         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "preset": args.preset, "chunk": args.chunk,
         "prompts": args.prompts, "length_min": int(lengths.min()), "length_max": int(lengths.max()),
         "length_mean": float(lengths.mean()), "weight_gb": weight_bytes / 1e9, "active_params_b": active / 1e9,
         "rows": []}
    errors: list = []
    packed = lambda name: name.startswith("packed")
    runs = [(name, lr) for name in args.variants for lr in (args.lane_rows if packed(name) else [0])]
    for name, lane_rows in runs:
        base, patches = PATCHES.get(name, (name, []))
        backends = variants(cfg)[base]
        for b in args.batch:
            row = {"variant": name + (f"_lanes{lane_rows}" if packed(name) and len(args.lane_rows) > 1 else ""),
                   "batch": b, "backends": dataclasses.asdict(backends), "patches": repr(patches)}
            jax.clear_caches()  # every variant traces afresh (a patched table is read while tracing)
            with patched(patches):
                res = guard(errors, f"{name} batch {b}", time_variant, model, cfg, backends, b, args.chunk, lengths,
                            args.calls, args.max_len, args.profile_calls, os.path.join(args.out, f"trace_{name}_{b}"),
                            packed(name), lane_rows or EngineConfig.prefill_lane_rows,
                            os.path.join(args.out, f"hlo_{name}_{b}.txt.gz"), name == "packed_by_layer")
            if res is None:
                row["error"] = errors[-1][:200]
            else:
                row.update(res)
                row["roofline_ms"] = 1e3 * max(weight_bytes / HBM_BYTES_PER_S,
                                               2 * active * res["valid_rows"] / FLOPS_PER_S)
            R["rows"].append(row)
            log({k: v for k, v in row.items() if k != "backends"})
            save_json(R, os.path.join(args.out, "prefill_timing.json"))
    write_markdown(R, os.path.join(args.out, "prefill_timing.md"))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
