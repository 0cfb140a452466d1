"""Packed-prompt layout: the host index maps and the two gathers between packed rows and per-prompt lanes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from drama3_jax.packing import Packing, pack_layout


def test_rows_go_to_their_lanes_and_back():
    rng = np.random.default_rng(0)
    lengths = [5, 1, 7]
    offsets, unpack, pack = pack_layout(lengths, num_rows=16, num_seqs=4, seq_len=8)
    assert offsets[:3].tolist() == [0, 5, 6] and unpack.shape == (4, 8) and pack.shape == (16,)
    p = Packing(jnp.asarray(unpack), jnp.asarray(pack))
    x = rng.standard_normal((1, 16, 3)).astype(np.float32)
    x[0, 13:] = 0  # the padding rows past the prompts
    lanes = np.asarray(p.to_seqs(jnp.asarray(x)))
    for i, (o, n) in enumerate(zip(offsets, lengths)):
        np.testing.assert_array_equal(lanes[i, :n], x[0, o:o + n])
        assert not lanes[i, n:].any()
    assert not lanes[3].any()  # the empty lane
    lanes_noisy = lanes + (np.arange(8)[None, :, None] >= np.array(lengths + [0])[:, None, None]) * 9.0
    np.testing.assert_array_equal(np.asarray(p.to_rows(jnp.asarray(lanes_noisy))), x)  # padding never gathered
    assert np.asarray(p.valid()).tolist() == [[True] * 13 + [False] * 3]


@pytest.mark.parametrize("lengths, rows, seqs, T", [([9], 16, 2, 8), ([4, 4, 4], 16, 2, 8), ([8, 8, 1], 16, 4, 8)])
def test_prompts_that_do_not_fit_are_refused(lengths, rows, seqs, T):
    with pytest.raises(ValueError, match="do not pack"):
        pack_layout(lengths, rows, seqs, T)
