"""Pallas (Triton lowering) routed-expert layer: two grouped GEMM kernels over a static block schedule.

  1. `gate_up_swiglu_grouped`: grid (I / bn, blocks). Each program gathers its block's token rows of x straight from
     [T, H] (no permuted copy), streams the expert's gate and up tiles [bn, H] once, accumulates both in fp32 and writes
     silu(gate) * up as bf16 into a block-padded activation buffer [blocks * bm, I].
  2. `down_weighted_grouped`: grid (H / bn, blocks). Reads the block's activation rows, streams the expert's down tile
     [bn, I], multiplies each row by its router weight and stores it at its (token, slot) row of y [T * k, H]
     (masked scatter by row index: every row of y is written exactly once).
  3. combine: out = sum_j y[t * k + j] (a plain reduction over k in XLA, fp32).

FP8 weights (e4m3 + fp32 scale per 128 x 128 block, W = q * s): tiles are loaded as FP8 (half the bytes of bf16),
converted to bf16 in registers and fed to a bf16 x bf16 -> fp32 dot (W8A16); as a tile never spans two scale blocks
(bn | 128, bk | 128), its scale is one scalar applied to the fp32 partial product of that K step (the "promotion"
of vLLM's block-FP8 fused_moe and DeepGEMM). N tiles are the fastest grid axis, so the programs that share a block's
activations run together and an expert's weight tiles are read from HBM once per step in decode.

W8A8 (`act_fp8=True`, FP8 weights): activations are e4m3 with one fp32 scale per (row, 128 columns)
(kernels/moe/quant.py) and meet the FP8 weight tile, as loaded, in an FP8 x FP8 -> fp32 dot; the partial product of
each K step is scaled by row scale x block scale. No weight conversion at all, and the FP8 tensor-core rate. Where the
quantisation happens is a config choice (`prequant`), the math is the same: in registers, per [rows, 128] tile inside
each K loop (every N tile of a block quantises the block's rows again: cheap for 16-row decode blocks), or once
outside: x quantised by one XLA op before the gate/up kernel, and the SwiGLU output quantised in the gate/up epilogue
(one 128-column group per N tile) and stored as e4m3 + scales, so both K loops are pure FP8 loads and dots (the
layout of DeepSeek-V3's FP8 recipe, and of vLLM's block-FP8 fused_moe with per-token-group quantisation).

Options (TritonMoeConfig, chosen per regime in kernels/moe/tuning.py from H200 sweeps): `gu_f16` runs the gate/up GEMM in
f16 when the weights are FP8 (e4m3 -> f16 is a single convert on sm90, -> bf16 is not; assumes |x| < 65504, true for the
RMS-normed MoE input); `swap_ab` puts the weight tile on the MMA's M side (measured slower in Triton, kept for study).
Measured (experiments/results/moe_summary.md): bf16 weights stream at ~3.9 TB/s at decode; FP8 at ~2.7 TB/s
(0.293 ms per layer at T=128, 64% of the FP8 roofline); prefill T=16384 at 390 TFLOP/s with bf16 weights.

Design sources (read, not copied): vLLM fused_moe (moe_align_block_size, in-kernel gather by token id, router weight
in the second GEMM's epilogue, block-FP8 promotion), tokamax ragged_dot GroupInfo (per-block metadata in XLA).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels import triton_fp8
from kernels.moe.quant import ACT_GROUP, quantize_groups_fp8, quantize_rows_fp8
from kernels.moe import routing_triton
from kernels.moe.routing import BlockSchedule, expert_block_schedule
from kernels.moe.tuning import TRITON_TABLE, TritonMoeConfig, pick
from kernels.moe.weights import ExpertWeights

triton_fp8.enable()  # the W8A8 dots on wgmma (kernels/triton_fp8.py)

_F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # a [m, k] . b [n, k]^T


def _check_fp8_tile(w: ExpertWeights, bn: int, bk: int, what: str):
    b0, b1 = w.block
    if not (b0 % bn == 0 and b1 % bk == 0):
        raise ValueError(f"{what}: FP8 tiles must lie inside one {w.block} scale block, got bn={bn}, bk={bk}")


def _check_act_fp8(w: ExpertWeights, bk: int, what: str):
    if not w.is_fp8:
        raise ValueError(f"{what}: act_fp8 (W8A8) needs FP8 expert weights")
    if bk != ACT_GROUP:
        raise ValueError(f"{what}: act_fp8 needs K tiles of {ACT_GROUP} (one activation scale group), got bk={bk}")


def _check_prequant(cfg: TritonMoeConfig, act_fp8: bool, gu_bn: int, scale) -> bool:
    """Whether the pre-quantised W8A8 layout applies; raises on a config that cannot run it."""
    if not cfg.prequant:
        return False
    if not act_fp8:
        raise ValueError("prequant is a W8A8 layout: it needs act_fp8=True")
    if cfg.swap_ab:
        raise ValueError("prequant is not implemented for swap_ab")
    if gu_bn != ACT_GROUP:
        raise ValueError(f"prequant quantises the SwiGLU output per gate/up N tile: gu_block_n must be {ACT_GROUP}, "
                         f"got {gu_bn}")
    if scale is None:
        raise ValueError("prequant needs the activation scales")
    return True


def _scaled_dot(a, w, scale, row_scale, *, swap_ab):
    """fp32 partial product of one K step: a [bm, bk] times the weight tile w [bn, bk] (same dtype: bf16/f16, or both
    e4m3 for W8A8), times the weight block `scale` (None for bf16 weights) and the per-row scale of a quantised `a`
    (None unless W8A8). [bm, bn], or [bn, bm] when swap_ab (W tile as the MMA's M side, as tokamax's sm90 quant kernel
    does)."""
    if swap_ab:
        d = jax.lax.dot_general(w, a, _NT, preferred_element_type=_F32)
        row_scale = None if row_scale is None else row_scale[None, :]
    else:
        d = jax.lax.dot_general(a, w, _NT, preferred_element_type=_F32)
        row_scale = None if row_scale is None else row_scale[:, None]
    if scale is not None:
        d = d * scale
    return d if row_scale is None else d * row_scale


def _gate_up_kernel(expert_ref, row0_ref, rows_ref, order_ref, x_ref, wg_ref, wu_ref, *rest, top_k, bm, bn, bk,
                    n_k, sblock, fp8, swap_ab, cdt, act_fp8, prequant):
    rest = list(rest)
    sg_ref, su_ref = (rest.pop(0), rest.pop(0)) if fp8 else (None, None)
    xs_ref = rest.pop(0) if prequant else None
    act_ref = rest.pop(0)
    as_ref = rest.pop(0) if prequant else None
    n = pl.program_id(0)
    b = pl.program_id(1)
    e = expert_ref[b]

    @pl.when(e >= 0)
    def _():
        row0 = row0_ref[b]
        nrows = rows_ref[b]
        r = jax.lax.broadcasted_iota(jnp.int32, (bm,), 0)
        pair = order_ref[pl.ds(row0, bm)]
        tok = jnp.where(r < nrows, pair // top_k, 0)  # padding rows read token 0; they are never stored downstream
        n0 = pl.multiple_of(n * bn, bn)

        def body(i, carry):
            accg, accu = carry
            k0 = pl.multiple_of(i * bk, bk)
            xt = x_ref[tok, pl.ds(k0, bk)]
            wg = wg_ref[e, pl.ds(n0, bn), pl.ds(k0, bk)]
            wu = wu_ref[e, pl.ds(n0, bn), pl.ds(k0, bk)]
            if not act_fp8:
                wg, wu = wg.astype(cdt), wu.astype(cdt)
            sg = sg_ref[e, n0 // sblock[0], k0 // sblock[1]] if fp8 else None
            su = su_ref[e, n0 // sblock[0], k0 // sblock[1]] if fp8 else None
            xs = None
            if prequant:  # x is e4m3 already: this K step's scale group of each row
                xs = xs_ref[tok, i]
            elif act_fp8:  # one quantised x tile for both GEMMs
                xt, xs = quantize_rows_fp8(xt.astype(cdt))
            else:
                xt = xt.astype(cdt)
            dg = _scaled_dot(xt, wg, sg, xs, swap_ab=swap_ab)
            du = _scaled_dot(xt, wu, su, xs, swap_ab=swap_ab)
            return accg + dg, accu + du

        z = jnp.zeros((bn, bm) if swap_ab else (bm, bn), _F32)
        accg, accu = jax.lax.fori_loop(0, n_k, body, (z, z))
        act = accg / (1.0 + jnp.exp(-accg)) * accu
        if swap_ab:
            act = act.T
        if prequant:  # this N tile is one scale group: e4m3 rows + one scale per row, from the bf16-rounded value
            q, qs = quantize_rows_fp8(act.astype(jnp.bfloat16))
            act_ref[pl.ds(b * bm, bm), pl.ds(n0, bn)] = q
            as_ref[n, pl.ds(b * bm, bm)] = qs
        else:
            act_ref[pl.ds(b * bm, bm), pl.ds(n0, bn)] = act.astype(act_ref.dtype)


def gate_up_swiglu_grouped(x, sched: BlockSchedule, w: ExpertWeights, top_k: int, cfg: TritonMoeConfig, *,
                           act_fp8: bool = False, x_scale=None, interpret: bool = False):
    """act [num_blocks * block_m, I] (bf16) = silu(x W_gate^T) * (x W_up^T) for every scheduled row; pad rows junk.
    act_fp8: x quantised per (row, 128 columns) and an FP8 x FP8 GEMM (W8A8).
    cfg.prequant (W8A8): x is e4m3 with `x_scale` [T, H / 128] fp32, and the result is (act e4m3 [num_blocks * block_m,
    I], act_scale [I / 128, num_blocks * block_m] fp32), quantised per (row, 128 columns) from its bf16 rounding."""
    T, H = x.shape
    E, I, _ = w.gate.shape
    bm, bn, bk = sched.block_m, min(cfg.gu_block_n, I), min(cfg.gu_block_k, H)
    if w.is_fp8:
        _check_fp8_tile(w, bn, bk, "gate/up")
    if act_fp8:
        _check_act_fp8(w, bk, "gate/up")
    prequant = _check_prequant(cfg, act_fp8, bn, x_scale)
    nb = sched.num_blocks
    # FP8 -> f16 is one hardware convert on sm90 (-> bf16 is not); the gate/up input x is the RMS-normed hidden state,
    # far inside f16 range, so `gu_f16` computes this GEMM in f16 (more mantissa than bf16) when the weights are FP8.
    cdt = jnp.float16 if (cfg.gu_f16 and w.is_fp8 and not act_fp8) else jnp.bfloat16
    kernel = functools.partial(_gate_up_kernel, top_k=top_k, bm=bm, bn=bn, bk=bk, n_k=H // bk, sblock=w.block,
                               fp8=w.is_fp8, swap_ab=cfg.swap_ab, cdt=cdt, act_fp8=act_fp8, prequant=prequant)
    args = [sched.block_expert, sched.block_row0, sched.block_rows, sched.order, x, w.gate, w.up]
    if w.is_fp8:
        args += [w.gate_scale, w.up_scale]
    out_shape = jax.ShapeDtypeStruct((nb * bm, I), jnp.bfloat16)
    if prequant:
        args.append(x_scale.astype(_F32))
        out_shape = (jax.ShapeDtypeStruct((nb * bm, I), jnp.float8_e4m3fn),
                     jax.ShapeDtypeStruct((I // ACT_GROUP, nb * bm), _F32))
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(I // bn, nb),
        compiler_params=plt.CompilerParams(num_warps=cfg.gu_warps, num_stages=cfg.gu_stages),
        interpret=interpret,
        name="moe_gate_up_swiglu",
    )(*args)


def _down_kernel(expert_ref, row0_ref, rows_ref, order_ref, rw_ref, act_ref, wd_ref, *rest, bm, bn, bk, n_k, sblock,
                 fp8, aliased, n_pairs, swap_ab, act_fp8, prequant):
    rest = list(rest)
    sd_ref = rest.pop(0) if fp8 else None
    as_ref = rest.pop(0) if prequant else None
    if aliased:
        rest.pop(0)  # the poisoned/initial y, aliased to the output
    (y_ref,) = rest
    n = pl.program_id(0)
    b = pl.program_id(1)
    e = expert_ref[b]

    @pl.when(e >= 0)
    def _():
        row0 = row0_ref[b]
        nrows = rows_ref[b]
        r = jax.lax.broadcasted_iota(jnp.int32, (bm,), 0)
        valid = r < nrows
        pair = order_ref[pl.ds(row0, bm)]
        # padding rows point at their own spare row M + r of y: masked off on GPU, and distinct from every real row
        # (interpret mode writes masked lanes back, so a shared dummy index would race with a real row)
        pair = jnp.where(valid, pair, n_pairs + r)
        n0 = pl.multiple_of(n * bn, bn)
        a0 = pl.multiple_of(b * bm, bm)

        def body(i, acc):
            k0 = pl.multiple_of(i * bk, bk)
            a = act_ref[pl.ds(a0, bm), pl.ds(k0, bk)]
            wd = wd_ref[e, pl.ds(n0, bn), pl.ds(k0, bk)]
            a_scale = None
            if prequant:  # e4m3 rows from the gate/up epilogue; this K step's scale group
                a_scale = as_ref[i, pl.ds(a0, bm)]
            elif act_fp8:
                a, a_scale = quantize_rows_fp8(a)
            else:
                wd = wd.astype(a.dtype)
            sd = sd_ref[e, n0 // sblock[0], k0 // sblock[1]] if fp8 else None
            return acc + _scaled_dot(a, wd, sd, a_scale, swap_ab=swap_ab)

        acc = jax.lax.fori_loop(0, n_k, body, jnp.zeros((bn, bm) if swap_ab else (bm, bn), _F32))
        rw = jnp.where(valid, rw_ref[jnp.where(valid, pair, 0)], 0.0)
        # int-array indices on both axes: a masked scatter of rows (also the form interpret mode supports)
        if swap_ab:
            y = (acc * rw[None, :]).astype(y_ref.dtype)
            cols = n0 + jax.lax.broadcasted_iota(jnp.int32, (bn, bm), 0)
            rows = jnp.broadcast_to(pair[None, :], (bn, bm))
            mask = jnp.broadcast_to(valid[None, :], (bn, bm))
        else:
            y = (acc * rw[:, None]).astype(y_ref.dtype)
            cols = n0 + jax.lax.broadcasted_iota(jnp.int32, (bm, bn), 1)
            rows = jnp.broadcast_to(pair[:, None], (bm, bn))
            mask = jnp.broadcast_to(valid[:, None], (bm, bn))
        plt.store(y_ref.at[rows, cols], y, mask=mask)


def down_weighted_grouped(act, sched: BlockSchedule, router_w, w: ExpertWeights, cfg: TritonMoeConfig, *,
                          out_dtype=jnp.bfloat16, y_init=None, act_fp8: bool = False, act_scale=None,
                          interpret: bool = False):
    """y [T * k + block_m, H]: y[p] = router_w[p] * (act_row(p) W_down^T) for p < T * k; the last block_m rows are
    spare (never written on GPU). `y_init` (optional, same shape) is aliased to the output, so a poisoned buffer shows
    any row the kernel failed to write. act_fp8: act quantised per (row, 128 columns), FP8 x FP8 GEMM (W8A8);
    with cfg.prequant, act is e4m3 already with `act_scale` [I / 128, rows] (gate_up_swiglu_grouped's output)."""
    E, H, I = w.down.shape
    M = router_w.shape[0]
    bm, bn, bk = sched.block_m, min(cfg.dn_block_n, H), min(cfg.dn_block_k, I)
    if w.is_fp8:
        _check_fp8_tile(w, bn, bk, "down")
    if act_fp8:
        _check_act_fp8(w, bk, "down")
    prequant = _check_prequant(cfg, act_fp8, ACT_GROUP, act_scale)
    nb = sched.num_blocks
    aliased = y_init is not None
    kernel = functools.partial(_down_kernel, bm=bm, bn=bn, bk=bk, n_k=I // bk, sblock=w.block, fp8=w.is_fp8,
                               aliased=aliased, n_pairs=M, swap_ab=cfg.swap_ab, act_fp8=act_fp8, prequant=prequant)
    args = [sched.block_expert, sched.block_row0, sched.block_rows, sched.order, router_w.astype(_F32), act, w.down]
    if w.is_fp8:
        args.append(w.down_scale)
    if prequant:
        args.append(act_scale.astype(_F32))
    aliases = {}
    if aliased:
        aliases = {len(args): 0}
        args.append(y_init.astype(out_dtype))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M + bm, H), out_dtype),
        grid=(H // bn, nb),
        input_output_aliases=aliases,
        compiler_params=plt.CompilerParams(num_warps=cfg.dn_warps, num_stages=cfg.dn_stages),
        interpret=interpret,
        name="moe_down_weighted",
    )(*args)


