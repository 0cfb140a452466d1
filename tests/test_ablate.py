"""The ablation harness end to end on the tiny model (CPU): JSON + Markdown written, every row served its streams."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_ablation_harness_on_the_tiny_model(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "experiments.ablate", "--out", str(out), "--preset", "tiny",
           "--configs", "ssm_fp32+admission_frames_5", "first_chunk_3", "full", "sync_tick", "--streams", "2",
           "--warmup", "1",
           "--max-new-tokens", "8", "--ref-seconds", "0.5", "1", "--trace-s", "2", "--trace-delay-s", "0",
           "--compilation-cache", os.environ["JAX_COMPILATION_CACHE_DIR"],
           "--engine", "prefill_chunk=64", "prefill_batch_sizes=1,2", "prefill_packed_rows=256", "max_reference_frames=224"]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((out / "ablate.json").read_text())
    table = (out / "ablate.md").read_text()
    rows = {r["name"]: r for r in result["rows"]}
    # full first, then the rows reconfigured on its engine (sync_tick: a policy field; first_chunk_3: the codec
    # schedule, its 3-frame chunks run padded to full's 4-frame calls), then ssm_fp32 with first frames on the
    # prefill lanes (a new engine: a new state dtype; its warm-up compiles the first-frames calls too), the profiled
    # run last (a new engine again)
    fp32_ff = "ssm_fp32+admission_frames_5"
    assert list(rows) == ["full", "first_chunk_3", "sync_tick", fp32_ff, "full_profiled"]
    assert rows[fp32_ff]["engine_config"]["admission_frames"] == 5
    assert result["command"].startswith("python experiments/ablate.py --out $OUT --preset tiny")
    for name, r in rows.items():
        assert r["status"] == "ok", r
        s = r["summary"]
        assert s["audio_s_per_s"] > 0 and s["ok"] == s["requests"] == 2 and s["broken"] == 0 and not s["failures"]
        assert r["engine_config"]["prefill_chunk"] == 64
        assert (r["compile_s"] == 0) == (name in ("sync_tick", "first_chunk_3")), (name, r["compile_s"])
        assert f"| {name} |" in table
    full, sync = (rows[n]["engine_config"] for n in ("full", "sync_tick"))
    assert (full["pipeline_depth"], sync["pipeline_depth"]) == (1, 0)
    assert rows["sync_tick"]["change"] == "pipeline_depth: 1 -> 0"
    assert table.strip() in proc.stdout  # the table is printed last
    assert "persistent compilation cache" in proc.stderr.lower()  # each compile's cache hit / miss, with its key
    trace = rows["full_profiled"]["trace"]  # the profiled window: GPU (here host-thunk) time per module
    assert 0 < trace["busy_share"] <= 1 and trace["kernels"] > 0
    assert trace["module_ms_per_s"]["jit_decode_step"] > 0 and "jit_prefill_step" in trace["module_ms_per_s"]
    assert "by jitted module" in table and not any("trace" in rows[n] for n in ("full", "sync_tick"))


def test_config_rows_compose():
    """'a+b' applies both rows' changes; 'full' and unknown names cannot be joined."""
    import argparse
    import dataclasses

    from experiments.ablate import config_change, config_name
    from serving.engine import EngineConfig

    base = EngineConfig(max_streams=8)
    base = dataclasses.replace(base, backends=dataclasses.replace(base.backends, moe_activations="fp8"))
    off, change = config_change(config_name("prefill_chunk_256+unpacked_prefill+moe_w8a16"))
    cfg = change(base)
    assert (cfg.prefill_chunk, cfg.prefill_packed_rows, cfg.backends.moe_activations) == (256, (), "bf16")
    assert cfg == dataclasses.replace(base, prefill_chunk=256, prefill_packed_rows=(), prefill_batch_sizes=(1, 4, 8),
                                      backends=dataclasses.replace(base.backends, moe_activations="bf16"))
    assert off.count(";") == 2 and "256-row" in off
    assert config_change(config_name("full"))[1](base) == base
    # a pool smaller than the concurrency (the queueing it causes is served: tests/serving/test_server.py)
    pool = config_change(config_name("pool_0.75x"))[1]
    assert [pool(dataclasses.replace(base, max_streams=n)).max_streams for n in (1, 2, 128)] == [1, 1, 96]
    for bad in ("full+moe_w8a16", "moe_w8a16+nope", "nope"):
        with pytest.raises(argparse.ArgumentTypeError):
            config_name(bad)
