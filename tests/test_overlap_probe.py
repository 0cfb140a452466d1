"""experiments/overlap_probe.py: its argument check (CI) and an end-to-end run on the tiny preset (slow tier)."""

from __future__ import annotations

import argparse
import json

import pytest

from experiments import overlap_probe


def test_shape_arguments():
    assert overlap_probe.parse_pair("128:8") == (128, 8)
    assert overlap_probe.parse_pair("0:0") == (0, 0)
    for bad in ("0:8", "4:0", "-1:2"):
        with pytest.raises(argparse.ArgumentTypeError):
            overlap_probe.parse_pair(bad)


@pytest.mark.slow
def test_tiny_run_times_each_pair(tmp_path):
    assert overlap_probe.main(["--out", str(tmp_path), "--preset", "tiny", "--slots", "3", "--codec", "2:4",
                               "--prefill", "128:2", "--prefill-chunk", "64", "--prefill-max-len", "80",
                               "--context", "16", "--max-len", "64", "--windows", "1", "--per-window", "1"]) == 0
    R = json.loads((tmp_path / "overlap_probe.json").read_text())
    assert R["decode_ms"] > 0 and set(R["pairs"]) == {"codec", "prefill"}
    for pair in R["pairs"].values():
        assert pair["alone_ms"] > 0 and pair["with_decode_ms"] > 0
        assert pair["serial_ms"] == pytest.approx(R["decode_ms"] + pair["alone_ms"])
        assert pair["overlap"] == pytest.approx(
            (pair["serial_ms"] - pair["with_decode_ms"]) / min(R["decode_ms"], pair["alone_ms"]))
    assert "xla_gpu_command_buffer_scheduling_mode" in R["xla_flags"]
