"""experiments/decode_profile.py on the tiny preset (CPU): the timing table and the trace breakdown by category."""

from __future__ import annotations

import gzip
import json

import pytest

from experiments import decode_profile


@pytest.mark.slow
def test_timing_and_profile_phases(tmp_path):
    common = ["--out", str(tmp_path), "--preset", "tiny", "--slots", "3", "--context", "16", "--max-len", "64"]
    decode_profile.main(common + ["--phase", "timing", "--variants", "pallas_bf16"])
    timing = json.loads((tmp_path / "decode_timing.json").read_text())
    (row,) = timing["rows"]
    assert "error" not in row, row.get("error")
    assert row["slots"] == 3 and row["step_ms"] > 0 and row["roofline_ms"] > 0
    assert "| pallas_bf16 | 3 |" in (tmp_path / "decode_timing.md").read_text()
    assert (tmp_path / "decode_timing.png").stat().st_size > 0

    decode_profile.main(common[:5] + ["2", "--pool", "5"] + common[6:] + ["--phase", "timing", "--rounds", "3"])
    (row,) = json.loads((tmp_path / "decode_timing.json").read_text())["rows"]  # 2 rows of 5, timed 3 times
    assert "error" not in row, row.get("error")
    assert (row["slots"], row["pool"]) == (2, 5) and row["step_ms"] > 0
    assert len(row["step_ms_rounds"]) == 3 and row["step_ms"] == sorted(row["step_ms_rounds"])[1]
    assert "| pallas_bf16 | 2 of 5 |" in (tmp_path / "decode_timing.md").read_text()

    decode_profile.main(common + ["--phase", "profile", "--variants", "pallas_bf16", "--profile-steps", "2"])
    (row,) = json.loads((tmp_path / "decode_profile.json").read_text())["rows"]
    assert "error" not in row, row.get("error")
    ms = row["kernel_ms_per_step"]
    for category in ("moe_experts", "gdn_core", "attention_core", "sampling", "tower", "backbone"):
        assert ms.get(category, 0) > 0, (category, ms)
    assert sum(ms.values()) > row["unattributed_ms_per_step"]  # most thunk time maps to a named scope
    assert row["categories"]["moe_experts"]["bytes"] > 0
    scopes = {name: (ms_, n) for name, ms_, n in row["by_scope"]}
    assert any("moe_experts" in name and n > 0 for name, (_, n) in scopes.items())
    assert sum(ms_ for ms_, _ in scopes.values()) <= sum(ms.values()) + 1e-6  # a split of the attributed time
    assert "By op" in (tmp_path / "decode_profile.md").read_text()
    assert (tmp_path / "decode_profile.png").stat().st_size > 0
    with gzip.open(tmp_path / "hlo_pallas_bf16_3.txt.gz", "rt") as fh:  # the fusions behind the kernel names
        assert fh.read().startswith("HloModule")


@pytest.mark.slow
def test_rounds_run_in_place_when_the_card_cannot_hold_another_state(tmp_path, monkeypatch):
    """--rounds on a card without room for a second state: each run's rounds are timed at once, in a row."""
    monkeypatch.setattr(decode_profile, "room_for_another", lambda state: False)
    decode_profile.main(["--out", str(tmp_path), "--preset", "tiny", "--slots", "2", "--context", "16", "--max-len",
                         "64", "--phase", "timing", "--variants", "pallas_bf16", "--rounds", "3"])
    (row,) = json.loads((tmp_path / "decode_timing.json").read_text())["rows"]
    assert "error" not in row, row.get("error")
    assert row["rounds_in_place"] and len(row["step_ms_rounds"]) == 3
    assert row["step_ms"] == sorted(row["step_ms_rounds"])[1]


