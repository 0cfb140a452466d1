"""Gated DeltaNet Pallas kernels (Triton lowering) vs the plain-jnp reference, in Pallas interpret mode on CPU.

Tolerances (relative Frobenius error ||x - ref|| / ||ref||):
  * fp32 dot mode (`dot="float32"`) vs the token-by-token recurrence: <= 2e-5 (only the summation order differs;
    measured ~5e-7 for the chunked prefill, ~1e-7 for decode).
  * bf16 dot operands (`dot="bfloat16"`, the fast GPU mode, as FLA does): <= 2e-2.
  * bf16 state pool, one decode step vs the reference step on the same bf16 pool: <= 1e-2 (both round the same fp32
    update to bf16); 40 decode steps with a bf16 pool vs an fp32 pool: <= 3e-2 on the outputs.
Interpret mode fills un-written outputs with NaN, so "no NaN + exact zeros past each length" checks full coverage.
Shapes are kept small (the interpreter runs each grid point in a loop); one case per kernel uses the full head
dimension 128, and the lowering test lowers both kernels at full Drama 3 shapes for an (abstract) H200.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.dispatch import pick_backend
from kernels.gdn import api, pallas_triton, reference
from kernels.h200_lowering import lower_for_h200

f32 = jnp.float32
# jitted references (eager op-by-op dispatch would dominate the test time)
ref_recurrent = jax.jit(reference.gated_delta_recurrent)
ref_decode = jax.jit(reference.gdn_decode_step,
                     static_argnames=("num_k_heads", "head_k_dim", "head_v_dim", "v_major", "a_col", "b_col"))
ref_conv = jax.jit(reference.causal_conv1d)


@functools.lru_cache(maxsize=None)
def _jitted(kind, static_kwargs):
    if kind == "packed":  # (q, k, v, g, beta, s0, lengths, offsets)
        fn = lambda *a, **kw: api.gdn_prefill(*a[:7], offsets=a[7], **kw)
    else:
        fn = api.gdn_prefill if kind == "prefill" else api.gdn_decode_step
    return jax.jit(functools.partial(fn, backend="pallas_triton", interpret=True, **dict(static_kwargs)))


def kernel_prefill(*args, **kw):
    """The Pallas prefill through the public api, in interpret mode, jitted once per static configuration."""
    return _jitted("prefill", tuple(sorted(kw.items())))(*args)


def kernel_decode(*args, slots=None, **kw):
    return _jitted("decode", tuple(sorted(kw.items())))(*args, slots=slots)


def rel(x, y) -> float:
    x = np.asarray(jnp.asarray(x, f32), np.float64)
    y = np.asarray(jnp.asarray(y, f32), np.float64)
    return float(np.linalg.norm(x - y) / np.linalg.norm(y))


def prefill_inputs(seed, B, T, hk, hv, dk, dv, dtype=f32):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = jax.random.normal(ks[0], (B, T, hk, dk), dtype)
    k = jax.random.normal(ks[1], (B, T, hk, dk), dtype)
    v = jax.random.normal(ks[2], (B, T, hv, dv), dtype)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, hv))) * 0.5   # log decay in about [-2, 0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, hv)))
    s0 = jax.random.normal(ks[5], (B, hv, dk, dv)) * 0.2
    return q, k, v, g, beta, s0


def nan_pad(x, lengths):
    """Garbage (NaN) at positions >= lengths: the kernel must not read them into the math."""
    T = x.shape[1]
    valid = jnp.arange(T)[None, :] < lengths[:, None]
    return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), x, jnp.nan).astype(x.dtype)


def decode_inputs(seed, slots_total, B, hk, hv, dk, dv, K=4, state_dtype=f32, x_dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    C = 2 * hk * dk + hv * dv
    x = jax.random.normal(ks[0], (B, C), x_dtype)
    a = jax.random.normal(ks[1], (B, hv), x_dtype)
    b = jax.random.normal(ks[2], (B, hv), x_dtype)
    conv = jax.random.normal(ks[3], (slots_total, K - 1, C), x_dtype)
    ssm = (jax.random.normal(ks[4], (slots_total, hv, dk, dv)) * 0.2).astype(state_dtype)
    w = (jax.random.normal(ks[5], (C, K)) * 0.5).astype(x_dtype)
    A_log = jax.random.normal(ks[6], (hv,)) * 0.5
    dt_bias = jax.random.normal(ks[7], (hv,))
    return x, a, b, conv, ssm, w, A_log, dt_bias


# ------------------------------------------------------------------------------------------------ prefill
@pytest.mark.parametrize("variant", ["dynamic", "static", "inverse_one_warp"])
def test_prefill_ragged_matches_recurrence(variant):
    """Lengths 1, 63, 64, 65, 300 in one right-padded batch, initial state carried in, NaN garbage past lengths,
    2 value heads per key head (q and k stored once per key head, each value head's row decays applied in the walk);
    the kernels with a dynamic or a static chunk loop in the state pass (the static one writes the zeros past each
    length itself), or with the inverse in one warp."""
    B, T, hk, hv, dk, dv = 5, 300, 1, 2, 32, 32
    if variant.endswith("static"):  # the static trip-count variant is slower to interpret: a shorter batch
        T, lengths = 130, jnp.array([1, 63, 64, 65, 130], jnp.int32)
    else:
        lengths = jnp.array([1, 63, 64, 65, 300], jnp.int32)
    q, k, v, g, beta, s0 = prefill_inputs(0, B, T, hk, hv, dk, dv)
    o, st = kernel_prefill(*(nan_pad(x, lengths) for x in (q, k, v, g, beta)), s0, lengths, dot="float32", bv=16,
                           static_loop=variant.endswith("static"),
                           inv_num_warps=1 if variant == "inverse_one_warp" else None)
    o_ref, st_ref = ref_recurrent(q, k, v, g, beta, s0, lengths)
    assert o.shape == (B, T, hv, dv) and o.dtype == f32 and st.shape == (B, hv, dk, dv) and st.dtype == f32
    assert not bool(jnp.isnan(o).any()) and not bool(jnp.isnan(st).any())
    pad = jnp.arange(T)[None, :] >= lengths[:, None]
    assert bool((jnp.where(pad[..., None, None], o, 0.0) == 0).all()) and bool((o[pad] == 0).all())
    for i in range(B):
        n = int(lengths[i])
        assert rel(o[i, :n], o_ref[i, :n]) <= 2e-5, i
        assert rel(st[i], st_ref[i]) <= 2e-5, i


def test_prefill_packed_reads_each_sequence_in_place():
    """Sequences of 65, 1, 64 and 63 rows packed end to end, NaN garbage in the padding rows, an empty lane, one
    initial state per lane: each sequence's rows and final state equal the recurrence alone; rows outside are 0."""
    hk, hv, dk, dv, T, N = 1, 2, 32, 32, 65, 220
    lengths = np.array([65, 1, 64, 63, 0], np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int32)
    offsets[-1] = N
    q, k, v, g, beta, _ = prefill_inputs(9, 1, N, hk, hv, dk, dv)
    s0 = prefill_inputs(10, len(lengths), 1, hk, hv, dk, dv)[5]
    used = int(lengths.sum())
    garbage = lambda x: x.at[:, used:].set(jnp.nan)
    run = _jitted("packed", (("dot", "float32"), ("seq_len", T)))
    o, st = run(*map(garbage, (q, k, v, g, beta)), s0, jnp.asarray(lengths), jnp.asarray(offsets))
    assert o.shape == (1, N, hv, dv) and st.shape == (len(lengths), hv, dk, dv)
    assert not bool(jnp.isnan(o).any()) and not bool((o[0, used:] != 0).any())
    for i, (off, n) in enumerate(zip(offsets, lengths)):
        if n == 0:
            assert rel(st[i], s0[i]) == 0  # an empty lane keeps its state
            continue
        cut = lambda x: x[:, off:off + n]
        o_ref, st_ref = ref_recurrent(*map(cut, (q, k, v, g, beta)), s0[i:i + 1])
        assert rel(o[:, off:off + n], o_ref) <= 2e-5, i
        assert rel(st[i], st_ref[0]) <= 2e-5, i


def test_prefill_full_head_dim_no_state_no_lengths():
    """D = 128 (the real head dim, default tuning), exactly one chunk, no initial state, lengths=None."""
    q, k, v, g, beta, _ = prefill_inputs(1, 1, 64, 1, 2, 128, 128)
    o, st = kernel_prefill(q, k, v, g, beta, dot="float32")
    o_ref, st_ref = ref_recurrent(q, k, v, g, beta)
    assert rel(o, o_ref) <= 2e-5 and rel(st, st_ref) <= 2e-5


@pytest.mark.parametrize("u_operand_dtype", [True, False])
def test_prefill_bf16_dots_and_bf16_inputs(u_operand_dtype):
    """The fast GPU mode: bf16 q/k/v inputs, bf16 dot operands, bf16 initial state; fp32 accumulation; the inverse
    and u stored in bf16 (the default) or u in fp32; 2 value heads per key head."""
    B, T, hk, hv, dk, dv = 2, 130, 2, 4, 32, 32
    lengths = jnp.array([130, 70], jnp.int32)
    q, k, v, g, beta, s0 = prefill_inputs(2, B, T, hk, hv, dk, dv, jnp.bfloat16)
    s0 = s0.astype(jnp.bfloat16)
    o, st = kernel_prefill(q, k, v, g, beta, s0, lengths, dot="bfloat16", bv=16, u_operand_dtype=u_operand_dtype)
    o_ref, st_ref = ref_recurrent(q, k, v, g, beta, s0, lengths)
    assert not bool(jnp.isnan(o).any())
    assert rel(o, o_ref) <= 2e-2 and rel(st, st_ref) <= 2e-2
    assert rel(o, o_ref) > 0  # really ran with bf16 operands (not silently fp32)


# ------------------------------------------------------------------------------------------------ decode
@pytest.mark.parametrize("grid", ["tiles", "split"])
@pytest.mark.parametrize("state_dtype,dims", [(f32, (2, 4, 32, 32)), (jnp.bfloat16, (2, 4, 32, 32)),
                                              (f32, (1, 2, 128, 128))])
def test_decode_step_matches_reference(state_dtype, dims, grid):
    """Slots in the batch are updated like the reference; every other slot is left bit-for-bit untouched. Both grids:
    a program per state tile with the conv shift in XLA, or the split pair (a prep launch per key head that shifts
    in place, then a launch per state tile)."""
    hk, hv, dk, dv = dims
    S, B = 6, 4
    slots = jnp.array([5, 0, 3, 2], jnp.int32)
    x, a, b, conv, ssm, w, A_log, dt_bias = decode_inputs(3, S, B, hk, hv, dk, dv, state_dtype=state_dtype)
    kw = dict(num_k_heads=hk, head_k_dim=dk, head_v_dim=dv, slots=slots)
    tune = ({"bv": 16} if dv == 32 else {}) | {"grid": grid}
    o, conv1, ssm1 = kernel_decode(x, a, b, conv, ssm, w, A_log, dt_bias, **tune, **kw)
    o_r, conv_r, ssm_r = ref_decode(x, a, b, conv, ssm, w, A_log, dt_bias, **kw)
    assert o.shape == (B, hv, dv) and o.dtype == f32 and not bool(jnp.isnan(o).any())
    assert ssm1.dtype == state_dtype and conv1.dtype == conv.dtype
    assert bool((conv1 == conv_r).all())                         # conv shift: exact
    untouched = jnp.array([1, 4])
    assert bool((ssm1[untouched] == ssm[untouched]).all()) and bool((conv1[untouched] == conv[untouched]).all())
    tol = 1e-5 if state_dtype == f32 else 1e-2
    assert rel(o, o_r) <= tol
    assert rel(ssm1[slots], ssm_r[slots]) <= tol
    assert rel(ssm1[slots], ssm[slots]) > 1e-3                   # the addressed slots really changed


@pytest.mark.parametrize("grid", ["tiles", "split"])
def test_decode_reads_the_fused_projection_in_place(grid):
    """a_col / b_col: q/k/v, b and a read from one [B, W] fused in-projection output (the model's column order, then
    padding) give exactly the result of the separate inputs, in the kernel and in the reference."""
    hk, hv, dk, dv, S = 2, 4, 32, 32, 5
    slots = jnp.array([3, 0, 4], jnp.int32)
    x, a, b, conv, ssm, w, A_log, dt_bias = decode_inputs(21, S, 3, hk, hv, dk, dv)
    z = jax.random.normal(jax.random.PRNGKey(22), (3, hv * dv), x.dtype)
    pad = jnp.full((3, 7), 3.0, x.dtype)
    proj = jnp.concatenate([x, z, b, a, pad], axis=1)
    b_col = x.shape[1] + z.shape[1]
    a_col = b_col + hv
    kw = dict(num_k_heads=hk, head_k_dim=dk, head_v_dim=dv, slots=slots)
    tune = dict(grid=grid, bv=16)
    want = kernel_decode(x, a, b, conv, ssm, w, A_log, dt_bias, **tune, **kw)
    got = kernel_decode(proj, None, None, conv, ssm, w, A_log, dt_bias, a_col=a_col, b_col=b_col, **tune, **kw)
    for g_, w_ in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g_), np.asarray(w_))
    ref = ref_decode(proj, None, None, conv, ssm, w, A_log, dt_bias, a_col=a_col, b_col=b_col, **kw)
    ref_sep = ref_decode(x, a, b, conv, ssm, w, A_log, dt_bias, **kw)
    for r_, s_ in zip(ref, ref_sep):
        np.testing.assert_array_equal(np.asarray(r_), np.asarray(s_))
    assert rel(got[0], ref[0]) <= 1e-5
    with pytest.raises(ValueError, match="a_col and b_col"):
        api.gdn_decode_step(proj, None, None, conv, ssm, w, A_log, dt_bias, a_col=a_col, **kw)


