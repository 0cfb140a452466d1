"""Append decode attention (kernels/append_attention): the Pallas kernel in interpret mode against the plain-jnp
reference, the reference against the model's separate ops, and the kernel's lowering for the H200.

Cases: both head layouts of Drama 3 (backbone [q_h | gate_h] per head with rotate-half RoPE, tower [all q | all
gates | k | v] with interleaved pairs), partial and full rotary dims, GQA 1 / 2 / 8 (group padded to 16 rows), ragged
start positions with 0 (empty cache), multiples of block_k and the last row; free slots (new_lengths 0); a pool
with more slots than sequences; a row at the cache length (not written); one split and several, some past a
sequence's keys. Cache rows at or past each position hold NaN before the kernel's call (never read; zeros for the
reference, which multiplies masked probabilities by them). Tolerances (max
|kernel - ref| / max |ref|): fp32 <= 1e-5; bf16 <= 1e-2; the caches' rows equal bit for bit in fp32 and within one
bf16 rounding step of the normed, rotated k in bf16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.append_attention import api, reference
from kernels.append_attention.layout import HeadLayout
from kernels.attention.reference import attention_reference
from kernels.h200_lowering import capture_ttir, compile_ttir, lower_for_h200
from kernels.norm.reference import rms_norm
from kernels.rope import apply_rope_interleaved, apply_rope_rotate_half

f32, bf16 = jnp.float32, jnp.bfloat16


def backbone_layout(Hq, Hkv, D, pad=0):
    return HeadLayout(Hq, Hkv, D, q0=0, q_step=2, gate0=1, gate_step=2, k0=2 * Hq + pad, v0=2 * Hq + pad + Hkv)


def tower_layout(Hq, Hkv, D):
    return HeadLayout(Hq, Hkv, D, q0=0, q_step=1, gate0=Hq, gate_step=1, k0=2 * Hq, v0=2 * Hq + Hkv)


def inputs(seed, B, S, L, layout, start, dtype, extra_cols=0):
    """proj [B, chunks * D + extra_cols], norm weights, caches [S, L, Hkv, D] (NaN at and past each sequence's
    start: never read before being written), start int32."""
    D, Hkv = layout.head_dim, layout.num_kv_heads
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    proj = (jax.random.normal(ks[0], (B, layout.chunks * D + extra_cols), f32) * 2.0).astype(dtype)
    qw, kw = (jax.random.normal(k, (D,), f32) * 0.3 for k in ks[1:3])
    k = jax.random.normal(ks[3], (S, L, Hkv, D), f32)
    v = jax.random.normal(ks[4], (S, L, Hkv, D), f32)
    start = jnp.asarray(start, jnp.int32)
    stale = jnp.arange(L)[None, :] >= jnp.pad(start, (0, S - B), constant_values=L)[:, None]
    stale = stale[:, :, None, None]
    return (proj, qw.astype(dtype), kw.astype(dtype), jnp.where(stale, jnp.nan, k).astype(dtype),
            jnp.where(stale, jnp.nan, v).astype(dtype), start)


def run(backend, args, new_lengths, layout, rot, style, **kw):
    proj, qw, kw_, kc, vc, start = args
    fn = jax.jit(functools.partial(api.append_decode_attention, layout=layout, rotary_dim=rot, rope_theta=1e4,
                                   rope_style=style, eps=1e-6, backend=backend, **kw))
    return fn(proj, qw, kw_, kc, vc, start, new_lengths)


def finite(c, B, start, L):
    """The caches' rows [0, B) below min(start + 1, L) (the NaN-free part after the write) as numpy fp32."""
    c = np.asarray(c[:B].astype(f32))
    return [c[b, :min(int(s) + 1, L)] for b, s in enumerate(np.asarray(start))]


