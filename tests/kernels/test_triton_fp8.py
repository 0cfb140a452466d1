"""kernels/triton_fp8.py: FP8 x FP8 Pallas-Triton dots lower to Hopper wgmma, and compute what the reference does.

The lowering checks compile for sm_90a on this CPU machine (kernels/h200_lowering.py: Pallas -> TTIR, then the pip
`triton` compiler to PTX); the numerics run in interpret mode.
"""

from __future__ import annotations

import functools
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels import triton_fp8
from kernels.h200_lowering import capture_ttirs, compile_ttir
from kernels.moe.pallas_triton import moe_experts_pallas_triton
from kernels.moe.tuning import TritonMoeConfig
from kernels.moe.weights import ExpertWeights

triton_fp8.enable()
F8, F32 = jnp.float8_e4m3fn, jnp.float32
sd = jax.ShapeDtypeStruct


def _matmul_nt(a, b, *, bk=64, interpret=False):
    """[m, K] . [n, K]^T in K steps of bk, fp32 accumulation (the MoE kernels' orientation)."""
    m, K = a.shape
    n = b.shape[0]

    def kernel(a_ref, b_ref, o_ref):
        def body(i, acc):
            at, bt = a_ref[:, pl.ds(i * bk, bk)], b_ref[:, pl.ds(i * bk, bk)]
            return acc + jax.lax.dot_general(at, bt, (((1,), (1,)), ((), ())), preferred_element_type=F32)

        o_ref[...] = jax.lax.fori_loop(0, K // bk, body, jnp.zeros((m, n), F32))

    return pl.pallas_call(kernel, out_shape=sd((m, n), F32), grid=(1,),
                          in_specs=[pl.BlockSpec((m, K), lambda i: (0, 0)), pl.BlockSpec((n, K), lambda i: (0, 0))],
                          out_specs=pl.BlockSpec((m, n), lambda i: (0, 0)),
                          compiler_params=plt.CompilerParams(num_warps=4, num_stages=3), interpret=interpret)(a, b)


def _mma_instructions(ttir: str, num_warps=4, num_stages=3) -> set[str]:
    _, ptx = compile_ttir(ttir, num_warps, num_stages)
    return set(re.findall(r"\b(wgmma\.mma_async\S*|mma\.sync\S*)", ptx))


def test_fp8_dot_lowers_to_wgmma_e4m3():
    (ttir,) = capture_ttirs(_matmul_nt, sd((128, 512), F8), sd((128, 512), F8))
    assert "maxNumImpreciseAcc = 64" in ttir
    ops = _mma_instructions(ttir)
    assert any(o.startswith("wgmma.mma_async") and o.endswith(".f32.e4m3.e4m3") for o in ops), ops
    assert not any(o.startswith("mma.sync") for o in ops), ops


def test_bf16_dot_lowering_unchanged():
    (ttir,) = capture_ttirs(_matmul_nt, sd((128, 512), jnp.bfloat16), sd((128, 512), jnp.bfloat16))
    assert "maxNumImpreciseAcc" not in ttir
    assert any(o.endswith(".f32.bf16.bf16") for o in _mma_instructions(ttir))


@pytest.mark.parametrize("m,n,K,bk", [(64, 128, 256, 64), (16, 32, 384, 128)])
def test_fp8_dot_numerics(m, n, K, bk):
    ka, kb = jax.random.split(jax.random.PRNGKey(int(np.random.default_rng().integers(1 << 20))))
    a = (jax.random.normal(ka, (m, K), F32) * 4).astype(F8)
    b = (jax.random.normal(kb, (n, K), F32) * 4).astype(F8)
    out = _matmul_nt(a, b, bk=bk, interpret=True)
    ref = jnp.dot(a.astype(F32), b.astype(F32).T, precision="highest")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-3)


def test_moe_w8a8_prequant_kernels_lower_to_wgmma():
    """Both grouped GEMMs of the pre-quantised W8A8 MoE layer at Drama 3's shapes (prefill tiles) run e4m3 wgmma."""
    E, H, I, T, k = 256, 2048, 512, 1024, 8
    w = ExpertWeights(gate=sd((E, I, H), F8), up=sd((E, I, H), F8), down=sd((E, H, I), F8),
                      gate_scale=sd((E, 4, 16), F32), up_scale=sd((E, 4, 16), F32), down_scale=sd((E, 16, 4), F32))
    cfg = TritonMoeConfig(block_m=64, gu_block_n=128, gu_block_k=128, dn_block_n=128, dn_block_k=128, gu_stages=3,
                          dn_stages=3, prequant=True)
    fn = functools.partial(moe_experts_pallas_triton, config=cfg, act_fp8=True, interpret=False)
    ttirs = capture_ttirs(fn, sd((T, H), jnp.bfloat16), sd((T, k), jnp.int32), sd((T, k), F32), w)
    assert len(ttirs) == 2
    for ttir in ttirs:
        ops = _mma_instructions(ttir, 4, 3)
        assert any(o.endswith(".f32.e4m3.e4m3") and o.startswith("wgmma") for o in ops), ops
