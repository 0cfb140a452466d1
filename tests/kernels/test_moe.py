"""Routed-expert (MoE) backends vs the plain-jnp reference, on CPU (Pallas kernels in interpret mode).

Shapes are scaled down (H 256, I 128) but keep the real structure: 128x128 FP8 scale blocks, distinct top-k experts per
token, ragged groups. Self-contained: needs no conftest fixture.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.moe import api
from kernels.moe.pallas_triton import moe_experts_pallas_triton
from kernels.moe.reference import moe_experts_reference
from kernels.moe.routing import expert_block_schedule, max_row_blocks
from kernels.moe.testing import random_expert_weights, random_routing, rel_err
from kernels.moe.tuning import TRITON_TABLE, TritonMoeConfig, pick

H, I = 256, 128
TOL = 1e-2  # bf16 operands, fp32 accumulation; the kernel also rounds y to bf16 before the k-sum
# small tiles so that even these shapes run several N tiles and K steps per program
CFG = TritonMoeConfig(block_m=8, gu_block_n=64, gu_block_k=128, dn_block_n=128, dn_block_k=64)

_seed = iter(range(10_000, 20_000))


def _key():
    return jax.random.PRNGKey(next(_seed) + int(np.random.default_rng().integers(1 << 20)))


def _run_poisoned(x, ids, tw, w, cfg, **options):
    """The kernel layer with its (token, slot) rows y aliased to a NaN-poisoned buffer: (out, y [T * k, H]), after
    checking that every row was written."""
    M = ids.size
    y_init = jnp.full((M + cfg.block_m, H), jnp.nan, jnp.bfloat16)
    out, y = moe_experts_pallas_triton(x, ids, tw, w, config=cfg, interpret=True, y_init=y_init, return_y=True,
                                       **options)
    assert bool(jnp.all(jnp.isfinite(y[:M].astype(jnp.float32)))), "some (token, slot) rows of y were not written"
    return out, y[:M]


def _inputs(T, E, k, fp8, **routing):
    w = random_expert_weights(_key(), E, H, I, fp8=fp8)
    x = jax.random.normal(_key(), (T, H), jnp.float32).astype(jnp.bfloat16)
    ids, tw = random_routing(_key(), T, E, k, **routing)
    return x, ids, tw, w


# (T, E, k, routing): T not a multiple of the block, zero-token experts, all tokens on one expert, a single token
CASES = [
    (13, 8, 2, {}),
    (37, 16, 4, dict(only_experts=[1, 2, 5, 6, 9, 11])),  # 10 of 16 experts get no token
    (21, 8, 3, dict(force_expert=5)),  # every token routes to expert 5 (21 rows, 3 blocks of 8 on one expert)
    (1, 16, 4, {}),
]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("T,E,k,routing", CASES, ids=["ragged", "empty_experts", "one_expert", "T1"])
def test_pallas_triton_matches_reference(T, E, k, routing, fp8):
    x, ids, tw, w = _inputs(T, E, k, fp8, **routing)
    M = T * k
    # poison y (aliased to the kernel output): every real row must be overwritten
    y_init = jnp.full((M + CFG.block_m, H), jnp.nan, jnp.bfloat16)
    out, y = moe_experts_pallas_triton(x, ids, tw, w, config=CFG, interpret=True, y_init=y_init, return_y=True)
    ref = moe_experts_reference(x, ids, tw, w)
    assert out.shape == (T, H) and out.dtype == x.dtype
    assert bool(jnp.all(jnp.isfinite(y[:M].astype(jnp.float32)))), "some (token, slot) rows of y were not written"
    assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
    err = rel_err(out, ref)
    assert err < TOL, err
    # per-slot check: y rows are the router-weighted expert outputs (catches a permutation that the k-sum would hide)
    single = moe_experts_reference(jnp.repeat(x, k, axis=0), ids.reshape(M, 1), tw.reshape(M, 1), w)
    assert rel_err(y[:M], single) < TOL


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_pallas_triton_swap_ab_f16_variant(fp8):
    """The swapped orientation (W . x^T, weights on the MMA's M side) and the f16 gate/up path for FP8 weights."""
    import dataclasses

    cfg = dataclasses.replace(CFG, swap_ab=True, gu_f16=True)
    x, ids, tw, w = _inputs(29, 16, 4, fp8, only_experts=[0, 3, 4, 7, 8, 15])
    M = 29 * 4
    y_init = jnp.full((M + cfg.block_m, H), jnp.nan, jnp.bfloat16)
    out, y = moe_experts_pallas_triton(x, ids, tw, w, config=cfg, interpret=True, y_init=y_init, return_y=True)
    assert bool(jnp.all(jnp.isfinite(y[:M].astype(jnp.float32))))
    assert rel_err(out, moe_experts_reference(x, ids, tw, w)) < TOL


def test_api_backends_agree():
    x, ids, tw, w = _inputs(19, 16, 4, fp8=True)
    ref = api.moe_experts(x, ids, tw, w, backend="reference")
    assert api.BACKENDS["pallas"] is api.BACKENDS["pallas_triton"]
    out = api.moe_experts(x, ids, tw, w, backend="pallas", interpret=True, config=CFG)
    assert rel_err(out, ref) < TOL
    assert rel_err(api.moe_experts(x, ids, tw, w, backend="xla_ragged_dot"), ref) < TOL
    with pytest.raises(ValueError):
        api.moe_experts(x, ids, tw, w, backend="nope")


def test_default_table_config_runs():
    """The tuning table's own decode config (bigger tiles than CFG) at a shape where its tiles fit."""
    x, ids, tw, w = _inputs(9, 8, 2, fp8=True)
    cfg = pick(TRITON_TABLE, 9 * 2, fp8=True)
    assert cfg.block_m == 16 and cfg.gu_f16
    assert pick(TRITON_TABLE, 8192 * 8, fp8=False).block_m == 128
    out = moe_experts_pallas_triton(x, ids, tw, w, interpret=True)
    assert rel_err(out, moe_experts_reference(x, ids, tw, w)) < TOL


@pytest.mark.parametrize("T,E,k,bm,routing", [
    (50, 16, 4, 8, {}),
    (7, 32, 8, 16, {}),  # every token's 8 experts distinct: up to 32 non-empty experts, 56 pairs
    (40, 8, 2, 16, dict(force_expert=3)),
    (16, 64, 4, 4, {}),
])
def test_block_schedule_covers_every_pair_once(T, E, k, bm, routing):
    ids, _ = random_routing(_key(), T, E, k, **routing)
    s = expert_block_schedule(ids, E, bm)
    M = T * k
    assert s.num_blocks == max_row_blocks(M, E, bm)
    flat = np.asarray(ids).reshape(-1)
    order = np.asarray(s.order)
    be, r0, nr = (np.asarray(a) for a in (s.block_expert, s.block_row0, s.block_rows))
    seen = []
    for b in range(s.num_blocks):
        if be[b] < 0:
            assert nr[b] == 0
            continue
        assert 1 <= nr[b] <= bm
        rows = order[r0[b]: r0[b] + nr[b]]
        assert np.all(flat[rows] == be[b]), "a block spans two experts"
        seen.extend(rows.tolist())
    assert sorted(seen) == list(range(M))
    used = be >= 0
    assert np.all(used[: used.sum()]), "unused blocks must come last"


@pytest.mark.parametrize("order", ["rank", "count", "argsort"])
@pytest.mark.parametrize("T,E,k,routing,masked", [(128, 256, 8, {}, 0), (33, 16, 4, dict(force_expert=5), 0),
                                                  (1, 8, 2, {}, 0), (40, 16, 4, {}, 13), (6, 8, 2, {}, 6)])
def test_block_schedule_order_is_the_stable_expert_sort(monkeypatch, order, T, E, k, routing, masked):
    """Every way of ordering the pairs (the rank count at decode sizes; above RANK_MAX_PAIRS the cumsum counting
    sort, or an argsort) gives the stable sort by expert, padded with the indices M..M+block_m-1; pairs routed
    nowhere (id E, here the last `masked` tokens, k of them per token) sort after every routed pair and are in no
    block."""
    from kernels.moe import routing as routing_mod

    monkeypatch.setattr(routing_mod, "RANK_MAX_PAIRS", 1 << 20 if order == "rank" else 0)
    monkeypatch.setattr(routing_mod, "LARGE_ORDER", "argsort" if order == "argsort" else "count")
    ids, _ = random_routing(_key(), T, E, k, **routing)
    ids = ids.at[T - masked:].set(E)
    bm = 16
    s = jax.jit(lambda i: expert_block_schedule(i, E, bm))(ids)
    flat = np.asarray(ids).reshape(-1)
    M = flat.size
    want = np.concatenate([np.argsort(flat, kind="stable"), np.arange(M, M + bm)])
    np.testing.assert_array_equal(np.asarray(s.order), want)
    assert int(np.asarray(s.block_rows).sum()) == (T - masked) * k


@pytest.mark.parametrize("order", ["rank", "count"])
def test_block_schedule_order_with_ids_repeated_within_a_token(monkeypatch, order):
    """Ids drawn with replacement (an expert twice in one token, which top-k never gives but the schedule accepts):
    still the stable sort by expert."""
    from kernels.moe import routing as routing_mod

    monkeypatch.setattr(routing_mod, "RANK_MAX_PAIRS", 1 << 20 if order == "rank" else 0)
    T, E, k, bm = 50, 6, 4, 8
    ids = jax.random.randint(_key(), (T, k), 0, E + 1, jnp.int32)  # E too: routed nowhere
    s = jax.jit(lambda i: expert_block_schedule(i, E, bm))(ids)
    flat = np.asarray(ids).reshape(-1)
    want = np.concatenate([np.argsort(flat, kind="stable"), np.arange(flat.size, flat.size + bm)])
    np.testing.assert_array_equal(np.asarray(s.order), want)


@pytest.mark.parametrize("backend,T", [("pallas_triton", 29), ("pallas_triton", 6), ("reference", 29),
                                       ("xla_ragged_dot", 29)])
def test_padding_rows_are_skipped_and_zero(backend, T):
    """valid=False rows (prompt padding, free decode slots) come out 0 and the valid rows exactly as without the mask;
    the Pallas backend routes them to no expert, so no (token, slot) row of theirs is computed. T = 6: few pairs,
    the one-program schedule reads the mask (as int, as DecodeState.active)."""
    E, k = 16, 4
    x, ids, tw, w = _inputs(T, E, k, fp8=True)
    n = 17 if T > 17 else T - 2
    valid = jnp.arange(T) < n
    if T <= 8:
        valid = valid.astype(jnp.int32)
    opts = dict(config=CFG, interpret=True) if backend == "pallas_triton" else {}
    full = api.moe_experts(x, ids, tw, w, backend=backend, **opts)
    out = api.moe_experts(x, ids, tw, w, backend=backend, valid=valid, **opts)
    assert bool((out[n:] == 0).all()) and bool((out[:n] == full[:n]).all())
    assert float(jnp.abs(out[:n].astype(jnp.float32)).max()) > 0
    if backend == "pallas_triton":  # the padding rows' pairs are never written (the poison stays)
        M = T * k
        y_init = jnp.full((M + CFG.block_m, H), jnp.nan, jnp.bfloat16)
        _, y = moe_experts_pallas_triton(x, ids, tw, w, valid=valid, config=CFG, interpret=True, y_init=y_init,
                                         return_y=True)
        written = np.isfinite(np.asarray(y[:M].astype(jnp.float32))).all(axis=1)
        np.testing.assert_array_equal(written, np.repeat(np.asarray(valid) != 0, k))


@pytest.mark.parametrize("T,E,k,bm,routing,masked", [
    (1, 256, 8, 16, {}, 0),  # one stream: the serving case this program is for
    (8, 256, 8, 16, {}, 0),  # the most pairs it takes (64)
    (3, 256, 8, 16, dict(force_expert=7), 0),  # every pair on one expert: 24 rows, two blocks
    (6, 16, 4, 8, {}, 2),  # pairs routed nowhere (prompt padding)
    (5, 8, 2, 16, dict(only_experts=[1, 6]), 5),  # every pair routed nowhere
    (7, 32, 8, 4, {}, 0),
])
def test_one_program_schedule_equals_the_xla_schedule(T, E, k, bm, routing, masked):
    """kernels/moe/routing_triton.py (interpret mode) gives the XLA schedule bit for bit: order, block experts, first
    rows and row counts."""
    from kernels.moe.routing_triton import expert_block_schedule_triton

    ids, _ = random_routing(_key(), T, E, k, **routing)
    ids = ids.at[T - masked:].set(E)
    want = expert_block_schedule(ids, E, bm)
    got = expert_block_schedule_triton(ids, E, bm, interpret=True)
    for field in ("order", "block_expert", "block_row0", "block_rows"):
        np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)), field)


