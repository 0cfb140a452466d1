"""experiments/codec_throughput.py on the tiny codec (CPU): a timed config and its profile by codec stage."""

from __future__ import annotations

import gzip
import json

import pytest

from experiments import codec_throughput


@pytest.mark.slow  # an experiment harness end to end: the slow tier
def test_timing_and_profile_by_stage(tmp_path):
    rc = codec_throughput.main(["--out", str(tmp_path), "--preset", "tiny", "--configs", "float32:2:4",
                                "--steps", "2", "--repeats", "1", "--profile-steps", "1",
                                "--variants", "default", "pointwise_conv"])
    assert rc == 0
    R = json.loads((tmp_path / "codec_throughput.json").read_text())
    rows = R["results"]
    assert [r["variant"] for r in rows] == ["default", "pointwise_conv"]
    for row in rows:
        assert (row["dtype"], row["batch"], row["chunk_frames"]) == ("float32", 2, 4) and row["ms_per_step"] > 0
    ms = R["profile"]["kernel_ms_per_call"]
    with gzip.open(tmp_path / "hlo_float32_2_4.txt.gz", "rt") as fh:  # the profiled step's compiled HLO
        assert fh.read().startswith("HloModule")
    for stage in codec_throughput.PROFILE_CATEGORIES:
        assert ms.get(stage, 0) > 0, (stage, ms)


def test_bad_config_is_rejected():
    with pytest.raises(SystemExit):
        codec_throughput.main(["--out", "unused", "--configs", "bf16:128"])