@pytest.mark.parametrize("grid", ["tiles", "split"])
@pytest.mark.parametrize("state_dtype", [f32, jnp.bfloat16])
def test_decode_v_major_pool_is_the_transposed_state(state_dtype, grid):
    """grid="tiles" or "split", v_major: a pool holding each head's state as [D_v, D_k] gives the reference's output
    and, once transposed back, its state (ragged slot order, D_v tiled in 4)."""
    hk, hv, dk, dv, S = 2, 4, 32, 64, 5
    slots = jnp.array([4, 1, 2], jnp.int32)
    x, a, b, conv, ssm, w, A_log, dt_bias = decode_inputs(8, S, 3, hk, hv, dk, dv, state_dtype=state_dtype)
    kw = dict(num_k_heads=hk, head_k_dim=dk, head_v_dim=dv, slots=slots)
    o, conv1, ssm_t = kernel_decode(x, a, b, conv, jnp.swapaxes(ssm, -1, -2), w, A_log, dt_bias, grid=grid,
                                    v_major=True, bv=16, **kw)
    o_r, conv_r, ssm_r = ref_decode(x, a, b, conv, ssm, w, A_log, dt_bias, **kw)
    tol = 1e-5 if state_dtype == f32 else 1e-2
    assert rel(o, o_r) <= tol and bool((conv1 == conv_r).all())
    assert rel(jnp.swapaxes(ssm_t, -1, -2), ssm_r) <= tol
    # the reference on the same v-major pool (the model's layout) is the K-major reference, transposed
    o_v, _, ssm_v = ref_decode(x, a, b, conv, jnp.swapaxes(ssm, -1, -2), w, A_log, dt_bias, v_major=True, **kw)
    assert rel(o_v, o_r) <= 1e-6 and rel(jnp.swapaxes(ssm_v, -1, -2), ssm_r) <= (1e-6 if state_dtype == f32 else 1e-2)
    assert rel(jnp.swapaxes(ssm_t, -1, -2)[slots], ssm[slots]) > 1e-3


