"""MoE router top-k kernel (kernels/router) against its reference (`lax.top_k` + softmax) in interpret mode, and its
lowering for the H200 (Pallas -> TTIR -> sm_90a, no spills)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.router.api import router_topk
from kernels.router.pallas_triton import router_topk_triton


def _logits(n, e, seed, kind):
    x = jax.random.normal(jax.random.PRNGKey(seed), (n, e), jnp.float32) * 3.0
    if kind == "ties":  # coarse values: many equal logits per row, and equal to the k-th
        x = jnp.round(x)  # also -0.0 next to 0.0: lax.top_k puts +0.0 first
    if kind == "bf16":  # the router GEMM's inputs are bf16; its fp32 outputs still tie more often
        x = x.astype(jnp.bfloat16)
    return x


@pytest.mark.parametrize("n,e,k", [(128, 256, 8), (13, 256, 8), (7, 8, 2), (33, 6, 3), (1, 16, 1)],
                         ids=["decode128", "ragged_rows", "tiny_model", "e_not_pow2", "one_row_k1"])
@pytest.mark.parametrize("kind", ["normal", "ties", "bf16"])
def test_kernel_matches_reference(n, e, k, kind):
    x = _logits(n, e, n * 31 + e, kind)
    ids, w = router_topk_triton(x, k, interpret=True)
    want_ids, want_w = router_topk(x, k, backend="reference")
    assert ids.shape == (n, k) and ids.dtype == jnp.int32 and w.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))  # ties to the lower expert, as lax.top_k
    np.testing.assert_allclose(np.asarray(w), np.asarray(want_w), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(w).sum(axis=1), 1.0, rtol=1e-6)
    assert np.all(np.diff(np.take_along_axis(np.asarray(x, np.float32), np.asarray(ids), 1), axis=1) <= 0)


@pytest.mark.parametrize("backend", ["pallas_triton", "reference"])
def test_logits_read_in_place_from_a_wider_projection(backend):
    """num_experts: the router logits are the first E columns of a fused projection's output [N, W]; the other
    columns (larger values here) must not be picked."""
    x = _logits(37, 256, 5, "normal")
    wide = jnp.concatenate([x, jnp.full((37, 1088), 50.0, jnp.float32)], axis=1)
    kw = {"interpret": True} if backend == "pallas_triton" else {}
    ids, w = router_topk(wide, 8, num_experts=256, backend=backend, **kw)
    want_ids, want_w = router_topk(x, 8, backend="reference")
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(w), np.asarray(want_w), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="num_experts"):
        router_topk(x, 8, num_experts=300, backend=backend)


@pytest.mark.parametrize("block_rows", [1, 8, 64])
def test_block_rows_do_not_change_the_result(block_rows):
    x = _logits(100, 256, 3, "normal")
    got = router_topk_triton(x, 8, block_rows=block_rows, interpret=True)
    want = router_topk_triton(x, 8, interpret=True)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_k_is_refused():
    with pytest.raises(ValueError, match="1 <= k <= E"):
        router_topk_triton(jnp.zeros((4, 8)), 9, interpret=True)


def test_lowers_and_compiles_for_h200_without_spills():
    from kernels.h200_lowering import capture_ttirs, compile_ttir
    from kernels.router.pallas_triton import TUNING

    for n in (128, 3072):
        (ttir,) = capture_ttirs(lambda x: router_topk_triton(x, 8, interpret=False), jnp.zeros((n, 256), jnp.float32))
        res, _ = compile_ttir(ttir, TUNING["num_warps"], 1)
        assert res["spill_bytes"] == 0, res
