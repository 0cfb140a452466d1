"""experiments/prefill_timing.py on the tiny preset (CPU): every variant timed and profiled, with a roofline."""

from __future__ import annotations

import gzip
import json

import pytest

from experiments import prefill_timing
from serving.engine import EngineConfig


@pytest.mark.slow
def test_prefill_timing_table(tmp_path):
    rc = prefill_timing.main(["--out", str(tmp_path), "--preset", "tiny", "--batch", "2", "--chunk", "512",
                              "--calls", "1", "--prompts", "3", "--max-len", "1030",
                              "--profile-calls", "1", "--variants", "default", "no_skip", "packed", "packed_by_layer"])
    assert rc == 0
    R = json.loads((tmp_path / "prefill_timing.json").read_text())
    assert [(r["variant"], r["batch"]) for r in R["rows"]] == [("default", 2), ("no_skip", 2), ("packed", 2),
                                                                ("packed_by_layer", 2)]
    assert 150 < R["length_mean"] < 500  # the synthetic set's prompts, built by the server's prompt builder
    for r in R["rows"]:
        assert "error" not in r, r.get("error")
        assert r["ms"] > 0 and r["roofline_ms"] > 0 and 0 < r["valid_rows"] <= r["padded_rows"]
    assert R["rows"][0]["backends"]["moe_skip_padding"] and not R["rows"][1]["backends"]["moe_skip_padding"]
    packed = R["rows"][2]
    assert packed["prompts"] == 2 and packed["padded_rows"] == packed["packed_rows"] == 1024  # the (1024, 2) bucket
    assert packed["valid_rows"] <= 1024 and packed["lanes"] == 1024 // EngineConfig.prefill_lane_rows == 2
    by_layer = R["rows"][3]  # the same call, one call per layer; not profiled (its kernels are in other modules)
    assert by_layer["packed_rows"] == 1024 and by_layer["prompts"] == 2 and "profile" not in by_layer
    md = (tmp_path / "prefill_timing.md").read_text()
    assert "| no_skip | 2 |" in md and "by category" in md
    ms = R["rows"][0]["profile"]["kernel_ms_per_call"]
    with gzip.open(tmp_path / "hlo_default_2.txt.gz", "rt") as fh:  # the profiled call's compiled HLO
        assert fh.read().startswith("HloModule")
    for category in ("moe_experts", "gdn_core", "attention_core", "backbone", "tower"):
        assert ms.get(category, 0) > 0, (category, ms)


def test_every_patch_variant_names_an_existing_switch():
    """Each PATCHES variant patches a module value that exists, with a value of its type (a renamed switch would
    otherwise be patched in vain: mock.patch.object fails only when the variant runs on the device)."""
    import importlib

    for name, (base, patches) in prefill_timing.PATCHES.items():
        assert base == "packed", name
        for module, attr, key, value in patches:
            current = getattr(importlib.import_module(module), attr)
            if key is None:
                assert type(current) is type(value), (name, attr)
            else:
                assert set(value) <= set(current[key]), (name, attr, key)
