"""Continuous-batching engine: a fixed pool of slots advanced together, one jitted step per host round trip.

Device state: one `DecodeState` for all S slots (backbone + tower caches [S, max_len, ...], GDN states, last hidden
state, last row, RAS window, per-request keys and sampling values) and one codec streaming state [S, ...]. Both are
created once and donated to every step. A request owns a slot from prefill to its last audio chunk.

One tick of the engine thread (`pipeline_depth` = 1, the default):
  1. decode: dispatch step n (`frames_per_step` frames for every slot; inactive slots compute and are ignored; with
     `decode_sizes`, over the smallest prefix of the pool that holds every stream, after moving streams down into
     free lower slots when that lets the step shrink: `_compact_slots`);
  2. host bookkeeping on the rows of step n-1 while step n runs: stop rules (EOS, frame cap, forced length,
     cancellation), one-frame hold-back for the semantic-0-before-EOS rule;
  3. audio: collect the codec output dispatched in the previous tick (queued on the device before step n), push PCM
     to each request's queue, then finish ended chunks (release the slot, or hand over to the next text chunk);
  4. codec: a streaming-decode call costs ~7 ms on the H200 however few frames it decodes, and its cost grows with
     streams x frames including padding (experiments/results/codec_throughput.md), so calls are few and full: every
     `codec_period` decode steps one call takes the pending frames of every playing stream and of every stream whose
     text chunk ended (the flush, which frees the slot); in between, a call runs only for streams whose first chunk
     (`codec_first_chunk` frames: time-to-first-audio) is ready or whose audio would run dry before the next
     periodic call (up to `codec_bridges` bridge chunks per stream), and takes only those. Flushes wait for the periodic
     call because at 128 streams streams end ~15 times a second, and a call each was ~10 extra calls/s on the H200
     (experiments/results/full_size_h200.md). At low load (`codec_low_load_chunk`) a periodic call waits while every
     stream it would serve has audio buffered well ahead, so a lone stream's frames go in fewer, longer calls. Just
     the called streams' codec state is gathered from the pool; stream counts and frames are padded to small static
     sets;
  5. admit: if the admission policy says so, prefill queued prompts and scatter them into free slots; their first
     valid step is n+1. Prompts of up to `prefill_chunk` rows are packed end to end into one call of a few static
     row counts (`prefill_packed_rows`, drama3_jax/packing.py), longer ones go alone in whole chunks. With
     `admission_frames`, a decode call over the prefill's lanes gives the new streams their first frames before they
     join the pool; its rows are processed with the steps' rows, in dispatch order.
So the device always has a step queued while the host works. `pipeline_depth` = 0 runs the same tick synchronously
(bookkeeping on step n's rows, codec output collected in the same tick): one step less latency, an idle device
during host work.
Only this module knows about slots, queues and time; the math is `drama3_jax.generate.frame_step`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from drama3_jax.backbone import Backends
from drama3_jax.generate import DecodeState, Prefiller, RequestSampling, frame_step_prefix
from drama3_jax.model import Drama3Model
from drama3_jax.prompt import build_prompt, history_for_chunk
from drama3_jax.sampling import SamplingParams
from serving.metrics import Metrics

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_streams: int = 128
    max_queue: int = 1024
    max_prompt_rows: int = 2048
    max_new_tokens: int = 2048  # frame cap per chunk of text
    frames_per_step: int = 1  # decode frames per host round trip
    pipeline_depth: int = 1  # decode steps in flight while the host processes the previous one (0 or 1)
    # warm-up compilations run at once. On the H200 (16 cores) a cold start of the full-size server compiled its 21
    # shapes in 221.5 s with 4 threads at 256 slots against 409-419 s serially at 128 (experiments/results/
    # serve_bench_14/); each shape takes ~1.5-2x longer under the contention, the whole ~half as long
    compile_threads: int = 4
    # up to 8 prompts per prefill call: on the H200 at 128 streams, (1, 4, 8) against (1, 4): 134.3 vs 122.8 audio s/s,
    # TTFA p50 846 vs 1,074 ms, both 0 broken (experiments/results/ablate_128_f/): with a cap of 4 the admission rate,
    # not the slots, bounded the queue
    prefill_batch_sizes: tuple[int, ...] = (1, 4, 8)
    prefill_chunk: int = 512  # prompt rows per prefill call (one compiled shape per batch size)
    # prompts of at most `prefill_chunk` rows are packed end to end into one prefill call of one of these row counts
    # (drama3_jax/packing.py): the row-wise layers (projections, experts, tower) compute no padding, while attention
    # and the GDN recurrence run per prompt over rows // `prefill_lane_rows` lanes (at least 1) of `prefill_chunk`
    # rows; the smallest call that holds the batch is used. Longer prompts go alone through the smallest of
    # `prefill_batch_sizes`, compiled only when `max_prompt_rows` allows them. () = no packing: every prompt is padded
    # to whole chunks in [batch, chunk] calls of `prefill_batch_sizes`.
    # On the H200 at 128 streams the admission takes ~7 prompts (~2,400 rows) per call, so with (512, 1024,
    # 2048, 4096) every busy call ran at 4,096 rows, as many as the [8, 512] batch it replaced (147.7 vs 146.5 audio
    # s/s, experiments/results/serve_bench_10/); 2,560 and 3,072 make those calls fit
    prefill_packed_rows: tuple[int, ...] = (512, 1024, 2048, 2560, 3072, 4096)
    # one prefill call of the synthetic set's prompts (mean 348 rows) on the H200: 8 prompts in 3,072 rows 86.7 ms with
    # 8 lanes (384) against 94.4 ms with 12 (256); 10-11 prompts in 4,096 rows 10.3 vs 10.6 ms per prompt; 512 (8
    # lanes at 4,096 rows) 11.5 (experiments/results/prefill_2026-12-02/lanes/)
    prefill_lane_rows: int = 384
    # run a packed prefill as one call per backbone layer (drama3_jax.generate.Prefiller by_layer): the same math,
    # one compiled layer per type and row count instead of a whole 40-layer module per row count. On the H200, 8
    # prompts in 3,072 rows: 68.54 ms against 71.95 / 74.33 ms as one call, compiled in 17.1 s against 50.6 / 48.0 s
    # (experiments/results/prefill_by_layer_2026-12-05/)
    prefill_by_layer: bool = True
    # admission policy: below `prefill_busy_streams` running streams admit at once; above it wait until
    # `prefill_min_batch` requests are queued or the oldest has waited `prefill_max_wait_ms`
    prefill_busy_streams: int = 32
    prefill_min_batch: int = 6
    # 30 ms against 100 ms at 128 streams on the H200: TTFA p50 415 vs 430 ms, after the start-up burst 336 vs
    # 390 ms, 167.6 vs 165.8 audio s/s, 0 broken, no underrun (experiments/results/ablate_2026-12-05/)
    prefill_max_wait_ms: float = 30.0
    # a prefill stalls every running stream for its duration: admit only while each stream that is playing has at
    # least this much audio buffered (new streams wait rather than running ones breaking)
    admit_guard_s: float = 0.25
    # the same for streams that have played only their first chunk and bridges (None: `admit_guard_s`; see
    # `guard_allows`)
    admit_guard_new_s: float | None = None
    # frames in a stream's first audio chunk. 2 (with the bridge) against 4 at 128 streams on the H200: TTFA p50 399
    # vs 430 ms, but 312 underruns (8.9 s) against 10 (0.004 s), and 491 (22.5 s, C50 57%, 1 broken) through the
    # server (experiments/results/ablate_2026-12-05/, serve_bench_20/): the short first chunk leaves too little
    # audio buffered before the stream's first periodic call
    codec_first_chunk: int = 4
    # frames decoded for newly admitted streams on their prefill's own lanes (one small decode call right after the
    # prefill, before they join the pool), so that a first chunk does not wait for that many steps of the whole
    # pool: at 128 streams on the H200 a pool step came every ~29 ms and admission to first audio took ~228 ms, about
    # 8 of them (prefill, 4 frames, the rows and the codec call a step behind each; experiments/results/
    # serve_bench_23/). The cost: a decode call over the prefill's lanes per admission (a step over a few rows still
    # reads every dense weight and those rows' experts, so its frames cost more GPU time each than the pool's ~0.2
    # ms at 128 streams), and one more compiled decode per prefill lane count. With `codec_first_chunk` + 1 frames
    # the first chunk is ready when the call's rows are (one frame is held back for the semantic-0-before-EOS rule).
    # 0: off (not yet timed on a GPU)
    admission_frames: int = 0
    codec_period: int = 8  # decode steps between the calls that serve every playing stream
    # between periodic calls, give a stream that has played at most this many chunks one more when its audio would run
    # dry before the next periodic call's audio lands (a "bridge", see `codec_takes`): up to this many bridges per
    # stream. 0 (off): with a 4-frame first chunk on the H200 at 128 streams one bridge cost more than the gaps it
    # filled (96.4 vs 86.7 audio s/s, TTFA p50 1,710 vs 3,103 ms, both 0 broken; experiments/results/ablate_128_c/),
    # and one bridge after a 2-frame first chunk left 312 underruns (ablate_2026-12-05/)
    codec_bridges: int = 0
    # most frames of one stream per codec call. A period's frames (the default) is enough: the periodic call empties
    # every playing stream, so a larger cap only adds a compiled shape that steady state never uses
    codec_chunk: int = 8
    # at low load (no more streams than the smallest codec batch), a periodic call is skipped while every stream it
    # would serve has at least `codec_defer_s` of audio buffered and fewer than this many frames pending, and then
    # takes up to this many frames of each (at least `codec_buckets[-1]`; one more compiled codec shape, for the
    # smallest batch only). At one stream a codec call costs about the same however few frames it decodes (7.88 ms
    # for 10 frames, 7.05 ms for 32 on the H200, experiments/results/codec_throughput.md): ~0.9 ms a frame in the
    # periodic 8-frame calls against ~0.2 in 32-frame ones, beside a ~4.7 ms decode step; a lone stream decodes ~10x
    # faster than real time, so its buffer soon allows it. One stream through the server on an H100: 203.5 against
    # 185.6 frames/s, TTFA p50 84 / 81 ms, no underrun (experiments/results/serve_c1_2026-12-07_h100/). 0: off
    codec_low_load_chunk: int = 32
    codec_defer_s: float = 1.0
    # streams per codec call are padded to one of these (or to the pool). (8, 32, 64) against (8,) at 128 streams on
    # the H200: 103.7 vs 98.4 audio s/s, TTFA p50 1,608 vs 1,924 ms, both 0 broken (experiments/results/ablate_128_d/)
    codec_batch_sizes: tuple[int, ...] = (8, 32, 64)
    # decode steps run over slots [0, n), n the smallest of these sizes (or the pool) above every occupied slot (new
    # streams take the lowest free slot): a step's cost follows the slots it covers, not the active streams (30.1 ms
    # at 256 slots vs 23.4 at 128 on the H200, experiments/results/decode_timing.md). () = always the whole pool. Each
    # size is one more compiled decode step. Off here (the tiny model); serving.launch sets FULL_SIZE_DECODE_SIZES for a
    # full-size model (+4.4-4.8% audio s/s at 128 streams on the H200, experiments/results/serve_bench_17/, _18/).
    decode_sizes: tuple[int, ...] = ()
    # with decode_sizes: when the streams would fit a smaller step but some sit in slots above it (the slots below
    # were freed by streams that ended first), move up to this many of the highest into free lower slots per step
    # (a gather/scatter of their cache rows and codec state), so the step shrinks with the load. 0: never
    compact_slots: int = 8
    stats_interval_s: float = 10.0  # log step / codec / prefill statistics this often (0: never)
    # an engine loop iteration (admit + tick) longer than this is logged with the time of each phase, and a Python
    # garbage collection longer than this is logged too (0: never): the diagnosis of stalls that break streams
    stall_warn_s: float = 0.25
    benchmark_mode: bool = False
    backends: Backends = Backends()
    # run each group of projections of one input as one GEMM (Drama3Model.fuse_projections, done in place on the model)
    fuse_projections: bool = True
    dtype: str = "bfloat16"
    ssm_state_dtype: str | None = None  # GDN recurrent state: None = the checkpoint's mamba_ssm_dtype

    @property
    def max_len(self) -> int:
        """Cache rows per slot: a prompt, its frames, and the frames a multi-frame step may run past a stop."""
        return self.max_prompt_rows + self.max_new_tokens + self.frames_per_step + 1

    # reference-encode shapes: compiled before the server reports ready ("start"), after it in a background thread
    # ("background": start-up is minutes shorter, but on the H200 decode fell from ~26 to 4-6 steps/s while those
    # compiles ran beside the engine), or by the first request that needs each shape ("lazy")
    encode_warmup: str = "start"
    encode_bucket_frames: int = 224  # reference audio is encoded in multiples of this many frames (~10.4 s)
    max_reference_frames: int = 672  # ~31 s

    @property
    def packed_buckets(self) -> tuple[tuple[int, int], ...]:
        """(rows, lanes) of the packed prefill calls, smallest first."""
        return tuple((n, max(1, n // self.prefill_lane_rows)) for n in sorted(set(self.prefill_packed_rows)))

    @property
    def batched_prefill_sizes(self) -> tuple[int, ...]:
        """Batch sizes of the compiled [batch, chunk] prefill calls."""
        if not self.prefill_packed_rows:
            return tuple(sorted(set(self.prefill_batch_sizes)))
        return (min(self.prefill_batch_sizes),) if self.max_prompt_rows > self.prefill_chunk else ()

    @property
    def codec_buckets(self) -> tuple[int, ...]:
        """Frame counts per codec call: a first chunk, one period's frames, the per-call cap."""
        period = self.codec_period * self.frames_per_step
        return tuple(sorted({self.codec_first_chunk, period, max(period, self.codec_chunk)}))

    @property
    def codec_shapes(self) -> tuple[tuple[int, int], ...]:
        """(streams, frames) of the compiled codec calls: every batch at every bucket, and the smallest batch at the
        low-load chunk too."""
        shapes = {(n, T) for n in self.codec_batches for T in self.codec_buckets}
        if self.low_load_frames:
            shapes.add((self.codec_batches[0], self.low_load_frames))
        return tuple(sorted(shapes))

    @property
    def low_load_frames(self) -> int:
        """Most frames of one stream per codec call at low load (never fewer than at other times); 0: no deferral."""
        return max(self.codec_low_load_chunk, self.codec_buckets[-1]) if self.codec_low_load_chunk else 0

    @property
    def codec_batches(self) -> tuple[int, ...]:
        """Stream counts per codec call."""
        return tuple(sorted({b for b in self.codec_batch_sizes if 0 < b < self.max_streams} | {self.max_streams}))

    @property
    def decode_steps(self) -> tuple[int, ...]:
        """Slot counts of the compiled decode steps."""
        return tuple(sorted({n for n in self.decode_sizes if 0 < n < self.max_streams} | {self.max_streams}))

    @property
    def encode_buckets(self) -> tuple[int, ...]:
        n = -(-self.max_reference_frames // self.encode_bucket_frames)
        return tuple(self.encode_bucket_frames * (i + 1) for i in range(n))


# fields the engine loop reads as it runs and no compiled shape depends on: `Engine.reconfigure` may change them
POLICY_FIELDS = frozenset({"max_queue", "pipeline_depth", "prefill_busy_streams", "prefill_min_batch",
                           "prefill_max_wait_ms", "admit_guard_s", "admit_guard_new_s", "codec_bridges",
                           "stats_interval_s", "stall_warn_s", "benchmark_mode", "codec_defer_s"})
# the codec schedule: frames per chunk and steps between periodic calls. A codec call runs at the smallest compiled
# frame count of its batch that holds its chunks (padded), so these may change too while the largest chunk they allow
# per batch is at most the largest frame count compiled for it
CODEC_SCHEDULE_FIELDS = frozenset({"codec_first_chunk", "codec_period", "codec_chunk", "codec_low_load_chunk"})
# compiled by `Engine.reconfigure` when it changes: one small decode call per prefill lane count
FIRST_FRAMES_FIELDS = frozenset({"admission_frames"})
RECONFIGURABLE_FIELDS = POLICY_FIELDS | CODEC_SCHEDULE_FIELDS | FIRST_FRAMES_FIELDS


def changed_fields(cfg: EngineConfig, base: EngineConfig) -> set[str]:
    return {f.name for f in dataclasses.fields(EngineConfig) if getattr(cfg, f.name) != getattr(base, f.name)}


def _largest_frames(shapes) -> dict[int, int]:
    """{streams: the largest frame count} of (streams, frames) codec shapes."""
    out: dict[int, int] = {}
    for n, T in shapes:
        out[n] = max(out.get(n, 0), T)
    return out


def policy_changes(cfg: EngineConfig, base: EngineConfig,
                   codec_shapes: tuple[tuple[int, int], ...] | None = None) -> set[str] | None:
    """Names of the fields where `cfg` differs from `base`, or None if `Engine.reconfigure` cannot make the change:
    a field outside RECONFIGURABLE_FIELDS, or a codec schedule whose largest chunk for some batch exceeds the largest
    frame count compiled for it (`codec_shapes`, default `base.codec_shapes`)."""
    changed = changed_fields(cfg, base)
    allowed = POLICY_FIELDS | FIRST_FRAMES_FIELDS
    compiled = _largest_frames(codec_shapes or base.codec_shapes)
    if all(T <= compiled.get(n, 0) for n, T in _largest_frames(cfg.codec_shapes).items()):
        allowed = allowed | CODEC_SCHEDULE_FIELDS
    return changed if changed <= allowed else None


@dataclasses.dataclass
class Request:
    """One speech request. `sink(kind, payload)` receives ("audio", pcm float32 array) / ("done", usage) /
    ("error", message) from the engine thread."""

    chunks: list[str]
    references: list[tuple[np.ndarray, str]]
    previous_takes: list[tuple[str, np.ndarray]]
    sampling: SamplingParams
    seed: int
    max_frames: int
    sink: Callable[[str, Any], None]
    ignore_eos: bool = False
    forced_frames: int | None = None
    id: str = ""
    prompt: np.ndarray | None = None  # rows of the current chunk
    t_arrival: float = dataclasses.field(default_factory=time.perf_counter)
    t_admit: float | None = None  # when its first prefill was dispatched
    t_first_audio: float | None = None
    t_audio_end: float = 0.0  # when the audio sent so far ends if played in real time from its first chunk
    cancelled: bool = False
    finished: bool = False
    chunk_index: int = 0
    takes: list = dataclasses.field(default_factory=list)  # (text, codes) of finished chunks
    frames: list = dataclasses.field(default_factory=list)  # frames [K] of the current chunk
    held: np.ndarray | None = None
    pending: list = dataclasses.field(default_factory=list)  # frames waiting for the codec
    audio_frames: int = 0
    audio_chunks: int = 0
    prompt_rows: int = 0
    slot: int = -1
    chunk_done: bool = False  # the current chunk has ended; its pending frames are being flushed
    needs_prefill: bool = False  # holds its slot while the next chunk's prompt waits for prefill
    first_step: int = 0  # rows of decode steps dispatched before this request's prefill belong to someone else


class QueueFull(Exception):
    pass


class Engine:
    def __init__(self, model: Drama3Model, tokenizer, codec, cfg: EngineConfig, metrics: Metrics | None = None):
        self.model_cfg = model.cfg
        self.tok = tokenizer
        self.codec = codec
        self.cfg = cfg
        self.metrics = metrics or Metrics()
        if cfg.fuse_projections:
            model.fuse_projections()
        self.graphdef, self.params = nnx.split(model)
        # jit flattens a plain list of arrays on its fast path; an nnx.State pytree (1,045 leaves for 40 layers)
        # costs host time on every call
        self._param_leaves, param_tree = jax.tree.flatten(self.params)
        S = cfg.max_streams
        backends = cfg.backends
        if cfg.encode_warmup not in ("start", "background", "lazy"):
            raise ValueError(f"encode_warmup must be 'start', 'background' or 'lazy', got {cfg.encode_warmup!r}")
        if cfg.codec_period < 1 or cfg.codec_first_chunk < 1 or cfg.codec_chunk < 1:
            raise ValueError("codec_period, codec_first_chunk and codec_chunk must be >= 1")
        _check_policy(cfg)
        if cfg.prefill_packed_rows and (max(cfg.prefill_packed_rows) < min(cfg.max_prompt_rows, cfg.prefill_chunk)
                                        or cfg.prefill_lane_rows < 1):
            raise ValueError(f"the largest packed prefill ({max(cfg.prefill_packed_rows)} rows) must hold one prompt "
                             f"of min(max_prompt_rows, prefill_chunk) rows, and prefill_lane_rows must be >= 1")

        def prefill_insert(pool, new, slots):  # function names are the module names in a profile
            return jax.tree.map(lambda p, n: p.at[slots].set(n.astype(p.dtype), mode="drop"), pool, new)

        def move_slots(tree, src, dst):  # rows src -> dst of every [S, ...] leaf; entries >= S are padding
            return jax.tree.map(lambda x: x.at[dst].set(jnp.take(x, src, axis=0, mode="clip"), mode="drop"), tree)

        def run_frames(params, state, n, frames):  # `frames` frame steps over rows [0, n): (rows [F, n, 1+K], state)
            model = nnx.merge(self.graphdef, jax.tree.unflatten(param_tree, params))

            def body(s, _):
                row, s = frame_step_prefix(model, s, n, backends)
                return s, row

            state, rows = jax.lax.scan(body, state, None, length=frames)
            return rows, state

        def decode_step(params, pool, n):
            return run_frames(params, pool, n, cfg.frames_per_step)

        def first_frames(params, new, n_real, frames):  # `admission_frames` on a prefill's lanes
            lanes = new.h.shape[0]
            active = (jnp.arange(lanes) < n_real).astype(new.active.dtype)  # empty lanes: routed to no expert
            rows, new = run_frames(params, dataclasses.replace(new, active=active), lanes, frames)
            return rows, dataclasses.replace(new, active=jnp.ones_like(new.active))

        def mark_free(active, slots):  # free slots' rows route to no expert (DecodeState.active); entries >= S pad
            return active.at[slots].set(0, mode="drop")

        donate = jax.default_backend() != "cpu"
        self.prefiller = Prefiller(model, cfg.max_len, cfg.prefill_chunk, backends,
                                   state_dtype=jnp.dtype(cfg.ssm_state_dtype) if cfg.ssm_state_dtype else None,
                                   by_layer=cfg.prefill_by_layer)
        self._insert = jax.jit(prefill_insert, donate_argnums=(0,) if donate else ())
        self._move = jax.jit(move_slots, donate_argnums=(0,) if donate else ())
        self._mark_free = jax.jit(mark_free, donate_argnums=(0,) if donate else ())
        self._step = jax.jit(decode_step, static_argnums=(2,), donate_argnums=(1,) if donate else ())
        self._first_frames = jax.jit(first_frames, static_argnums=(3,), donate_argnums=(1,) if donate else ())
        self._first_frames_compiled: set[tuple[int, int]] = set()  # (frames, lanes) of the compiled calls
        self._row_shapes = None  # see _empty_state
        self._decode_steps = cfg.decode_steps
        self._codec_shapes = cfg.codec_shapes  # (streams, frames) of the compiled codec calls (fixed by warm_up)
        self.pool: DecodeState | None = None
        self.codec_state = None
        self.slots: list[Request | None] = [None] * S
        self.waiting: deque[Request] = deque()
        self.continuations: deque[Request] = deque()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stop_flag = threading.Event()
        self.draining = False
        self.dead: str | None = None
        self.ready = False
        self.thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._steps_dispatched = 0
        # (step index, rows on the device, dispatch time, the request of each slot it ran over, True), or a prefill's
        # `admission_frames` (its requests' first step, rows, dispatch time, the request of each lane, False), not
        # yet processed, in dispatch order
        self._inflight: deque = deque()
        self._codec_inflight = None  # ([(request, frames)], audio on the device, dispatch time) not yet delivered
        self._stats = self._new_stats()
        self._phases: dict[str, float] = {}  # seconds per phase of the current loop iteration (stall diagnosis)
        self._codec_countdown = cfg.codec_period  # decode steps until the next call for every playing stream
        # moving averages (seconds) of the interval between decode steps and of a codec call's latency: the horizon
        # of the "running dry" rule in `codec_takes`
        self._step_interval_s, self._codec_latency_s, self._last_rows_t = 0.0, 0.0, None

    # ------------------------------------------------------------------------------------------ lifecycle
    def warm_up(self) -> float:
        """Allocate the pools and compile every static shape the loop can use, `compile_threads` compilations at a
        time (XLA compiles outside the GIL). Reference-encode shapes follow `encode_warmup`; the gauge
        drama3_warmup_pending counts the shapes still compiling after ready. Returns seconds spent before ready."""
        t0 = time.perf_counter()
        S, K = self.cfg.max_streams, self.model_cfg.row_width
        self.pool = self._empty_pool()
        self.codec_state = self.codec.reset(self.codec.init_state(S), np.zeros(S, bool))  # compiles the reset too

        def prefill(b):
            rows = np.zeros((b, self.cfg.prefill_chunk, K), np.int32)
            rows[:, :, 0] = self.model_cfg.eos_token_id
            return self.prefiller(rows, np.full((b,), 2, np.int32),
                                  RequestSampling.make([SamplingParams()] * b, list(range(b))))

        def prefill_packed(n, lanes):
            prompt = np.zeros((2, K), np.int32)
            prompt[:, 0] = self.model_cfg.eos_token_id
            return self.prefiller.packed([prompt], RequestSampling.make([SamplingParams()] * lanes,
                                                                        list(range(lanes))), n, lanes)

        def decode_compile(n):  # ahead of time, one job per size, so the sizes compile side by side; the pool is
            # only read for its shapes here, and the compiled executable lands in jit's cache for `decode_run`
            return self._step.lower(self._param_leaves, self.pool, n).compile()

        def decode_run():  # after every compile: each call donates and replaces the pool
            for n in self._decode_steps:
                rows, self.pool = self._step(self._param_leaves, self.pool, n)
            if self.cfg.compact_slots and len(self._decode_steps) > 1:  # the slot moves, all entries padding
                pad = jnp.full((self.cfg.compact_slots,), S, jnp.int32)
                self.pool = self._move(self.pool, pad, pad)
                self.codec_state = self._move(self.codec_state, pad, pad)
            self._free_on_device([])
            return rows

        def codec_step(n, T):  # the serving path on a throwaway state, every row padding
            codes = np.zeros((n, self.model_cfg.num_codebooks, T), np.int32)
            return self.codec.step_slots(self.codec.init_state(S), np.full(n, S), codes, np.zeros(n, np.int32))[0]

        def encode(n):  # reference encodes (serving.references) pad to these lengths
            return self.codec.encode(np.zeros(n * self.codec.frame_length, np.float32), self.codec.cfg.sample_rate,
                                     bucket_frames=self.cfg.encode_bucket_frames)

        jobs = {f"decode step {n} slots": functools.partial(decode_compile, n) for n in self._decode_steps}
        prefills = {f"prefill batch {b}": (b, functools.partial(prefill, b)) for b in self.cfg.batched_prefill_sizes}
        prefills.update({f"prefill packed {n} rows ({lanes} lanes)": (lanes, functools.partial(prefill_packed, n, lanes))
                         for n, lanes in self.cfg.packed_buckets})
        jobs.update({name: fn for name, (_, fn) in prefills.items()})
        jobs.update(self._first_frames_jobs(self.cfg.admission_frames))
        jobs.update({f"codec {n} streams x {T} frames": functools.partial(codec_step, n, T)
                     for n, T in self._codec_shapes})
        encodes = {f"reference encode {n} frames": functools.partial(encode, n) for n in self.cfg.encode_buckets}
        if self.cfg.encode_warmup == "start":
            jobs.update(encodes)
        background = encodes if self.cfg.encode_warmup == "background" else {}

        def timed(name, fn):
            t = time.perf_counter()
            out, what = fn(), "compiled"
            if not isinstance(out, jax.stages.Compiled):  # the jobs that run their shape once
                out, what = jax.block_until_ready(out), "compiled and run"
            log.info("warm-up: %s %s in %.1f s", name, what, time.perf_counter() - t)
            return out

        with ThreadPoolExecutor(max_workers=max(1, self.cfg.compile_threads)) as ex:
            results = {name: ex.submit(timed, name, fn) for name, fn in jobs.items()}
            results = {name: _warm_up_result(name, f, self.cfg) for name, f in results.items()}
        t = time.perf_counter()
        jax.block_until_ready(decode_run())
        log.info("warm-up: decode steps run in %.1f s", time.perf_counter() - t)
        inserts = {b: name for name, (b, _) in prefills.items()}  # the scatter into the pool, all rows dropped
        for b, name in inserts.items():
            self.pool = self._insert(self.pool, results[name], jnp.asarray(np.full((b,), S, np.int32)))
        jax.block_until_ready(self.pool)
        dt = time.perf_counter() - t0
        log.info("warm-up: %d shapes compiled in %.1f s", len(jobs) + len(inserts), dt)
        self.metrics.compile_seconds.set(dt)
        self.metrics.warmup_pending.set(len(background))
        if background:
            threading.Thread(target=self._warm_in_background, args=(background, timed), daemon=True,
                             name="encode-warm-up").start()
        self.ready = True
        return dt

    def _warm_in_background(self, jobs: dict, timed):
        for name, fn in jobs.items():
            try:
                timed(name + " (background)", fn)
            except Exception:  # a failed warm-up compile is retried by the first request that needs the shape
                log.exception("background warm-up of %s failed", name)
            self.metrics.warmup_pending.dec()

    def _empty_state(self, rows: int) -> DecodeState:
        """A DecodeState of `rows` zero rows: the pool's layout, or a prefill's lanes'."""
        if self._row_shapes is None:  # one prefilled row's shapes (traced, not run)
            prompt = np.zeros((1, self.cfg.prefill_chunk, self.model_cfg.row_width), np.int32)
            self._row_shapes = jax.eval_shape(lambda: self.prefiller(prompt, np.full((1,), 2, np.int32),
                                                                     RequestSampling.make([SamplingParams()], [0])))
        return jax.tree.map(lambda x: jnp.zeros((rows,) + x.shape[1:], x.dtype), self._row_shapes)

    def _empty_pool(self) -> DecodeState:
        return self._empty_state(self.cfg.max_streams)

    def _first_frames_jobs(self, frames: int) -> dict[str, Callable[[], Any]]:
        """Warm-up jobs for the `frames`-frame call on a prefill's lanes (`admission_frames`): one per lane count of
        the prefill calls not yet compiled for it, each run once on empty lanes (routed to no expert)."""
        lanes = sorted(set(self.cfg.batched_prefill_sizes) | {n for _, n in self.cfg.packed_buckets})
        todo = [n for n in lanes if frames and (frames, n) not in self._first_frames_compiled]

        def job(n):
            rows, _ = self._first_frames(self._param_leaves, self._empty_state(n), jnp.int32(0), frames)
            self._first_frames_compiled.add((frames, n))
            return rows

        return {f"first frames x{frames} ({n} lanes)": functools.partial(job, n) for n in todo}

    def reconfigure(self, cfg: EngineConfig) -> float:
        """Swap in `cfg` while the engine is idle (no stream active, queued or in flight), keeping its compiled
        shapes and slot pool: `cfg` may differ from the current configuration in POLICY_FIELDS, within the compiled
        codec frame counts in CODEC_SCHEDULE_FIELDS, and in `admission_frames`, whose calls are compiled here when
        new (the ablation harness runs its admission, tick, codec schedule and first-frames rows on one warmed-up
        engine). Returns the seconds spent compiling."""
        if not self.reconfigurable(cfg):
            raise ValueError("reconfigure changes only " + ", ".join(sorted(RECONFIGURABLE_FIELDS))
                             + f" (chunks within the compiled codec shapes {self._codec_shapes}); build a new "
                             + "Engine for "
                             + ", ".join(sorted(changed_fields(cfg, self.cfg) - RECONFIGURABLE_FIELDS)))
        _check_policy(cfg)
        self._check_idle()
        t, jobs = time.perf_counter(), self._first_frames_jobs(cfg.admission_frames)
        # side by side, as warm_up compiles (one full-size decode compile is ~100 s; there is one per lane count)
        with ThreadPoolExecutor(max_workers=max(1, self.cfg.compile_threads)) as ex:
            done = {name: ex.submit(fn) for name, fn in jobs.items()}
            for name, f in done.items():
                jax.block_until_ready(f.result())
                log.info("reconfigure: %s compiled and run", name)
        dt = time.perf_counter() - t if jobs else 0.0
        with self.lock:
            self._check_idle()
            self.cfg = cfg
        return dt

    def _check_idle(self):
        if self.active_count() or self.waiting or self.continuations or self._inflight or self._codec_inflight:
            raise RuntimeError("reconfigure needs an idle engine")

    def reconfigurable(self, cfg: EngineConfig) -> bool:
        """Whether `reconfigure(cfg)` can make the change (see `policy_changes`)."""
        return policy_changes(cfg, self.cfg, self._codec_shapes) is not None

    def start(self):
        if not self.ready:
            self.warm_up()
        self.thread = threading.Thread(target=self._run, name="drama3-engine", daemon=True)
        self.thread.start()

    def shutdown(self, drain_timeout: float = 10.0):
        """Stop admitting; let running streams finish for up to `drain_timeout` s; cancel the rest."""
        self.draining = True
        deadline = time.perf_counter() + drain_timeout
        while time.perf_counter() < deadline and (self.active_count() or self.waiting or self.continuations):
            time.sleep(0.02)
        with self.lock:
            for r in list(self.waiting) + [r for r in self.slots if r is not None]:
                r.cancelled = True
                r.sink("error", "server shutting down")
            self.waiting.clear()
        self.stop_flag.set()
        self.wake.set()
        if self.thread:
            self.thread.join(timeout=30)

    # ------------------------------------------------------------------------------------------ requests
    def submit(self, req: Request) -> Request:
        if self.dead:
            raise RuntimeError(f"engine is dead: {self.dead}")
        if self.draining:
            raise RuntimeError("server is shutting down")
        with self.lock:
            if len(self.waiting) >= self.cfg.max_queue:
                self.metrics.rejected.inc()
                raise QueueFull()
            req.id = req.id or f"req-{next(self._ids)}"
            req.prompt = self._build_prompt(req)
            self.waiting.append(req)
            self.metrics.queue_depth.set(len(self.waiting))
        self.wake.set()
        return req

    def cancel(self, req: Request):
        if not req.finished:
            req.cancelled = True
            self.wake.set()

    def active_count(self) -> int:
        return sum(r is not None for r in self.slots)

    def _build_prompt(self, req: Request) -> np.ndarray:
        history = list(req.previous_takes) + history_for_chunk(req.chunk_index, req.takes)
        rows = build_prompt(self.tok, self.model_cfg, req.chunks[req.chunk_index], req.references, history)
        if len(rows) > self.cfg.max_prompt_rows:
            raise ValueError(f"prompt has {len(rows)} rows; this server allows {self.cfg.max_prompt_rows} "
                             "(shorter references or text)")
        req.prompt_rows = len(rows)
        return rows

    # ------------------------------------------------------------------------------------------ loop
    def _run(self):
        try:
            while not self.stop_flag.is_set():
                self._drop_cancelled_waiting()
                t0 = time.perf_counter()
                admitted = self._admit()
                self._phases["admit"] = time.perf_counter() - t0
                self._log_stats()
                if self.active_count() or self._inflight or self._codec_inflight:
                    self._tick()
                    self._check_stall(time.perf_counter() - t0)
                elif not admitted:
                    self.wake.wait(timeout=self._policy_wait() or 0.05)
                    self.wake.clear()
        except Exception as e:  # the device is in an unknown state: fail every request, report dead
            log.exception("engine died")
            self.dead = repr(e)
            with self.lock:
                for r in list(self.waiting) + [r for r in self.slots if r is not None]:
                    r.sink("error", f"engine failure: {e}")
                self.waiting.clear()

    @staticmethod
    def _new_stats() -> dict:
        return dict(t=time.perf_counter(), steps=0, step_rows=0, codec_calls=0, codec_frames=0,
                    codec_padded_frames=0, prefills=0, prefill_requests=0, queue_wait=[], to_first_audio=[])

    def _log_stats(self):
        """Every `stats_interval_s`: decode steps/s, codec calls (frames used / computed), prefill calls."""
        st, now = self._stats, time.perf_counter()
        if not self.cfg.stats_interval_s or now - st["t"] < self.cfg.stats_interval_s:
            return
        dt = now - st["t"]
        log.info("engine: %.1f decode steps/s (%d frames each, %.0f slots on average), codec %.1f calls/s (%d frames "
                 "of %d computed), prefill %.1f calls/s (%d requests), %d active, %d waiting; time to first audio = "
                 "queue wait p50 %s + admission to first audio p50 %s", st["steps"] / dt,
                 self.cfg.frames_per_step, st["step_rows"] / max(1, st["steps"]), st["codec_calls"] / dt,
                 st["codec_frames"], st["codec_padded_frames"], st["prefills"] / dt, st["prefill_requests"],
                 self.active_count(), len(self.waiting), _p50_ms(st["queue_wait"]), _p50_ms(st["to_first_audio"]))
        self._stats = self._new_stats()

    def _drop_cancelled_waiting(self):
        with self.lock:
            if any(r.cancelled for r in self.waiting):
                self.waiting = deque(r for r in self.waiting if not r.cancelled)
                self.metrics.queue_depth.set(len(self.waiting))

    def _policy_wait(self) -> float | None:
        if not self.waiting:
            return None
        age = time.perf_counter() - self.waiting[0].t_arrival
        return max(0.0, self.cfg.prefill_max_wait_ms / 1e3 - age)

    def _should_admit(self) -> bool:
        if self.continuations:
            return True
        if self.draining:
            return False
        free = self.cfg.max_streams - self.active_count()
        if free == 0 or not self.waiting:
            return False
        new_s = self.cfg.admit_guard_s if self.cfg.admit_guard_new_s is None else self.cfg.admit_guard_new_s
        if not guard_allows(self.slots, time.perf_counter(), self.cfg.admit_guard_s, new_s,
                            new_chunks=self.cfg.codec_bridges + 1):
            return False
        if self.active_count() < self.cfg.prefill_busy_streams:
            return True
        age_ms = (time.perf_counter() - self.waiting[0].t_arrival) * 1e3
        return len(self.waiting) >= self.cfg.prefill_min_batch or age_ms >= self.cfg.prefill_max_wait_ms

    def _admit(self) -> bool:
        if not self._should_admit():
            return False
        free = [i for i, r in enumerate(self.slots) if r is None]
        with self.lock:
            batch, packed = self._take_batch(len(free))
            self.metrics.queue_depth.set(len(self.waiting))
        if not batch:
            return False
        if packed:
            n_rows = sum(len(r.prompt) for r in batch)
            N, B = next((n, lanes) for n, lanes in self.cfg.packed_buckets if n >= n_rows and lanes >= len(batch))
            rows = None
        else:
            B = next(b for b in self.cfg.batched_prefill_sizes if b >= len(batch))
            C = self.cfg.prefill_chunk
            T = -(-max(len(r.prompt) for r in batch) // C) * C
            rows = np.zeros((B, T, self.model_cfg.row_width), np.int32)
        lengths = np.full((B,), 2, np.int32)
        slot_ids = np.full((B,), self.cfg.max_streams, np.int32)  # padding entries are dropped by the scatter
        params, seeds = [SamplingParams()] * B, list(range(B))
        fresh_codec = np.zeros(self.cfg.max_streams, bool)
        for i, r in enumerate(batch):
            s = r.slot if r.slot >= 0 else free.pop(0)
            if rows is not None:
                rows[i, :len(r.prompt)] = r.prompt
            lengths[i] = len(r.prompt)
            slot_ids[i] = s
            params[i], seeds[i] = r.sampling, chunk_seed(r.seed, r.chunk_index)
            if r.slot < 0:
                fresh_codec[s] = True
            r.slot = s
            r.needs_prefill = False
            r.first_step = self._steps_dispatched
            self.slots[s] = r
        t0 = time.perf_counter()
        for r in batch:
            if r.t_admit is None:
                r.t_admit = t0
                self.metrics.queue_wait_seconds.observe(t0 - r.t_arrival)
                self._stats["queue_wait"].append(t0 - r.t_arrival)
        sampling = RequestSampling.make(params, seeds)
        if packed:
            new = self.prefiller.packed([r.prompt for r in batch], sampling, N, B)
        else:
            new = self.prefiller(rows, lengths, sampling)
        if self.cfg.admission_frames:  # its rows are processed in order with the pool steps' (see `_tick`)
            rows, new = self._first_frames(self._param_leaves, new, jnp.int32(len(batch)), self.cfg.admission_frames)
            self._inflight.append((self._steps_dispatched, rows, t0, list(batch), False))
        self.pool = self._insert(self.pool, new, jnp.asarray(slot_ids))
        if fresh_codec.any():
            self.codec_state = self.codec.reset(self.codec_state, fresh_codec)
        self.metrics.prefill_seconds.observe(time.perf_counter() - t0)
        self._stats["prefills"] += 1
        self._stats["prefill_requests"] += len(batch)
        self.metrics.prefill_batch.observe(len(batch))
        self.metrics.active.set(self.active_count())
        return True

    def _take_batch(self, free: int) -> tuple[list[Request], bool]:
        """The requests of the next prefill call, in arrival order: text-chunk continuations (they keep their slots),
        then new requests while slots are free. Returns (requests, packed). Packed (`prefill_packed_rows`, when the
        first prompt fits one chunk): prompts while they fit the largest packed call; a longer prompt starts its own
        call. Else a [batch, chunk] call (with packing on, one long prompt)."""
        C, packs = self.cfg.prefill_chunk, self.cfg.packed_buckets
        if self.continuations:
            first = self.continuations[0]
        elif self.waiting and free and not self.draining:
            first = self.waiting[0]
        else:
            return [], False
        packed = bool(packs) and len(first.prompt) <= C
        cap = packs[-1][1] if packed else self.cfg.batched_prefill_sizes[-1]
        batch: list[Request] = []
        rows = 0
        for q in (self.continuations, self.waiting):
            while q and len(batch) < cap:
                r = q[0]
                if r.slot < 0 and (self.draining or free == 0):
                    break
                if packed and (len(r.prompt) > C or rows + len(r.prompt) > packs[-1][0]):
                    return batch, packed  # it starts the next call: arrival order is kept
                batch.append(q.popleft())
                rows += len(r.prompt)
                free -= r.slot < 0
        return batch, packed

    def _tick(self):
        ph, t = self._phases, time.perf_counter()

        def lap(name):
            nonlocal t
            now = time.perf_counter()
            ph[name] = ph.get(name, 0.0) + now - t
            t = now

        for name in ("dispatch", "rows", "audio", "codec"):
            ph[name] = 0.0
        if self.active_count():
            self._dispatch_step()
        lap("dispatch")
        while len(self._inflight) > (self.cfg.pipeline_depth if self.active_count() else 0):
            self._process_rows(*self._inflight.popleft())  # waits for the step's rows
        lap("rows")
        self._deliver_audio()  # waits for the codec call's PCM
        lap("audio")
        self._dispatch_codec()
        lap("codec")
        if self.cfg.pipeline_depth == 0:
            self._deliver_audio()
            lap("audio")

    def _check_stall(self, seconds: float):
        msg = slow_iteration_message(self._phases, seconds, self.cfg.stall_warn_s)
        if msg:
            self.metrics.stalls.inc()
            log.warning("%s; %d active, %d waiting", msg, self.active_count(), len(self.waiting))

    def _dispatch_step(self):
        t0 = time.perf_counter()
        n = self._decode_steps[-1]
        if len(self._decode_steps) > 1:
            if self.cfg.compact_slots:
                self._compact_slots()
            top = max(s for s, r in enumerate(self.slots) if r is not None)
            n = next(n for n in self._decode_steps if n > top)
        rows, self.pool = self._step(self._param_leaves, self.pool, n)
        self._stats["step_rows"] += n
        self.metrics.step_slots.labels(slots=str(n)).inc()
        self._inflight.append((self._steps_dispatched, rows, t0, self.slots[:n], True))
        self._steps_dispatched += 1

    def _compact_slots(self):
        """Move streams from slots above the smallest decode size that fits them all into free slots below it, at
        most `compact_slots` per call. The device runs the move after the step in flight and before the next one;
        the step in flight keeps its own slot -> request map for its rows."""
        occupied = [s for s, r in enumerate(self.slots) if r is not None]
        if not occupied:
            return
        target = next(n for n in self._decode_steps if n >= len(occupied))
        movers = [s for s in reversed(occupied) if s >= target][:self.cfg.compact_slots]
        if not movers:
            return
        free = [s for s in range(target) if self.slots[s] is None][:len(movers)]
        S, k = self.cfg.max_streams, self.cfg.compact_slots
        src, dst = np.full(k, S, np.int32), np.full(k, S, np.int32)
        src[:len(movers)], dst[:len(movers)] = movers, free
        src, dst = jnp.asarray(src), jnp.asarray(dst)
        self.pool = self._move(self.pool, src, dst)
        self.codec_state = self._move(self.codec_state, src, dst)
        self._free_on_device(movers)
        for a, b in zip(movers, free):
            r = self.slots[a]
            self.slots[a], self.slots[b] = None, r
            r.slot = b
        self.metrics.slot_moves.inc(len(movers))

    def _process_rows(self, step: int, rows, t0: float, owners: list, pool_step: bool = True):
        """Stop rules and frame bookkeeping on the rows [F, n, 1+K] of decode step `step`; owners[s] is the request
        that held slot s when the step was dispatched (slots may have moved since: see `_compact_slots`). Not a pool
        step: the `admission_frames` of a prefill's lanes, owners[s] the request of lane s, `step` their first."""
        rows = np.asarray(rows)  # the one host transfer per step
        if pool_step:
            now = time.perf_counter()
            self.metrics.step_seconds.observe(now - t0)
            if self._last_rows_t is not None and now - self._last_rows_t < 1.0:  # not across an idle spell
                self._step_interval_s = _ema(self._step_interval_s, now - self._last_rows_t)
            self._last_rows_t = now
            self._stats["steps"] += 1
        eos, sem0 = self.model_cfg.eos_token_id, self.model_cfg.semantic_start_token_id
        n_frames = 0
        for s, r in enumerate(owners):
            if r is None or r.finished:
                continue
            if r.cancelled:
                self._release(r.slot, "cancelled")
                continue
            if r.chunk_done or r.needs_prefill or step < r.first_step:
                continue
            for f in range(rows.shape[0]):
                row = rows[f, s]
                forced = r.forced_frames is not None
                limit = r.forced_frames if forced else r.max_frames
                is_eos = row[0] == eos and not (forced or r.ignore_eos)
                if is_eos:
                    if r.held is not None and r.held[0] != sem0:
                        r.pending.append(r.held[1:])
                    r.held = None
                    self._end_chunk(r)
                    break
                if r.held is not None:
                    r.pending.append(r.held[1:])
                r.held = row
                r.frames.append(row[1:])
                n_frames += 1
                if len(r.frames) >= limit:
                    r.pending.append(r.held[1:])
                    r.held = None
                    self._end_chunk(r)
                    break
        self.metrics.frames.inc(n_frames)
        if not pool_step:
            self.metrics.admission_frames.inc(n_frames)

    def _end_chunk(self, r: Request):
        """The current text chunk is done: queue the next chunk (same slot) or mark the request finished."""
        codes = np.stack(r.frames, axis=1) if r.frames else np.zeros((self.model_cfg.num_codebooks, 0), np.int32)
        r.takes.append((r.chunks[r.chunk_index], codes))
        r.frames = []
        r.chunk_done = True

    def _dispatch_codec(self):
        """One streaming-decode call (see the module docstring for when, and for which streams)."""
        self._codec_countdown -= 1
        periodic = self._codec_countdown <= 0
        # the next periodic call's audio lands after the steps still to run plus one codec call
        horizon = (self._codec_countdown + 1) * self._step_interval_s + self._codec_latency_s
        # low load: every call fits the smallest batch, compiled at the low-load chunk too
        low_load = self.cfg.low_load_frames > 0 and self.active_count() <= self.cfg.codec_batches[0]
        cap = self.cfg.low_load_frames if low_load else self.cfg.codec_buckets[-1]
        ready = codec_takes(self.slots, periodic, self.cfg.codec_first_chunk, cap, now=time.perf_counter(),
                            horizon_s=horizon, bridges=self.cfg.codec_bridges,
                            defer_s=self.cfg.codec_defer_s if low_load else None)
        if periodic:
            self._codec_countdown = self.cfg.codec_period
        if not ready:
            return
        n = next(b for b in self.cfg.codec_batches if b >= len(ready))
        T = min(t for b, t in self._codec_shapes if b == n and t >= max(take for _, _, take in ready))
        codes = np.zeros((n, self.model_cfg.num_codebooks, T), np.int32)
        slots = np.full(n, self.cfg.max_streams, np.int32)  # padding rows: out-of-range slot, nothing written
        n_new = np.zeros(n, np.int32)
        for i, (s, r, take) in enumerate(ready):
            codes[i, :, :take] = np.stack(r.pending[:take], axis=1)
            slots[i], n_new[i] = s, take
            del r.pending[:take]
            r.audio_frames += take
            r.audio_chunks += 1
        t0 = time.perf_counter()
        audio, self.codec_state = self.codec.step_slots(self.codec_state, slots, codes, n_new)
        self._codec_inflight = ([(r, take) for _, r, take in ready], audio, t0)

    def _deliver_audio(self):
        """Collect the last codec call's PCM, push it to its requests, then finish the chunks that have ended."""
        if self._codec_inflight is not None:
            owners, audio, t0 = self._codec_inflight
            self._codec_inflight = None
            audio = np.asarray(audio)
            self.metrics.codec_seconds.observe(time.perf_counter() - t0)
            self._codec_latency_s = _ema(self._codec_latency_s, time.perf_counter() - t0)
            used = sum(take for _, take in owners)
            computed = audio.shape[0] * audio.shape[1] // self.codec.frame_length
            self.metrics.codec_frames.labels(kind="used").inc(used)
            self.metrics.codec_frames.labels(kind="computed").inc(computed)
            st = self._stats
            st["codec_calls"] += 1
            st["codec_frames"] += used
            st["codec_padded_frames"] += computed
            fl = self.codec.frame_length
            now = time.perf_counter()
            for i, (r, take) in enumerate(owners):
                if r.t_first_audio is None:
                    r.t_first_audio = now
                    self.metrics.ttfa_seconds.observe(now - r.t_arrival)
                    if r.t_admit is not None:
                        self.metrics.admit_to_first_audio_seconds.observe(now - r.t_admit)
                        self._stats["to_first_audio"].append(now - r.t_admit)
                r.t_audio_end = max(r.t_audio_end, now) + take * fl / self.codec.cfg.sample_rate
                r.sink("audio", audio[i, :take * fl])
        for s, r in enumerate(self.slots):
            if r is None or not r.chunk_done or r.pending:
                continue
            r.chunk_done = False
            if r.chunk_index + 1 == len(r.chunks):
                self._release(s, "done")
                continue
            r.chunk_index += 1  # next chunk of a long text: same slot, same codec stream
            try:
                r.prompt = self._build_prompt(r)
            except ValueError as e:
                r.sink("error", str(e))
                self._release(s, "error")
                continue
            r.needs_prefill = True
            with self.lock:
                self.continuations.append(r)

    def _free_on_device(self, slots):
        """Mark `slots` free in the pool (DecodeState.active = 0), so the decode steps route their rows to no expert
        until a prefill inserts a stream there. One compiled shape: the list is padded to S entries."""
        S = self.cfg.max_streams
        pad = np.full((S,), S, np.int32)
        pad[:len(slots)] = slots
        self.pool = dataclasses.replace(self.pool, active=self._mark_free(self.pool.active, jnp.asarray(pad)))

    def _release(self, s: int, status: str):
        r = self.slots[s]
        self.slots[s] = None
        if r is None:
            return
        self._free_on_device([s])
        r.finished = True
        self.metrics.requests.labels(status=status).inc()
        self.metrics.active.set(self.active_count())
        if status == "done":
            frames = sum(c.shape[1] for _, c in r.takes)
            self.metrics.audio_seconds.inc(frames * self.codec.frame_length / self.codec.cfg.sample_rate)
            r.sink("done", {"input_tokens": r.prompt_rows, "output_tokens": frames,
                            "total_tokens": r.prompt_rows + frames})


def _check_policy(cfg: EngineConfig):
    if cfg.pipeline_depth not in (0, 1):
        raise ValueError(f"pipeline_depth must be 0 or 1, got {cfg.pipeline_depth}")
    if cfg.codec_bridges < 0:
        raise ValueError(f"codec_bridges must be >= 0, got {cfg.codec_bridges}")
    if cfg.admission_frames < 0:
        raise ValueError(f"admission_frames must be >= 0, got {cfg.admission_frames}")
    if cfg.codec_low_load_chunk < 0 or cfg.codec_defer_s < 0:
        raise ValueError("codec_low_load_chunk and codec_defer_s must be >= 0, got "
                         f"{cfg.codec_low_load_chunk} and {cfg.codec_defer_s}")


def codec_takes(slots, periodic: bool, first_chunk: int, cap: int, *, now: float = 0.0, horizon_s: float = 0.0,
                bridges: int = 0, defer_s: float | None = None) -> list[tuple[int, Request, int]]:
    """The streams one codec call decodes, as (slot, request, frames taken), at most `cap` frames of each:
    - at any call, a stream whose first chunk is ready (`first_chunk` pending frames, none decoded yet), and a stream
      that has played at least one and at most `bridges` chunks, has `first_chunk` more pending and whose audio ends
      (`t_audio_end`) within `horizon_s` of `now`, i.e. before the next periodic call's audio can arrive (a bridge).
      A short first chunk would otherwise run dry waiting for the period: gaps of up to ~0.1 s right after the start
      at 128 streams on the H200 (experiments/results/serve_bench_4), and one bridge after a 2-frame first chunk was
      not enough (ablate_2026-12-05/). At most `bridges` per stream, so an overloaded engine does not turn into a
      codec call every step (0: none);
    - on a periodic call also every other playing stream and every stream whose text chunk ended (its flush); with
      `defer_s` (low load), none of those while each of them has at least `defer_s` (and `horizon_s`) of audio
      buffered, fewer than `cap` frames pending and its text chunk still running: their frames wait for a fuller
      call."""
    ready, periodic_only = [], set()  # slots taken only because the call is periodic
    for s, r in enumerate(slots):
        if r is None or not r.pending:
            continue
        enough = len(r.pending) >= first_chunk
        first_ready = r.audio_chunks == 0 and enough
        running_dry = (1 <= r.audio_chunks <= bridges and enough and not r.chunk_done
                       and r.t_audio_end - now < horizon_s)
        if first_ready or running_dry or (periodic and (r.audio_chunks > 0 or r.chunk_done)):
            ready.append((s, r, min(len(r.pending), cap)))
            if not (first_ready or running_dry):
                periodic_only.add(s)
    if defer_s is not None and periodic_only and all(
            not r.chunk_done and len(r.pending) < cap and r.t_audio_end - now >= max(defer_s, horizon_s)
            for s, r, _ in ready if s in periodic_only):
        ready = [e for e in ready if e[0] not in periodic_only]
    return ready


def _warm_up_result(name: str, future, cfg: EngineConfig):
    """A warm-up job's result; running out of GPU memory becomes an error that names the shape and the limits that
    set the memory (the JAX error alone names only an executable)."""
    try:
        return future.result()
    except Exception as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise MemoryError(out_of_memory_message(name, cfg)) from e


def out_of_memory_message(name: str, cfg: EngineConfig) -> str:
    return (f"out of GPU memory while warming up {name} (max_streams {cfg.max_streams}, max_prompt_rows "
            f"{cfg.max_prompt_rows}, max_new_tokens {cfg.max_new_tokens}, codec batches {cfg.codec_batch_sizes}, "
            f"{cfg.compile_threads} warm-up jobs at once): lower --max-streams, --max-new-tokens, --max-prompt-rows, "
            "--codec-batch-sizes or --compile-threads, or raise --gpu-memory-fraction")


def guard_allows(slots, now: float, guard_s: float, guard_new_s: float, new_chunks: int = 1) -> bool:
    """The admission guard: True when every stream that is playing and still generating has at least `guard_s` of
    audio buffered (`t_audio_end - now`), or `guard_new_s` if it has played at most `new_chunks` chunks (its first
    chunk and the bridges of `codec_takes`: the engine passes codec_bridges + 1). A new stream's first chunk is short
    (`codec_first_chunk` frames) and so are its bridges, so with one threshold for all, each admission blocks the next
    until the new streams' next periodic chunk."""
    for r in slots:
        if r is None or r.t_first_audio is None or r.chunk_done:
            continue
        if r.t_audio_end - now < (guard_new_s if r.audio_chunks <= new_chunks else guard_s):
            return False
    return True


def slow_iteration_message(phases: dict[str, float], seconds: float, threshold_s: float) -> str | None:
    """The warning for an engine loop iteration of `seconds` (phase name -> seconds), or None if it was not slow."""
    if not threshold_s or seconds < threshold_s:
        return None
    parts = ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in sorted(phases.items(), key=lambda kv: -kv[1]) if v >= 1e-3)
    return f"engine: slow iteration {1e3 * seconds:.0f} ms ({parts})"


def _p50_ms(seconds: list[float]) -> str:
    return f"{1e3 * float(np.median(seconds)):.0f} ms" if seconds else "-"


def _ema(avg: float, x: float, weight: float = 0.1) -> float:
    """Exponential moving average; the first sample (avg 0) is taken as is."""
    return x if avg == 0.0 else avg + weight * (x - avg)


def new_seed() -> int:
    return int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF


def chunk_seed(seed: int, chunk_index: int) -> int:
    """Seed of text chunk i of a request (the same rule as `drama3_jax.generate.generate`: seed + i)."""
    return (seed + chunk_index) & 0x7FFFFFFF
