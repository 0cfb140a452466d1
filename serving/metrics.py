"""Prometheus metrics of the server and engine (exposed at GET /metrics)."""

from __future__ import annotations

import gc
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0)
log = logging.getLogger(__name__)
_STEP = (0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.queue_depth = Gauge("drama3_queue_depth", "requests waiting for a slot", registry=r)
        self.active = Gauge("drama3_active_streams", "streams holding a slot", registry=r)
        self.requests = Counter("drama3_requests", "finished requests by status", ["status"], registry=r)
        self.rejected = Counter("drama3_rejected", "requests rejected because the queue was full", registry=r)
        self.frames = Counter("drama3_generated_frames", "audio frames generated", registry=r)
        self.admission_frames = Counter("drama3_admission_frames", "frames decoded on a prefill's lanes before "
                                        "their streams joined the decode pool (--admission-frames)", registry=r)
        self.audio_seconds = Counter("drama3_audio_seconds", "seconds of audio delivered", registry=r)
        self.ttfa_seconds = Histogram("drama3_time_to_first_audio_seconds", "arrival to first audio chunk",
                                      buckets=_LATENCY, registry=r)
        # the two parts of the time to first audio: waiting for admission, then prefill + first frames + codec
        self.queue_wait_seconds = Histogram("drama3_queue_wait_seconds", "arrival to the dispatch of its prefill",
                                            buckets=_LATENCY, registry=r)
        self.admit_to_first_audio_seconds = Histogram(
            "drama3_admit_to_first_audio_seconds", "prefill dispatch to first audio chunk (prefill, first frames, "
            "codec)", buckets=_LATENCY, registry=r)
        self.step_seconds = Histogram("drama3_decode_step_seconds", "one decode call (all slots)", buckets=_STEP,
                                      registry=r)
        self.step_slots = Counter("drama3_decode_step_slots", "decode steps dispatched, by the slots they ran over "
                                  "(the pool, or a smaller --decode-sizes step)", ["slots"], registry=r)
        self.slot_moves = Counter("drama3_slot_moves", "streams moved to a lower slot so that the decode step covers "
                                  "fewer slots (--decode-sizes)", registry=r)
        self.prefill_seconds = Histogram("drama3_prefill_seconds", "one prefill batch", buckets=_STEP, registry=r)
        self.prefill_batch = Histogram("drama3_prefill_batch_size", "requests per prefill batch",
                                       buckets=(1, 2, 4, 8, 16, 32), registry=r)
        self.codec_seconds = Histogram("drama3_codec_step_seconds", "one streaming codec call", buckets=_STEP,
                                       registry=r)
        self.codec_frames = Counter("drama3_codec_frames", "stream-frames through the codec: used = real frames, "
                                    "computed = including padding rows and frames", ["kind"], registry=r)
        self.compile_seconds = Gauge("drama3_warmup_compile_seconds", "start-up compilation time", registry=r)
        self.warmup_pending = Gauge("drama3_warmup_pending", "shapes still compiling in the background after ready",
                                    registry=r)
        self.stalls = Counter("drama3_engine_stalls", "engine loop iterations slower than --stall-warn-s (each logged "
                              "with its phase times)", registry=r)
        self.gc_pause_seconds = Histogram("drama3_gc_pause_seconds", "Python garbage collection pauses",
                                          buckets=_STEP, registry=r)
        self.compilations = Counter("drama3_xla_compilations", "XLA backend compilations in this process",
                                    registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class GcPauseMonitor:
    """Times Python's garbage collections (all generations) into a histogram (None: none) and logs those longer
    than `warn_s`. Install once per process; collections run in whatever thread allocates, the engine's included."""

    def __init__(self, histogram, warn_s: float):
        self.histogram, self.warn_s, self._t0 = histogram, warn_s, None

    def __call__(self, phase: str, info: dict):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            dt, self._t0 = time.perf_counter() - self._t0, None
            if self.histogram is not None:
                self.histogram.observe(dt)
            if self.warn_s and dt >= self.warn_s:
                log.warning("garbage collection of generation %d took %.0f ms (%d collected)", info["generation"],
                            1e3 * dt, info["collected"])

    def install(self):
        gc.callbacks.append(self)
        return self

    def uninstall(self):
        if self in gc.callbacks:
            gc.callbacks.remove(self)


def freeze_heap_and_watch_gc(histogram, warn_s: float) -> GcPauseMonitor:
    """Call once the model is built and compiled: move the long-lived heap (model, JAX, executables) out of the
    collector's generations, so a full collection while serving scans only what requests allocate, then time every
    collection from now on (see GcPauseMonitor)."""
    gc.collect()
    gc.freeze()
    return GcPauseMonitor(histogram, warn_s).install()
