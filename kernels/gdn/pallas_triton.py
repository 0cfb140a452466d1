"""Gated DeltaNet Pallas kernels, Triton lowering (`pl.pallas_call` + `plt.CompilerParams`), for the H200.

Two kernel families, same math as `reference.py` (see its docstring for shapes and the recurrence):

* `gdn_decode_step_triton` - one token per stream, all streams at once: causal conv1d (kernel K) + SiLU on the q/k/v
  channels, beta/decay from the raw a/b projections, q/k L2 norm, delta-rule update, output; the state is read and
  written once, in place in the slot pool (`input_output_aliases`; donate the pools at the outer `jax.jit` so XLA does
  not copy them). `v_major=True` takes a pool holding each head's state as [D_v, D_k] (the model's cache layout:
  the D_k reductions then run along the contiguous axis, within a warp's lanes). Two grids
  (`TUNING["decode"]["grid"]`):
    - "split" (default): two launches. `_decode_prep_kernel`, one program per (stream, key head), does everything
      but the state once per key head (conv + SiLU, norms, k.q, gates) and shifts its conv channels in place; then
      `_decode_state_kernel`, one program per (stream, value head, bv slice), streams its state tile (load, two
      reductions, update, store) with nothing else on its critical path.
    - "tiles": one launch, one program per (stream, value head, bv slice), as vLLM's
      `fused_sigmoid_gating_delta_rule_update`; each program recomputes its key head's q/k and only reads the conv
      state, which the kernel writes shifted into a new pool when the batch is the whole pool (else one XLA op).
    (A third grid, one program per (stream, key head) walking its tiles with loads issued ahead, lost to both on
    every H200 run and was removed; its last code is in commit e099f4b.)

* `gated_delta_chunk_prefill_triton` - chunked prefill (chunk 64, WY/UT form) for a right-padded batch with
  per-sequence lengths, initial state in, final state out, q/k L2 norm fused; `gated_delta_packed_prefill_triton`
  the same for sequences packed end to end on one row axis (the kernels address every sequence by its first row, so
  a right-padded batch is the packed case with offsets b * T). Three launches:
    1. `_inv_kernel`, parallel over (sequence, value head, chunk): A = strictly-lower(beta K K^T * decay) as its
       ten 16x16 blocks, (I + A)^-1 by forward substitution of the four diagonal blocks and block merges (the
       blocking of FLA's `solve_tril`), fp32 accumulation in registers (the merges' block dots in tf32 under bf16
       operands, TUNING's inv_dot), stored in the dot operand dtype.
    2. `_wu_kernel`, same grid: the sequential pass's dot operands w = (I+A)^-1 (beta e^g k), u = (I+A)^-1 (beta v),
       Aqk = tril(q k^T * decay), the chunk decay e^g_last and the row decays g, g_last - g; the normalised q and k
       once per key head (the value heads sharing it apply their own decays in the walk).
    3. `_state_kernel`, grid (sequence, value head, D_v slice): walks the chunks sequentially with the [D_k, bv]
       state slice held in registers (never round-tripping HBM between chunks):
       v_new = u - w S;  o = e^g (q S) + Aqk v_new;  S <- e^{g_last} S + k^T (e^{g_last - g} v_new).
  Algorithm as in FLA `chunk_gated_delta_rule` (chunk_scaled_dot_kkt + solve_tril + recompute_w_u, then
  chunk_delta_h fused with chunk_o so the per-chunk states are never stored).
  (A one-launch variant that inverted each chunk's A in the state pass's own program lost at every shape on the
  H200, 1.5-5x slower: results/prefill_gdn_2026-12-02b/, code in commit c56b007. A fourth launch computing o apart
  from the walk, as FLA's chunk_fwd_o, was 7-11% slower: results/gdn_prefill_osplit_2026-12-03/, code in commit
  321299e.)

H200 measurements and their analysis: experiments/results/gdn_summary.md.

Precision (`dot` mode): "float32" = IEEE fp32 dots (bit-for-bit the reference's math up to summation order; slow on
GPU, used by the CPU tests), "tf32" = fp32 operands on tensor cores (TF32), "bfloat16" = bf16 operands, fp32
accumulation (what FLA does). The inverse (fp32 accumulation; tf32 block products unless the mode is "float32"),
cumsums, gates and the state are fp32 in every mode.

Tuning values live in TUNING (data, not scattered constants).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels.gdn.reference import L2_EPS

f32 = jnp.float32

# Tuning table. Keys are read by the wrappers below; override per call with keyword arguments. Prefill values from
# the H200 run in experiments/results/gdn_bench.md (2026-11-30): the state pass is latency-bound per chunk, so a
# small grid (fewer programs than SMs at bv 64, e.g. B=1) takes bv 32 (0.47 vs 0.55 ms at B=1, T=4096) and a larger
# one bv 64 (0.82 vs 0.95 ms at B=8, T=1024). `bv: None` = that automatic choice.
TUNING = {
    # grid "split" (the default): a prep launch per (stream, key head) (conv, norms, gates, k.q, conv shift in place),
    # then a streaming launch per state tile (`_decode_prep_kernel`, `_decode_state_kernel`). H200, 2026-12-02
    # (results/gdn_decode_split_2026-12-02/), one layer at 128 streams: K-major pool 0.117 ms (bf16) / 0.170 (fp32)
    # against 0.155 / 0.204 for "tiles" in the same run; a v-major pool 0.098 (bf16, bv 128 / 8 warps) / 0.172
    # (fp32, bv 64 / 4 warps); Nsight: the prep takes 9.9 us with 2 warps (11.1 with 4, 12.4 with 1).
    # grid "tiles": one program per (stream, value head, bv slice) that also recomputes its key head's q/k
    # (`_decode_tile_kernel`; results/gdn_decode_tiles/). conv_shift "kernel": the kernel writes the shifted conv
    # state into a new pool when the batch is the whole pool; "xla": a separate XLA op.
    "decode": {"grid": "split", "bv": 64, "num_warps": 4, "num_stages": 1, "conv_shift": "kernel"},
    "decode_split": {"bv": 64, "num_warps": 4, "num_stages": 1, "prep_num_warps": 2},
    "decode_split_v_major_bf16_state": {"bv": 128, "num_warps": 8},
    # inverse: A's blocks from block dots, X in registers, stored in bf16 (`_inv_kernel`). H100, 2026-12-06
    # (results/gdn_prefill_2026-12-06_h100/), its launch against the previous form (A as one [64, 64] dot parked in
    # an fp32 buffer and read back, an fp32 inverse; commit 28d3a5a): 0.022 against 0.039 ms at 1 x 1024, 0.082
    # against 0.102 at 1 x 4096, 0.145 against 0.183 at 8 x 1024, 0.528 against 0.653 at 8 x 4096. Warps by grid
    # size: 2 below `inv_large_grid` programs (1 x 1024: 0.022 against 0.037 with 1 warp; equal at 1 x 4096, 2,048
    # programs), 1 from there (8 x 1024: 0.145 against 0.159; 8 x 4096: 0.528 against 0.620). `inv_num_warps` set =
    # that count everywhere.
    # u_operand_dtype: u = X (beta v) stored in the dot operand dtype (bf16), as FLA stores it, not fp32: the walk's
    # largest input at half the bytes. H100, 2026-12-06 (results/gdn_prefill_2026-12-05_h100/): 5-7% faster per
    # layer at every shape (1 x 4096: 0.428 against 0.458 ms), o rel. error 4.4e-3 against 4.0e-3.
    # (A form that also computed the operands in the inverse's launch, by 16-row blocks, was 1.7-2x slower per
    # layer at every shape and warp count on an H100 on 2026-12-06; its code is in commit 3b90dac.)
    # q and k per key head: the operand launch stores the normalised q and k once per key head and the walk applies
    # the row decays e^gc, e^(gl - gc), instead of q e^gc and k e^(gl - gc) per value head (24 of the launch's
    # ~128 KB per (value head, chunk) fewer). H100, 2026-12-06 (results/gdn_prefill_2026-12-06b_h100/), one layer
    # against the per-value-head form (commit 321299e): 8 x 4096 2.331 against 2.457 ms, 8 x 1024 0.637 against
    # 0.663, 1 x 1024 0.104 against 0.111, 1 x 4096 0.367 against 0.365. wu_num_warps 16 was 1-4% slower than 8
    # at every shape in the same run, and 11-16% slower at 70 registers once 8 warps fit in 126 (H100, 2026-12-06,
    # results/gdn_2026-12-06_h100/).
    # inv_dot: the inverse's X block dots; None = "float32" (FMA, exact) under fp32 operands, else "tf32" (one
    # tensor-core pass; X is stored in bf16 afterwards, with 3 fewer mantissa bits than tf32). H100, 2026-12-06
    # (results/gdn_inverse_2026-12-06_h100/), one layer against fp32 block dots: 1 x 4096 0.312 against 0.362 ms,
    # 8 x 4096 2.027 against 2.222, 8 x 1024 0.553 against 0.622, 1 x 1024 0.110 against 0.112; the inverse launch
    # 0.049 against 0.083 ms at 1 x 4096; o rel. error 4.313e-3 against 4.306e-3. "tf32x3" (three passes, fp32-level)
    # was in between: 0.325 / 2.039 ms. A second call: 1 x 4096 0.300 ms (exact 0.344, tf32x3 0.317).
    "prefill_prep": {"inv_num_warps": None, "inv_num_warps_small_grid": 2, "inv_num_warps_large_grid": 1,
                     "inv_large_grid": 2048, "wu_num_warps": 8, "num_stages": 1, "u_operand_dtype": True,
                     "inv_dot": None},
    "prefill_state": {"bv": None, "bv_small_grid": 32, "bv_large_grid": 64, "num_sms": 132, "num_warps": 4,
                      "num_stages": 2, "static_loop": True},
    "prefill": {"dot": "bfloat16"},
}
CHUNK = 64     # rows per chunk (prefill)
SUB = 16       # rows per sub-block of the triangular inverse

_DOT_DTYPE = {"float32": f32, "tf32": f32, "tf32x3": f32, "bfloat16": jnp.bfloat16}


def _dot(a, b, mode: str, trans_a: bool = False):
    """a @ b (or a^T @ b) with fp32 accumulation under the given operand mode."""
    dt = _DOT_DTYPE[mode]
    a = a.astype(dt)
    b = b.astype(dt)
    if mode == "tf32":
        prec = (jax.lax.Precision.HIGH, jax.lax.Precision.HIGH)
    elif mode == "tf32x3":  # three tf32 tensor-core passes (split operands): fp32-level accuracy
        prec = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    elif mode == "float32":
        prec = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    else:
        prec = None
    dims = (((0,), (0,)), ((), ())) if trans_a else (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=prec, preferred_element_type=f32)


def _l2n(x):
    """Row-wise L2 normalisation, as reference.l2_normalize (eps inside the rsqrt)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def _softplus(x):
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def _params(table: str, overrides: dict) -> dict:
    p = dict(TUNING[table])
    p.update({k: v for k, v in overrides.items() if v is not None})
    return p


