"""Run the protocol: per concurrency level (optionally on a fresh server), warm-up requests first and dropped, then
R timed rounds of the whole request set; write results.json, traces.jsonl, table.md and plots."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from contextlib import nullcontext
from pathlib import Path

from tqdm import tqdm

from serving.bench import report
from serving.bench.client import Sampling, run_batch
from serving.bench.dataset import BenchRequest, warmup_requests
from serving.bench.launcher import LaunchedServer
from serving.bench.metrics import BROKEN_GAP_S, Trace, average_rounds, round_summary

log = logging.getLogger("bench")
FRAME_SAMPLES = 2048


@dataclasses.dataclass
class BenchConfig:
    base_url: str
    concurrency: list[int]
    rounds: list[int]  # one per level
    warmup: int
    out: Path
    sampling: Sampling
    forced_lengths: bool = False
    sample_rate: int = 44100
    launch: str | None = None
    launch_timeout: float = 1800.0
    timeout: float = 600.0
    model: str | None = None
    source: str = ""


def run_level(cfg: BenchConfig, c: int, rounds: int, reqs: list[BenchRequest],
              warm: list[BenchRequest]) -> tuple[dict, list[list[Trace]]]:
    """Warm-ups (dropped), then `rounds` timed passes over reqs at concurrency c."""
    bar = tqdm(total=len(warm) + rounds * len(reqs), desc=f"{c} streams", unit="req", dynamic_ncols=True)

    def batch(items):
        return asyncio.run(run_batch(cfg.base_url, items, c, cfg.sampling, cfg.forced_lengths, model=cfg.model,
                                     timeout=cfg.timeout, frame_samples=FRAME_SAMPLES,
                                     on_done=lambda _t: bar.update()))

    with bar:
        warm_traces = batch(warm) if warm else []
        per_round = [batch(reqs) for _ in range(rounds)]
    summaries = [round_summary(t, cfg.sample_rate, FRAME_SAMPLES, c) for t in per_round]
    level = {"concurrency": c,
             "warmup": {"requests": len(warm_traces),
                        "failed": sum(t.failure_key() is not None for t in warm_traces)},
             "rounds": summaries, "mean": average_rounds(summaries)}
    return level, per_round


def run(cfg: BenchConfig, reqs: list[BenchRequest]) -> dict:
    """The whole benchmark; returns what results.json holds."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    warm = warmup_requests(reqs, cfg.warmup)
    levels, traces_by_level = [], {}
    with open(cfg.out / "traces.jsonl", "w") as traces_file:
        for c, rounds in zip(cfg.concurrency, cfg.rounds):
            server = (LaunchedServer(cfg.launch, cfg.base_url, c, cfg.out / f"server_c{c}.log", cfg.launch_timeout)
                      if cfg.launch else nullcontext())
            with server:
                level, per_round = run_level(cfg, c, rounds, reqs, warm)
            levels.append(level)
            traces_by_level[c] = [t for r in per_round for t in r]
            for i, traces in enumerate(per_round):
                for row in report.trace_rows(c, i, traces):
                    traces_file.write(json.dumps(row) + "\n")
            m = level["mean"]
            log.info("%d streams: %.2f audio s/s, TTFA p50 %.0f ms, RTF p50 %.3f, %d broken, failures %s", c,
                     m["audio_s_per_s"], m["ttfa_ms"]["p50"], m["rtf"]["p50"], m["broken"], m["failures"])
            report.plot_gap_timeline(per_round[0], cfg.sample_rate, cfg.out / f"gaps_c{c}.png",
                                     f"{c} streams, round 1")
            # rewritten after every level, so a run cut short keeps the levels it finished
            results = {"config": _config_record(cfg, len(reqs)), "published": report.PUBLISHED, "levels": levels}
            report.write_json(cfg.out / "results.json", results)
            (cfg.out / "table.md").write_text(report.markdown_table(levels))
    report.plot_scaling(levels, cfg.out / "throughput_ttfa.png")
    report.plot_ttfa_cdf(traces_by_level, cfg.out / "ttfa_cdf.png")
    return results


def _config_record(cfg: BenchConfig, n: int) -> dict:
    return {"base_url": cfg.base_url, "source": cfg.source, "requests_per_round": n,
            "concurrency": cfg.concurrency, "rounds": cfg.rounds, "sampling": dataclasses.asdict(cfg.sampling),
            "forced_lengths": cfg.forced_lengths, "launch": cfg.launch,
            "warmup": {"requests": cfg.warmup, "protocol": "distinct requests (row i's reference with row i+1's "
                       "text), sent first at the level's concurrency on each fresh server, excluded from metrics"},
            "sample_rate": cfg.sample_rate, "frame_samples": FRAME_SAMPLES,
            "player": {"start": "first chunk", "speed": 1.0, "broken_gap_s": BROKEN_GAP_S,
                       "continuity": "share of streams whose total stall <= 50/100/200 ms"}}
