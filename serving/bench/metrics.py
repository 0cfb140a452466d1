"""Benchmark metric math: pure functions over recorded request traces.

Definitions (serving-contract.md section 3):
- TTFA = arrival of the first non-empty chunk - send time (vLLM-Omni `audio_ttfp`, benchmarks/patch/patch.py).
- RTF = (arrival of the last chunk - send time) / audio seconds (vLLM-Omni `audio_rtf` uses end of body; the last
  chunk is the same instant up to the chunked terminator).
- Audio seconds = PCM bytes / 2 (s16le) / sample rate, mono. The rate must be the server's (44.1 kHz for Drama 3):
  vLLM-Omni's bench defaults to 24 kHz and overstated Fish throughput 1.8375x (vllm-omni PR #3773).
- Throughput = sum of audio seconds / wall time of the timed window (vLLM-Omni benchmarks/metrics/metrics.py).
- Player: starts at the first chunk, plays at 1x, stalls when its buffer is empty and resumes when data arrives.
  Each stall is a gap; a stream is *broken* if one gap exceeds 100 ms. The total stall time equals vLLM-Omni's
  `max_underrun_s` (largest deficit of bytes received vs. bytes played since the first chunk), and C50/C100/C200
  (sglang-omni benchmarks/metrics/performance.py) are the shares of streams whose total stall is <= 50/100/200 ms.
- Burst and steady state (ours, beside the published definitions above): a closed loop at concurrency C sends its
  first C requests at once. `ttfa_after_burst_ms` is the TTFA of the requests sent after those C; `steady_audio_s_per_s`
  is the audio that arrives between the first audio of the last of those C requests and the last send, per second of
  that window (the loop is full and still refilled; the start-up burst and the drain at the end are outside it).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np

BYTES_PER_SAMPLE = 2  # s16le mono
BROKEN_GAP_S = 0.1
CONTINUITY_MS = (50, 100, 200)


@dataclasses.dataclass
class Trace:
    """One request as the client saw it. Times are seconds on one monotonic clock; chunks are (arrival, bytes)."""

    id: str
    send: float
    chunks: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    end: float | None = None
    status: int | None = None  # HTTP status, None if no response arrived
    error: str | None = None  # transport / stream error after or instead of a status
    expected_bytes: int | None = None  # forced_frames * frame bytes, when the length was forced

    @property
    def audio_bytes(self) -> int:
        return sum(n for _, n in self.chunks)

    def failure_key(self) -> str | None:
        """None for a good stream, else the HTTP status, 'stream_error:<kind>', 'empty' or 'short'."""
        if self.status is not None and self.status != 200:
            return str(self.status)
        if self.error is not None:
            return f"stream_error:{self.error}" if self.status == 200 else f"error:{self.error}"
        if self.audio_bytes == 0:
            return "empty"
        if self.expected_bytes is not None and self.audio_bytes < self.expected_bytes:
            return "short"
        return None


def audio_seconds(n_bytes: int, sample_rate: int) -> float:
    return n_bytes / BYTES_PER_SAMPLE / sample_rate


def ttfa(t: Trace) -> float:
    """Seconds from send to the first non-empty chunk."""
    return next(a for a, n in t.chunks if n > 0) - t.send


def rtf(t: Trace, sample_rate: int) -> float:
    """(last chunk - send) / audio seconds."""
    return (t.chunks[-1][0] - t.send) / audio_seconds(t.audio_bytes, sample_rate)


def playback_gaps(chunks: list[tuple[float, int]], sample_rate: int) -> list[tuple[float, float]]:
    """Starvation gaps (start, length) of a 1x player that starts at the first non-empty chunk and stalls on empty."""
    gaps = []
    play_end = None  # when the buffered audio runs out
    for arrival, n in chunks:
        if n <= 0:
            continue
        dur = audio_seconds(n, sample_rate)
        if play_end is None:
            play_end = arrival + dur
        elif arrival > play_end:
            gaps.append((play_end, arrival - play_end))
            play_end = arrival + dur
        else:
            play_end += dur
    return gaps


def start_gap(chunks: list[tuple[float, int]], sample_rate: int) -> float:
    """The player's stall right after the first chunk (before the second non-empty one arrives), 0 if none: the gap a
    server's chunk schedule causes at the start, told apart from stalls later in the stream."""
    audio = [(a, n) for a, n in chunks if n > 0]
    if len(audio) < 2:
        return 0.0
    (a0, n0), (a1, _) = audio[:2]
    return max(0.0, a1 - (a0 + audio_seconds(n0, sample_rate)))