def _conv_rows(conv_ref, x_ref, slot, bi, off: int, n: int, ksize: int):
    """The K rows the conv of channels [off, off + n) reads: conv_state rows of `slot` (cast to x's dtype, as
    reference.causal_conv1d) then x row `bi`. Rows 1.. are that slot's next conv state."""
    ch = pl.ds(off, n)
    return [conv_ref[slot, i, ch].astype(x_ref.dtype) for i in range(ksize - 1)] + [x_ref[bi, ch]]


def _silu_of_conv(rows, w_ref, off: int, n: int):
    """SiLU of the depthwise causal conv of `rows` (from `_conv_rows`) with taps w_ref[off:off + n]; fp32 sum."""
    ch = pl.ds(off, n)
    y = rows[0].astype(f32) * w_ref[ch, 0].astype(f32)
    for i in range(1, len(rows)):
        y = y + rows[i].astype(f32) * w_ref[ch, i].astype(f32)
    return y * jax.nn.sigmoid(y)


def _conv_silu(conv_ref, x_ref, w_ref, slot, bi, off: int, n: int, ksize: int, shift_ref=None, shift_when=None):
    """Depthwise causal conv + SiLU of channels [off, off + n) over [conv_state rows of `slot`..., x row `bi`]. With
    `shift_ref` (a separate output pool), also writes these channels' next conv state (rows 1.. then x) to its row
    `bi`, under `shift_when` if given; conv_ref itself is only read."""
    rows = _conv_rows(conv_ref, x_ref, slot, bi, off, n, ksize)
    if shift_ref is not None:
        def shift():
            for i, r in enumerate(rows[1:]):
                shift_ref[bi, i, pl.ds(off, n)] = r.astype(shift_ref.dtype)

        shift() if shift_when is None else pl.when(shift_when)(shift)
    return _silu_of_conv(rows, w_ref, off, n)