@pytest.mark.parametrize("state_dtype", [f32, jnp.bfloat16])
def test_decode_tiles_whole_pool_shifts_conv_state_in_kernel(state_dtype):
    """grid="tiles" over the whole pool (slots=None): the kernel itself writes the shifted conv state (no XLA
    concatenate left in the program), exactly the reference's, with 2 value heads per key head and 2 D_v tiles."""
    hk, hv, dk, dv, B = 2, 4, 32, 32, 3
    x, a, b, conv, ssm, w, A_log, dt_bias = decode_inputs(11, B, B, hk, hv, dk, dv, state_dtype=state_dtype)
    kw = dict(num_k_heads=hk, head_k_dim=dk, head_v_dim=dv)
    args = (x, a, b, conv, ssm, w, A_log, dt_bias)
    o_r, conv_r, ssm_r = ref_decode(*args, **kw)
    tol = 1e-5 if state_dtype == f32 else 1e-2
    for shift in ("kernel", "xla"):  # the tuning default, and the separate XLA op it replaced
        jaxpr = str(jax.make_jaxpr(lambda *z: pallas_triton.gdn_decode_step_triton(
            *z, **kw, interpret=True, grid="tiles", bv=16, conv_shift=shift))(*args))
        assert ("concatenate" in jaxpr) == (shift == "xla")
        o, conv1, ssm1 = kernel_decode(*args, grid="tiles", bv=16, conv_shift=shift, **kw)
        assert conv1.dtype == conv.dtype and bool((conv1 == conv_r).all())
        assert bool((conv1 != conv).any())
        assert rel(o, o_r) <= tol and rel(ssm1, ssm_r) <= tol