def test_variant_patches_hold_while_open_and_are_undone():
    from kernels.gdn import pallas_triton
    from kernels.moe import routing, routing_triton

    before = (routing.RANK_MAX_PAIRS, routing_triton.MAX_PAIRS, dict(pallas_triton.TUNING["decode"]))
    stack = decode_profile.variant_patches("pallas_bf16_w8a8_fused_argsort_xlashift")
    assert routing.RANK_MAX_PAIRS == routing_triton.MAX_PAIRS == 0
    assert pallas_triton.TUNING["decode"]["conv_shift"] == "xla"
    assert pallas_triton.TUNING["decode"]["bv"] == before[2]["bv"]  # the rest of the row kept
    stack.close()
    assert (routing.RANK_MAX_PAIRS, routing_triton.MAX_PAIRS, pallas_triton.TUNING["decode"]) == before
    decode_profile.variant_patches("pallas_bf16").close()  # a variant without patches


def test_moe_small_pair_variants_add_a_w8a8_row_for_few_streams():
    """The MoE tile variants put one row for <= 64 pairs (up to eight streams) in front of the W8A8 rows: narrow
    gate/up N tiles quantising in-kernel; more pairs keep the table's prequant row; closing the patch restores it."""
    from kernels.moe import pallas_triton
    from kernels.moe.tuning import TRITON_TABLE, pick

    before = pallas_triton.TRITON_TABLE
    stack = decode_profile.variant_patches("pallas_bf16_w8a8_fused_moe_gu16")
    small = pick(pallas_triton.TRITON_TABLE, 8, fp8=True, act_fp8=True)
    assert (small.gu_block_n, small.gu_warps, small.prequant) == (16, 1, False)
    assert pick(pallas_triton.TRITON_TABLE, 65, fp8=True, act_fp8=True) == pick(TRITON_TABLE, 65, True, True)
    stack.close()
    assert pallas_triton.TRITON_TABLE is before
    assert pick(before, 8, fp8=True, act_fp8=True).prequant


def test_kernels_replayed_without_an_hlo_op_are_found_by_kernel_name():
    """Trace events of kernels replayed from a command buffer carry only the kernel name: a fusion's kernel name is
    its instruction name with '.' and '-' as '_', a Pallas kernel's the `name` of its custom call's backend config."""
    from experiments.decode_profile import kernel_names_from_hlo, op_names_from_hlo
    hlo = "\n".join([
        '  %loop_transpose_fusion.22 = bf16[8,512]{1,0} fusion(%p), kind=kLoop, calls=%f, '
        'metadata={op_name="jit(prefill_step)/backbone/gdn_core/transpose"}',
        '  ROOT %custom-call.7 = f32[64]{0} custom-call(%x), custom_call_target="__gpu$xla.gpu.triton", '
        'metadata={op_name="jit(prefill_step)/backbone/moe_experts/pallas_call"}, '
        'backend_config={"name":"moe_gate_up_swiglu","ir":"abc","num_warps":4}',
        '  %add.3 = f32[64]{0} add(%a, %b)',
        '  %pallas_call.758 = s32[8]{0} custom-call(%l), custom_call_target="__gpu$xla.gpu.triton", '
        'metadata={op_name="jit(step)/sampling/sample_main_ras/pallas_call"}, '
        'backend_config={"name":"sample_main_ras","ir":"abc"}',
        '  %pallas_call.9 = s32[8]{0} custom-call(%l), custom_call_target="__gpu$xla.gpu.triton", '
        'api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(step)/tower/sampling/sample_filtered/pallas_call"}, '
        'backend_config={grid_x = 8 : i32, ir = "abc", name = "sample_filtered", num_warps = 8 : i32}',
    ])
    k = kernel_names_from_hlo(hlo)
    assert k["loop_transpose_fusion_22"] == "jit(prefill_step)/backbone/gdn_core/transpose"
    assert k["moe_gate_up_swiglu"] == "jit(prefill_step)/backbone/moe_experts/pallas_call"
    assert k["custom_call_7"] == k["moe_gate_up_swiglu"] and "add_3" not in k
    assert k["sample_main_ras"] == "jit(step)/sampling/sample_main_ras/pallas_call"   # jax names it pallas_call.N
    assert k["sample_filtered"] == "jit(step)/tower/sampling/sample_filtered/pallas_call"   # typed-FFI config
    assert op_names_from_hlo(hlo)["loop_transpose_fusion.22"] == k["loop_transpose_fusion_22"]
