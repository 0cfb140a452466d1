"""Benchmark outputs: results.json, traces.jsonl, table.md and PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from serving.bench.metrics import Trace, audio_seconds, playback_gaps, ttfa

# vLLM-Omni's published Drama 3 result (PR #8933, one H200; issue #9): 1,088 Seed-TTS-Eval English requests.
PUBLISHED = {64: {"audio_s_per_s": 162.0, "rtf": 0.375, "ttfa_p50_ms": 198.0, "broken": None},
             128: {"audio_s_per_s": 222.2, "rtf": 0.515, "ttfa_p50_ms": 255.0, "broken": 0}}


def _clean(x):
    """NaN -> None, recursively (JSON has no NaN)."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(_clean(obj), indent=2) + "\n")


def trace_rows(level: int, rnd: int, traces: list[Trace]) -> list[dict]:
    """Raw per-request timings, seconds from the round's first send."""
    t0 = min(t.send for t in traces)
    return [{"concurrency": level, "round": rnd, "id": t.id, "send": t.send - t0,
             "chunks": [[a - t0, n] for a, n in t.chunks], "end": None if t.end is None else t.end - t0,
             "status": t.status, "error": t.error, "failure": t.failure_key()} for t in traces]


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def markdown_table(levels: list[dict]) -> str:
    """One row per concurrency level (means over rounds), beside the published figures."""
    head = ("| streams | rounds | ok / failed | audio s/s | frames/s | TTFA p50 / p90 / p99 ms | RTF p50 / p90 / mean "
            "| broken (at start) | C50 / C100 / C200 | underrun s | published audio s/s / RTF / TTFA p50 ms / broken "
            "| steady audio s/s | TTFA p50 / p90 ms after the burst |\n"
            "|---:|---:|---:|---:|---:|---|---|---:|---|---:|---|---:|---|\n")
    rows = []
    for lv in levels:
        m, c = lv["mean"], lv["concurrency"]
        pub = PUBLISHED.get(c)
        pub_s = (f"{pub['audio_s_per_s']:.1f} / {pub['rtf']:.3f} / {pub['ttfa_p50_ms']:.0f} / "
                 f"{_f(pub['broken'], 'd')}" if pub else "-")
        t, r, k, la = m["ttfa_ms"], m["rtf"], m["continuity"], m["ttfa_after_burst_ms"]
        rows.append(
            f"| {c} | {m['rounds']} | {m['ok']} / {sum(m['failures'].values())} | {_f(m['audio_s_per_s'], '.2f')} "
            f"| {_f(m['frames_per_s'], '.1f')} | {_f(t['p50'], '.0f')} / {_f(t['p90'], '.0f')} / "
            f"{_f(t['p99'], '.0f')} | {_f(r['p50'], '.3f')} / {_f(r['p90'], '.3f')} / {_f(r['mean'], '.3f')} "
            f"| {m['broken']} ({m.get('broken_at_start', '-')}) | {_f(k['C50'], '.0%')} / {_f(k['C100'], '.0%')} / {_f(k['C200'], '.0%')} "
            f"| {_f(m['underrun_total_s'], '.2f')} | {pub_s} | {_f(m['steady_audio_s_per_s'], '.2f')} "
            f"| {_f(la['p50'], '.0f')} / {_f(la['p90'], '.0f')} |")
    return head + "\n".join(rows) + "\n"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_scaling(levels: list[dict], path: Path) -> None:
    """Throughput and median TTFA vs concurrency, with the published points."""
    plt = _plt()
    cs = [lv["concurrency"] for lv in levels]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(cs, [lv["mean"]["audio_s_per_s"] for lv in levels], "o-", label="measured")
    b.plot(cs, [lv["mean"]["ttfa_ms"]["p50"] for lv in levels], "o-", label="measured p50")
    b.plot(cs, [lv["mean"]["ttfa_ms"]["p90"] for lv in levels], "s--", label="measured p90")
    pc = sorted(PUBLISHED)
    a.plot(pc, [PUBLISHED[c]["audio_s_per_s"] for c in pc], "k*", ms=10, label="vLLM-Omni published")
    b.plot(pc, [PUBLISHED[c]["ttfa_p50_ms"] for c in pc], "k*", ms=10, label="vLLM-Omni published p50")
    ticks = sorted(set(cs) | set(pc))
    for ax, ylabel in ((a, "audio seconds / wall second"), (b, "time to first audio (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, labels=[str(t) for t in ticks])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ttfa_cdf(traces_by_level: dict[int, list[Trace]], path: Path) -> None:
    """Empirical CDF of time to first audio, one curve per concurrency level (all rounds)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for c, traces in traces_by_level.items():
        v = np.sort([1e3 * ttfa(t) for t in traces if t.failure_key() is None])
        if len(v):
            ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=f"{c} streams")
    ax.set_xlabel("time to first audio (ms)")
    ax.set_ylabel("share of requests")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_gap_timeline(traces: list[Trace], sample_rate: int, path: Path, title: str, max_streams: int = 64) -> None:
    """Per stream: waiting for first audio (grey), playing (green), starved (red); up to max_streams good streams
    evenly spaced in send order."""
    plt = _plt()
    good = sorted((t for t in traces if t.failure_key() is None), key=lambda t: t.send)
    shown = good[::math.ceil(len(good) / max_streams)] if good else []
    t0 = min((t.send for t in traces), default=0.0)
    fig, ax = plt.subplots(figsize=(10, 1.5 + 0.12 * len(shown)))
    for y, t in enumerate(shown):
        first = next(a for a, n in t.chunks if n > 0)
        gaps = playback_gaps(t.chunks, sample_rate)
        play = audio_seconds(t.audio_bytes, sample_rate) + sum(g for _, g in gaps)
        ax.broken_barh([(t.send - t0, first - t.send)], (y - 0.4, 0.8), color="0.8")
        ax.broken_barh([(first - t0, play)], (y - 0.4, 0.8), color="tab:green")
        if gaps:
            ax.broken_barh([(s - t0, g) for s, g in gaps], (y - 0.4, 0.8), color="tab:red")
    ax.set_xlabel("seconds since the round started")
    ax.set_ylabel("stream")
    ax.set_title(title + "  (grey: waiting, green: playing, red: starved)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
