"""Start the Drama 3 speech server.

    python -m serving.launch                                   # embedded tiny random model (smoke test, CPU ok)
    python -m serving.launch --checkpoint /path/to/drama-3-orbax --max-streams 128

With no checkpoint the server builds a tiny random-weight model deterministically at start-up (no download): the
whole pipeline works, the audio is noise. The log and /v1/models say so.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger("serving")


# Decode sizes for a full-size model: on the H200 at 128 streams, 172.3 / 172.1 audio s/s against 164.4 / 164.9 with
# whole-pool steps in two pairs of runs (experiments/results/serve_bench_17/, serve_bench_18/). 1: a lone stream (moved
# down to slot 0) steps alone: 4.55 ms against 5.93 for one stream in a 16-row step, in one process on an H100
# (experiments/results/decode_2026-12-07_h100/), for one more compiled step
FULL_SIZE_DECODE_SIZES = (1, 16, 32, 64)


def resolve_decode_sizes(requested, max_streams: int, full_size: bool) -> tuple[int, ...]:
    """--decode-sizes as given; when not given, FULL_SIZE_DECODE_SIZES below the pool for a full-size model and none
    for the tiny one (whose extra compilations would only slow its start)."""
    if requested is not None:
        return tuple(requested)
    return tuple(n for n in FULL_SIZE_DECODE_SIZES if n < max_streams) if full_size else ()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="converted checkpoint directory (scripts/convert_checkpoint.py)")
    ap.add_argument("--random-weights", choices=["tiny", "full"], default="tiny",
                    help="model to build when no checkpoint is given: the tiny smoke-test model, or the full-size "
                         "model (FP8 experts, ~36B parameters) initialised on the device for speed tests")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default="drama-3")
    ap.add_argument("--max-streams", type=int, default=128, help="decode slots (concurrent streams)")
    ap.add_argument("--max-queue", type=int, default=1024, help="queued requests before 429")
    ap.add_argument("--max-new-tokens", type=int, default=2048, help="frame cap per request (per text chunk)")
    ap.add_argument("--max-prompt-rows", type=int, default=2048)
    ap.add_argument("--max-input-chars", type=int, default=20_000)
    ap.add_argument("--frames-per-step", type=int, default=1, help="decode frames per host round trip")
    ap.add_argument("--prefill-batch-sizes", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--prefill-chunk", type=int, default=512, help="prompt rows per prefill call")
    ap.add_argument("--prefill-packed-rows", type=int, nargs="*", default=[512, 1024, 2048, 2560, 3072, 4096],
                    help="row counts of the packed prefill calls (prompts of up to --prefill-chunk rows end to end); "
                         "no values: no packing, every prompt padded to whole chunks in --prefill-batch-sizes calls")
    ap.add_argument("--prefill-lane-rows", type=int, default=384,
                    help="a packed call of N rows holds at most N // this many prompts")
    ap.add_argument("--prefill-by-layer", action=argparse.BooleanOptionalAction, default=True,
                    help="run each packed prefill as one call per backbone layer (one compiled layer per type and "
                         "row count: a shorter start-up; --no-prefill-by-layer: one call)")
    ap.add_argument("--prefill-busy-streams", type=int, default=32)
    ap.add_argument("--prefill-min-batch", type=int, default=6)
    ap.add_argument("--prefill-max-wait-ms", type=float, default=30.0)
    ap.add_argument("--admit-guard-s", type=float, default=0.25,
                    help="admit new requests only while every playing stream has this much audio buffered")
    ap.add_argument("--admit-guard-new-s", type=float, default=None,
                    help="the same for streams that have played only their first chunk and bridges (default: "
                         "--admit-guard-s)")
    ap.add_argument("--codec-first-chunk", type=int, default=4,
                    help="frames in a stream's first audio chunk")
    ap.add_argument("--admission-frames", type=int, default=0,
                    help="frames decoded for newly admitted streams on their prefill's lanes before they join the "
                         "decode pool, so that their first audio chunk does not wait for that many pool steps (one "
                         "more compiled decode per prefill lane count; 0: off)")
    ap.add_argument("--codec-chunk", type=int, default=8, help="most frames of one stream per codec call")
    ap.add_argument("--codec-period", type=int, default=8,
                    help="decode steps between the codec calls that serve every playing stream")
    ap.add_argument("--codec-bridges", type=int, default=0,
                    help="between periodic calls, give a stream that has played at most this many chunks one more "
                         "when its audio would run dry before the next periodic call (0: never)")
    ap.add_argument("--codec-low-load-chunk", type=int, default=32,
                    help="with no more streams than the smallest codec batch, skip the periodic codec call while "
                         "every stream it would serve has --codec-defer-s of audio buffered, and let such calls take "
                         "up to this many frames per stream (one more compiled codec shape; 0: off)")
    ap.add_argument("--codec-defer-s", type=float, default=1.0,
                    help="buffered audio (seconds) above which --codec-low-load-chunk defers a stream's frames")
    ap.add_argument("--decode-sizes", type=int, nargs="*", default=None,
                    help="decode steps run over the first n slots, n the smallest of these (or --max-streams) above "
                         "every occupied slot; each size compiles one more decode step (default: "
                         f"{' '.join(map(str, FULL_SIZE_DECODE_SIZES))} below the pool for a full-size model, none "
                         "for the tiny one; no values: always the whole pool)")
    ap.add_argument("--compact-slots", type=int, default=8,
                    help="with --decode-sizes: streams moved per step from slots above the smallest size that fits "
                         "them all into free slots below it (0: never)")
    ap.add_argument("--codec-batch-sizes", type=int, nargs="+", default=[8, 32, 64],
                    help="streams per codec call are padded to one of these (or to --max-streams)")
    ap.add_argument("--encode-warmup", default="start", choices=["start", "background", "lazy"],
                    help="compile the reference-encode shapes before ready, after it in the background (slows "
                         "decoding while it runs), or on first use")
    ap.add_argument("--compile-threads", type=int, default=4,
                    help="start-up compilations run at once")
    ap.add_argument("--pipeline-depth", type=int, default=1, choices=[0, 1],
                    help="decode steps in flight while the host processes the previous one")
    ap.add_argument("--stall-warn-s", type=float, default=0.25,
                    help="log engine iterations, garbage collections and XLA compilations after start-up that take "
                         "longer than this (0: never)")
    ap.add_argument("--voices-dir", default=None, help="where uploaded voices are stored (default: a temp dir)")
    ap.add_argument("--allowed-local-media-path", default=None, help="directory file:// references may read")
    ap.add_argument("--benchmark-mode", action="store_true", help="accept ignore_eos / forced_frames")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--ssm-state-dtype", default=None, choices=["float32", "bfloat16"],
                    help="GDN recurrent-state dtype (default: the checkpoint's mamba_ssm_dtype)")
    ap.add_argument("--kernels", default="auto", choices=["auto", "reference"],
                    help="auto: Pallas kernels (MoE, GDN, sampling) on GPU, plain-jnp references elsewhere")
    ap.add_argument("--moe-compute-padding", action="store_true",
                    help="route a prefill's padding rows through the experts too (by default they are skipped)")
    ap.add_argument("--moe-activations", default="auto", choices=["auto", "bf16", "fp8"],
                    help="routed experts with FP8 weights: FP8 activations quantised per token and 128 columns (fp8: "
                         "W8A8 on FP8 tensor cores), or bf16 activations (W8A16); auto: fp8 when the checkpoint's "
                         "quantization_config has activation_scheme 'dynamic', else bf16")
    ap.add_argument("--compilation-cache", default=os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(
                    Path.home() / ".cache" / "drama3-jax" / "xla"),
                    help="persistent XLA compilation cache directory ('' disables; default $JAX_COMPILATION_CACHE_DIR, "
                         "else ~/.cache/drama3-jax/xla)")
    ap.add_argument("--gpu-memory-fraction", type=float, default=None,
                    help="share of the GPU's memory JAX reserves (weights, stream state, compiled calls' buffers); "
                         "default $XLA_PYTHON_CLIENT_MEM_FRACTION, else 0.92")
    ap.add_argument("--shutdown-timeout", type=float, default=10.0, help="seconds to drain streams on SIGTERM")
    ap.add_argument("--log-level", default="info")
    return ap


def tiny_random_parts(dtype):
    """The embedded smoke-test model: tiny random talker (written in the real layout, converted, loaded), tokenizer,
    and a tiny random codec built in memory. Deterministic."""
    from drama3_jax.checkpoint import convert, load_model, write_random_checkpoint
    from drama3_jax.codec import Codec, random_codec, tiny_codec_config
    from drama3_jax.config import tiny_config
    from drama3_jax.tokenizer import load_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="drama3-tiny-"))
    write_random_checkpoint(tiny_config(), tmp / "hf", seed=0)
    convert(tmp / "hf", tmp / "orbax", progress=False)
    talker = load_model(tmp / "orbax", dtype=dtype)
    return talker, load_tokenizer(tmp / "orbax", talker.cfg), Codec(random_codec(tiny_codec_config(), seed=0))


def random_parts_in_memory(cfg, codec_cfg, dtype, seed: int = 0):
    """Random talker built on the device, a synthetic tokenizer with the config's id layout, a random codec: the
    full-size model for speed tests with no checkpoint file. Deterministic for a seed."""
    from drama3_jax.codec import Codec, random_codec
    from drama3_jax.random_init import random_talker
    from drama3_jax.tokenizer import load_tokenizer, write_synthetic_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="drama3-random-"))
    write_synthetic_tokenizer(tmp, cfg)
    talker = random_talker(cfg, seed, dtype=dtype)
    return talker, load_tokenizer(tmp, cfg), Codec(random_codec(codec_cfg, seed=seed, dtype=dtype))


def main(argv=None):
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from drama3_jax.xla_flags import MEM_FRACTION_ENV, apply_default_xla_flags, apply_gpu_memory_fraction

    try:  # both before JAX starts its backends; a bad fraction is a usage error before anything is changed
        log.info("%s=%s", MEM_FRACTION_ENV, apply_gpu_memory_fraction(args.gpu_memory_fraction))
    except ValueError as e:
        build_parser().error(str(e))
    log.info("XLA_FLAGS=%s", apply_default_xla_flags())
    import jax
    import jax.numpy as jnp
    from flax import nnx

    if args.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
        if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    import uvicorn

    from drama3_jax.backbone import Backends, default_moe_activations
    from serving.api import ServerState, create_app
    from serving.engine import Engine, EngineConfig
    from serving.metrics import Metrics, freeze_heap_and_watch_gc
    from serving.references import ReferenceResolver
    from serving.voices import VoiceStore

    metrics = Metrics()
    serving_started = threading.Event()

    def on_compile(event, seconds, **_kw):
        if event != "/jax/core/compile/backend_compile_duration":
            return
        metrics.compilations.inc()
        if serving_started.is_set() and args.stall_warn_s and seconds >= args.stall_warn_s:
            log.warning("XLA compilation while serving took %.1f s (a shape compiled on first use)", seconds)

    jax.monitoring.register_event_duration_secs_listener(on_compile)
    dtype = jnp.dtype(args.dtype)
    t0 = time.perf_counter()
    if args.checkpoint:
        import drama3_jax

        parts = drama3_jax.load(args.checkpoint, dtype=dtype, codec_dtype=dtype)
        if parts.codec is None or parts.tokenizer is None:
            raise SystemExit(f"{args.checkpoint} lacks the codec or tokenizer.json; convert with the codec "
                             "(--codec PATH) and keep tokenizer.json beside config.json")
        talker, tok, codec = parts.talker, parts.tokenizer, parts.codec
        description = f"Fish Audio Drama 3 ({args.checkpoint})"
    elif args.random_weights == "full":
        from drama3_jax.codec import full_codec_config
        from drama3_jax.config import full_config

        talker, tok, codec = random_parts_in_memory(full_config(), full_codec_config(), dtype)
        n_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(talker)))
        description = "FULL-SIZE RANDOM-WEIGHT MODEL (no checkpoint given; for speed tests): the audio is noise"
        log.warning("no --checkpoint: full-size random-weight talker, %.1f GiB of weights", n_bytes / 2**30)
    else:
        talker, tok, codec = tiny_random_parts(dtype)
        description = "TINY RANDOM-WEIGHT SMOKE-TEST MODEL (no checkpoint given): the audio is noise"
        log.warning("no --checkpoint: serving an embedded tiny random-weight model; its audio is noise")
    log.info("model ready in %.1f s", time.perf_counter() - t0)
    moe_activations = (default_moe_activations(talker.cfg) if args.moe_activations == "auto"
                       else args.moe_activations)
    log.info("routed experts: %s activations", moe_activations)
    full_size = bool(args.checkpoint) or args.random_weights == "full"
    cfg = EngineConfig(max_streams=args.max_streams, max_queue=args.max_queue, max_prompt_rows=args.max_prompt_rows,
                       max_new_tokens=args.max_new_tokens, frames_per_step=args.frames_per_step,
                       prefill_batch_sizes=tuple(sorted(args.prefill_batch_sizes)), prefill_chunk=args.prefill_chunk,
                       prefill_packed_rows=tuple(args.prefill_packed_rows), prefill_lane_rows=args.prefill_lane_rows,
                       prefill_by_layer=args.prefill_by_layer,
                       prefill_busy_streams=args.prefill_busy_streams, prefill_min_batch=args.prefill_min_batch,
                       prefill_max_wait_ms=args.prefill_max_wait_ms, admit_guard_s=args.admit_guard_s,
                       admit_guard_new_s=args.admit_guard_new_s,
                       codec_first_chunk=args.codec_first_chunk, admission_frames=args.admission_frames,
                       codec_chunk=args.codec_chunk, codec_batch_sizes=tuple(args.codec_batch_sizes),
                       decode_sizes=resolve_decode_sizes(args.decode_sizes, args.max_streams, full_size=full_size),
                       compact_slots=args.compact_slots,
                       codec_period=args.codec_period, codec_bridges=args.codec_bridges,
                       codec_low_load_chunk=args.codec_low_load_chunk, codec_defer_s=args.codec_defer_s,
                       pipeline_depth=args.pipeline_depth, compile_threads=args.compile_threads,
                       stall_warn_s=args.stall_warn_s,
                       encode_warmup=args.encode_warmup,
                       benchmark_mode=args.benchmark_mode, dtype=args.dtype, ssm_state_dtype=args.ssm_state_dtype,
                       backends=dataclasses.replace(Backends.auto() if args.kernels == "auto" else Backends(),
                                                    moe_activations=moe_activations,
                                                    moe_skip_padding=not args.moe_compute_padding))
    engine = Engine(talker, tok, codec, cfg, metrics)
    voices = VoiceStore(args.voices_dir or tempfile.mkdtemp(prefix="drama3-voices-"))
    resolver = ReferenceResolver(codec, talker.cfg, args.allowed_local_media_path, cfg.encode_bucket_frames)
    state = ServerState(engine=engine, resolver=resolver,
                        voices=voices, served_model_name=args.served_model_name, model_description=description,
                        max_input_chars=args.max_input_chars, benchmark_mode=args.benchmark_mode,
                        api_key=args.api_key)
    app = create_app(state)
    log.info("compiling prefill (packed calls of (rows, prompts) %s, batch sizes %s of %d-row chunks), the decode "
             "step and the codec ...", cfg.packed_buckets, cfg.batched_prefill_sizes, cfg.prefill_chunk)
    try:
        dt = engine.warm_up()
    except MemoryError as e:
        log.error("%s", e)
        raise SystemExit(1) from e
    log.info("warm-up (compilation) took %.1f s", dt)
    freeze_heap_and_watch_gc(metrics.gc_pause_seconds, args.stall_warn_s)
    serving_started.set()
    engine.start()
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=args.shutdown_timeout + 5))
    stop_original = server.handle_exit

    def on_signal(sig, frame):  # SIGTERM/SIGINT: readiness 503, drain streams, then stop uvicorn
        log.info("signal %s: draining for up to %.0f s", sig, args.shutdown_timeout)

        def drain():
            engine.shutdown(args.shutdown_timeout)
            stop_original(sig, frame)

        threading.Thread(target=drain, daemon=True).start()

    server.handle_exit = on_signal
    log.info("serving %s on http://%s:%d", args.served_model_name, args.host, args.port)
    server.run()
    if not engine.stop_flag.is_set():
        engine.shutdown(0)


if __name__ == "__main__":
    main()
