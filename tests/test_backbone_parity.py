"""Backbone parity against transformers' Qwen3.5-MoE on the same random weights (loaded through our converter)."""

from __future__ import annotations

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import drama3_jax
import drama3_jax.backbone
from drama3_jax.backbone import init_cache
from tests.conftest import random_rows
from tests.reference.torch_backbone import TorchBackbone


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def torch_ref(tiny_hf_dir):
    return TorchBackbone(tiny_hf_dir)


@pytest.fixture(scope="module")
def jax_fp32(tiny_fp8_dir):
    return drama3_jax.load_talker(tiny_fp8_dir, dtype=jnp.float32)


@nnx.jit(static_argnames=("fresh",))
def forward_logits(model, rows, cache, lengths, fresh=False):
    h, cache = model.forward(rows, cache, lengths, fresh=fresh)
    return model.full_logits(h), cache


@nnx.jit(static_argnames=("fresh", "backends"))
def forward_with(model, rows, cache, lengths, fresh, backends):
    """model.forward under jit, for tests that compare backends (one compile per shape and backend set)."""
    return model.forward(rows, cache, lengths, fresh=fresh, backends=backends)


def jax_logits(model, rows, lengths, max_len=128, dtype=jnp.float32):
    cache = init_cache(model.cfg.text, rows.shape[0], max_len, dtype)
    logits, cache = forward_logits(model, jnp.asarray(rows), cache, jnp.asarray(lengths, jnp.int32), fresh=True)
    return np.asarray(logits, np.float32), cache


def test_full_sequence_logits_match_transformers(torch_ref, jax_fp32, tiny_cfg):
    """Ragged batch (right padding on our side), text + semantic rows, fp32: rel. error < 1e-4."""
    lengths = [70, 45, 1]
    rows = random_rows(tiny_cfg, 3, 70, seed=1, semantic_from=20)
    ours, _ = jax_logits(jax_fp32, rows, lengths)
    errs = []
    for b, n in enumerate(lengths):
        ref = torch_ref.logits(torch.from_numpy(rows[b:b + 1, :n]).long())[0].numpy()
        errs.append(rel_err(ours[b, :n], ref))
    print("full-sequence logits rel. errors:", errs)
    assert max(errs) < 1e-4


def test_prefill_then_16_decode_steps_matches_full_forward(torch_ref, jax_fp32, tiny_cfg):
    rows = random_rows(tiny_cfg, 2, 48, seed=2, semantic_from=10)
    full, _ = jax_logits(jax_fp32, rows, [48, 48])
    cache = init_cache(tiny_cfg.text, 2, 64, jnp.float32)
    logits, cache = forward_logits(jax_fp32, jnp.asarray(rows[:, :32]), cache, jnp.array([32, 32]), fresh=True)
    steps = [np.asarray(logits)]
    for t in range(32, 48):
        logits, cache = forward_logits(jax_fp32, jnp.asarray(rows[:, t:t + 1]), cache, jnp.array([1, 1]))
        steps.append(np.asarray(logits))
    inc = np.concatenate(steps, axis=1)
    assert np.asarray(cache.lengths).tolist() == [48, 48]
    err_self = rel_err(inc, full)
    ref_inc = torch_ref.incremental_logits(torch.from_numpy(rows).long(), prefill=32).numpy()
    err_ref = rel_err(inc, ref_inc)
    print(f"prefill+decode vs full: {err_self:.2e}; vs transformers incremental: {err_ref:.2e}")
    assert err_self < 1e-4 and err_ref < 1e-4


def test_decode_from_ragged_prefill(jax_fp32, tiny_cfg):
    """Streams at different positions decode in one batch exactly as each one alone."""
    rows = random_rows(tiny_cfg, 2, 40, seed=3, semantic_from=5)
    lengths = np.array([30, 17])
    _, cache = jax_logits(jax_fp32, rows[:, :30], lengths, max_len=64)
    nxt = np.stack([rows[0, 30], rows[1, 17]])[:, None]
    step, _ = forward_logits(jax_fp32, jnp.asarray(nxt), cache, jnp.array([1, 1]))
    padded = np.zeros((2, 31, rows.shape[-1]), np.int32)
    for b, n in enumerate(lengths):
        padded[b, :n], padded[b, n] = rows[b, :n], nxt[b, 0]
    alone, _ = jax_logits(jax_fp32, padded, lengths + 1, max_len=64)
    for b, n in enumerate(lengths):
        assert rel_err(np.asarray(step)[b, 0], alone[b, n]) < 1e-5


