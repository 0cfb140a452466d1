"""Ablation of the serving optimisations: the engine with every optimisation on ("full"), then with each one switched
off in turn, driven in-process by the benchmark client's protocol (synthetic English set with forced lengths, closed
loop at C streams, warm-up requests dropped). One table: audio s/s, TTFA, RTF, broken streams, decode step time,
compile time, and each row's full engine configuration in the JSON.

    python -m experiments.ablate --out DIR [--preset full|tiny] [--streams 128] [--configs full gdn_ref ...]
        [--budget-s 480] [--engine prefill_chunk=128 ...]

The model parts are built once. A configuration that differs from the live engine's in admission / guard / tick fields
only (`serving.engine.POLICY_FIELDS`: rows admit_now, sync_tick, guard_*, prefill_*, codec_bridges_*), or in its codec
schedule within the compiled frame counts (`CODEC_SCHEDULE_FIELDS`: first_chunk_2, codec_period_4, ...), runs on that
engine, reconfigured ("compile s" 0), as does a row that changes `admission_frames` (admission_frames_5: "compile s"
is then its first-frames calls' compile); any other gets a fresh `Engine` (warm-up compile, run; the previous one shut
down and its device memory freed). Requests are the benchmark client's request bodies, validated and prepared by the
server's own code (`serving.api.prepare_request`), and the figures come from `serving.bench.metrics.round_summary`, so
they are defined exactly as `drama3-bench` defines them (chunk arrival = the engine's audio callback; bytes = samples
* 2 as s16le).
JSON and Markdown are rewritten after every configuration (partial results survive a time-out); a configuration that
would not finish within --budget-s (judging by the quickest one run so far, its compilation left out: a row that
reuses the compiled shapes compiles nothing, and the first row's cold compile would otherwise skip every other row) is
recorded as skipped. "decode ms/call" is the engine's `drama3_decode_step_seconds` (dispatch to rows on the host) over
the timed rounds.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import gc
import logging
import math
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from datetime import datetime, timezone
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from drama3_jax.backbone import Backends, default_moe_activations  # noqa: E402
from drama3_jax.prompt import build_prompt, normalize_text, split_long_text  # noqa: E402
from experiments.common import command_line, log, save_json  # noqa: E402
from experiments.decode_profile import gpu_kernel_events  # noqa: E402
from serving.bench.client import Sampling, request_body  # noqa: E402
from serving.bench.dataset import synthetic, warmup_requests  # noqa: E402
from serving.bench.metrics import BYTES_PER_SAMPLE, Trace, average_rounds, round_summary  # noqa: E402
from serving.api import ServerState, prepare_request  # noqa: E402
from serving.engine import Engine, EngineConfig, policy_changes  # noqa: E402
from serving.launch import resolve_decode_sizes  # noqa: E402
from serving.metrics import freeze_heap_and_watch_gc  # noqa: E402
from serving.protocol import SpeechRequest  # noqa: E402
from serving.references import ReferenceResolver  # noqa: E402
from serving.voices import VoiceStore  # noqa: E402


def _backends(**kw) -> Callable[[EngineConfig], EngineConfig]:
    return lambda c: dataclasses.replace(c, backends=dataclasses.replace(c.backends, **kw))


# name: (what is switched off, the change to the full configuration); run in this order: the rows that reuse the
# full configuration's compiled executables first, then those that recompile, the slowest last
CONFIGS: dict[str, tuple[str, Callable[[EngineConfig], EngineConfig]]] = {
    "full": ("nothing (every optimisation on)", lambda c: c),
    "admit_now": ("prefill admission policy -> admit every arrival at once",
                  lambda c: dataclasses.replace(c, prefill_busy_streams=max(c.prefill_busy_streams, c.max_streams),
                                                  admit_guard_s=float("-inf"))),
    "codec_every_step": ("periodic codec calls (every 8 steps) -> a call every step for every playing stream",
                         lambda c: dataclasses.replace(c, codec_period=1)),
    "codec_bridges_1": ("no bridge chunk before a new stream's first periodic call (its first chunk may run dry) -> "
                        "one bridge", lambda c: dataclasses.replace(c, codec_bridges=1)),
    "codec_bridges_3": ("no bridge chunk -> up to 3 per stream, each when its audio would run dry before the next "
                        "periodic call (for short first chunks)", lambda c: dataclasses.replace(c, codec_bridges=3)),
    "codec_low_load_off": ("at low load (streams <= the smallest codec batch) periodic codec calls skipped while "
                           "each stream has 1 s of audio buffered, then up to 32 frames a stream -> every periodic "
                           "call runs", lambda c: dataclasses.replace(c, codec_low_load_chunk=0)),
    # candidate settings (not switches of an optimisation), each changing one admission / batching knob: the guard
    # rows reuse the compiled executables, the prefill and codec rows below compile new shapes
    "guard_new_0.1s": ("admission guard for streams on their first chunk (and bridges) 0.25 s -> 0.1 s",
                       lambda c: dataclasses.replace(c, admit_guard_new_s=0.1)),
    "guard_0.1s": ("admission guard 0.25 s -> 0.1 s", lambda c: dataclasses.replace(c, admit_guard_s=0.1)),
    "prefill_wait_100ms": ("longest wait for a prefill batch 30 ms -> 100 ms (fuller prefill batches)",
                           lambda c: dataclasses.replace(c, prefill_max_wait_ms=100.0)),
    "prefill_min_batch_3": ("prefill batch to wait for (above 32 busy streams) 6 -> 3 requests (TTFA)",
                            lambda c: dataclasses.replace(c, prefill_min_batch=3)),
    "codec_full_pool": ("codec on the called streams only -> on the whole slot pool",
                        lambda c: dataclasses.replace(c, codec_batch_sizes=())),
    "sync_tick": ("pipelined engine tick -> synchronous tick",
                  lambda c: dataclasses.replace(c, pipeline_depth=0)),
    "unpacked_prefill": ("packed prefill (prompts end to end in calls of 512-4,096 rows) -> each prompt padded to "
                         "whole chunks in [batch, chunk] calls of batch 1, 4 or 8",
                         lambda c: dataclasses.replace(c, prefill_packed_rows=(), prefill_batch_sizes=(1, 4, 8))),
    "packed_2048": ("largest packed prefill call 4,096 rows (16 prompts) -> 2,048 (8): shorter stalls, more calls",
                    lambda c: dataclasses.replace(c, prefill_packed_rows=tuple(
                        n for n in c.prefill_packed_rows if n <= 2048))),
    "packed_lanes_256": ("packed prefill lanes rows // 384 -> rows // 256 (3,072 rows: 8 -> 12 prompts)",
                         lambda c: dataclasses.replace(c, prefill_lane_rows=256)),
    "prefill_one_call": ("packed prefill as one call per backbone layer -> one call (a 40-layer module per row count)",
                         lambda c: dataclasses.replace(c, prefill_by_layer=False)),
    "prefill_chunk_256": ("512-row prefill chunks -> 256-row", lambda c: dataclasses.replace(c, prefill_chunk=256)),
    "first_chunk_3": ("first audio chunk 4 frames -> 3 (TTFA; its codec call runs at 4 frames, padded)",
                      lambda c: dataclasses.replace(c, codec_first_chunk=3)),
    "first_chunk_2": ("first audio chunk 4 frames -> 2 (TTFA; its codec call runs at 4 frames, padded)",
                      lambda c: dataclasses.replace(c, codec_first_chunk=2)),
    "admission_frames_5": ("new streams' first frames from the pool's steps -> 5 from a decode call on their "
                           "prefill's lanes (TTFA; one more compiled decode per prefill lane count)",
                           lambda c: dataclasses.replace(c, admission_frames=5)),
    "codec_period_4": ("periodic codec call every 8 decode steps -> every 4 (smaller, more frequent calls: buffers "
                       "refilled sooner)", lambda c: dataclasses.replace(c, codec_period=4)),
    "codec_batches_8": ("codec batch sizes (8, 32, 64, pool) -> (8, pool)",
                        lambda c: dataclasses.replace(c, codec_batch_sizes=(8,))),
    # the decode step's cost follows the slot pool, not the active streams: a pool smaller than the concurrency
    # (arrivals beyond it queue, as the admission guard makes them do anyway)
    "pool_0.75x": ("slot pool = concurrency -> 3/4 of it", lambda c: dataclasses.replace(c, max_streams=max(
        1, c.max_streams * 3 // 4))),
    "pool_0.875x": ("slot pool = concurrency -> 7/8 of it", lambda c: dataclasses.replace(c, max_streams=max(
        1, c.max_streams * 7 // 8))),
    "whole_pool_steps": ("decode step over the smallest of serving.launch's decode sizes that covers the occupied "
                         "slots -> always over the whole pool", lambda c: dataclasses.replace(c, decode_sizes=())),
    "gdn_ref": ("GDN Pallas kernels (prefill + decode) -> jnp reference", _backends(gdn_prefill="reference",
                                                                                    gdn_decode="reference")),
    "moe_xla": ("Pallas MoE -> XLA ragged_dot", _backends(moe="xla_ragged_dot")),
    "moe_w8a16": ("routed experts W8A8 (FP8 activations per token and 128 columns, the checkpoint's dynamic scheme) "
                  "-> W8A16 (bf16 activations)", _backends(moe_activations="bf16")),
    "moe_padding": ("MoE skips the prompt padding of a prefill -> computes it", _backends(moe_skip_padding=False)),
    "sampling_ref": ("fused sampling kernel -> sort-based reference", _backends(sampling="reference")),
    "router_ref": ("Pallas router top-k + softmax kernel -> lax.top_k + softmax", _backends(router="reference")),
    # candidate (off by default until timed)
    "norm_at_input": ("MoE output added by XLA before the next layer's input RMSNorm -> both in the norm kernel's "
                      "launch", _backends(norm_at_input=True)),
    "tower_norm": ("tower residual add + RMSNorm pairs in XLA -> norm-kernel launches", _backends(tower_norm="auto")),
    "append_attention": ("decode attention layers as separate XLA ops around the attention kernel -> one append-"
                         "attention launch each (q/k norms, RoPE, KV write, attention)",
                         _backends(append_attention="auto")),
    "norm_ref": ("residual add + RMSNorm + the MoE input's e4m3 groups as one Pallas launch -> XLA's ops, the MoE "
                 "quantising its input", _backends(norm="reference")),
    "ssm_fp32": ("bf16 GDN state -> fp32", lambda c: dataclasses.replace(c, ssm_state_dtype="float32")),
    "four_frames": ("one frame per host call (the server default, pipelined) -> 4 frames per call (multi-frame "
                    "decode: a scan of 4 frame steps in one executable)",
                    lambda c: dataclasses.replace(c, frames_per_step=4)),
    "attention_ref": ("attention kernel -> jnp reference", _backends(attention="reference")),
    "xla_prefill_attention": ("flash prefill attention kernel -> XLA's attention (scores in HBM) for Tq > 1",
                              _backends(attention="pallas_triton_decode")),
    "moe_ref": ("Pallas MoE -> jnp reference (gathers expert weights per token)", _backends(moe="reference")),
}


def config_name(name: str) -> str:
    """argparse type of --configs: a row of CONFIGS, or rows joined by '+' (their changes applied in that order)."""
    unknown = [part for part in name.split("+") if part not in CONFIGS or part == "full"]
    if unknown and name != "full":
        raise argparse.ArgumentTypeError(f"unknown configuration {unknown[0]!r} in {name!r}; choose from "
                                         + ", ".join(CONFIGS) + " (or join rows other than 'full' with '+')")
    return name


def config_change(name: str) -> tuple[str, Callable[[EngineConfig], EngineConfig]]:
    """(what is switched off, the change) of a --configs entry; 'a+b' composes the rows' changes."""
    parts = [CONFIGS[part] for part in name.split("+")]
    if len(parts) == 1:
        return parts[0]
    return "; ".join(off for off, _ in parts), functools.reduce(lambda f, g: lambda c: g(f(c)), (ch for _, ch in parts))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", choices=["full", "tiny"], default="full",
                    help="full: full-size random-weight model built on the device; tiny: the embedded smoke model")
    ap.add_argument("--configs", nargs="+", type=config_name, default=list(CONFIGS),
                    help="configurations to run, in this order except that 'full' and the rows that change only "
                         "admission / guard / tick fields go first (they share full's compiled engine); 'a+b' "
                         "applies the changes of rows a and b together")
    ap.add_argument("--streams", type=int, default=128, help="concurrency C = engine slots (except in the pool_* rows)")
    ap.add_argument("--requests", type=int, default=None, help="requests per timed round (default: --streams)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=8, help="distinct warm-up requests per configuration, dropped")
    ap.add_argument("--frames-per-step", type=int, default=1, help="decode frames per host call in 'full'")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="frame cap; caps forced lengths as the client does (default: the set's longest)")
    ap.add_argument("--max-prompt-rows", type=int, default=None,
                    help="default: the set's longest prompt rounded up to the prefill chunk")
    ap.add_argument("--engine", nargs="+", default=[], metavar="FIELD=VALUE",
                    help="other EngineConfig fields of every configuration, e.g. prefill_batch_sizes=1,4,8 "
                         "prefill_chunk=128 (Python literals)")
    ap.add_argument("--ref-seconds", type=float, nargs=2, default=[3.0, 10.0], metavar=("MIN", "MAX"))
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic set")
    ap.add_argument("--budget-s", type=float, default=math.inf,
                    help="wall-time budget from start: a configuration is skipped when even the quickest one run so "
                         "far (less its compile time) would not finish within it")
    ap.add_argument("--trace-s", type=float, default=0.0,
                    help="after the configurations, run 'full' once more and profile this many seconds of its timed "
                         "round: GPU time per jitted module (decode step, prefill, codec, ...) and the idle share")
    ap.add_argument("--trace-delay-s", type=float, default=15.0, help="start the trace this long into the round")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per timed round before giving up")
    ap.add_argument("--compilation-cache", default=os.path.join(tempfile.gettempdir(), "drama3-ablate-xla"),
                    help="persistent XLA compilation cache shared by the configurations ('' disables)")
    return ap