@pytest.mark.parametrize("grid", ["tiles", "split"])
def test_decode_without_slots_and_bf16_state_drift(grid):
    """slots=None (row i = slot i); 40 steps with a bf16 pool stay within 3e-2 of the fp32 pool."""
    hk, hv, dk, dv, B, n = 1, 2, 32, 32, 2, 40
    x, a, b, conv, ssm, w, A_log, dt_bias = decode_inputs(4, B, B, hk, hv, dk, dv)
    kw = dict(num_k_heads=hk, head_k_dim=dk, head_v_dim=dv, interpret=True, bv=16, grid=grid)
    step = jax.jit(lambda *args: pallas_triton.gdn_decode_step_triton(*args, **kw))
    xs = jax.random.normal(jax.random.PRNGKey(5), (n, B, x.shape[1]), x.dtype)
    ab = jax.random.normal(jax.random.PRNGKey(6), (n, 2, B, hv), a.dtype)
    pools = {f32: (conv, ssm), jnp.bfloat16: (conv, ssm.astype(jnp.bfloat16))}
    outs = {}
    for dt, (c, s) in pools.items():
        res = []
        for t in range(n):
            o, c, s = step(xs[t], ab[t, 0], ab[t, 1], c, s, w, A_log, dt_bias)
            res.append(o)
        outs[dt] = jnp.stack(res)
        assert s.dtype == dt
    # fp32 pool against the plain reference over the same 40 steps
    c, s, res = conv, ssm, []
    for t in range(n):
        o, c, s = ref_decode(xs[t], ab[t, 0], ab[t, 1], c, s, w, A_log, dt_bias, num_k_heads=hk, head_k_dim=dk,
                             head_v_dim=dv)
        res.append(o)
    assert rel(outs[f32], jnp.stack(res)) <= 2e-5
    err = rel(outs[jnp.bfloat16], outs[f32])
    assert 0 < err <= 3e-2


