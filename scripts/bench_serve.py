"""Streaming TTS serving benchmark for any OpenAI-compatible /v1/audio/speech server (raw PCM streaming).

Reproduces vLLM-Omni's published Drama 3 protocol (one H200): 1,088 English voice-cloning requests per round
(reference as codes + transcript), temperature 1.0, top_p 0.9, top_k 30, max_new_tokens 500, a fresh server per
concurrency level, 8 warm-up requests dropped, 3 rounds at 64 streams and 5 at 128, averaged:

    drama3-bench --requests seedtts_en.jsonl --concurrency 64 128 --rounds 3 5 --warmup 8 --out bench-out \\
        --launch "python -m serving.launch --checkpoint CKPT --port {port} --max-streams {concurrency}"

Request sets: --requests FILE.jsonl (rows: text, ref_text, ref_audio_codes [10][T], optional forced_frames, id),
--requests meta.lst --codes-dir DIR (Seed-TTS-Eval; DIR/<prompt wav stem>.npy from `python -m drama3_jax.codec
encode`), or --synthetic N --seed S (English, 8-30 words, 3-10 s references of random codes).
Random-weight models: --forced-lengths sends ignore_eos + forced_frames (the row's, else 8.6 per word, capped at
--max-new-tokens); the server must run with --benchmark-mode.
Outputs in --out: results.json, traces.jsonl, table.md, throughput_ttfa.png, ttfa_cdf.png, gaps_c<N>.png.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from serving.bench.client import Sampling
from serving.bench.dataset import RequestFileError, load_jsonl, load_seedtts, synthetic
from serving.bench.runner import BenchConfig, run


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="drama3-bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--requests", metavar="FILE", help="request set: .jsonl, or Seed-TTS-Eval meta.lst")
    src.add_argument("--synthetic", type=int, metavar="N", help="generate N synthetic English requests")
    ap.add_argument("--codes-dir", help="with --requests meta.lst: directory of <prompt wav stem>.npy codes")
    ap.add_argument("--seed", type=int, default=0, help="seed of --synthetic")
    ap.add_argument("--ref-seconds", type=float, nargs=2, default=[3.0, 10.0], metavar=("MIN", "MAX"),
                    help="reference length range of --synthetic")
    ap.add_argument("--codebook-sizes", type=int, nargs=2, default=[4096, 1024], metavar=("SEMANTIC", "RESIDUAL"),
                    help="code ranges: codebook 0 < SEMANTIC, 1..9 < RESIDUAL (tiny test model: 64 48)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--rounds", type=int, nargs="+", default=[1],
                    help="timed rounds: one value for every level, or one per --concurrency value")
    ap.add_argument("--warmup", type=int, default=8, help="distinct warm-up requests sent first and dropped")
    ap.add_argument("--out", default="bench-out", help="output directory")
    ap.add_argument("--launch", metavar="CMD",
                    help="start this server per level ({port}, {concurrency} substituted), wait for /health, stop it")
    ap.add_argument("--launch-timeout", type=float, default=1800.0, help="seconds to wait for /health")
    ap.add_argument("--forced-lengths", action="store_true", help="send ignore_eos + forced_frames")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--top-k", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=500)
    ap.add_argument("--sample-rate", type=int, default=44100,
                    help="PCM rate for audio durations; must be the server's (Drama 3: 44100)")
    ap.add_argument("--model", help="'model' field to send (default: none, the server's own)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request read timeout, seconds")
    return ap


def load_requests(args, ap: argparse.ArgumentParser):
    sizes = tuple(args.codebook_sizes)
    if args.synthetic is not None:
        if args.synthetic < 1:
            ap.error("--synthetic needs N >= 1")
        return synthetic(args.synthetic, args.seed, sizes, ref_seconds=tuple(args.ref_seconds)), \
            f"synthetic {args.synthetic} (seed {args.seed})"
    try:
        if args.requests.endswith(".lst"):
            if not args.codes_dir:
                ap.error("--requests meta.lst needs --codes-dir")
            return load_seedtts(args.requests, args.codes_dir, sizes), args.requests
        return load_jsonl(args.requests, sizes), args.requests
    except RequestFileError as e:
        ap.error(str(e))


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if len(args.rounds) not in (1, len(args.concurrency)):
        ap.error("--rounds takes one value or one per --concurrency value")
    if min(args.concurrency) < 1 or min(args.rounds) < 1 or args.warmup < 0:
        ap.error("--concurrency and --rounds must be >= 1, --warmup >= 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("httpx", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    reqs, source = load_requests(args, ap)
    cfg = BenchConfig(base_url=args.base_url, concurrency=args.concurrency,
                      rounds=args.rounds * len(args.concurrency) if len(args.rounds) == 1 else args.rounds,
                      warmup=args.warmup, out=Path(args.out),
                      sampling=Sampling(args.temperature, args.top_p, args.top_k, args.max_new_tokens),
                      forced_lengths=args.forced_lengths, sample_rate=args.sample_rate, launch=args.launch,
                      launch_timeout=args.launch_timeout, timeout=args.timeout, model=args.model, source=source)
    try:
        results = run(cfg, reqs)
    except RuntimeError as e:  # a launched server that did not come up
        print(f"drama3-bench: {e}", file=sys.stderr)
        return 1
    print((cfg.out / "table.md").read_text())
    dead = [lv["concurrency"] for lv in results["levels"] if lv["mean"]["ok"] == 0]
    if dead:
        print(f"drama3-bench: no successful request at concurrency {dead}", file=sys.stderr)
    return 1 if dead else 0


if __name__ == "__main__":
    sys.exit(main())