# ------------------------------------------------------------------------------------------ requests
def drive(engine: Engine, bodies: list[dict], concurrency: int, timeout: float) -> tuple[list[Trace], list[str]]:
    """Closed loop: submit in order with at most `concurrency` in flight; one Trace per body, and engine errors.
    Each body goes through the server's own validation and request preparation (`serving.api.prepare_request`),
    with seed = its index so every configuration samples the same way."""
    state = ServerState(engine=engine, resolver=ReferenceResolver(engine.codec, engine.model_cfg),
                        voices=VoiceStore(tempfile.mkdtemp(prefix="ablate-voices-")), benchmark_mode=True)
    frame_bytes = engine.codec.frame_length * BYTES_PER_SAMPLE
    free = threading.Semaphore(concurrency)
    traces, reqs, errors = [], [], []
    deadline = time.perf_counter() + timeout

    def sink(trace: Trace, kind: str, payload):
        now = time.perf_counter()
        if kind == "audio":
            trace.chunks.append((now, payload.size * BYTES_PER_SAMPLE))
            return
        trace.end = now
        if kind == "error":
            trace.error = "engine_error"
            errors.append(str(payload))
        free.release()

    for i, body in enumerate(bodies):
        t = Trace(f"r{i}", time.perf_counter(), expected_bytes=body["forced_frames"] * frame_bytes)
        traces.append(t)
        if not free.acquire(timeout=max(0.0, deadline - time.perf_counter())):
            t.error = "timeout"
            continue
        t.send = time.perf_counter()
        try:
            sreq = SpeechRequest.model_validate({**body, "seed": i})
            reqs.append(engine.submit(prepare_request(state, sreq, lambda k, p, t=t: sink(t, k, p))))
            t.status = 200
        except Exception as e:  # what the server answers 4xx/5xx; the stream never starts
            t.error = type(e).__name__
            errors.append(repr(e))
            free.release()
    while any(t.status == 200 and t.end is None for t in traces) and time.perf_counter() < deadline:
        time.sleep(0.01)
    for t, r in zip([t for t in traces if t.status == 200], reqs):
        if t.end is None:
            engine.cancel(r)
            t.error = "timeout"
    return traces, errors


