"""Serving benchmark (issue #9): request sets, streaming client, metric math, reports. CLI: scripts/bench_serve.py."""