def request_metrics(t: Trace, sample_rate: int) -> dict:
    """Per-request numbers of a good stream (see module doc)."""
    gaps = playback_gaps(t.chunks, sample_rate)
    return {"id": t.id, "ttfa_s": ttfa(t), "rtf": rtf(t, sample_rate),
            "audio_s": audio_seconds(t.audio_bytes, sample_rate), "latency_s": t.chunks[-1][0] - t.send,
            "n_chunks": len(t.chunks), "n_gaps": len(gaps), "max_gap_s": max((g for _, g in gaps), default=0.0),
            "underrun_s": sum(g for _, g in gaps), "start_gap_s": start_gap(t.chunks, sample_rate)}


def percentile(values, q: float) -> float:
    """Linear-interpolated percentile (numpy default, as vLLM's bench), NaN when empty."""
    return float(np.percentile(values, q)) if len(values) else math.nan


def _burst(traces: list[Trace], concurrency: int) -> list[Trace]:
    """The first `concurrency` requests sent: the closed loop's start-up burst."""
    return sorted(traces, key=lambda t: t.send)[:concurrency]


def steady_window(traces: list[Trace], concurrency: int) -> tuple[float, float]:
    """(start, end) of the steady window (module doc); start >= end when the round never reaches it."""
    start = max((t.send + ttfa(t) for t in _burst(traces, concurrency) if any(n > 0 for _, n in t.chunks)),
                default=math.inf)
    return start, max((t.send for t in traces), default=-math.inf)


def round_summary(traces: list[Trace], sample_rate: int, frame_samples: int, concurrency: int) -> dict:
    """Aggregate one timed round: wall window from the first send to the last chunk/end of any request.
    `concurrency`: the closed loop's streams (the size of the burst at the start; see the module doc)."""
    good = [t for t in traces if t.failure_key() is None]
    per = [request_metrics(t, sample_rate) for t in good]
    ends = [t.end if t.end is not None else (t.chunks[-1][0] if t.chunks else t.send) for t in traces]
    wall = max(ends) - min(t.send for t in traces) if traces else math.nan
    audio = sum(p["audio_s"] for p in per)
    ttfas, rtfs, under = ([p[k] for p in per] for k in ("ttfa_s", "rtf", "underrun_s"))
    n = len(per)
    burst = {id(t) for t in _burst(traces, concurrency)}
    later = [1e3 * p["ttfa_s"] for t, p in zip(good, per) if id(t) not in burst]
    t0, t1 = steady_window(traces, concurrency)
    steady = sum(b for t in good for at, b in t.chunks if t0 <= at < t1)
    return {
        "requests": len(traces), "ok": n,
        "failures": dict(Counter(k for t in traces if (k := t.failure_key()) is not None)),
        "wall_s": wall, "audio_s": audio,
        "audio_s_per_s": audio / wall if wall > 0 else math.nan,
        "frames_per_s": audio * sample_rate / frame_samples / wall if wall > 0 else math.nan,
        "ttfa_ms": {f"p{q}": 1e3 * percentile(ttfas, q) for q in (50, 90, 99)} | {"mean": _mean(ttfas, 1e3)},
        "ttfa_after_burst_ms": {f"p{q}": percentile(later, q) for q in (50, 90)},
        "steady_audio_s_per_s": (audio_seconds(steady, sample_rate) / (t1 - t0) if t1 > t0 else math.nan),
        "rtf": {"p50": percentile(rtfs, 50), "p90": percentile(rtfs, 90), "mean": _mean(rtfs)},
        "broken": sum(p["max_gap_s"] > BROKEN_GAP_S for p in per),
        # of those, the streams whose stall right after the first chunk already breaks them
        "broken_at_start": sum(p["start_gap_s"] > BROKEN_GAP_S for p in per),
        "start_gaps": sum(p["start_gap_s"] > 0 for p in per),
        "underrun_events": sum(p["n_gaps"] for p in per),
        "underrun_total_s": sum(under),
        "underrun_ms": {"p50": 1e3 * percentile(under, 50), "p99": 1e3 * percentile(under, 99)},
        "continuity": {f"C{ms}": (sum(u <= ms / 1e3 for u in under) / n if n else math.nan) for ms in CONTINUITY_MS},
    }


def _mean(values, scale: float = 1.0) -> float:
    return scale * float(np.mean(values)) if len(values) else math.nan


def average_rounds(rounds: list[dict]) -> dict:
    """Mean over rounds of every numeric leaf; counts (requests, ok, broken, events, failures) are summed."""
    summed = {"requests", "ok", "broken", "broken_at_start", "start_gaps", "underrun_events"}
    out: dict = {"rounds": len(rounds)}
    for key, first in rounds[0].items():
        if key == "failures":
            out[key] = dict(sum((Counter(r[key]) for r in rounds), Counter()))
        elif isinstance(first, dict):
            out[key] = {k: float(np.mean([r[key][k] for r in rounds])) for k in first}
        elif key in summed:
            out[key] = sum(r[key] for r in rounds)
        else:
            out[key] = float(np.mean([r[key] for r in rounds]))
    return out