def test_prefill_then_decode_equals_one_long_prefill():
    """Ragged prompts (65 and 40 tokens) through conv + gates + the prefill kernel, then 3 fused decode steps
    from the resulting pools: outputs and final state equal one reference pass over each whole sequence."""
    hk, hv, dk, dv, K, n = 1, 2, 32, 32, 4, 3
    C = 2 * hk * dk + hv * dv
    kd = hk * dk
    lens = [65, 40]
    B, T = len(lens), max(lens)
    ks = jax.random.split(jax.random.PRNGKey(7), 6)
    seqs = [jax.random.normal(jax.random.fold_in(ks[0], i), (L + n, C)) for i, L in enumerate(lens)]
    abs_ = [jax.random.normal(jax.random.fold_in(ks[1], i), (L + n, 2, hv)) for i, L in enumerate(lens)]
    w = jax.random.normal(ks[2], (C, K)) * 0.5
    A_log = jax.random.normal(ks[3], (hv,)) * 0.5
    dt_bias = jax.random.normal(ks[4], (hv,))
    lengths = jnp.array(lens, jnp.int32)

    def split(y, Bn, Tn):
        return (y[..., :kd].reshape(Bn, Tn, hk, dk), y[..., kd:2 * kd].reshape(Bn, Tn, hk, dk),
                y[..., 2 * kd:].reshape(Bn, Tn, hv, dv))

    # prompt: right-padded batch through the kernel
    mixed = jnp.stack([jnp.pad(s[:L], ((0, T - L), (0, 0))) for s, L in zip(seqs, lens)])
    ab = jnp.stack([jnp.pad(x[:L], ((0, T - L), (0, 0), (0, 0))) for x, L in zip(abs_, lens)])
    y, conv_pool = ref_conv(mixed, w, None, lengths)
    g, beta = reference.gdn_gates(ab[:, :, 0], ab[:, :, 1], A_log, dt_bias)
    o_pre, ssm_pool = kernel_prefill(*split(y, B, T), g, beta, None, lengths, dot="float32", bv=16)
    # decode: pools hold slot i = sequence i, in reverse slot order to exercise the indirection
    slots = jnp.array([1, 0], jnp.int32)
    conv_pool, ssm_pool = conv_pool[::-1], ssm_pool[::-1]
    o_dec = []
    for t in range(n):
        x_t = jnp.stack([s[L + t] for s, L in zip(seqs, lens)])
        ab_t = jnp.stack([x[L + t] for x, L in zip(abs_, lens)])
        o, conv_pool, ssm_pool = kernel_decode(x_t, ab_t[:, 0], ab_t[:, 1], conv_pool, ssm_pool, w, A_log, dt_bias,
                                               num_k_heads=hk, head_k_dim=dk, head_v_dim=dv, slots=slots, bv=16)
        o_dec.append(o)
    o_dec = jnp.stack(o_dec, 1)  # [B, n, hv, dv]
    for i, (s, x, L) in enumerate(zip(seqs, abs_, lens)):
        yi, _ = ref_conv(s[None], w)
        gi, bi = reference.gdn_gates(x[None, :, 0], x[None, :, 1], A_log, dt_bias)
        o_full, st_full = ref_recurrent(*split(yi, 1, L + n), gi, bi)
        assert rel(o_pre[i, :L], o_full[0, :L]) <= 2e-5
        assert rel(o_dec[i], o_full[0, L:]) <= 2e-5
        assert rel(ssm_pool[slots[i]], st_full[0]) <= 2e-5