def _histogram(engine: Engine, name: str) -> tuple[float, float]:
    reg = engine.metrics.registry
    return reg.get_sample_value(f"{name}_sum") or 0.0, reg.get_sample_value(f"{name}_count") or 0.0


# ------------------------------------------------------------------------------------------ engine profile
def engine_time_budget(trace_dir: str) -> dict:
    """Where the GPU's time goes while the engine serves: kernel time per jitted module (ms per wall second of the
    trace window) and the share of the window with no kernel running (host gaps, waits)."""
    events = gpu_kernel_events(trace_dir)
    if not events:
        return {}
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
    t0, t1 = spans[0][0], max(end for _, end in spans)
    busy, covered = 0.0, -math.inf
    for start, end in spans:  # union of the kernel intervals
        busy += max(0.0, end - max(start, covered))
        covered = max(covered, end)
    window_s = (t1 - t0) / 1e6
    per_module = defaultdict(float)
    for e in events:
        per_module[e.get("args", {}).get("hlo_module") or "(no module)"] += e["dur"] / 1e3 / window_s
    return {"window_s": window_s, "kernels": len(events), "busy_share": busy / (t1 - t0),
            "module_ms_per_s": dict(sorted(per_module.items(), key=lambda kv: -kv[1]))}


def trace_later(delay_s: float, seconds: float, trace_dir: str, out: dict) -> threading.Thread:
    """Profile the whole process for `seconds`, `delay_s` from now, in a thread; the budget lands in out["trace"]."""
    def run():
        time.sleep(delay_s)
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        time.sleep(seconds)
        jax.profiler.stop_trace()
        out["trace"] = engine_time_budget(trace_dir)

    thread = threading.Thread(target=run, daemon=True, name="engine-trace")
    thread.start()
    return thread