@pytest.mark.parametrize("dtype", [f32, bf16])
@pytest.mark.parametrize("case", [
    dict(Hq=4, Hkv=4, D=16, rot=16, style="rotate_half", layout="backbone", block_k=16, num_splits=1),
    dict(Hq=4, Hkv=2, D=32, rot=8, style="rotate_half", layout="backbone", block_k=16, num_splits=3),
    dict(Hq=16, Hkv=2, D=64, rot=16, style="interleaved", layout="tower", block_k=32, num_splits=4),
    dict(Hq=8, Hkv=1, D=16, rot=16, style="interleaved", layout="tower", block_k=8, num_splits=None),
], ids=["gqa1_one_split", "gqa2_partial_rope", "gqa8_tower", "gqa8_auto_splits"])
def test_kernel_vs_reference(dtype, case):
    Hq, Hkv, D, L = case["Hq"], case["Hkv"], case["D"], 70
    layout = (backbone_layout(Hq, Hkv, D, pad=1) if case["layout"] == "backbone" else tower_layout(Hq, Hkv, D))
    start = [0, 1, 31, 32, 63, 64, 69]
    B, S = len(start), len(start) + 2                      # a slot pool's prefix
    args = inputs(len(start) * D + Hq, B, S, L, layout, start, dtype, extra_cols=D // 2)
    new_lengths = jnp.asarray([1, 1, 1, 0, 1, 1, 1], jnp.int32)     # slot 3 free: writes, does not see its row
    zeroed = args[:3] + (jnp.nan_to_num(args[3]), jnp.nan_to_num(args[4])) + args[5:]   # the reference multiplies
    ref = run("reference", zeroed, new_lengths, layout, case["rot"], case["style"])      # masked 0s by stale rows
    got = run("pallas_triton", args, new_lengths, layout, case["rot"], case["style"], interpret=True,
              block_k=case["block_k"], num_splits=case["num_splits"])
    o_ref, o = np.asarray(ref[0].astype(f32)), np.asarray(got[0].astype(f32))
    assert o.shape == (B, Hq * D) and np.isfinite(o).all() and np.abs(o_ref).max() > 0
    tol = 1e-5 if dtype == f32 else 1e-2
    assert np.abs(o - o_ref).max() / np.abs(o_ref).max() <= tol
    for c_ref, c, c_in in zip(ref[1:], got[1:], args[3:5]):
        np.testing.assert_array_equal(np.asarray(c[B:].astype(f32)), np.asarray(c_in[B:].astype(f32)))  # rows >= B
        for r, g in zip(finite(c_ref, B, args[5], L), finite(c, B, args[5], L)):
            assert np.isfinite(g).all()
            np.testing.assert_allclose(g, r, rtol=0 if dtype == f32 else 8e-3, atol=3e-7 if dtype == f32 else 0)


def test_row_at_the_cache_length_is_not_written():
    """start == L: nothing is written and the whole cache is visible, as the reference's dropped scatter."""
    layout, L = tower_layout(4, 2, 16), 24
    args = inputs(3, 2, 2, L, layout, [5, 5], f32)
    kc = jax.random.normal(jax.random.PRNGKey(9), args[3].shape, f32)
    args = args[:3] + (kc, kc * 0.5) + (jnp.asarray([L, 5], jnp.int32),)
    ones = jnp.ones((2,), jnp.int32)
    ref = run("reference", args, ones, layout, 16, "interleaved")
    got = run("pallas_triton", args, ones, layout, 16, "interleaved", interpret=True, block_k=8, num_splits=2)
    np.testing.assert_array_equal(np.asarray(got[1][0]), np.asarray(kc[0]))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ref[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("style", ["rotate_half", "interleaved"])
def test_reference_equals_the_model_ops(style):
    """The reference composes the model's ops: q / k norms, RoPE, the cache write and the attention give what the
    backbone's and the tower's separate-op path computes (drama3_jax/backbone.py GatedAttention, tower.py)."""
    Hq, Hkv, D, L, rot = 4, 2, 16, 20, 8
    layout = backbone_layout(Hq, Hkv, D) if style == "rotate_half" else tower_layout(Hq, Hkv, D)
    args = inputs(11, 3, 3, L, layout, [0, 7, 19], f32)
    proj, qw, kw, kc, vc, start = args
    kc, vc = jnp.nan_to_num(kc), jnp.nan_to_num(vc)
    rope = apply_rope_rotate_half if style == "rotate_half" else apply_rope_interleaved
    q, gate, k, v = reference.split_heads(proj, layout)
    pos = start[:, None]
    q = rope(rms_norm(q, qw, 1e-6)[:, None], pos, rot, 1e4)
    k = rope(rms_norm(k, kw, 1e-6)[:, None], pos, rot, 1e4)
    kc2 = jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice(c, n, (s, 0, 0)))(kc, k, start)
    vc2 = jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice(c, n, (s, 0, 0)))(vc, v[:, None], start)
    o = attention_reference(q, kc2, vc2, pos, start + 1, scale=D ** -0.5)[:, 0] * jax.nn.sigmoid(gate)
    got = run("reference", (proj, qw, kw, kc, vc, start), jnp.ones((3,), jnp.int32), layout, rot, style)
    for g, r in zip(got, (o.reshape(3, -1), kc2, vc2)):      # jitted against eager: fp32 fusion order only
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-6)