# ------------------------------------------------------------------------------------------------ dispatch / lowering
def test_api_dispatch():
    assert jax.default_backend() == "cpu"
    pick = lambda table, name: pick_backend(table, name, "GDN", auto="pallas_triton")
    assert pick(api.PREFILL_BACKENDS, "auto") is reference.gated_delta_chunked       # CPU: the reference
    assert pick(api.DECODE_BACKENDS, "auto") is reference.gdn_decode_step
    assert pick(api.PREFILL_BACKENDS, "pallas_triton") is pallas_triton.gated_delta_chunk_prefill_triton
    assert pick(api.DECODE_BACKENDS, "pallas_triton") is pallas_triton.gdn_decode_step_triton
    q, k, v, g, beta, _ = prefill_inputs(8, 1, 5, 1, 2, 16, 16)
    with pytest.raises(ValueError, match="unknown GDN backend"):
        api.gdn_prefill(q, k, v, g, beta, backend="nope")


def test_triton_lowering_full_shapes_for_h200():
    """Both kernels lower to Triton custom calls at full Drama 3 shapes (H_k 16, H_v 32, D 128, conv 8192) for an
    abstract H200; the decode call aliases both pools in place (no copy of the pool per step)."""
    sd = jax.ShapeDtypeStruct
    B, T, S, hk, hv, d, K = 4, 300, 8, 16, 32, 128, 4
    C = 2 * hk * d + hv * d
    bf = jnp.bfloat16
    for sdt, grid in ((bf, "tiles"), (f32, "split"), (bf, "split")):
        txt = lower_for_h200(lambda x, a, b, c, s, w, al, dt, sl: pallas_triton.gdn_decode_step_triton(
            x, a, b, c, s, w, al, dt, num_k_heads=hk, head_k_dim=d, head_v_dim=d, slots=sl, grid=grid),
            sd((B, C), bf), sd((B, hv), bf), sd((B, hv), bf), sd((S, K - 1, C), bf), sd((S, hv, d, d), sdt),
            sd((C, K), bf), sd((hv,), f32), sd((hv,), f32), sd((B,), jnp.int32), donate=(3, 4))
        # "split": the prep launch (conv pool in place), then the state launch (state pool in place)
        launches = 2 if grid == "split" else 1
        assert txt.count("__gpu$xla.gpu.triton") == launches and "output_operand_aliases" in txt
        if grid != "tiles":  # "tiles" with slots shifts the conv pool in XLA
            assert "scatter" not in txt and "concatenate" not in txt  # no XLA op touches the pools
    for dot, inv_dot in (("bfloat16", None), ("bfloat16", "tf32x3"), ("bfloat16", "float32"), ("tf32", None)):
        txt = lower_for_h200(lambda q, k, v, g, be, s0, ln: pallas_triton.gated_delta_chunk_prefill_triton(
            q, k, v, g, be, s0, ln, dot=dot, inv_dot=inv_dot), sd((B, T, hk, d), bf),
            sd((B, T, hk, d), bf), sd((B, T, hv, d), bf), sd((B, T, hv), f32), sd((B, T, hv), f32),
            sd((B, hv, d, d), f32), sd((B,), jnp.int32))
        # inverse, w/u operands, state pass
        assert txt.count("__gpu$xla.gpu.triton") == 3
    N = 2 * T  # packed: B sequences of at most T rows in 2T rows, read in place
    txt = lower_for_h200(lambda q, k, v, g, be, s0, ln, off: pallas_triton.gated_delta_packed_prefill_triton(
        q, k, v, g, be, s0, off, ln, seq_len=T), sd((1, N, hk, d), f32), sd((1, N, hk, d), f32),
        sd((1, N, hv, d), f32), sd((1, N, hv), f32), sd((1, N, hv), f32), sd((B, hv, d, d), f32),
        sd((B,), jnp.int32), sd((B,), jnp.int32))
    assert txt.count("__gpu$xla.gpu.triton") == 3 and "gather" not in txt