def test_main_logits_are_the_band_and_eos_rows(jax_fp32, tiny_cfg):
    rows = random_rows(tiny_cfg, 1, 12, seed=4, semantic_from=6)
    cache = init_cache(tiny_cfg.text, 1, 16, jnp.float32)
    h, _ = jax_fp32.forward(jnp.asarray(rows), cache, jnp.array([12]), fresh=True)
    full = np.asarray(jax_fp32.full_logits(h))
    band = np.asarray(jax_fp32.main_logits(h))
    s, e = tiny_cfg.semantic_start_token_id, tiny_cfg.semantic_end_token_id
    assert band.shape[-1] == tiny_cfg.band_size + 1
    np.testing.assert_allclose(band[..., :-1], full[..., s:e + 1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(band[..., -1], full[..., tiny_cfg.eos_token_id], rtol=1e-5, atol=1e-5)


def test_fp8_experts_match_dequantised_bf16_experts(tiny_fp8_dir, tiny_bf16_dir, tiny_cfg):
    """FP8 weights dequantised in the op vs weights dequantised to bf16 at conversion: bf16-level agreement."""
    fp8 = drama3_jax.load_talker(tiny_fp8_dir, dtype=jnp.float32)
    bf16 = drama3_jax.load_talker(tiny_bf16_dir, dtype=jnp.float32)
    assert fp8.model.language_model.layers[0].mlp.experts.gate_proj.weight[...].dtype == jnp.float8_e4m3fn
    assert bf16.model.language_model.layers[0].mlp.experts.gate_proj.weight_scale_inv is None
    rows = random_rows(tiny_cfg, 2, 24, seed=5, semantic_from=8)
    a, _ = jax_logits(fp8, rows, [24, 24])
    b, _ = jax_logits(bf16, rows, [24, 24])
    err = rel_err(a, b)
    print(f"fp8 vs bf16-dequantised experts: {err:.2e}")
    assert 0 < err < 1e-2


def test_bf16_compute_no_worse_than_reference_bf16(tiny_fp8_dir, tiny_hf_dir, torch_ref, tiny_cfg):
    """bf16 weights/activations (fp32 norms, softmax, GDN state): our deviation from fp32 must not exceed the
    deviation of transformers' own bf16 run. (Max errors are dominated by top-k routing flips, so the bound is
    relative to the reference's, not an absolute tolerance.)"""
    rows = random_rows(tiny_cfg, 2, 24, seed=6, semantic_from=8)
    ours, _ = jax_logits(drama3_jax.load_talker(tiny_fp8_dir), rows, [24, 24], dtype=jnp.bfloat16)
    t_rows = torch.from_numpy(rows).long()
    ref32 = torch_ref.logits(t_rows).numpy()
    ref16 = TorchBackbone(tiny_hf_dir, dtype=torch.bfloat16).logits(t_rows).numpy()
    ours_err, ref_err = rel_err(ours, ref32), rel_err(ref16, ref32)
    print(f"bf16 vs fp32: ours {ours_err:.2e}, transformers {ref_err:.2e}")
    assert ours_err <= 1.25 * ref_err


@pytest.mark.parametrize("router", ["reference", "pallas_triton"])
def test_router_weights_equal_softmax_then_top_k(jax_fp32, tiny_cfg, router):
    """The router takes top-k of the logits and a softmax over those k: the same experts and weights as the
    checkpoint's softmax over all experts, top-k, renormalise (on the logits of fresh random hidden states), with
    either router backend (kernels/router; the Pallas one in interpret mode here)."""
    moe = jax_fp32.model.language_model.layers[0].mlp
    x = jnp.asarray(np.random.default_rng(7).standard_normal((33, tiny_cfg.text.hidden_size)), jnp.float32)
    logits = x @ moe.gate.weight[...].T
    ids, w = moe.route(logits, router)
    probs = np.asarray(jax.nn.softmax(logits, axis=-1), np.float64)
    ref_ids = np.argsort(-probs, axis=-1, kind="stable")[:, :tiny_cfg.text.num_experts_per_tok]
    ref_w = np.take_along_axis(probs, ref_ids, -1)
    assert np.array_equal(np.asarray(ids), ref_ids)
    np.testing.assert_allclose(np.asarray(w), ref_w / ref_w.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)


def test_moe_activations_option(jax_fp32, tiny_cfg):
    """`moe_activations` is validated; on the tiny model (hidden 64: no whole 128-column groups) "fp8" falls back to
    bf16 activations instead of failing, so `--moe-activations fp8` serves any checkpoint."""
    import dataclasses

    from drama3_jax.backbone import Backends

    with pytest.raises(ValueError, match="moe_activations"):
        Backends(moe_activations="int8")
    rows = jnp.asarray(random_rows(tiny_cfg, 2, 9, seed=5, semantic_from=4))
    lengths = jnp.asarray([9, 7], jnp.int32)
    out = []
    for b in (Backends(), dataclasses.replace(Backends(), moe_activations="fp8")):
        cache = init_cache(jax_fp32.cfg.text, 2, 32, jnp.float32)
        h, _ = jax_fp32.forward(rows, cache, lengths, fresh=True, backends=b)
        out.append(np.asarray(h))
    assert np.isfinite(out[0]).all()
    np.testing.assert_array_equal(out[0], out[1])


def test_moe_activations_fp8_runs_w8a8_on_whole_128_column_groups(tiny_cfg):
    """A MoE layer whose hidden and expert widths are whole 128-column groups (as in the real model) runs W8A8 with
    "fp8": the Pallas kernels (interpret mode, the tuning table's W8A8 rows) give the reference's W8A8 output, at an
    FP8-sized distance from bf16 activations, at a decode size and at a prefill size."""
    import dataclasses

    from drama3_jax.backbone import SparseMoe
    from kernels.moe.testing import random_expert_weights

    text = dataclasses.replace(tiny_cfg.text, hidden_size=128, moe_intermediate_size=128)
    moe = SparseMoe(text, fp8_block=(128, 128), dtype=jnp.bfloat16)
    keys = jax.random.split(jax.random.PRNGKey(int(np.random.default_rng().integers(1 << 20))), 8)
    w = random_expert_weights(keys[0], text.num_experts, 128, 128, fp8=True)
    for name, q, sc in (("gate_proj", w.gate, w.gate_scale), ("up_proj", w.up, w.up_scale),
                        ("down_proj", w.down, w.down_scale)):
        getattr(moe.experts, name).weight[...] = q
        getattr(moe.experts, name).weight_scale_inv[...] = sc
    for k, lin in zip(keys[1:], (moe.gate, moe.shared_expert.gate_proj, moe.shared_expert.up_proj,
                                 moe.shared_expert.down_proj, moe.shared_expert_gate)):
        lin.weight[...] = (jax.random.normal(k, lin.weight.shape) / np.sqrt(lin.weight.shape[1])).astype(jnp.bfloat16)
    for T in (5, 300):  # 10 and 600 (token, expert) pairs: the W8A8 decode and prefill rows of the table
        x = jax.random.normal(keys[6 + (T > 5)], (1, T, 128)).astype(jnp.bfloat16)
        a8 = moe(x, backend="reference", act_fp8=True)
        a16 = moe(x, backend="reference", act_fp8=False)
        kernel = moe(x, backend="pallas_triton", act_fp8=True)
        assert rel_err(kernel, a8) < 2e-2
        assert 1e-3 < rel_err(a8, a16) < 0.1  # quantised for real, and only by FP8 rounding


def test_fused_projections_equal_the_checkpoint_layout(tiny_fp8_dir, tiny_cfg):
    """Drama3Model.fuse_projections (each group of projections of one input as one GEMM) changes no result: the
    prefill (backbone, teacher-forced tower and its head logits) and a decode step equal the checkpoint-layout
    model's, and the weights are the same numbers, moved rather than copied (except the main token's band + EOS
    rows of lm_head, copied into one weight: the main logits from it equal the two products on lm_head's slices)."""
    from drama3_jax.nn import FusedLinear

    model = drama3_jax.load_talker(tiny_fp8_dir, dtype=jnp.float32)
    rows = jnp.asarray(random_rows(tiny_cfg, 2, 9, seed=11, semantic_from=4))
    lengths = jnp.asarray([9, 6], jnp.int32)

    def run():
        h, logits, cache = model.teacher_forced(rows, lengths, 32)
        step, _ = model.forward(rows[:, :1], cache.backbone, jnp.ones((2,), jnp.int32))
        return [np.asarray(a) for a in (h, logits, step, model.main_logits(step))]

    count = lambda: sum(x.size for x in jax.tree.leaves(nnx.state(model)))  # noqa: E731
    before, n_before = run(), count()
    model.fuse_projections().fuse_projections()  # idempotent
    layer = model.model.language_model.layers
    assert isinstance(layer[0].linear_attn.in_proj, FusedLinear) and isinstance(layer[3].self_attn.qkv_proj,
                                                                                 FusedLinear)
    assert not hasattr(layer[0].linear_attn, "in_proj_qkv") and not hasattr(layer[0].mlp, "gate")
    mlp = layer[0].mlp.in_proj
    assert mlp.sizes == (tiny_cfg.text.num_experts, 32, 32, 1) and mlp.weight.shape[0] == 128  # 73 rows + 55 zero
    H = tiny_cfg.text.hidden_size
    assert model.main_head.shape == (tiny_cfg.band_size + 1, H)
    assert count() == n_before + sum(-sum(m.sizes) % 64 * m.weight.shape[1] for m in _fused(model)) + (
        tiny_cfg.band_size + 1) * H
    for a, b in zip(run(), before):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())
    # one GEMM; the decode profile's `_sliced_head` variant (MAIN_HEAD_GEMM off) traces the slices + concatenation
    h = jnp.asarray(before[2])
    with mock.patch.object(drama3_jax.backbone, "MAIN_HEAD_GEMM", False):
        sliced = str(jax.make_jaxpr(model.main_logits)(h))
    assert "concatenate" in sliced and "concatenate" not in str(jax.make_jaxpr(model.main_logits)(h))


def _fused(model):
    from drama3_jax.nn import FusedLinear

    return [m for _, m in nnx.iter_graph(model) if isinstance(m, FusedLinear)]


def test_default_moe_activations_follow_the_checkpoint(tiny_cfg):
    import dataclasses

    from drama3_jax.backbone import default_moe_activations
    from drama3_jax.config import QuantConfig

    assert tiny_cfg.quant.activation_scheme == "dynamic" and default_moe_activations(tiny_cfg) == "fp8"
    assert default_moe_activations(dataclasses.replace(tiny_cfg, quant=None)) == "bf16"
    static = dataclasses.replace(tiny_cfg, quant=QuantConfig(activation_scheme="static"))
    assert default_moe_activations(static) == "bf16"


def test_dense_backend_in_the_model(jax_fp32, tiny_cfg, monkeypatch):
    """Backends(dense="pallas") runs every projection of the tiny model whose shape fits (small tiles patched into
    the table, Pallas interpret mode) and gives the reference's hidden states, prefill and one decode step."""
    import dataclasses

    from drama3_jax.backbone import Backends
    from kernels.dense import tuning
    from kernels.dense import pallas_triton

    small = tuning.DenseConfig(block_n=16, block_k=16, split_k=2)
    monkeypatch.setattr(tuning, "TABLE", ((0, small),))
    calls = []
    real = pallas_triton.linear_pallas_triton
    monkeypatch.setattr("kernels.dense.api.linear_pallas_triton",
                        lambda x, w, **kw: calls.append(w.shape) or real(x, w, **kw))
    rows = jnp.asarray(random_rows(tiny_cfg, 2, 9, seed=6, semantic_from=4))
    lengths = jnp.asarray([9, 6], jnp.int32)
    out = []
    for b in (Backends(), dataclasses.replace(Backends(), dense="pallas")):
        cache = init_cache(jax_fp32.cfg.text, 2, 32, jnp.float32)
        h, cache = jax_fp32.forward(rows, cache, lengths, fresh=True, backends=b)
        h1, _ = jax_fp32.forward(rows[:, :1], cache, jnp.ones((2,), jnp.int32), backends=b)
        out.append((np.asarray(h), np.asarray(h1)))
    t = jax_fp32.cfg.text
    assert (t.linear_conv_dim, t.hidden_size) in calls  # GDN
    assert (t.num_attention_heads * t.head_dim * 2, t.hidden_size) in calls  # attention
    assert (t.shared_expert_intermediate_size, t.hidden_size) in calls  # shared expert
    for ref, got in zip(*out):
        assert np.isfinite(ref).all()
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


# the reference backend's mask is CI's at the kernel level (tests/kernels/test_moe.py), so its in-model run is slow-tier
@pytest.mark.parametrize("moe", [pytest.param("reference", marks=pytest.mark.slow), "pallas_triton"])
def test_moe_skips_prompt_padding_without_changing_the_prompt(jax_fp32, tiny_cfg, moe):
    """Backends.moe_skip_padding (the default): a right-padded prefill routes its padding rows to no expert; the
    valid rows' hidden states, the caches' lengths and GDN states, and the next decode step are exactly as without it."""
    import dataclasses

    from drama3_jax.backbone import Backends

    rows = jnp.asarray(random_rows(tiny_cfg, 3, 24, seed=7, semantic_from=6))
    lengths = jnp.asarray([24, 11, 2], jnp.int32)
    nxt = jnp.asarray(random_rows(tiny_cfg, 3, 1, seed=8, semantic_from=0))
    out = {}
    for skip in (True, False):
        b = dataclasses.replace(Backends(), moe=moe, moe_skip_padding=skip)
        cache = init_cache(jax_fp32.cfg.text, 3, 32, jnp.float32)
        h, cache = jax_fp32.forward(rows, cache, lengths, fresh=True, backends=b)
        step, _ = jax_fp32.forward(nxt, cache, jnp.ones(3, jnp.int32), backends=b)
        out[skip] = (np.asarray(h), cache, np.asarray(step))
    (h1, c1, s1), (h0, c0, s0) = out[True], out[False]
    for i, n in enumerate(np.asarray(lengths)):
        np.testing.assert_array_equal(h1[i, :n], h0[i, :n])
    np.testing.assert_array_equal(np.asarray(c1.lengths), np.asarray(c0.lengths))
    for a, b in zip(c1.ssm + c1.conv, c0.ssm + c0.conv):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(s1, s0)
    assert np.isfinite(h1).all() and not np.array_equal(h1, h0)  # padding rows differ: the mask is really on


# the unfused layout (not what the engine serves) in the slow tier, to keep CI inside its 15 minutes
@pytest.mark.parametrize("fused", [pytest.param(False, marks=pytest.mark.slow), True])
def test_gdn_kernels_in_the_model_on_the_v_major_cache(jax_fp32, tiny_fp8_dir, tiny_cfg, monkeypatch, fused):
    """Backends(gdn_prefill=gdn_decode="pallas_triton") (interpret mode, fp32 dots) run the model's v-major GDN cache
    ([S, H_v, D_v, D_k]): a ragged prefill, then two decode steps, give the reference backends' hidden states and
    GDN caches. Fused: with the in-projections as one GEMM, whose output the decode kernels and the router read in
    place (columns, not slices)."""
    import dataclasses
    import functools

    from drama3_jax.backbone import Backends
    from kernels.gdn import api as gdn_api

    if fused:
        jax_fp32 = drama3_jax.load_talker(tiny_fp8_dir, dtype=jnp.float32).fuse_projections()

    for table, kw in ((gdn_api.PREFILL_BACKENDS, dict(dot="float32")), (gdn_api.DECODE_BACKENDS, {})):
        monkeypatch.setitem(table, "pallas_triton", functools.partial(table["pallas_triton"], interpret=True, **kw))
    rows = jnp.asarray(random_rows(tiny_cfg, 2, 6, seed=9, semantic_from=3))
    nxt = jnp.asarray(random_rows(tiny_cfg, 2, 2, seed=10, semantic_from=0))
    lengths = jnp.asarray([6, 4], jnp.int32)
    out = []
    kernels = dict(gdn_prefill="pallas_triton", gdn_decode="pallas_triton",
                   router="pallas_triton" if fused else "reference")
    for b in (Backends(), dataclasses.replace(Backends(), **kernels)):
        cache = init_cache(jax_fp32.cfg.text, 2, 32, jnp.float32)
        h, cache = forward_with(jax_fp32, rows, cache, lengths, True, b)
        hs = [h]
        for s in range(2):
            h1, cache = forward_with(jax_fp32, nxt[:, s:s + 1], cache, jnp.ones((2,), jnp.int32), False, b)
            hs.append(h1)
        out.append(([np.asarray(x) for x in hs], [np.asarray(s) for s in cache.ssm]))
    t = jax_fp32.cfg.text
    assert out[1][1][0].shape == (2, t.linear_num_value_heads, t.linear_value_head_dim, t.linear_key_head_dim)
    (h_ref, s_ref), (h_k, s_k) = out
    for ref, got in zip(h_ref + s_ref, h_k + s_k):
        assert np.isfinite(ref).all()
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_backbone_passes_its_router_backend_to_every_moe_layer(jax_fp32, tiny_cfg, monkeypatch):
    """Backends.router reaches the router of every MoE layer (traced only), and one layer's output with the Pallas
    router (interpret mode: the same XLA ops on the CPU) equals the reference router's exactly."""
    import dataclasses

    from drama3_jax import backbone
    from drama3_jax.backbone import Backends

    seen = []
    real = backbone.router_topk
    monkeypatch.setattr(backbone, "router_topk", lambda *a, backend, **kw: seen.append(backend) or real(*a, **kw))
    rows = jnp.asarray(random_rows(tiny_cfg, 2, 12, seed=21, semantic_from=4))
    cache = init_cache(jax_fp32.cfg.text, 2, 16, jnp.float32)
    b = dataclasses.replace(Backends(), router="pallas_triton")
    jax.make_jaxpr(lambda r: jax_fp32.forward(r, cache, jnp.asarray([12, 7], jnp.int32), fresh=True, backends=b))(rows)
    assert seen == ["pallas_triton"] * tiny_cfg.text.num_hidden_layers
    monkeypatch.setattr(backbone, "router_topk", real)
    moe = jax_fp32.model.language_model.layers[0].mlp
    x = jnp.asarray(np.random.default_rng(5).standard_normal((9, tiny_cfg.text.hidden_size)), jnp.float32)
    ref, kern = (np.asarray(moe(x, backend="reference", router=r)) for r in ("reference", "pallas_triton"))
    np.testing.assert_array_equal(kern, ref)


def test_fused_add_norm_kernel_in_the_model(jax_fp32, tiny_cfg):
    """Backends.norm="pallas_triton" (interpret mode on the CPU): the residual add + post-attention RMSNorm of every
    layer as one launch gives the reference ops' hidden states, for a ragged prefill and a decode step; so does
    norm_at_input, where the MoE output's add joins the next layer's input norm (and the final norm) too."""
    import dataclasses

    from drama3_jax.backbone import Backends

    rows = jnp.asarray(random_rows(tiny_cfg, 2, 7, seed=31, semantic_from=3))
    nxt = jnp.asarray(random_rows(tiny_cfg, 2, 1, seed=32, semantic_from=0))
    lengths = jnp.asarray([7, 5], jnp.int32)
    n_layers = len(tiny_cfg.text.layer_types)
    out = []
    for b, launches in ((Backends(), 0), (dataclasses.replace(Backends(), norm="pallas_triton"), n_layers),
                        (dataclasses.replace(Backends(), norm="pallas_triton", norm_at_input=True), 2 * n_layers)):
        cache = init_cache(jax_fp32.cfg.text, 2, 16, jnp.float32)
        h, cache = forward_with(jax_fp32, rows, cache, lengths, True, b)
        h1, _ = forward_with(jax_fp32, nxt, cache, jnp.ones((2,), jnp.int32), False, b)
        out.append([np.asarray(h), np.asarray(h1)])
        jaxpr = str(jax.make_jaxpr(lambda r, c: jax_fp32.forward(r, c, lengths, fresh=True, backends=b))(rows, cache))
        # layers' norms: 1 per layer; at input: 1 more per layer (layers 1.. and the final norm)
        assert jaxpr.count("name=add_rms_norm") == launches, jaxpr.count("name=add_rms_norm")
    ref = out[0]
    for got in out[1:]:
        for r, g in zip(ref, got):
            assert np.isfinite(r).all() and np.abs(r).max() > 0
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * np.abs(r).max())