def test_reference_with_the_decode_attention_kernel():
    """attention_backend="pallas_triton" (the bench's separate-ops baseline): the reference's attention step on the
    decode kernel (interpret mode) over a pool prefix with a free row gives the plain-jnp attention's output and the
    same cache writes."""
    layout, L = backbone_layout(4, 2, 16), 40
    args = inputs(13, 3, 4, L, layout, [0, 17, 39], f32)
    proj, qw, kw, kc, vc, start = args
    args = (proj, qw, kw, jnp.nan_to_num(kc), jnp.nan_to_num(vc), start)
    new = jnp.asarray([1, 0, 1], jnp.int32)
    ref = run("reference", args, new, layout, 8, "rotate_half")
    got = run("reference", args, new, layout, 8, "rotate_half", attention_backend="pallas_triton", interpret=True,
              block_k=8, num_splits=2)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ref[0]), rtol=1e-5, atol=1e-5)
    for g, r in zip(got[1:], ref[1:]):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))


def test_api_validates_its_inputs():
    layout = tower_layout(4, 2, 16)
    proj, qw, kw, kc, vc, start = inputs(0, 2, 2, 8, layout, [1, 2], f32)
    call = functools.partial(api.append_decode_attention, q_norm=qw, k_norm=kw, start=start,
                             new_lengths=jnp.ones((2,), jnp.int32), layout=layout, rotary_dim=16, rope_theta=1e4,
                             rope_style="interleaved", eps=1e-6)
    with pytest.raises(ValueError, match="do not hold"):
        call(proj[:, :-16], k_cache=kc, v_cache=vc)
    with pytest.raises(ValueError, match="do not match"):
        call(proj, k_cache=kc[..., :8], v_cache=vc[..., :8])
    with pytest.raises(ValueError, match="rope"):
        call(proj, k_cache=kc, v_cache=vc, rope_style="neox")
    with pytest.raises(ValueError, match="unknown append attention backend"):
        call(proj, k_cache=kc, v_cache=vc, backend="nope")
    with pytest.raises(ValueError, match="do not group"):
        HeadLayout(3, 2, 16, 0, 1, 3, 1, 6, 8)


@pytest.mark.parametrize("layout,style", [(backbone_layout(16, 2, 256), "rotate_half"),
                                          (tower_layout(16, 2, 256), "interleaved")], ids=["backbone", "tower"])
def test_lowering_for_h200(layout, style):
    """Drama 3 shapes (Hq 16, Hkv 2, D 256, rotary 64, 2,048-row bf16 caches): one Triton call at 128 slots, and the
    one-slot kernel compiles for sm_90a without spills (the triton package's compiler, kernels/h200_lowering.py)."""
    sd = jax.ShapeDtypeStruct
    fn = functools.partial(api.append_decode_attention, layout=layout, rotary_dim=64, rope_theta=1e7,
                           rope_style=style, eps=1e-6, backend="pallas_triton", interpret=False)
    args = lambda B: (sd((B, 36 * 256), bf16), sd((256,), bf16), sd((256,), bf16), sd((B, 2048, 2, 256), bf16),
                      sd((B, 2048, 2, 256), bf16), sd((B,), jnp.int32), sd((B,), jnp.int32))
    assert lower_for_h200(fn, *args(128)).count("__gpu$xla.gpu.triton") == 1
    report, _ = compile_ttir(capture_ttir(fn, *args(1)), 4, 2)
    assert report["spill_bytes"] in (0, None) and report["registers"] <= 255, report
