"""The plain-jnp gated delta rule: recurrence vs chunked form vs transformers' torch functions."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

from drama3_jax.packing import pack_layout
from kernels.gdn import api
from kernels.gdn import reference as ref

HK, HV, DK, DV = 2, 4, 16, 8


def inputs(B, T, seed):
    r = np.random.default_rng(seed)
    q = r.normal(size=(B, T, HK, DK)).astype(np.float32)
    k = r.normal(size=(B, T, HK, DK)).astype(np.float32)
    v = r.normal(size=(B, T, HV, DV)).astype(np.float32)
    g = -np.exp(r.normal(size=(B, T, HV))).astype(np.float32) * 0.3
    beta = 1 / (1 + np.exp(-r.normal(size=(B, T, HV)))).astype(np.float32)
    s0 = r.normal(size=(B, HV, DK, DV)).astype(np.float32)
    return q, k, v, g, beta, s0


def hf_rule(q, k, v, g, beta, s0):
    rep = HV // HK
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x))
    o, s = hf.torch_recurrent_gated_delta_rule(
        t(np.repeat(q, rep, 2)), t(np.repeat(k, rep, 2)), t(v), g=t(g), beta=t(beta), initial_state=t(s0),
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o.numpy(), s.numpy()


@pytest.mark.parametrize("lengths", [[1], [63], [64], [65], [130, 64, 1, 65]])
def test_chunked_equals_recurrent_and_transformers(lengths):
    T = max(lengths)
    q, k, v, g, beta, s0 = inputs(len(lengths), T, seed=T)
    L = jnp.asarray(lengths, jnp.int32)
    o_r, s_r = ref.gated_delta_recurrent(q, k, v, g, beta, s0, L)
    o_c, s_c = ref.gated_delta_chunked(q, k, v, g, beta, s0, L)
    np.testing.assert_allclose(o_c, o_r, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(s_c, s_r, rtol=1e-4, atol=1e-4)
    for b, n in enumerate(lengths):
        o_h, s_h = hf_rule(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], g[b:b + 1, :n], beta[b:b + 1, :n],
                           s0[b:b + 1])
        np.testing.assert_allclose(np.asarray(o_r)[b, :n], o_h[0], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(s_r)[b], s_h[0], rtol=1e-4, atol=1e-4)
        assert not np.any(np.asarray(o_r)[b, n:])  # padded positions give zero output


def packed(lengths, num_rows, seq_len):
    """Sequences of `lengths` packed end to end in `num_rows` rows (an empty lane last), NaN in the padding rows."""
    offsets, _, pack = pack_layout(lengths, num_rows, len(lengths) + 1, seq_len)
    lens = np.array(list(lengths) + [0], np.int32)
    offsets[len(lengths)] = num_rows  # an empty lane starts past the rows (Packing.offsets)
    return jnp.asarray(offsets), jnp.asarray(lens), jnp.asarray(pack)


def test_packed_conv_equals_the_conv_of_each_sequence():
    """Lengths 5, 1, 2 (shorter than the K-1 = 3 state rows), 9 and an empty lane, each with its own initial state;
    garbage (NaN) in the padding rows never reaches a sequence."""
    r = np.random.default_rng(1)
    C, K, T, N = 12, 4, 9, 20
    lengths = [5, 1, 2, 9]
    offsets, lens, pack = packed(lengths, N, T)
    x = r.normal(size=(N, C)).astype(np.float32)
    x[sum(lengths):] = np.nan
    w = r.normal(size=(C, K)).astype(np.float32)
    state = r.normal(size=(len(lens), K - 1, C)).astype(np.float32)
    y, new = ref.causal_conv1d_packed(jnp.asarray(x), jnp.asarray(w), jnp.asarray(state), pack, offsets, lens, T)
    y, new = np.asarray(y), np.asarray(new)
    for p, (o, n) in enumerate(zip(np.asarray(offsets), np.asarray(lens))):
        if n:
            y_p, s_p = ref.causal_conv1d(jnp.asarray(x[None, o:o + n]), jnp.asarray(w), jnp.asarray(state[p:p + 1]))
            np.testing.assert_array_equal(y[o:o + n], np.asarray(y_p)[0])
            np.testing.assert_array_equal(new[p], np.asarray(s_p)[0])
        else:
            np.testing.assert_array_equal(new[p], state[p])  # an empty lane keeps its state
    assert not y[sum(lengths):].any()


def test_packed_prefill_equals_each_sequence_alone():
    lengths = [65, 1, 30]
    T, N = 65, 110
    offsets, lens, pack = packed(lengths, N, T)
    q, k, v, g, beta, s0 = inputs(1, N, seed=3)
    s0 = np.concatenate([s0, s0 * 0.5, -s0, s0 * 2])  # one initial state per lane, the empty lane's too
    o, st = api.gdn_prefill(q, k, v, g, beta, s0, lens, offsets=offsets, seq_len=T, backend="reference")
    assert o.shape == (1, N, HV, DV) and st.shape == (4, HV, DK, DV)
    for p, (off, n) in enumerate(zip(np.asarray(offsets), lengths)):
        cut = lambda x: x[:, off:off + n]
        o_p, s_p = ref.gated_delta_recurrent(*map(cut, (q, k, v, g, beta)), s0[p:p + 1])
        np.testing.assert_allclose(np.asarray(o)[0, off:off + n], np.asarray(o_p)[0], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(st)[p], np.asarray(s_p)[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(st)[3], s0[3])
    assert not np.asarray(o)[0, sum(lengths):].any()


def test_causal_conv1d_matches_torch_and_carries_state():
    r = np.random.default_rng(0)
    B, T, C, K = 2, 9, 12, 4
    x = r.normal(size=(B, T, C)).astype(np.float32)
    w = r.normal(size=(C, K)).astype(np.float32)
    y, state = ref.causal_conv1d(jnp.asarray(x), jnp.asarray(w), lengths=jnp.array([9, 5]))
    conv = torch.nn.functional.conv1d(torch.from_numpy(x).transpose(1, 2), torch.from_numpy(w)[:, None], groups=C,
                                      padding=K - 1)[..., :T]
    np.testing.assert_allclose(y, torch.nn.functional.silu(conv).transpose(1, 2).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(state[0], x[0, -3:])
    np.testing.assert_array_equal(state[1], x[1, 2:5])
    # continuing from the state equals convolving the concatenation
    x2 = r.normal(size=(B, 4, C)).astype(np.float32)
    y2, _ = ref.causal_conv1d(jnp.asarray(x2), jnp.asarray(w), state[:1].repeat(2, 0))
    y_all, _ = ref.causal_conv1d(jnp.concatenate([x[:1], x2[:1]], 1), jnp.asarray(w))
    np.testing.assert_allclose(y2[0], y_all[0, T:], rtol=1e-5, atol=1e-5)


def test_decode_step_on_slot_pool_touches_only_its_slots():
    r = np.random.default_rng(1)
    S, C = 5, 2 * HK * DK + HV * DV
    conv = jnp.asarray(r.normal(size=(S, 3, C)).astype(np.float32))
    ssm = jnp.asarray(r.normal(size=(S, HV, DK, DV)).astype(np.float32))
    slots = jnp.array([3, 0])
    args = (jnp.asarray(r.normal(size=(2, C)).astype(np.float32)), jnp.asarray(r.normal(size=(2, HV)).astype(np.float32)),
            jnp.asarray(r.normal(size=(2, HV)).astype(np.float32)))
    w, A_log, dt = (jnp.asarray(r.normal(size=s).astype(np.float32)) for s in ((C, 4), (HV,), (HV,)))
    kw = dict(num_k_heads=HK, head_k_dim=DK, head_v_dim=DV)
    o, conv2, ssm2 = ref.gdn_decode_step(*args, conv, ssm, w, A_log, dt, slots=slots, **kw)
    for s in (1, 2, 4):
        np.testing.assert_array_equal(conv2[s], conv[s])
        np.testing.assert_array_equal(ssm2[s], ssm[s])
    o_dense, conv_d, ssm_d = ref.gdn_decode_step(*args, conv[slots], ssm[slots], w, A_log, dt, **kw)
    np.testing.assert_allclose(o, o_dense, rtol=1e-6)
    np.testing.assert_allclose(ssm2[slots], ssm_d, rtol=1e-6)
    np.testing.assert_allclose(conv2[slots], conv_d, rtol=1e-6)
    assert not np.allclose(ssm2[3], ssm[3])