def _decay_beta(alog_ref, dtb_ref, a_ref, b_ref, bi, h, a_off: int, b_off: int):
    """(e^g, beta) of value head h for row bi: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b); a and b
    at columns a_off + h, b_off + h of their refs."""
    g = -jnp.exp(alog_ref[h].astype(f32)) * _softplus(a_ref[bi, a_off + h].astype(f32) + dtb_ref[h].astype(f32))
    return jnp.exp(g), jax.nn.sigmoid(b_ref[bi, b_off + h].astype(f32))


# ==================================================================================================== decode
def _decode_tile_kernel(slots_ref, x_ref, a_ref, b_ref, w_ref, alog_ref, dtb_ref, conv_ref, state_ref,
                        o_ref, state_out_ref, conv_out_ref=None, *, hk, dk, dv, rep, bv, ksize, v_major, a_off,
                        b_off):
    """One [D_k, bv] state tile per program (grid (stream, value head, D_v slice)): many small independent programs
    instead of a loop over a key head's tiles, so the state traffic is spread over the whole GPU. Each program
    recomputes its key head's conv'd q/k (cheap, L2-resident) and only reads the conv state: programs of one key head
    share q/k channels, so an in-place shift would race. With `conv_out_ref` (every slot in the batch) the shifted
    conv state goes to that separate pool: each program writes its v channels, the first program of a key head its
    q/k channels. Otherwise the caller shifts the conv state afterwards.
    v_major: the pool holds each head's state transposed, [D_v, D_k], so the D_k reductions run along the contiguous
    axis (a layout experiment; the model's pools are [D_k, D_v])."""
    bi = pl.program_id(0)
    h = pl.program_id(1)
    j = pl.program_id(2)
    slot = slots_ref[bi]
    kh = h // rep
    kd = hk * dk
    conv = functools.partial(_conv_silu, conv_ref, x_ref, w_ref, slot, bi, ksize=ksize)

    tile = (slot, h, pl.ds(j * bv, bv), slice(None)) if v_major else (slot, h, slice(None), pl.ds(j * bv, bv))
    s = state_ref[tile].astype(f32)  # issued first: the longest latency; [bv, dk] if v_major else [dk, bv]
    qk_writer = ((h % rep) == 0) & (j == 0)
    q = _l2n(conv(kh * dk, dk, shift_ref=conv_out_ref, shift_when=qk_writer)) * (dk ** -0.5)
    k = _l2n(conv(kd + kh * dk, dk, shift_ref=conv_out_ref, shift_when=qk_writer))
    v = conv(2 * kd + h * dv + j * bv, bv, shift_ref=conv_out_ref)
    d, beta = _decay_beta(alog_ref, dtb_ref, a_ref, b_ref, bi, h, a_off, b_off)
    kd_axis = 1 if v_major else 0  # the D_k axis of the tile
    kb = k[None, :] if v_major else k[:, None]
    kv = d * jnp.sum(s * kb, axis=kd_axis)
    sq = d * jnp.sum(s * (q[None, :] if v_major else q[:, None]), axis=kd_axis)
    delta = beta * (v - kv)
    s = d * s + kb * (delta[:, None] if v_major else delta[None, :])
    state_out_ref[tile] = s.astype(state_out_ref.dtype)
    o_ref[bi, h, pl.ds(j * bv, bv)] = sq + delta * jnp.sum(k * q)


def _decode_prep_kernel(slots_ref, x_ref, a_ref, b_ref, w_ref, alog_ref, dtb_ref, conv_ref,
                        qk_ref, kq_ref, v_ref, d_ref, beta_ref, conv_out_ref, *, hk, dk, dv, rep, ksize, barrier,
                        a_off, b_off):
    """grid="split", launch 1 of 2, grid (stream, key head): everything of the step but the state, once per key head.
    Writes the normalised, scaled q and the normalised k ([B, 2, H_k, D_k] fp32), k . q ([B, H_k]), the conv'd v of
    the `rep` value heads ([B, H_v, D_v] fp32), e^g and beta ([B, H_v] fp32), and shifts this program's conv channels
    in place (its key head's q/k channels and its value heads' v channels: no other program touches them)."""
    bi = pl.program_id(0)
    kh = pl.program_id(1)
    slot = slots_ref[bi]
    kd = hk * dk
    ranges = [(kh * dk, dk), (kd + kh * dk, dk), (2 * kd + kh * rep * dv, rep * dv)]  # q, k, v channels
    rows = [_conv_rows(conv_ref, x_ref, slot, bi, off, n, ksize) for off, n in ranges]
    q, k, v = (_silu_of_conv(r, w_ref, off, n) for r, (off, n) in zip(rows, ranges))
    q = _l2n(q) * (dk ** -0.5)
    k = _l2n(k)
    qk_ref[bi, 0, kh, :] = q
    qk_ref[bi, 1, kh, :] = k
    kq_ref[bi, kh] = jnp.sum(k * q)
    heads = pl.ds(kh * rep, rep)
    v_ref[bi, heads, :] = v.reshape(rep, dv)
    a = a_ref[bi, pl.ds(a_off + kh * rep, rep)].astype(f32)
    g = -jnp.exp(alog_ref[heads].astype(f32)) * _softplus(a + dtb_ref[heads].astype(f32))
    d_ref[bi, heads] = jnp.exp(g)
    beta_ref[bi, heads] = jax.nn.sigmoid(b_ref[bi, pl.ds(b_off + kh * rep, rep)].astype(f32))
    # the in-place shift from the rows already in registers, after a barrier: a thread holding a replicated copy of a
    # channel must not overwrite a row another thread has yet to read (an H200 run of an earlier kernel without such a
    # barrier gave wrong results for some tunings)
    if barrier:
        plt.debug_barrier()
    for (off, n), r in zip(ranges, rows):
        for i, row in enumerate(r[1:]):
            conv_out_ref[slot, i, pl.ds(off, n)] = row.astype(conv_out_ref.dtype)


