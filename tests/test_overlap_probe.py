"""experiments/overlap_probe.py: its argument check (CI) and an end-to-end run on the tiny preset (slow tier)."""

from __future__ import annotations

import argparse
import json

import pytest

from experiments import overlap_probe


def test_codec_shape_argument():
    assert overlap_probe.parse_codec("128:8") == (128, 8)
    for bad in ("0:8", "4:0", "-1:2"):
        with pytest.raises(argparse.ArgumentTypeError):
            overlap_probe.parse_codec(bad)


@pytest.mark.slow
def test_tiny_run_writes_the_three_timings(tmp_path):
    assert overlap_probe.main(["--out", str(tmp_path), "--preset", "tiny", "--slots", "3", "--codec", "2:4",
                               "--context", "16", "--max-len", "64", "--windows", "1", "--per-window", "1"]) == 0
    R = json.loads((tmp_path / "overlap_probe.json").read_text())
    assert R["decode_ms"] > 0 and R["codec_ms"] > 0 and R["both_ms"] > 0
    assert R["serial_ms"] == pytest.approx(R["decode_ms"] + R["codec_ms"])
    assert R["overlap"] == pytest.approx((R["serial_ms"] - R["both_ms"]) / min(R["decode_ms"], R["codec_ms"]))
    assert "xla_gpu_command_buffer_scheduling_mode" in R["xla_flags"]