# ------------------------------------------------------------------------------------------ one configuration
class LiveEngine:
    """One warmed-up engine at a time. A row whose configuration differs from the live engine's in
    serving.engine.POLICY_FIELDS only (admission, guard, tick), or in its codec schedule within the compiled frame
    counts, reuses it through `Engine.reconfigure`: no compile; one that changes `admission_frames` too, compiling
    only the new first-frames calls.
    Any other row shuts it down, frees its device memory and builds its own. (On the H200 a second Engine of the
    same shapes in one process compiled its talker steps again, 158 of 268 s, despite the persistent cache:
    experiments/results/ablate_128_g/.)"""

    def __init__(self, talker, tok, codec):
        self.parts, self.engine = (talker, tok, codec), None

    def get(self, cfg: EngineConfig) -> tuple[Engine, float]:
        """(an engine running `cfg`, seconds spent compiling for it)."""
        if self.engine is not None and self.engine.reconfigurable(cfg):
            try:
                return self.engine, self.engine.reconfigure(cfg)
            except RuntimeError:  # still busy (a round that timed out): start over on a fresh engine
                log("the live engine is not idle; building a fresh one")
        self.close()
        self.engine = Engine(*self.parts, cfg)
        compile_s = self.engine.warm_up()
        self.engine.start()
        return self.engine, compile_s

    def close(self):
        if self.engine is None:
            return
        self.engine.shutdown(drain_timeout=0)
        self.engine.pool = self.engine.codec_state = self.engine.prefiller = None
        self.engine = None
        gc.collect()


