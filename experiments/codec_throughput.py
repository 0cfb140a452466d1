"""Streaming codec decode throughput: B streams x T-frame chunks per `Codec.step`, bf16 weights and activations.

    python experiments/codec_throughput.py --out DIR [--preset full] [--budget-s 240] [--configs bfloat16:128:8 ...]
        [--profile-steps N]

For each (batch, chunk) it builds random full-size weights (the table's distributions, not zeros), warms up (compile
included) and times `repeats` runs of `steps` dependent steps, each run synchronised once at its end (async
dispatch hides host overhead the way a serving loop would); ms/step is the median run / steps. Reported beside it:
seconds of audio per second, the analytic decode FLOPs per audio second, the achieved TFLOP/s against the measured
~780 TFLOP/s bf16 dense rate of the H200 (KINDS.md), and the weight-read floor. The baseline in the same run is the
same step in fp32 weights/activations (XLA's default TF32 matmuls). Results go to DIR/codec_throughput.json and are
printed as a table; configs are run most important first and skipped once the time budget is spent. With
--profile-steps N, N more steps of the first config run under the profiler: GPU kernel time per step by codec stage
(the name scopes of `ModifiedDAC.decode_step`: embed, post_module, upsample, decoder) and by op. --variants runs every
config once per variant, in one process (jit caches cleared in between): "default" is the code as it is; the others
patch a module-level choice while the step is traced (VARIANTS below), for A/B figures from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.common import command_line, patched  # noqa: E402
from experiments.decode_profile import profile_calls  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from drama3_jax.codec.config import CodecConfig, codec_preset  # noqa: E402
from drama3_jax.codec.convert import random_codec  # noqa: E402
from drama3_jax.codec.model import DILATIONS  # noqa: E402
from drama3_jax.codec.streaming import Codec  # noqa: E402

PROFILE_CATEGORIES = ("codec_embed", "codec_post_module", "codec_upsample", "codec_decoder")
# name -> experiments.common.patched patches applied while the step is traced
VARIANTS = {
    "default": [],
    # the residual units' 1x1 convs as cuDNN convs, not matmuls (drama3_jax/codec/layers.py POINTWISE_AS_MATMUL)
    "pointwise_conv": [("drama3_jax.codec.layers", "POINTWISE_AS_MATMUL", None, False)],
    # the residual units' Snake + 1x1 + bias + residual add as one Pallas launch (kernels/snake_linear)
    "snake_linear_kernel": [("drama3_jax.codec.layers", "TAIL_BACKEND", None, "auto")],
    # the same at 4 warps and half the accumulator rows (96 channels: 64-row blocks at 164 registers, three programs
    # per SM, against one at 8 warps; 192: 32-row blocks, 255 registers, no spills; 384: 16 rows, 76 bytes spilled)
    "snake_linear_kernel_4warps": [("drama3_jax.codec.layers", "TAIL_BACKEND", None, "auto"),
                                   ("kernels.snake_linear.pallas_triton", "TUNING", None,
                                    {"num_warps": 4, "num_stages": 1}),
                                   ("kernels.snake_linear.pallas_triton", "ACC_ELEMENTS", None, 8192)],
}
DEFAULT_CONFIGS = ("bfloat16:128:32", "bfloat16:128:10", "bfloat16:32:32", "bfloat16:32:10", "bfloat16:1:10",
                   "bfloat16:1:32", "float32:128:32", "float32:1:10")
PEAK_BF16_FLOPS = 780e12  # measured 8192^3 bf16 matmul on this workplace's H200 (KINDS.md: 769-798 TFLOP/s)
HBM_BYTES_PER_S = 4.3e12  # measured device-to-device copy (KINDS.md)


def decode_flops_per_frame(cfg: CodecConfig) -> float:
    """Multiply-adds x 2 of one decoded frame in steady state (window full): codebook projections, post_module,
    upsample (transposed conv + ConvNeXt), decoder convs; elementwise work (Snake, norms) not counted."""
    t, d = cfg.quantizer_transformer, cfg.latent_dim
    hd = t.n_head * t.head_dim
    f = 2 * cfg.n_codebooks * cfg.codebook_dim * d
    f += t.n_layer * 2 * (d * 3 * hd + hd * d + 3 * d * t.intermediate_size + 2 * t.window * hd)
    rate = 1
    for factor in reversed(cfg.downsample_factors):
        f += 2 * d * d * factor * rate  # transposed conv k = stride: every input sample x every tap
        rate *= factor
        f += rate * 2 * (7 * d + 8 * d * d)  # ConvNeXt: depthwise k7 + pwconv1/2
    dims = cfg.decoder_dims
    f += rate * 2 * d * dims[0] * 7
    for i, s in enumerate(cfg.decoder_rates):
        f += 2 * dims[i] * dims[i + 1] * 2 * s * rate  # transposed conv k = 2s
        rate *= s
        f += rate * len(DILATIONS) * 2 * dims[i + 1] ** 2 * (7 + 1)  # residual units: k7 + k1
    return f + rate * 2 * dims[-1] * 7


def decode_weight_bytes(codec: Codec) -> int:
    """Bytes of the weights a decode step reads (codebooks, post_module, upsample, decoder)."""
    m = codec.model
    parts = [m.quantizer.semantic_quantizer, m.quantizer.quantizer, m.quantizer.post_module, m.quantizer.upsample,
             m.decoder]
    from flax import nnx

    return sum(x.nbytes for p in parts for x in jax.tree.leaves(nnx.state(p, nnx.Param)))


def time_steps(codec: Codec, batch: int, chunk: int, steps: int, repeats: int, seed: int) -> dict:
    cfg = codec.cfg
    r = np.random.default_rng(seed)
    chunks = [jnp.asarray(np.stack([r.integers(0, n, (batch, chunk)) for n in cfg.codebook_sizes], axis=1),
                          jnp.int32) for _ in range(steps)]
    state = codec.init_state(batch)
    t0 = time.perf_counter()
    for c in chunks[:2]:  # compile + warm-up
        audio, state = codec.step(state, c)
    audio.block_until_ready()
    compile_s = time.perf_counter() - t0
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for c in chunks:
            audio, state = codec.step(state, c)
        audio.block_until_ready()
        runs.append((time.perf_counter() - t0) / steps)
    assert bool(jnp.all(jnp.isfinite(audio))) and float(jnp.std(audio.astype(jnp.float32))) > 1e-3
    step_s = statistics.median(runs)
    audio_s = batch * chunk * cfg.frame_length / cfg.sample_rate
    return {"batch": batch, "chunk_frames": chunk, "ms_per_step": step_s * 1e3,
            "ms_per_step_min": min(runs) * 1e3, "ms_per_step_max": max(runs) * 1e3,
            "audio_s_per_step": audio_s, "audio_s_per_s": audio_s / step_s, "warmup_compile_s": compile_s,
            "steps_per_run": steps, "runs": repeats}


def profile_steps(codec: Codec, batch: int, chunk: int, n: int, trace_dir: str, hlo_out: str | None = None) -> dict:
    """GPU kernel time of `n` streaming steps (B streams x T new frames) by codec stage and op, per step; the step's
    compiled HLO gzipped to `hlo_out` if given (the fusions behind the kernel names)."""
    r = np.random.default_rng(0)
    codes = jnp.asarray(np.stack([r.integers(0, k, (batch, chunk)) for k in codec.cfg.codebook_sizes], axis=1),
                        jnp.int32)
    state = codec.init_state(batch)
    hlo = codec.step_hlo(state, codes)

    def run():
        nonlocal state
        audio, state = codec.step(state, codes)
        return audio

    return profile_calls(run, hlo, n, trace_dir, warmup=2, module="_step", categories=PROFILE_CATEGORIES,
                         hlo_out=hlo_out)


def parse_config(text: str) -> tuple[str, int, int]:
    """"dtype:streams:frames" -> (dtype, B, T)."""
    try:
        dtype, b, t = text.split(":")
        return jnp.dtype(dtype).name, int(b), int(t)
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"config {text!r}: expected dtype:streams:frames, e.g. bfloat16:128:8")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="full")
    ap.add_argument("--budget-s", type=float, default=240.0, help="start no new config after this many seconds")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--configs", type=parse_config, nargs="+", default=[parse_config(c) for c in DEFAULT_CONFIGS],
                    help="dtype:streams:frames per step, most important first")
    ap.add_argument("--profile-steps", type=int, default=0, help="profile this many steps of the first config")
    ap.add_argument("--variants", nargs="+", default=["default"], choices=sorted(VARIANTS),
                    help="code variants, each over every config (the profile runs the default code)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    cfg = codec_preset(args.preset)
    flops_frame = decode_flops_per_frame(cfg)
    flops_audio_s = flops_frame * cfg.sample_rate / cfg.frame_length
    plan = args.configs
    codecs, results = {}, []
    stack, active = patched([]), "default"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": command_line(args.out),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
            "jax": jax.__version__, "host": platform.node(), "preset": args.preset,
            "decode_flops_per_frame": flops_frame, "decode_flops_per_audio_s": flops_audio_s,
            "peak_bf16_flops": PEAK_BF16_FLOPS, "hbm_bytes_per_s": HBM_BYTES_PER_S,
            "xla_flags": os.environ.get("XLA_FLAGS", "")}
    for variant, (dtype, batch, chunk) in ((v, c) for v in args.variants for c in plan):
        if time.perf_counter() - t_start > args.budget_s:
            print(f"budget spent: skipping {variant} {dtype} B={batch} T={chunk}", flush=True)
            continue
        if variant != active:  # a patched module value only takes effect in a fresh trace
            stack.close()
            stack, active = patched(VARIANTS[variant]), variant
            jax.clear_caches()
        if dtype not in codecs:
            t0 = time.perf_counter()
            codecs[dtype] = Codec(random_codec(cfg, seed=0, dtype=jnp.dtype(dtype)))
            meta[f"build_s_{dtype}"] = time.perf_counter() - t0
            meta[f"weight_bytes_{dtype}"] = decode_weight_bytes(codecs[dtype])
        res = time_steps(codecs[dtype], batch, chunk, args.steps, args.repeats, seed=batch * 100 + chunk)
        res["dtype"], res["variant"] = dtype, variant
        step_s = res["ms_per_step"] / 1e3
        res["achieved_tflops"] = flops_audio_s * res["audio_s_per_s"] / 1e12
        res["roofline_ms_per_step"] = flops_audio_s * res["audio_s_per_step"] / PEAK_BF16_FLOPS * 1e3
        res["weight_read_floor_ms"] = meta[f"weight_bytes_{dtype}"] / HBM_BYTES_PER_S * 1e3
        res["fraction_of_peak"] = res["roofline_ms_per_step"] / 1e3 / step_s
        results.append(res)
        print(json.dumps(res), flush=True)
        (out / "codec_throughput.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    stack.close()
    report = {"meta": meta, "results": results}
    if args.profile_steps and results:
        jax.clear_caches()
        dtype, batch, chunk = plan[0]
        report["profile"] = {"dtype": dtype, "batch": batch, "chunk_frames": chunk,
                             **profile_steps(codecs[dtype], batch, chunk, args.profile_steps,
                                             str(out / f"trace_{dtype}_{batch}_{chunk}"),
                                             str(out / f"hlo_{dtype}_{batch}_{chunk}.txt.gz"))}
    meta["total_s"] = time.perf_counter() - t_start
    (out / "codec_throughput.json").write_text(json.dumps(report, indent=1))
    print(f"\n{meta['device']}  decode {flops_audio_s / 1e9:.1f} GFLOP per audio second "
          f"({flops_frame / 1e9:.2f} GFLOP/frame)")
    print(f"{'variant':16} {'dtype':9} {'B':>4} {'T':>3} {'ms/step':>9} {'audio s/s':>10} {'TFLOP/s':>8} {'%peak':>6} "
          f"{'roof ms':>8} {'compile s':>9}")
    for r in results:
        print(f"{r['variant']:16} {r['dtype']:9} {r['batch']:>4} {r['chunk_frames']:>3} {r['ms_per_step']:>9.2f} "
              f"{r['audio_s_per_s']:>10.1f} {r['achieved_tflops']:>8.1f} {100 * r['fraction_of_peak']:>5.1f}% "
              f"{r['roofline_ms_per_step']:>8.2f} {r['warmup_compile_s']:>9.1f}")
    if "profile" in report:
        p = report["profile"]
        print(f"\nprofile, {p['dtype']} B={p['batch']} T={p['chunk_frames']}: GPU kernel ms per step by stage")
        for name, ms in sorted(p["kernel_ms_per_call"].items(), key=lambda kv: -kv[1]):
            print(f"  {name:20} {ms:8.3f}")
        print(f"  {'(unattributed)':20} {p['unattributed_ms_per_call']:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
