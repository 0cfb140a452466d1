"""Tower parity against a PyTorch restatement on the same weights, and cached decode vs teacher forcing."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import drama3_jax
from drama3_jax.model import init_model_cache
from tests.conftest import random_rows
from tests.reference.torch_backbone import TorchBackbone
from tests.reference.torch_tower import TorchTower
from tests.test_backbone_parity import rel_err


@pytest.fixture(scope="module")
def model(tiny_fp8_dir):
    return drama3_jax.load_talker(tiny_fp8_dir, dtype=jnp.float32)


@nnx.jit(static_argnames=("max_len",))
def teacher(model, rows, lengths, max_len):
    return model.teacher_forced(rows, lengths, max_len)


def test_teacher_forced_heads_match_torch_restatement(model, tiny_hf_dir, tiny_cfg):
    rows = random_rows(tiny_cfg, 2, 40, seed=11, semantic_from=12)
    rows[1, 25, 0] = tiny_cfg.eos_token_id  # a non-semantic label inside the audio part
    hidden, logits, _ = teacher(model, jnp.asarray(rows), jnp.array([40, 40]), 64)
    tb = TorchBackbone(tiny_hf_dir)
    t_rows = torch.from_numpy(rows).long()
    t_hidden = tb.model.model(inputs_embeds=tb.embed(t_rows)).last_hidden_state
    ref = TorchTower(tiny_hf_dir).head_logits(t_hidden, t_rows).numpy()
    err = rel_err(np.asarray(logits), ref)
    print(f"tower teacher-forced head logits vs torch: {err:.2e}")
    assert logits.shape == (2, 39, 9, tiny_cfg.tower.vocab_size)
    assert err < 1e-4


def test_incremental_tower_decode_equals_teacher_forcing(model, tiny_cfg):
    """Prefill n rows, then feed each following row one at a time (teacher codes chosen): the head logits of every
    decode step equal the teacher-forced ones."""
    rows = random_rows(tiny_cfg, 2, 30, seed=12, semantic_from=8)
    _, full, _ = teacher(model, jnp.asarray(rows), jnp.array([30, 30]), 64)
    n = 20
    hidden, _, cache = teacher(model, jnp.asarray(rows[:, :n]), jnp.array([n, n]), 64)

    @nnx.jit
    def step(model, h, row, next_row, cache):
        codes, logits, tcache = model.tower(h, next_row[..., 0], row, cache.tower, jnp.array([1, 1]),
                                            lambda i, _: next_row[..., 2 + i])
        h2, bcache = model.forward(next_row, cache.backbone, jnp.array([1, 1]))
        return codes, logits, h2, type(cache)(bcache, tcache)

    h = hidden[:, n - 1:n]
    for t in range(n - 1, 29):
        codes, logits, h, cache = step(model, h, jnp.asarray(rows[:, t:t + 1]), jnp.asarray(rows[:, t + 1:t + 2]), cache)
        np.testing.assert_array_equal(np.asarray(codes)[:, 0], rows[:, t + 1, 2:])
        assert rel_err(np.asarray(logits)[:, 0], np.asarray(full)[:, t]) < 1e-5
    assert np.asarray(cache.tower.lengths).tolist() == [29, 29]
    assert np.asarray(cache.backbone.lengths).tolist() == [30, 30]


def test_tower_norm_kernel_equals_the_reference_ops(model, tiny_cfg):
    """Backends.tower_norm="pallas_triton" (interpret mode on the CPU): the tower layers' residual add + norm pairs as
    norm-kernel launches give the reference ops' head logits, and the jaxpr holds 2 launches per tower layer."""
    import dataclasses

    import jax

    from drama3_jax.backbone import Backends

    rows, lengths = jnp.asarray(random_rows(tiny_cfg, 2, 12, seed=13, semantic_from=3)), jnp.array([12, 9])
    b = dataclasses.replace(Backends(), tower_norm="pallas_triton")
    _, ref, _ = model.teacher_forced(rows, lengths, 16)
    _, got, _ = model.teacher_forced(rows, lengths, 16, backends=b)
    assert np.isfinite(np.asarray(ref)).all() and np.abs(np.asarray(ref)).max() > 0
    assert rel_err(np.asarray(got), np.asarray(ref)) < 1e-5
    jaxpr = str(jax.make_jaxpr(lambda r: model.teacher_forced(r, lengths, 16, backends=b)[1])(rows))
    assert jaxpr.count("name=add_rms_norm") == 2 * tiny_cfg.tower.num_layers


def test_tower_cache_layout(tiny_cfg):
    c = init_model_cache(tiny_cfg, 3, 16, jnp.float32)
    assert len(c.tower.k) == 13 and c.tower.k[0].shape == (3, 16, 2, 16)
    assert len(c.backbone.k) == 1 and len(c.backbone.ssm) == 3