def run_config(live: LiveEngine, cfg: EngineConfig, timed: list[dict], warm: list[dict], args,
               trace_s: float = 0.0) -> dict:
    """Compile (or reuse the live engine), warm up, time `args.rounds` rounds (profiling `trace_s` seconds of the
    first). An engine that failed is shut down and its device memory freed."""
    codec = live.parts[2]
    try:
        engine, compile_s = live.get(cfg)
        warm_traces, errors = drive(engine, warm, args.streams, args.timeout) if warm else ([], [])
        names = ("drama3_decode_step_seconds", "drama3_prefill_seconds", "drama3_codec_step_seconds",
                 "drama3_queue_wait_seconds", "drama3_admit_to_first_audio_seconds")
        before = {n: _histogram(engine, n) for n in names}
        rounds, profiled = [], {}
        for i in range(args.rounds):
            tracer = (trace_later(args.trace_delay_s, trace_s, tempfile.mkdtemp(prefix="engine-trace-"), profiled)
                      if trace_s and i == 0 else None)
            traces, errs = drive(engine, timed, args.streams, args.timeout)
            if tracer is not None:
                tracer.join()
            errors += errs
            rounds.append(round_summary(traces, codec.cfg.sample_rate, codec.frame_length, args.streams))
        mean_ms = {}
        for n in names:
            (s0, c0), (s1, c1) = before[n], _histogram(engine, n)
            mean_ms[n.removeprefix("drama3_").removesuffix("_seconds") + "_ms"] = (
                1e3 * (s1 - s0) / (c1 - c0) if c1 > c0 else math.nan)
        return {"status": "ok", "compile_s": compile_s, "summary": average_rounds(rounds), "rounds": rounds,
                "mean_ms": mean_ms, "decode_frame_ms": mean_ms["decode_step_ms"] / cfg.frames_per_step,
                "warmup": {"requests": len(warm_traces),
                           "failed": sum(t.failure_key() is not None for t in warm_traces)},
                "errors": sorted(set(errors))[:5], **profiled}
    except BaseException:
        live.close()
        raise