def test_fused_input_decode_compiles_for_h200_without_spills():
    """The default decode pair (grid "split", v-major bf16 pool) reading q/k/v, a and b in place from a fused
    projection output of Drama 3's width: both launches compile to sm_90a (pip triton's ptxas) without spills."""
    from kernels.h200_lowering import capture_ttirs, compile_ttir

    sd = jax.ShapeDtypeStruct
    B, hk, hv, d, K = 128, 16, 32, 128, 4
    C = 2 * hk * d + hv * d
    W = C + hv * d + 2 * hv
    bf = jnp.bfloat16
    ttirs = capture_ttirs(lambda p, c, s, w, al, dt: pallas_triton.gdn_decode_step_triton(
        p, None, None, c, s, w, al, dt, num_k_heads=hk, head_k_dim=d, head_v_dim=d, v_major=True,
        a_col=W - hv, b_col=W - 2 * hv), sd((B, W), bf), sd((B, K - 1, C), bf), sd((B, hv, d, d), bf),
        sd((C, K), bf), sd((hv,), f32), sd((hv,), f32))
    assert len(ttirs) == 2
    p = pallas_triton.TUNING["decode_split"] | pallas_triton.TUNING["decode_split_v_major_bf16_state"]
    for ttir, warps in zip(ttirs, (p["prep_num_warps"], p["num_warps"])):
        res, _ = compile_ttir(ttir, warps, 1)
        assert res["spill_bytes"] == 0, res
