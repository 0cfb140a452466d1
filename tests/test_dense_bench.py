"""experiments/dense_bench.py: the decode step's projection shapes, the sweep's candidates, a tiny CPU run."""

from __future__ import annotations

import json

import pytest

from drama3_jax.config import preset
from experiments import dense_bench
from kernels.dense.pallas_triton import check_shapes


def test_step_shapes_of_the_full_model():
    fused = dense_bench.step_shapes(preset("full"))  # the server's layout (Drama3Model.fuse_projections)
    assert fused[(12352, 2048)] == 30  # GDN in_proj_{qkv, z, b, a}
    assert fused[(1344, 2048)] == 40  # router + shared expert gate/up + its gate, 64-aligned
    assert fused[(12288, 2048)] == 13  # tower w1 + w3
    uses = dense_bench.step_shapes(preset("full"), fused=False)
    assert uses[(8192, 2048)] == 30 + 10  # GDN in_proj_qkv + attention q_proj (with its gate)
    assert uses[(4096, 2048)] == 30 + 9  # GDN in_proj_z + the 9 tower heads
    assert uses[(512, 2048)] == 2 * 40 + 2 * 10  # shared expert gate/up, attention k/v
    assert uses[(256, 2048)] == 40 and uses[(1, 2048)] == 40  # router, shared-expert gate
    assert uses[(6144, 2048)] == 2 * 13 and uses[(2048, 6144)] == 13  # tower FFN
    for (n, k) in uses | fused:
        for m in (1, 128):
            for cfg in dense_bench.sweep_configs(n, k, m):
                check_shapes(m, n, k, cfg)
                assert 64 <= (n // cfg.block_n) * cfg.split_k <= 1056 and cfg.swap_ab == (m <= 64)


@pytest.mark.slow  # an experiment harness end to end: the slow tier
def test_tiny_run_writes_table(tmp_path):
    res = dense_bench.main(["--out", str(tmp_path), "--preset", "tiny", "--rows", "4", "--reps", "1"])
    assert res["rows"] and all(r["xla"]["ms"] > 0 for r in res["rows"])
    assert json.loads((tmp_path / "dense_bench.json").read_text())["preset"] == "tiny"
    assert "| M | XLA ms/step |" in (tmp_path / "dense_bench.md").read_text()