# ------------------------------------------------------------------------------------------ report
def flat_config(cfg: EngineConfig) -> dict:
    """EngineConfig fields, the backends as `backends.<op>`."""
    d = dataclasses.asdict(cfg)
    return {**{k: v for k, v in d.items() if k != "backends"}, **{f"backends.{k}": v for k, v in d["backends"].items()}}


def changes(cfg: EngineConfig, base: EngineConfig) -> str:
    """The fields where `cfg` differs from `base`, as `field: base -> cfg`."""
    a, b = flat_config(base), flat_config(cfg)
    return ", ".join(f"{k}: {a[k]} -> {b[k]}" for k in b if a[k] != b[k]) or "-"


def markdown(result: dict) -> str:
    f = lambda x, d=1: "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{d}f}"
    lines = [f"# Serving ablation ({result['preset']} model, {result['streams']} streams)", "",
             f"Command: `{result['command']}`  ",
             f"Device: {result['device']} ({result['device_kind']}), jax {result['jax']}, {result['date']}  ",
             f"Protocol: {result['protocol']}  ", f"Full configuration: `{result['full_config']}`", "",
             "| config | switched off | change | audio s/s | steady audio s/s | TTFA p50 ms | TTFA p90 ms | TTFA after "
             "the burst p50 ms | mean queue wait + admission to first audio ms | RTF p50 | broken | underruns (s) | "
             "failed | decode ms/call | ms/frame | compile s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | {r['off']} | {r['change']} | {r['status']}: {r['reason']} "
                         "| | | | | | | | | | | | |")
            continue
        s = r["summary"]
        lines.append(f"| {r['name']} | {r['off']} | {r['change']} | {f(s['audio_s_per_s'])} | "
                     f"{f(s.get('steady_audio_s_per_s'))} | {f(s['ttfa_ms']['p50'], 0)} | {f(s['ttfa_ms']['p90'], 0)} | "
                     f"{f(s.get('ttfa_after_burst_ms', {}).get('p50'), 0)} | "
                     f"{f(r['mean_ms'].get('queue_wait_ms'), 0)} + {f(r['mean_ms'].get('admit_to_first_audio_ms'), 0)} | "
                     f"{f(s['rtf']['p50'], 3)} | "
                     f"{s['broken']} | {s['underrun_events']} ({f(s['underrun_total_s'], 2)}) | "
                     f"{s['requests'] - s['ok']} | {f(r['mean_ms']['decode_step_ms'], 2)} | "
                     f"{f(r['decode_frame_ms'], 2)} | {f(r['compile_s'])} |")
    for r in result["rows"]:
        t = r.get("trace")
        if t:
            lines += ["", f"GPU time of '{r['name']}' by jitted module, over a {t['window_s']:.1f} s profile of its "
                      f"first timed round ({t['kernels']:,} kernels; kernels running {100 * t['busy_share']:.0f}% of "
                      "the window):", "", "| module | GPU ms per wall second |", "|---|---|"]
            lines += [f"| {m} | {ms:.1f} |" for m, ms in t["module_ms_per_s"].items()]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ main
