"""experiments/append_attention_bench.py end to end on tiny shapes in interpret mode (slow tier): both layouts at 1
and 3 streams, the kernel within bf16 rounding of the separate ops (whose attention runs on the decode kernel) and
the same cache rows written."""

from __future__ import annotations

import json

import pytest

from experiments import append_attention_bench


@pytest.mark.slow
def test_smoke_run_writes_both_layouts(tmp_path):
    append_attention_bench.main(["--out", str(tmp_path), "--smoke", "--streams", "1,3", "--chain", "2",
                                 "--repeats", "2"])
    R = json.loads((tmp_path / "append_attention_bench.json").read_text())
    assert [(r["streams"], r["layout"]) for r in R["rows"]] == [(1, "backbone"), (1, "tower"), (3, "backbone"),
                                                              (3, "tower")]
    for r in R["rows"]:
        assert r["ref_us"] > 0 and r["kernel_us"] > 0 and r["roofline_us"] >= 0  # rounds to 0 at tiny shapes
        assert r["out_rel_err"] < 1e-2 and r["k_row_rel_err"] == 0
    assert "| 3 | tower |" in (tmp_path / "append_attention_bench.md").read_text()
