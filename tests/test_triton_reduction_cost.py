"""experiments/triton_reduction_cost.py compiles its three search variants for sm_90 on a CPU and writes its table."""

import json

from experiments import triton_reduction_cost as trc


def test_reports_every_variant(tmp_path):
    assert trc.main(["--out", str(tmp_path), "--pivots", "4"]) == 0
    rows = json.loads((tmp_path / "triton_reduction_cost.json").read_text())["rows"]
    assert [(r["variant"], r["pivots"], r["halvings_per_pass"]) for r in rows] == [
        ("scalar", 1, 1), ("vector", 4, 2), ("split", 4, 2)]
    for r in rows:
        assert r["registers"] > 0 and r["bar_sync"] > 0 and r["shfl_sync"] > 0, r
    # each variant's pass holds its reductions: the scalar one's single sum is the fewest barriers
    assert rows[0]["bar_sync"] < min(r["bar_sync"] for r in rows[1:])
    assert "| vector | 4 | 2 |" in (tmp_path / "triton_reduction_cost.md").read_text()