def _decode_state_kernel(slots_ref, qk_ref, kq_ref, v_ref, d_ref, beta_ref, state_ref, o_ref, state_out_ref, *, dk,
                         bv, rep, v_major):
    """grid="split", launch 2 of 2, grid (stream, value head, D_v slice): the delta rule on one state tile, from the
    prepared q, k, v and gates; a streaming kernel (tile in, tile out) with nothing else on its critical path."""
    bi = pl.program_id(0)
    h = pl.program_id(1)
    j = pl.program_id(2)
    slot = slots_ref[bi]
    tile = (slot, h, pl.ds(j * bv, bv), slice(None)) if v_major else (slot, h, slice(None), pl.ds(j * bv, bv))
    s = state_ref[tile].astype(f32)  # [bv, dk] if v_major else [dk, bv]
    q = qk_ref[bi, 0, h // rep, :]
    k = qk_ref[bi, 1, h // rep, :]
    v = v_ref[bi, h, pl.ds(j * bv, bv)]
    d = d_ref[bi, h]
    beta = beta_ref[bi, h]
    kd_axis = 1 if v_major else 0
    kb, qb = (k[None, :], q[None, :]) if v_major else (k[:, None], q[:, None])
    kv = jnp.sum(s * kb, axis=kd_axis)
    sq = jnp.sum(s * qb, axis=kd_axis)
    delta = beta * (v - d * kv)
    s = d * s + kb * (delta[:, None] if v_major else delta[None, :])
    state_out_ref[tile] = s.astype(state_out_ref.dtype)
    o_ref[bi, h, pl.ds(j * bv, bv)] = d * sq + delta * kq_ref[bi, h // rep]


def _decode_split(slots, mixed_qkv, a, b, conv_state, ssm_state, conv_weight, A_log, dt_bias, *, hk, dk, dv, rep,
                  bv, ksize, v_major, p, interpret, a_off, b_off):
    """grid="split": `_decode_prep_kernel` then `_decode_state_kernel`; both pools updated in place."""
    B = mixed_qkv.shape[0]
    hv = hk * rep
    qk, kq, v, d, beta, conv_state = pl.pallas_call(
        functools.partial(_decode_prep_kernel, hk=hk, dk=dk, dv=dv, rep=rep, ksize=ksize, barrier=not interpret,
                          a_off=a_off, b_off=b_off),
        out_shape=(jax.ShapeDtypeStruct((B, 2, hk, dk), f32), jax.ShapeDtypeStruct((B, hk), f32),
                   jax.ShapeDtypeStruct((B, hv, dv), f32),
                   jax.ShapeDtypeStruct((B, hv), f32), jax.ShapeDtypeStruct((B, hv), f32),
                   jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype)),
        grid=(B, hk),
        input_output_aliases={7: 5},
        compiler_params=plt.CompilerParams(num_warps=p["prep_num_warps"], num_stages=1),
        interpret=interpret,
        name="gdn_decode_prep",
    )(slots, mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state)
    o, ssm_state = pl.pallas_call(
        functools.partial(_decode_state_kernel, dk=dk, bv=bv, rep=rep, v_major=v_major),
        out_shape=(jax.ShapeDtypeStruct((B, hv, dv), f32), jax.ShapeDtypeStruct(ssm_state.shape, ssm_state.dtype)),
        grid=(B, hv, dv // bv),
        input_output_aliases={6: 1},
        compiler_params=plt.CompilerParams(num_warps=p["num_warps"], num_stages=p["num_stages"]),
        interpret=interpret,
        name="gdn_decode_state",
    )(slots, qk, kq, v, d, beta, ssm_state)
    return o, conv_state, ssm_state


def _shift_conv_state(conv_state, mixed_qkv, slots):
    """conv_state[slots] (all rows when None) <- its last K-2 rows followed by this step's input (the reference's
    cast); one fused XLA kernel."""
    new = mixed_qkv[:, None].astype(conv_state.dtype)
    if slots is None:
        return jnp.concatenate([conv_state[:, 1:], new], axis=1)
    return conv_state.at[slots].set(jnp.concatenate([conv_state[slots, 1:], new], axis=1))


def gdn_decode_step_triton(mixed_qkv, a, b, conv_state, ssm_state, conv_weight, A_log, dt_bias, *,
                           num_k_heads: int, head_k_dim: int, head_v_dim: int, slots=None, interpret: bool = False,
                           bv: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                           grid: str | None = None, v_major: bool | None = None,
                           conv_shift: str | None = None, prep_num_warps: int | None = None,
                           a_col: int | None = None, b_col: int | None = None):
    """Fused single-token GDN step on slot pools; same contract as `reference.gdn_decode_step`.

    The pools are updated in place (input_output_aliases); only the `slots` rows change. Donate conv_state and
    ssm_state at the enclosing jit to avoid a copy of the pool. With a_col / b_col the kernels read q/k/v, a and b
    from the one fused projection output (passed three times: no slice copies)."""
    asked = {k: v for k, v in dict(bv=bv, num_warps=num_warps, num_stages=num_stages,
                                   grid=grid, v_major=v_major, conv_shift=conv_shift,
                                   prep_num_warps=prep_num_warps).items() if v is not None}
    p = _params("decode", asked)
    if p["grid"] == "split":
        bf16_vmajor = TUNING["decode_split_v_major_bf16_state"] if v_major and ssm_state.dtype == jnp.bfloat16 else {}
        p = _params("decode_split", bf16_vmajor | asked) | {"grid": "split"}
    a_off, b_off = (0, 0) if a_col is None else (a_col, b_col)
    if a_col is not None:
        a = b = mixed_qkv
    B, C = mixed_qkv.shape[0], conv_state.shape[-1]
    hv = A_log.shape[-1]
    hk, dk, dv = num_k_heads, head_k_dim, head_v_dim
    rep = hv // hk
    ksize = conv_weight.shape[-1]
    bv_ = min(p["bv"], dv)
    assert C == 2 * hk * dk + hv * dv and conv_state.shape[1:] == (ksize - 1, C)
    assert mixed_qkv.shape[1] == C if a_col is None else max(C, a_off + hv, b_off + hv) <= mixed_qkv.shape[1]
    assert ssm_state.shape[1:] == ((hv, dv, dk) if p.get("v_major") else (hv, dk, dv)) and dv % bv_ == 0
    given_slots = slots
    if slots is None:
        assert conv_state.shape[0] == B and ssm_state.shape[0] == B
        slots = jnp.arange(B, dtype=jnp.int32)
    slots = slots.astype(jnp.int32)
    params = plt.CompilerParams(num_warps=p["num_warps"], num_stages=p["num_stages"])
    if p["grid"] == "split":
        return _decode_split(slots, mixed_qkv, a, b, conv_state, ssm_state, conv_weight, A_log, dt_bias, hk=hk, dk=dk,
                             dv=dv, rep=rep, bv=bv_, ksize=ksize, v_major=p.get("v_major", False), p=p,
                             interpret=interpret, a_off=a_off, b_off=b_off)
    if p["grid"] == "tiles":
        # the whole pool in the batch: the kernel writes the shifted conv state into a new pool (one XLA op less per
        # layer); a pool prefix keeps the rows past it, so there the XLA shift updates the given rows in place
        assert p["conv_shift"] in ("kernel", "xla"), p["conv_shift"]
        shift_in_kernel = given_slots is None and p["conv_shift"] == "kernel"
        out_shape = (jax.ShapeDtypeStruct((B, hv, dv), f32), jax.ShapeDtypeStruct(ssm_state.shape, ssm_state.dtype))
        if shift_in_kernel:
            out_shape += (jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),)
        o, ssm_state, *conv_new = pl.pallas_call(
            functools.partial(_decode_tile_kernel, hk=hk, dk=dk, dv=dv, rep=rep, bv=bv_, ksize=ksize,
                              v_major=p.get("v_major", False), a_off=a_off, b_off=b_off),
            out_shape=out_shape,
            grid=(B, hv, dv // bv_),
            input_output_aliases={8: 1},
            compiler_params=params,
            interpret=interpret,
            name="gdn_decode_step_tiles",
        )(slots, mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, ssm_state)
        conv_state = conv_new[0] if shift_in_kernel else _shift_conv_state(conv_state, mixed_qkv[:, :C], given_slots)
        return o, conv_state, ssm_state
    raise ValueError(f"unknown decode grid {p['grid']!r}: expected 'split' or 'tiles'")


# ==================================================================================================== prefill
def _tri_inv_unit(blocks_t, n):
    """(I + A)^-1 for each strictly lower-triangular [n, n] A, given as A^T in `blocks_t`, by forward substitution on
    rows (fp32): row i of X = e_i - sum_{m<i} A[i, m] X[m, :]. One loop over rows updates all blocks (a compact
    kernel body). Row i of A is column i of A^T: a reduction whose result is already indexed like the rows of X, so
    no step moves a vector to the other axis's layout (a shared-memory round trip in Triton); 1-5% faster for the
    inverse launch than from A on an H100 (results/gdn_inverse_2026-12-06_h100/)."""
    r = jnp.arange(n, dtype=jnp.int32)[:, None]
    c = jnp.arange(n, dtype=jnp.int32)[None, :]
    eye = jnp.where(r == c, 1.0, 0.0).astype(f32)

    def row(i, Xs):
        out = []
        for At, X in zip(blocks_t, Xs):
            a_i = jnp.sum(jnp.where(c == i, At, 0.0), axis=1)     # row i of A, indexed by m
            contrib = jnp.sum(a_i[:, None] * X, axis=0)           # sum_m A[i, m] X[m, :]
            out.append(jnp.where(r == i, X - contrib[None, :], X))
        return tuple(out)

    return jax.lax.fori_loop(1, n, row, tuple(eye for _ in blocks_t))


def _invert_blocks(A: dict, diag_t: list, nb: int, dot: str) -> dict:
    """(I + A)^-1 of a strictly lower-triangular matrix given as its [SUB, SUB] blocks A[i, j] (j < i) and its
    diagonal blocks transposed (diag_t[i] = A[i, i]^T), fp32 accumulation: forward substitution of the diagonal
    blocks, then X_ij = -X_ii sum_{m=j}^{i-1} A_im X_mj (FLA solve_tril's blocking), block dots in `dot` mode.
    Returns the blocks X[i, j], j <= i (those above the diagonal are zero)."""
    X = dict(zip([(i, i) for i in range(nb)], _tri_inv_unit(diag_t, SUB)))
    for d in range(1, nb):
        for i in range(d, nb):
            j = i - d
            acc = _dot(A[i, j], X[j, j], dot)
            for m in range(j + 1, i):
                acc = acc + _dot(A[i, m], X[m, j], dot)
            X[i, j] = -_dot(X[i, i], acc, dot)
    return X


def _masked_load(ref, mask, shape, dtype=f32):
    return plt.load(ref, mask=jnp.broadcast_to(mask, shape), other=0).astype(dtype)


def _wu_kernel(len_ref, off_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, x_ref,
               w_ref, u_ref, qn_ref, kn_ref, aqk_ref, dl_ref, gc_ref, gr_ref, *, rep, dk, dv, scale, dot):
    """Per (sequence, value head, chunk), everything the sequential pass needs as ready-made dot operands:
    w = X (beta e^gc k), u = X (beta v), Aqk = tril(q k^T e^(gc_i-gc_j)), dl = e^gl (gl = the chunk's total log
    decay; 1 for chunks past the end), and the row decays gc, gl - gc [B, H_v, T] (fp32). The normalised (scaled)
    q and k go to qn_ref / kn_ref [B, H_k, T, D_k] once per key head (from its first value head's program): the
    walk applies the row decays, so q and k cross HBM once per key head, not per value head."""
    bi, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kh = h // rep
    L = len_ref[bi]
    t0 = c * CHUNK

    @pl.when(t0 < L)
    def _():
        cr = jnp.arange(CHUNK, dtype=jnp.int32)
        valid = (t0 + cr) < L
        rows = pl.ds(t0, CHUNK)
        src = pl.ds(off_ref[bi] + t0, CHUNK)
        be = _masked_load(beta_ref.at[src, h], valid, (CHUNK,))
        gc = jnp.cumsum(_masked_load(g_ref.at[src, h], valid, (CHUNK,)))
        gl = jnp.sum(jnp.where(cr == CHUNK - 1, gc, 0.0))
        X = x_ref[bi, h, rows, :]
        # v, k, q each loaded where first used and q, k rounded to the operand dtype once normalised (the dots would
        # round them there anyway): 126 registers in 8 warps (ptxas, sm_90a) against 134, so two programs fit an SM;
        # 5-9% faster per layer on an H100 (1 x 4096: 0.358 against 0.395 ms; results/gdn_prefill_2026-12-06c_h100/)
        v = _masked_load(v_ref.at[src, h, :], valid[:, None], (CHUNK, dv))
        u_ref[bi, h, rows, :] = _dot(X, v * be[:, None], dot).astype(u_ref.dtype)
        k = _l2n(_masked_load(k_ref.at[src, kh, :], valid[:, None], (CHUNK, dk)))
        w_ref[bi, h, rows, :] = _dot(X, k * (be * jnp.exp(gc))[:, None], dot).astype(w_ref.dtype)
        gc_ref[bi, h, rows] = gc
        gr_ref[bi, h, rows] = gl - gc
        k = k.astype(kn_ref.dtype)
        q = (_l2n(_masked_load(q_ref.at[src, kh, :], valid[:, None], (CHUNK, dk))) * scale).astype(qn_ref.dtype)

        @pl.when(h % rep == 0)
        def _():
            qn_ref[bi, kh, rows, :] = q
            kn_ref[bi, kh, rows, :] = k
        tri = cr[:, None] >= cr[None, :]
        dg = jnp.where(tri, gc[:, None] - gc[None, :], 0.0)
        aqk_ref[bi, h, rows, :] = jnp.where(tri, _dot_nt(q, k, dot) * jnp.exp(dg), 0.0).astype(aqk_ref.dtype)
        dl_ref[bi, h, c] = jnp.exp(gl)

    @pl.when(t0 >= L)
    def _():
        dl_ref[bi, h, c] = jnp.ones((), f32)


def _inv_kernel(len_ref, off_ref, k_ref, g_ref, beta_ref, x_ref, *, rep, dk, dot, inv_dot):
    """Per (sequence, value head, chunk): X = (I + A)^-1 with A = strictly-lower(beta K K^T * exp(gc_i - gc_j)).

    A's ten [16, 16] blocks on and below the diagonal come from block dots of k's 16-row blocks, so A and X stay in
    registers; X (fp32 accumulation, FLA solve_tril's blocking, block dots in `inv_dot` mode) is stored once, in
    x_ref's dtype (the dot operand dtype: `_wu_kernel` rounds X to it anyway), zeros above the diagonal blocks. The
    layout of FLA's fused kkt + solve_tril kernel (chunk_fwd.py)."""
    bi, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kh = h // rep
    L = len_ref[bi]
    t0 = c * CHUNK
    nb = CHUNK // SUB

    @pl.when(t0 < L)
    def _():
        sr = jnp.arange(SUB, dtype=jnp.int32)
        upper = sr[:, None] < sr[None, :]
        k, be, gc = [], [], []
        base = jnp.zeros((), f32)  # the chunk's log decay summed over the blocks before this one
        for i in range(nb):
            valid = (t0 + i * SUB + sr) < L
            src = pl.ds(off_ref[bi] + t0 + i * SUB, SUB)
            k.append(_l2n(_masked_load(k_ref.at[src, kh, :], valid[:, None], (SUB, dk))))
            be.append(_masked_load(beta_ref.at[src, h], valid, (SUB,)))
            g = _masked_load(g_ref.at[src, h], valid, (SUB,))
            gc.append(jnp.cumsum(g) + base)
            base = base + jnp.sum(g)
        A, diag_t = {}, []
        for i in range(nb):
            for j in range(i):
                A[i, j] = be[i][:, None] * _dot_nt(k[i], k[j], dot) * jnp.exp(gc[i][:, None] - gc[j][None, :])
            # A[i, i]^T[m, r] = be[r] (k_m . k_r) e^(gc_r - gc_m) for m < r (K K^T is symmetric)
            dg = gc[i][None, :] - gc[i][:, None]
            diag_t.append(jnp.where(upper, be[i][None, :] * _dot_nt(k[i], k[i], dot) *
                                    jnp.exp(jnp.where(upper, dg, 0.0)), 0.0))
        X = _invert_blocks(A, diag_t, nb, inv_dot)
        zero = jnp.zeros((SUB, SUB), x_ref.dtype)
        for i in range(nb):
            for j in range(nb):
                x_ref[bi, h, pl.ds(t0 + i * SUB, SUB), pl.ds(j * SUB, SUB)] = (
                    X[i, j].astype(x_ref.dtype) if j <= i else zero)


def _dot_nt(a, b, mode):
    """a @ b^T (contract the last dims)."""
    dt = _DOT_DTYPE[mode]
    prec = {"tf32": (jax.lax.Precision.HIGH,) * 2, "float32": (jax.lax.Precision.HIGHEST,) * 2}.get(mode)
    return jax.lax.dot_general(a.astype(dt), b.astype(dt), (((1,), (1,)), ((), ())), precision=prec,
                               preferred_element_type=f32)


def _state_kernel(len_ref, off_ref, w_ref, u_ref, qn_ref, kn_ref, aqk_ref, dl_ref, gc_ref, gr_ref, *rest, dk, bv, nc,
                  dot, has_init, static_loop, span, rep):
    """Per (sequence, value head, D_v slice): the sequential chunk walk with the state slice in registers, q and k
    those of the value head's key head (`_wu_kernel`'s qn, kn) and the row decays applied on the [64, bv] sides:
    v_new = u - w S;  o = e^gc (q S) + Aqk v_new;  S <- dl S + k^T (e^(gl - gc) v_new). Writes o on the sequence's
    rows only, or with `span` (static; needs static_loop) on its first `span` rows: the rows past its length come
    out 0 (their operands load as 0), so a right-padded batch needs no masking pass after the kernel."""
    if has_init:
        s0_ref, *rest = rest
    o_ref, st_ref = rest
    bi, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    L = len_ref[bi]
    off = off_ref[bi]
    cols = pl.ds(j * bv, bv)
    cr = jnp.arange(CHUNK, dtype=jnp.int32)
    if has_init:
        S = s0_ref[bi, h, :, cols].astype(f32)
    else:
        S = jnp.zeros((dk, bv), f32)

    def body(c, S):
        t0 = c * CHUNK
        rows = pl.ds(t0, CHUNK)
        if static_loop:  # chunks past the end were never written: masked loads give zeros (a no-op chunk)
            live = jnp.broadcast_to(t0 < L, (CHUNK, 1))
            ld = lambda ref, n, dt: _masked_load(ref, live, (CHUNK, n), dt)
        else:
            ld = lambda ref, n, dt: ref[...].astype(dt)
        opdt = _DOT_DTYPE[dot]
        w = ld(w_ref.at[bi, h, rows, :], dk, opdt)
        if static_loop:  # dead chunks: q = k = 0 and decays e^0
            row_exp = lambda ref: jnp.exp(_masked_load(ref.at[bi, h, rows], t0 < L, (CHUNK,)))[:, None]
        else:
            row_exp = lambda ref: jnp.exp(ref[bi, h, rows])[:, None]
        kh = h // rep
        kn = ld(kn_ref.at[bi, kh, rows, :], dk, opdt)
        u = ld(u_ref.at[bi, h, rows, cols], bv, f32)
        dl = dl_ref[bi, h, c]
        v_new = u - _dot(w, S, dot)
        aqk = ld(aqk_ref.at[bi, h, rows, :], CHUNK, opdt)
        o = row_exp(gc_ref) * _dot(ld(qn_ref.at[bi, kh, rows, :], dk, opdt), S, dot)   # (q e^gc) S = e^gc (q S)
        o = o + _dot(aqk, v_new, dot)
        plt.store(o_ref.at[pl.ds(off + t0, CHUNK), h, cols], o,
                  mask=jnp.broadcast_to(((t0 + cr) < (L if span is None else span))[:, None], (CHUNK, bv)))
        # (k e^(gl - gc))^T v_new = k^T (e^(gl - gc) v_new)
        return dl * S + _dot(kn, row_exp(gr_ref) * v_new, dot, trans_a=True)

    # static: a fixed trip count (scf.for: Triton can software-pipeline the loads); else only the live chunks
    S = jax.lax.fori_loop(0, nc if static_loop else (L + CHUNK - 1) // CHUNK, body, S)
    st_ref[bi, h, :, cols] = S


def _chunk_prefill(q, k, v, g, beta, initial_state, offsets, lengths, seq_len: int, interpret: bool = False, *,
                   dot=None, bv=None, static_loop=None, num_warps=None, num_stages=None,
                   inv_num_warps=None, wu_num_warps=None, u_operand_dtype=None, inv_dot=None, padded=False):
    """The chunked prefill on rows: q, k [N, H_k, D_k], v [N, H_v, D_v], g, beta [N, H_v]; sequence b holds rows
    offsets[b] .. offsets[b] + lengths[b] - 1 (lengths <= seq_len); three launches.
    Returns (o [N, H_v, D_v] fp32, written on those rows only; final_state [B, H_v, D_k, D_v] fp32; zero_filled).
    `padded`: the right-padded layout (offsets b * seq_len); where the walk computes o over a static chunk loop it
    also writes the zeros past each length, and `zero_filled` says so (no masking pass needed). Tuning overrides:
    see TUNING ("prefill", "prefill_state", "prefill_prep")."""
    pd = _params("prefill", dict(dot=dot))
    dot = pd["dot"]
    N, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    B = offsets.shape[0]
    rep = hv // hk
    assert k.shape == q.shape and g.shape == beta.shape == (N, hv)
    lengths = jnp.minimum(lengths.astype(jnp.int32), seq_len)
    offsets = offsets.astype(jnp.int32)
    has_init = initial_state is not None
    out_shape = (jax.ShapeDtypeStruct((N, hv, dv), f32), jax.ShapeDtypeStruct((B, hv, dk, dv), f32))
    ps = _params("prefill_state", dict(bv=bv, static_loop=static_loop, num_warps=num_warps, num_stages=num_stages))
    pp = _params("prefill_prep", dict(inv_num_warps=inv_num_warps, wu_num_warps=wu_num_warps,
                                      u_operand_dtype=u_operand_dtype, inv_dot=inv_dot))
    nc = pl.cdiv(seq_len, CHUNK)
    tp = nc * CHUNK
    bv_ = ps["bv"]
    if bv_ is None:  # fewer state-pass programs than SMs at the large tile: split D_v finer
        bv_ = ps["bv_small_grid"] if B * hv * (dv // ps["bv_large_grid"]) < ps["num_sms"] else ps["bv_large_grid"]
    bv_ = min(bv_, dv)
    assert dv % bv_ == 0
    opdt = _DOT_DTYPE[dot]  # everything the state pass reads as a dot operand is stored in the operand dtype
    inv_warps = pp["inv_num_warps"]
    if inv_warps is None:  # small grids: more warps per chunk; large ones: more chunks per SM
        large = B * hv * nc >= pp["inv_large_grid"]
        inv_warps = pp["inv_num_warps_large_grid"] if large else pp["inv_num_warps_small_grid"]
    inv_dot = pp["inv_dot"] or ("float32" if dot == "float32" else "tf32")
    if interpret and inv_dot == "tf32x3":  # the interpreter's CPU dots have no tf32x3 algorithm: fp32 there
        inv_dot = "float32"
    pinv = plt.CompilerParams(num_warps=inv_warps, num_stages=pp["num_stages"])
    pwu = plt.CompilerParams(num_warps=pp["wu_num_warps"], num_stages=pp["num_stages"])
    qk = jax.ShapeDtypeStruct((B, hk, tp, dk), opdt)
    rowdecay = jax.ShapeDtypeStruct((B, hv, tp), f32)
    operands_shape = (jax.ShapeDtypeStruct((B, hv, tp, dk), opdt),                          # w
                      jax.ShapeDtypeStruct((B, hv, tp, dv), opdt if pp["u_operand_dtype"] else f32),  # u
                      qk, qk,                                                                  # qn, kn
                      jax.ShapeDtypeStruct((B, hv, tp, CHUNK), opdt),                       # Aqk
                      jax.ShapeDtypeStruct((B, hv, nc), f32),                               # dl
                      rowdecay, rowdecay)                                                      # gc, gl - gc
    xinv = pl.pallas_call(
        functools.partial(_inv_kernel, rep=rep, dk=dk, dot=dot, inv_dot=inv_dot),
        out_shape=jax.ShapeDtypeStruct((B, hv, tp, CHUNK), opdt),
        grid=(B, hv, nc), compiler_params=pinv, interpret=interpret, name="gdn_prefill_inverse",
    )(lengths, offsets, k, g, beta)
    operands = pl.pallas_call(
        functools.partial(_wu_kernel, rep=rep, dk=dk, dv=dv, scale=dk ** -0.5, dot=dot),
        out_shape=operands_shape, grid=(B, hv, nc), compiler_params=pwu, interpret=interpret,
        name="gdn_prefill_wu",
    )(lengths, offsets, q, k, v, g, beta, xinv)
    args = (lengths, offsets, *operands) + ((initial_state,) if has_init else ())
    zero_filled = padded and ps["static_loop"]
    o, final_state = pl.pallas_call(
        functools.partial(_state_kernel, dk=dk, bv=bv_, nc=nc, dot=dot, has_init=has_init,
                          static_loop=ps["static_loop"], span=seq_len if zero_filled else None, rep=rep),
        out_shape=out_shape,
        grid=(B, hv, dv // bv_),
        compiler_params=plt.CompilerParams(num_warps=ps["num_warps"], num_stages=ps["num_stages"]),
        interpret=interpret,
        name="gdn_prefill_state",
    )(*args)
    return o, final_state, zero_filled


def gated_delta_chunk_prefill_triton(q, k, v, g, beta, initial_state=None, lengths=None, *, interpret: bool = False,
                                     **tuning):
    """Chunked gated delta rule; same contract as `reference.gated_delta_chunked` (o and final state in fp32).

    q, k [B, T, H_k, D_k]; v [B, T, H_v, D_v]; g (log decay), beta [B, T, H_v]; initial_state [B, H_v, D_k, D_v]
    (fp32 or bf16); lengths [B] (None: all T). Positions >= lengths[b] give zero output and leave the state alone.
    `tuning`: overrides of TUNING's prefill entries (`dot`, `bv`, `num_warps`, ...; see `_chunk_prefill`)."""
    B, T = q.shape[:2]
    lengths = jnp.full((B,), T, jnp.int32) if lengths is None else jnp.minimum(lengths.astype(jnp.int32), T)
    rows = lambda x: x.reshape((B * T,) + x.shape[2:])
    o, st, zero_filled = _chunk_prefill(*map(rows, (q, k, v, g, beta)), initial_state,
                                        jnp.arange(B, dtype=jnp.int32) * T, lengths, T, interpret, padded=True,
                                        **tuning)
    o = o.reshape((B, T) + o.shape[1:])
    if zero_filled:
        return o, st
    valid = jnp.arange(T)[None, :] < lengths[:, None]
    return jnp.where(valid[..., None, None], o, 0.0), st


def gated_delta_packed_prefill_triton(q, k, v, g, beta, initial_state, offsets, lengths, *, seq_len: int,
                                      interpret: bool = False, **tuning):
    """The chunked prefill on sequences packed end to end; same contract as `reference.gated_delta_packed`.

    q, k [1, N, H_k, D_k]; v [1, N, H_v, D_v]; g, beta [1, N, H_v]; sequence p at rows offsets[p] .. offsets[p] +
    lengths[p] - 1 (lengths <= seq_len, static). The kernels read those rows in place (no gather into lanes) and
    write o there; rows outside every sequence come back zero. `tuning` as for `gated_delta_chunk_prefill_triton`."""
    N = q.shape[1]
    o, st, _ = _chunk_prefill(q[0], k[0], v[0], g[0], beta[0], initial_state, offsets, lengths, seq_len, interpret,
                              **tuning)
    r = jnp.arange(N, dtype=jnp.int32)[:, None]
    valid = ((r >= offsets[None, :]) & (r < (offsets + lengths)[None, :])).any(axis=1)
    return jnp.where(valid[:, None, None], o, 0.0)[None], st