def block_schedule(topk_ids, num_experts: int, block_m: int, interpret: bool, valid=None) -> BlockSchedule:
    """The expert block schedule: one Pallas program for few pairs (single streams, small batches: the XLA chain of
    small kernels is latency there), XLA otherwise; the same schedule either way. valid [T] or None: the pairs of
    rows marked False / 0 are routed to no expert."""
    few = topk_ids.size <= routing_triton.MAX_PAIRS and num_experts & (num_experts - 1) == 0
    if few:
        return routing_triton.expert_block_schedule_triton(topk_ids, num_experts, block_m, valid=valid,
                                                           interpret=interpret)
    if valid is not None:
        topk_ids = jnp.where(valid[:, None], topk_ids, num_experts)
    return expert_block_schedule(topk_ids, num_experts, block_m)


def _default_interpret() -> bool:
    return jax.default_backend() != "gpu"


def moe_experts_pallas_triton(x, topk_ids, topk_weights, w: ExpertWeights, *, valid=None,
                              config: TritonMoeConfig | None = None, act_fp8: bool = False, x_fp8=None,
                              interpret: bool | None = None, y_init=None, return_y: bool = False):
    """Routed-expert layer (see module doc). x [T, H]; topk_ids/topk_weights [T, k]; returns [T, H] in x.dtype.

    valid [T] bool or int (None: every row): rows marked False / 0 (prompt padding, free decode slots) are routed to
    no expert, so the grouped GEMMs skip their pairs (the grid's unused blocks exit at once), and their output is 0.

    act_fp8: W8A8 (FP8 weights only), with the W8A8 rows of the tuning table unless `config` is given. x_fp8: x's e4m3
    groups (q [T, H], scale [T, H / 128]) made beforehand (kernels/norm fuses them into the layer's RMSNorm), used by
    the configurations that quantise outside the K loops instead of quantising x here.
    interpret=None runs the real kernel on GPU and Pallas interpret mode elsewhere."""
    T, H = x.shape
    k = topk_ids.shape[1]
    cfg = config or pick(TRITON_TABLE, T * k, w.is_fp8, act_fp8)
    if interpret is None:
        interpret = _default_interpret()
    sched = block_schedule(topk_ids, w.num_experts, cfg.block_m, interpret, valid)
    xb = x.astype(jnp.bfloat16)
    x_scale = act_scale = None
    prequant = act_fp8 and cfg.prequant
    if prequant:
        xb, x_scale = quantize_groups_fp8(xb) if x_fp8 is None else x_fp8
    act = gate_up_swiglu_grouped(xb, sched, w, k, cfg, act_fp8=act_fp8, x_scale=x_scale, interpret=interpret)
    if prequant:
        act, act_scale = act
    y = down_weighted_grouped(act, sched, topk_weights.reshape(-1), w, cfg, y_init=y_init, act_fp8=act_fp8,
                              act_scale=act_scale, interpret=interpret)
    out = jnp.sum(y[: T * k].reshape(T, k, H).astype(_F32), axis=1).astype(x.dtype)
    if valid is not None:  # the skipped pairs' rows of y were never written
        out = jnp.where(valid[:, None], out, 0)
    return (out, y) if return_y else out