@pytest.mark.parametrize("T,E,k,free_rows,as_int", [
    (1, 256, 8, [0], True),       # one free decode slot
    (8, 256, 8, [1, 5, 6], True),  # 64 pairs, three free slots
    (3, 16, 8, [2], False),       # 24 pairs padded to 32 inside the program
    (5, 8, 2, [], True),          # every row active
])
def test_one_program_schedule_takes_a_row_mask(T, E, k, free_rows, as_int):
    """valid [T] given to the one-program schedule equals routing the masked rows' pairs to no expert (id E) in the
    XLA schedule, bit for bit; int (DecodeState.active) or bool masks."""
    from kernels.moe.routing_triton import expert_block_schedule_triton

    ids, _ = random_routing(_key(), T, E, k)
    valid = np.ones(T, bool)
    valid[free_rows] = False
    want = expert_block_schedule(jnp.where(jnp.asarray(valid)[:, None], ids, E), E, 16)
    mask = jnp.asarray(valid.astype(np.int32) if as_int else valid)
    got = expert_block_schedule_triton(ids, E, 16, valid=mask, interpret=True)
    for field in ("order", "block_expert", "block_row0", "block_rows"):
        np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)), field)


def test_one_program_schedule_is_used_for_few_pairs_and_lowers_for_h200():
    """The MoE layer takes the one-program schedule up to MAX_PAIRS pairs and the XLA one above; the program
    compiles for sm_90a without spills at 8 and 64 pairs; more pairs than it takes are refused."""
    from kernels.h200_lowering import capture_ttirs, compile_ttir
    from kernels.moe.routing_triton import MAX_PAIRS, expert_block_schedule_triton

    def kernels_of(T):
        x, ids, tw, w = _inputs(T, 16, 4, fp8=False)
        return str(jax.make_jaxpr(lambda *a: moe_experts_pallas_triton(*a, config=CFG, interpret=True))(x, ids, tw, w))

    assert "moe_block_schedule" in kernels_of(MAX_PAIRS // 4)
    assert "moe_block_schedule" not in kernels_of(MAX_PAIRS // 4 + 1)
    for T in (1, 8):
        (ttir,) = capture_ttirs(lambda i: expert_block_schedule_triton(i, 256, 16).order, jnp.zeros((T, 8), jnp.int32))
        res, _ = compile_ttir(ttir, 4, 1)
        assert res["spill_bytes"] == 0, res
        (ttir,) = capture_ttirs(lambda i, v: expert_block_schedule_triton(i, 256, 16, valid=v).order,
                                jnp.zeros((T, 8), jnp.int32), jnp.ones((T,), jnp.int32))  # with the row mask
        res, _ = compile_ttir(ttir, 4, 1)
        assert res["spill_bytes"] == 0, res
    with pytest.raises(ValueError, match="at most"):
        expert_block_schedule_triton(jnp.zeros((MAX_PAIRS + 1, 1), jnp.int32), 256, 16)


def test_block_schedule_worst_case_bound_is_tight():
    """E experts with one pair each: every block holds one row, and the bound is exactly reached."""
    E, bm = 24, 8
    ids = jnp.arange(E, dtype=jnp.int32).reshape(E, 1)
    s = expert_block_schedule(ids, E, bm)
    assert s.num_blocks == E
    assert np.all(np.asarray(s.block_expert) == np.arange(E))


@pytest.mark.parametrize("T,E,k,routing", CASES[:3], ids=["ragged", "empty_experts", "one_expert"])
@pytest.mark.parametrize("swap_ab", [False, True], ids=["ab", "swap_ab"])
def test_pallas_triton_w8a8_matches_reference(T, E, k, routing, swap_ab):
    """W8A8: activations quantised per (row, 128 columns) in the kernel, FP8 x FP8 GEMMs; against the reference that
    quantises the same way (fp32 GEMMs), and within FP8 error of the bf16-activation reference."""
    import dataclasses

    cfg = dataclasses.replace(CFG, dn_block_k=128, swap_ab=swap_ab)
    x, ids, tw, w = _inputs(T, E, k, fp8=True, **routing)
    M = T * k
    out, y = _run_poisoned(x, ids, tw, w, cfg, act_fp8=True)
    ref = moe_experts_reference(x, ids, tw, w, act_fp8=True)
    assert rel_err(out, ref) < TOL
    single = moe_experts_reference(jnp.repeat(x, k, axis=0), ids.reshape(M, 1), tw.reshape(M, 1), w, act_fp8=True)
    assert rel_err(y, single) < TOL
    # the quantisation is real (not a no-op) and its error is FP8-sized
    err_a16 = rel_err(out, moe_experts_reference(x, ids, tw, w))
    assert 1e-3 < err_a16 < 0.1, err_a16


@pytest.mark.parametrize("T,E,k,routing", CASES, ids=["ragged", "empty_experts", "one_expert", "T1"])
def test_pallas_triton_w8a8_prequant_matches_in_kernel_quantisation(T, E, k, routing):
    """prequant (x quantised once outside, the SwiGLU output quantised in the gate/up epilogue and passed as e4m3 +
    scales) is the same math as quantising every tile inside the K loops: equal outputs, every row written, and the
    W8A8 reference within bf16 tolerance."""
    import dataclasses

    cfg = dataclasses.replace(CFG, gu_block_n=128, dn_block_k=128, prequant=True)
    x, ids, tw, w = _inputs(T, E, k, fp8=True, **routing)
    out, _ = _run_poisoned(x, ids, tw, w, cfg, act_fp8=True)
    in_kernel = moe_experts_pallas_triton(x, ids, tw, w, config=dataclasses.replace(cfg, prequant=False),
                                          act_fp8=True, interpret=True)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(in_kernel, np.float32))
    assert rel_err(out, moe_experts_reference(x, ids, tw, w, act_fp8=True)) < TOL


def test_w8a8_takes_the_input_groups_made_beforehand():
    """x_fp8 (the e4m3 groups kernels/norm writes with the layer's RMSNorm): the Pallas layer and the reference use
    them as given. The same groups as their own quantisation give the same output; other groups (x scaled by 2)
    change it the way scaling x does."""
    import dataclasses

    from kernels.moe.quant import quantize_groups_fp8

    cfg = dataclasses.replace(CFG, gu_block_n=128, dn_block_k=128, prequant=True)
    x, ids, tw, w = _inputs(9, 8, 2, fp8=True)
    own = moe_experts_pallas_triton(x, ids, tw, w, config=cfg, act_fp8=True, interpret=True)
    given = moe_experts_pallas_triton(x, ids, tw, w, config=cfg, act_fp8=True, interpret=True,
                                      x_fp8=quantize_groups_fp8(x.astype(jnp.bfloat16)))
    np.testing.assert_array_equal(np.asarray(given, np.float32), np.asarray(own, np.float32))
    ref = moe_experts_reference(x, ids, tw, w, act_fp8=True)
    ref_given = moe_experts_reference(x, ids, tw, w, act_fp8=True, x_fp8=quantize_groups_fp8(x.astype(jnp.bfloat16)))
    np.testing.assert_array_equal(np.asarray(ref_given, np.float32), np.asarray(ref, np.float32))
    q2, s2 = quantize_groups_fp8((2 * x).astype(jnp.bfloat16))
    doubled = moe_experts_pallas_triton(x, ids, tw, w, config=cfg, act_fp8=True, interpret=True, x_fp8=(q2, s2))
    want = moe_experts_pallas_triton(2 * x, ids, tw, w, config=cfg, act_fp8=True, interpret=True)
    np.testing.assert_array_equal(np.asarray(doubled, np.float32), np.asarray(want, np.float32))
    assert rel_err(doubled, own) > 0.1


def test_w8a8_prequant_rules():
    import dataclasses

    x, ids, tw, w = _inputs(5, 8, 2, fp8=True)
    cfg = dataclasses.replace(CFG, gu_block_n=128, dn_block_k=128, prequant=True)
    with pytest.raises(ValueError, match="needs act_fp8"):
        moe_experts_pallas_triton(x, ids, tw, w, config=cfg, interpret=True)
    with pytest.raises(ValueError, match="gu_block_n must be 128"):
        moe_experts_pallas_triton(x, ids, tw, w, config=dataclasses.replace(cfg, gu_block_n=64), act_fp8=True,
                                  interpret=True)
    with pytest.raises(ValueError, match="swap_ab"):
        moe_experts_pallas_triton(x, ids, tw, w, config=dataclasses.replace(cfg, swap_ab=True), act_fp8=True,
                                  interpret=True)


def test_w8a8_rules():
    x, ids, tw, w = _inputs(5, 8, 2, fp8=True)
    with pytest.raises(ValueError, match="K tiles of 128"):
        moe_experts_pallas_triton(x, ids, tw, w, config=CFG, act_fp8=True, interpret=True)  # CFG: down bk 64
    _, _, _, wb = _inputs(5, 8, 2, fp8=False)
    with pytest.raises(ValueError, match="FP8 expert weights"):
        moe_experts_reference(x, ids, tw, wb, act_fp8=True)
    cfg = pick(TRITON_TABLE, 128 * 8, fp8=True, act_fp8=True)
    assert cfg.gu_block_k == cfg.dn_block_k == 128 and not cfg.gu_f16
    assert pick(TRITON_TABLE, 8192 * 8, fp8=True, act_fp8=True).gu_block_k == 128


def test_fp8_row_quantisation():
    """quantize_rows_fp8: scale = row amax / 448, so the largest entry maps to +-448 exactly; zero rows stay zero."""
    from kernels.moe.quant import FP8_MAX, fake_quantize_groups_fp8, quantize_rows_fp8

    x = jax.random.normal(_key(), (6, 128), jnp.float32) * 3.0
    x = x.at[2].set(0.0)
    q, s = quantize_rows_fp8(x)
    assert q.dtype == jnp.float8_e4m3fn and s.shape == (6,)
    amax = jnp.max(jnp.abs(q.astype(jnp.float32)), axis=1)
    np.testing.assert_allclose(np.asarray(amax)[[0, 1, 3, 4, 5]], FP8_MAX)
    assert float(jnp.max(jnp.abs(q[2].astype(jnp.float32)))) == 0.0
    fq = fake_quantize_groups_fp8(x.reshape(3, 256))
    err = float(jnp.max(jnp.abs(fq - x.reshape(3, 256)) / (jnp.abs(x.reshape(3, 256)) + 1e-3)))
    assert 0 < err < 0.07  # e4m3: 3 mantissa bits, relative rounding error <= 2^-4 (plus subnormals near 0)
    with pytest.raises(ValueError):
        fake_quantize_groups_fp8(jnp.ones((2, 100)))