def engine_overrides(items: list[str]) -> dict:
    """`FIELD=VALUE` strings -> EngineConfig fields (values as Python literals, else strings; one number for a
    tuple field is a 1-tuple)."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"backends"}
    tuples = {k for k in fields if isinstance(getattr(EngineConfig, k, None), tuple)}
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in fields:
            raise SystemExit(f"--engine {item}: not an EngineConfig field ({', '.join(sorted(fields))})")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
        if key in tuples and not isinstance(out[key], tuple):
            out[key] = (out[key],)
    return out


def log_persistent_cache():
    """Log JAX's persistent-compilation-cache hits, misses (with their keys), writes and skipped writes at INFO:
    which engine compile reused which executable (a second engine of the same shapes recompiled on the H200,
    ablate_128_g/)."""
    wanted = ("Persistent compilation cache hit", "PERSISTENT COMPILATION CACHE MISS", "Not writing persistent cache",
              "Writing ")

    def keep(record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(wanted):
            return False
        record.levelno, record.levelname = logging.INFO, "INFO"
        return True

    for name in ("jax._src.compiler", "jax._src.compilation_cache"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG)
        logger.addFilter(keep)


def run_order(names: list[str], base: EngineConfig) -> list[str]:
    """The --configs rows in their order, except that 'full' and the rows that it can be reconfigured to (policy,
    codec schedule and first-frames fields, `serving.engine.policy_changes`) come first: they all run on full's
    engine (LiveEngine) before any row replaces it."""
    shares = [n for n in names if n != "full" and policy_changes(config_change(n)[1](base), base) is not None]
    return ["full"] * ("full" in names) + shares + [n for n in names if n != "full" and n not in shares]


def build_parts(preset: str):
    if preset == "tiny":
        from serving.launch import tiny_random_parts

        return tiny_random_parts(jnp.float32)
    from drama3_jax.codec import full_codec_config
    from drama3_jax.config import full_config
    from serving.launch import random_parts_in_memory

    return random_parts_in_memory(full_config(), full_codec_config(), jnp.bfloat16)


def main(argv=None):
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_persistent_cache()
    t0 = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    if args.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    talker, tok, codec = build_parts(args.preset)
    freeze_heap_and_watch_gc(None, EngineConfig.stall_warn_s)  # as the server does after start-up
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(talker)))
    log(f"{args.preset} model built in {time.perf_counter() - t0:.1f} s ({weights / 2**30:.2f} GiB of weights)")

    mcfg, n_req = talker.cfg, args.requests or args.streams
    sizes = (mcfg.band_size, min(codec.cfg.codebook_sizes[1:]))
    reqs = synthetic(n_req, args.seed, sizes, ref_seconds=tuple(args.ref_seconds))
    warm = warmup_requests(reqs, args.warmup)
    longest = max(request_body(r, Sampling(), True, None)["forced_frames"] for r in reqs + warm)
    sampling = Sampling(max_new_tokens=args.max_new_tokens or longest)
    timed_bodies, warm_bodies = ([request_body(r, sampling, True, None) for r in rs] for rs in (reqs, warm))
    base = EngineConfig(max_streams=args.streams, max_new_tokens=sampling.max_new_tokens,
                        frames_per_step=args.frames_per_step, benchmark_mode=True,
                        backends=dataclasses.replace(Backends.auto(),
                                                     moe_activations=default_moe_activations(talker.cfg)),
                        encode_warmup="lazy",  # the synthetic set sends its references as codes: nothing to encode
                        dtype=str(jnp.dtype(talker.lm_head.weight[...].dtype)), ssm_state_dtype="bfloat16",
                        # the server's default for the model (serving.launch --decode-sizes not given)
                        decode_sizes=resolve_decode_sizes(None, args.streams, full_size=args.preset == "full"))
    rows_needed = max(len(build_prompt(tok, mcfg, split_long_text(normalize_text(b["input"]))[0],
                                       [(np.asarray(b["ref_audio_codes"]), b["ref_text"])]))
                      for b in timed_bodies + warm_bodies)
    base = dataclasses.replace(base, **engine_overrides(args.engine))
    base = dataclasses.replace(base, max_prompt_rows=args.max_prompt_rows or
                               -(-rows_needed // base.prefill_chunk) * base.prefill_chunk)
    forced = [b["forced_frames"] for b in timed_bodies]
    result = {
        "command": command_line(args.out), "preset": args.preset, "device": str(jax.devices()[0]),
        "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "streams": args.streams,
        "weights_gib": weights / 2**30,
        "protocol": (f"synthetic English set (seed {args.seed}, {n_req} requests, references {args.ref_seconds[0]:g}-"
                     f"{args.ref_seconds[1]:g} s, forced lengths {min(forced)}-{max(forced)} frames, mean "
                     f"{np.mean(forced):.0f}; longest prompt {rows_needed} rows), sampling "
                     f"{dataclasses.asdict(sampling)}, closed loop at {args.streams} streams, {args.warmup} warm-up "
                     f"requests dropped, {args.rounds} timed round(s)"),
        "full_config": " ".join(f"{k}={v}" for k, v in flat_config(base).items()),
        "rows": []}
    walls = []  # wall times of the configurations run so far, less their warm-up compilation
    live = LiveEngine(talker, tok, codec)
    # the profiled run goes last: a jax.profiler trace on the H200 was followed by CUDA_ERROR_LAUNCH_FAILED twice
    # (a known failure mode, jax-ml/jax#40260), which would take the configurations after it down too
    profiled = {"full_profiled": ("nothing; profiled for the GPU time split, figures not for comparison", lambda c: c)}
    for name in run_order(args.configs, base) + (list(profiled) if args.trace_s else []):
        off, change = profiled[name] if name in profiled else config_change(name)
        cfg = change(base)
        row = {"name": name, "off": off, "change": changes(cfg, base), "engine_config": dataclasses.asdict(cfg)}
        result["rows"].append(row)
        elapsed, quickest = time.perf_counter() - t0, min(walls, default=0.0)
        if name not in ("full", *profiled) and cfg == base:
            row.update(status="skipped", reason="same configuration as full")
        elif elapsed + quickest >= args.budget_s:
            row.update(status="skipped", reason=f"budget: {elapsed:.0f} s of {args.budget_s:.0f} s spent" +
                       (f", the quickest configuration so far took {quickest:.0f} s besides compiling" if walls
                        else ""))
        else:
            log(f"{name}: {off} ({row['change']})")
            t = time.perf_counter()
            try:
                row.update(run_config(live, cfg, timed_bodies, warm_bodies, args,
                                      trace_s=args.trace_s if name in profiled else 0.0))
            except Exception as e:  # e.g. out of memory at compile: record it and go on
                row.update(status="error", reason=repr(e)[:300])
            row["wall_s"] = time.perf_counter() - t
            walls.append(row["wall_s"] - row.get("compile_s", 0.0))
            live_gib = sum(x.nbytes for x in jax.live_arrays()) / 2**30
            log(f"{name}: {row['status']} in {row['wall_s']:.0f} s; live device arrays {live_gib:.2f} GiB")
        save_json(result, os.path.join(args.out, "ablate.json"))
        with open(os.path.join(args.out, "ablate.md"), "w") as fh:
            fh.write(markdown(result))
    live.close()
    print(markdown(result), flush=True)
    return result


if __name__ == "__main__":
    main()
