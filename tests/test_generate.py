"""End-to-end generation on the tiny checkpoint, and the parity CLI's teacher-forced logits vs incremental decode."""

from __future__ import annotations

import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import drama3_jax
from drama3_jax.backbone import Backends
from drama3_jax.generate import Prefiller, RequestSampling, _step, generate, generate_iter, generate_rows
from drama3_jax.parity import teacher_forced_logits
from drama3_jax.prompt import build_prompt
from drama3_jax.sampling import SamplingParams
from drama3_jax.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def model(tiny_fp8_dir):
    return drama3_jax.load_talker(tiny_fp8_dir, dtype=jnp.float32)


@pytest.fixture(scope="module")
def tok(tiny_fp8_dir, model):
    return load_tokenizer(tiny_fp8_dir, model.cfg)


def ref_codes(cfg, T, seed):
    r = np.random.default_rng(seed)
    c = r.integers(0, cfg.tower.vocab_size, (cfg.num_codebooks, T)).astype(np.int32)
    c[0] = r.integers(0, cfg.band_size, T)
    return c


def test_generate_is_deterministic_for_a_seed_and_stops_at_the_cap(model, tok):
    refs = [(ref_codes(model.cfg, 12, 0), "We asked twenty people.")]
    a = generate(model, tok, "Hello there, how are you?", refs, seed=3, max_new_frames=12)
    b = generate(model, tok, "Hello there, how are you?", refs, seed=3, max_new_frames=12)
    c = generate(model, tok, "Hello there, how are you?", refs, seed=4, max_new_frames=12)
    assert a.shape[0] == 10 and 0 < a.shape[1] <= 12
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a[0].max() < model.cfg.band_size and a[1:].max() < model.cfg.tower.vocab_size
    frames = list(generate_iter(model, tok, "Hello there, how are you?", refs, seed=3, max_new_frames=12))
    np.testing.assert_array_equal(np.stack(frames, axis=1), a)


def test_stops_on_eos_and_drops_semantic0_before_eos(tiny_fp8_dir, tok):
    """A model rigged so each step's main token is <|semantic:0|> or EOS (decided by the sign of one hidden unit):
    generation returns the raw frames up to EOS, minus the <|semantic:0|> frame right before it."""
    m = drama3_jax.load_talker(tiny_fp8_dir, dtype=jnp.float32)
    cfg = m.cfg
    H = cfg.text.hidden_size
    g = np.full(H, -1.0, np.float32)
    g[0] = 0.0  # final norm keeps only hidden unit 0
    m.model.language_model.norm.weight[...] = jnp.asarray(g)
    w = np.zeros((cfg.text.vocab_size, H), np.float32)
    w[cfg.eos_token_id, 0], w[cfg.semantic_start_token_id, 0] = 100.0, -100.0
    m.lm_head.weight[...] = jnp.asarray(w)
    rows = build_prompt(tok, cfg, "Stop now.")
    params, seed, cap = SamplingParams(temperature=1e-6), 0, 16
    out = generate_rows(m, [rows], [params], [seed], max_new_frames=cap)[0]
    # replay the raw decode loop
    state = Prefiller(m, max_len=64, chunk=32)(np.pad(rows, ((0, 64 - len(rows)), (0, 0)))[None],
                                               np.array([len(rows)], np.int32), RequestSampling.make([params], [seed]))
    raw = []
    for _ in range(cap):
        row, state = _step(m, state)
        raw.append(np.asarray(row)[0])
        if raw[-1][0] == cfg.eos_token_id:
            break
    assert raw[-1][0] == cfg.eos_token_id and len(raw) >= 2, "this seed must reach EOS after a semantic frame"
    assert all(r[0] == cfg.semantic_start_token_id for r in raw[:-1])
    expected = np.stack(raw[:-2], axis=1)[1:] if len(raw) > 2 else np.zeros((10, 0), np.int32)
    np.testing.assert_array_equal(out, expected)
    assert list(generate_iter(m, tok, "Stop now.", sampling=params, seed=seed, max_new_frames=cap)) == \
        [expected[:, t] for t in range(expected.shape[1])] or expected.shape[1] == 0


def test_batch_of_four_equals_each_alone(model, tok):
    cfg = model.cfg
    prompts = [build_prompt(tok, cfg, "One small step."),
               build_prompt(tok, cfg, "A much longer sentence that takes a few more tokens to say.",
                            [(ref_codes(cfg, 9, 1), "Reference words.")]),
               build_prompt(tok, cfg, "<|speaker:1|> Hi! <|speaker:2|> Hello."),
               build_prompt(tok, cfg, "Numbers: 3.14 and 12:30.")]
    params = [SamplingParams(), SamplingParams(0.7, 0.8, 0), SamplingParams(1.2, 0.95, 40), SamplingParams(1.0, 0.9, 5)]
    seeds = [11, 12, 13, 14]
    batch = generate_rows(model, prompts, params, seeds, max_new_frames=10)
    for i in range(4):
        alone = generate_rows(model, [prompts[i]], [params[i]], [seeds[i]], max_new_frames=10)[0]
        np.testing.assert_array_equal(batch[i], alone)


def test_parity_logits_match_incremental_generation(model, tok):
    """Greedy heads (T -> 0): every generated code c1..c9 is the argmax of the teacher-forced head logits of the
    parity interface on prompt + generated rows, and the main token is the argmax of its main logits unless RAS
    replaced a repeat."""
    cfg = model.cfg
    prompt = build_prompt(tok, cfg, "Check the parity path.", [(ref_codes(cfg, 6, 2), "Six frames.")])
    codes = generate_rows(model, [prompt], [SamplingParams(temperature=1e-6, top_p=1.0)], [5], max_new_frames=10)[0]
    n = codes.shape[1]
    assert n > 0
    gen_rows = np.concatenate([(codes[0] + cfg.semantic_start_token_id)[None], codes], 0).T
    rows = np.concatenate([prompt, gen_rows], 0)
    main, heads = teacher_forced_logits(model, rows)
    P = len(prompt)
    for t in range(n):
        pos = P - 1 + t  # logits for row P + t come from row P - 1 + t
        np.testing.assert_array_equal(np.argmax(heads[pos], axis=-1), codes[1:, t])
        recent = rows[max(0, P + t - 16):P + t, 0]
        top = np.argmax(main[pos])
        if cfg.semantic_start_token_id + top not in recent:
            assert codes[0, t] == top
    assert np.isnan(heads[:P - 2]).all(axis=(1, 2)).any()  # text rows of the prompt: NaN head logits
    assert not np.isnan(main).any()


def test_parity_cli(tiny_fp8_dir, tmp_path, model, tok):
    rows = build_prompt(tok, model.cfg, "Command line.", [(ref_codes(model.cfg, 5, 3), "Five.")])
    np.save(tmp_path / "rows.npy", rows)
    subprocess.run([sys.executable, "-m", "drama3_jax.parity", "--checkpoint", str(tiny_fp8_dir), "--rows",
                    str(tmp_path / "rows.npy"), "--out", str(tmp_path / "out.npz")], check=True, capture_output=True)
    out = np.load(tmp_path / "out.npz")
    main, heads = teacher_forced_logits(model, rows)
    T = len(rows)
    assert out["main_logits"].shape == (T - 1, model.cfg.band_size + 1)
    assert out["head_logits"].shape == (T - 1, 9, model.cfg.band_size)
    np.testing.assert_allclose(out["main_logits"], main, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["head_logits"], heads, rtol=1e-5, atol=1e-5)


def test_frame_step_over_a_pool_prefix_equals_the_prefix_alone(model, tok):
    """A decode step over rows [0, 2) of a 4-row pool gives the rows of a 2-row batch of the same prompts, and leaves
    rows 2..3 of every cache and per-row field bit-for-bit untouched (the engine's step sized to its active slots)."""
    import dataclasses

    import jax

    from drama3_jax.generate import _PER_ROW, DecodeState, _prefiller, frame_step, frame_step_prefix
    cfg = model.cfg
    assert set(_PER_ROW) | {"cache"} == {f.name for f in dataclasses.fields(DecodeState)}
    prompts = [build_prompt(tok, cfg, "One small step."), build_prompt(tok, cfg, "Numbers: 3.14 and 12:30."),
               build_prompt(tok, cfg, "A third prompt.", [(ref_codes(cfg, 5, 3), "Ref.")]),
               build_prompt(tok, cfg, "<|speaker:1|> Hi!")]
    params, seeds = [SamplingParams(1.0, 0.9, 30)] * 4, [21, 22, 23, 24]
    lengths = np.array([len(p) for p in prompts], np.int32)
    prefill = _prefiller(model, 256, Backends())
    rows = np.zeros((4, -(-int(lengths.max()) // prefill.chunk) * prefill.chunk, cfg.row_width), np.int32)
    for i, p in enumerate(prompts):
        rows[i, :len(p)] = p
    pool = prefill(rows, lengths, RequestSampling.make(params, seeds))
    pair = jax.tree.map(lambda x: x[:2], pool)  # a 2-row batch of the first two prompts (rows are independent)
    step_prefix = jax.jit(lambda s: frame_step_prefix(model, s, 2))
    step_pair = jax.jit(lambda s: frame_step(model, s))
    before = jax.tree.map(lambda x: np.asarray(x[2:]), pool)
    for _ in range(3):
        got, pool = step_prefix(pool)
        want, pair = step_pair(pair)
        assert got.shape == (2, cfg.row_width)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_allclose(np.asarray(pool.h[:2]), np.asarray(pair.h), rtol=1e-5, atol=1e-5)
    assert np.asarray(pool.cache.backbone.lengths).tolist() == (lengths + 3).tolist()[:2] + lengths.tolist()[2:]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a[2:]), b), pool, before)


def test_free_slots_are_routed_to_no_expert(model, tok):
    """A pool row marked free (DecodeState.active 0) gets no routed-expert output (its hidden changes), and the other
    rows' tokens and hidden are bit-for-bit those of the same step with every row active (rows are independent).
    The Pallas MoE (interpret mode, as on the GPU) reads the mask inside its one-program expert schedule; the other
    MoE backends' masks: tests/kernels/test_moe.py."""
    import dataclasses

    import jax

    from drama3_jax.generate import _prefiller, frame_step
    cfg = model.cfg
    prompts = [build_prompt(tok, cfg, "One small step."), build_prompt(tok, cfg, "A free slot's stale row.")]
    lengths = np.array([len(p) for p in prompts], np.int32)
    prefill = _prefiller(model, 256, Backends())
    rows = np.zeros((2, -(-int(lengths.max()) // prefill.chunk) * prefill.chunk, cfg.row_width), np.int32)
    for i, p in enumerate(prompts):
        rows[i, :len(p)] = p
    pool = prefill(rows, lengths, RequestSampling.make([SamplingParams()] * 2, [5, 6]))
    assert np.asarray(pool.active).tolist() == [1, 1]
    step = jax.jit(lambda s: frame_step(model, s, Backends(moe="pallas_triton")))
    got, free = step(dataclasses.replace(pool, active=jnp.asarray([1, 0], jnp.int32)))
    want, full = step(pool)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(free.h[0]), np.asarray(full.h[0]))
    assert not np.array_equal(np.asarray(free.h[1]), np.asarray(full.h[1]))
    assert np.asarray(free.active).tolist() == [1, 0]


def test_packed_prefill_equals_the_batched_prefill(model, tok):
    """Prompts packed end to end (Prefiller.packed: row-wise layers over the packed rows, attention and the GDN
    recurrence per prompt) give the batched prefill's caches, last hidden and start state, and the same frames after
    it; empty lanes stay empty."""
    import jax

    from drama3_jax.generate import frame_step
    cfg = model.cfg
    prompts = [build_prompt(tok, cfg, "One small step."),
               build_prompt(tok, cfg, "A third prompt.", [(ref_codes(cfg, 7, 3), "Reference words.")]),
               build_prompt(tok, cfg, "<|speaker:1|> Hi! <|speaker:2|> Hello."),
               build_prompt(tok, cfg, "Numbers: 3.14 and 12:30.")]
    lengths = np.array([len(p) for p in prompts], np.int32)
    prefill = Prefiller(model, max_len=256, chunk=128)
    assert lengths.max() <= prefill.chunk and lengths.min() < lengths.max()
    params, seeds = [SamplingParams(1.0, 0.9, 30)] * 6, [31, 32, 33, 34, 0, 1]
    rows = np.zeros((4, prefill.chunk, cfg.row_width), np.int32)
    for i, p in enumerate(prompts):
        rows[i, :len(p)] = p
    want = prefill(rows, lengths, RequestSampling.make(params[:4], seeds[:4]))
    got = prefill.packed(prompts, RequestSampling.make(params, seeds), num_rows=int(lengths.sum()) + 13, num_seqs=6)
    n = lengths[:, None]
    for a, b in zip(jax.tree.leaves(got.cache), jax.tree.leaves(want.cache)):
        a, b = np.asarray(a), np.asarray(b)
        if a.ndim >= 3 and a.shape[1] == 256:  # KV caches: rows past each prompt's length are never read
            keep = (np.arange(256)[None, :] < n)[(...,) + (None,) * (a.ndim - 2)]
            a, b = a[:4] * keep, b * keep
        else:
            a = a[:4]
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert np.asarray(got.cache.backbone.lengths).tolist() == lengths.tolist() + [0, 0]
    assert np.asarray(got.cache.tower.lengths).tolist() == (lengths - 1).tolist() + [0, 0]
    np.testing.assert_allclose(np.asarray(got.h[:4]), np.asarray(want.h), rtol=1e-5, atol=1e-5)
    assert not np.asarray(got.h[4:]).any()
    for f in ("row", "recent", "frame", "keys", "temperature", "top_p", "top_k"):
        np.testing.assert_array_equal(np.asarray(getattr(got, f))[:4], np.asarray(getattr(want, f)))
    step = jax.jit(lambda s: frame_step(model, s))  # one compiled shape: the packed state's first 4 lanes
    got = jax.tree.map(lambda x: x[:4], got)
    for _ in range(3):
        r_got, got = step(got)
        r_want, want = step(want)
        np.testing.assert_array_equal(np.asarray(r_got), np.asarray(r_want))


def test_packed_prefill_by_layer_equals_the_one_call_prefill(model, tok):
    """Prefiller(by_layer=True): the packed prefill as one call per backbone layer gives the one-call packed prefill's
    whole DecodeState, and compiles one layer executable per layer type (3 GDN layers + 1 attention layer here)."""
    import jax

    cfg = model.cfg
    prompts = [build_prompt(tok, cfg, "One small step."),
               build_prompt(tok, cfg, "A third prompt.", [(ref_codes(cfg, 5, 2), "Reference words.")])]
    params, seeds = [SamplingParams(1.0, 0.9, 30)] * 3, [7, 8, 9]
    n = sum(len(p) for p in prompts)
    runs = {}
    for by_layer in (False, True):
        prefill = Prefiller(model, max_len=256, chunk=128, by_layer=by_layer)
        runs[by_layer] = prefill.packed(prompts, RequestSampling.make(params, seeds), num_rows=n + 5, num_seqs=3)
    assert prefill._packed_layer._cache_size() == len(set(cfg.text.layer_types)) == 2
    assert len(prefill.layer_types) == 4
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6),
                 runs[True], runs[False])


def test_packed_prefill_with_the_flash_attention_kernel(model, tok, monkeypatch):
    """The packed prefill with attention backend "pallas_triton" (its Pallas kernels in interpret mode: the
    backbone's and the tower's attention over each prompt's lanes) gives the reference backend's caches and last
    hidden; the other ops stay on the reference."""
    import functools

    import jax

    from kernels.attention import api
    monkeypatch.setitem(api.BACKENDS, "pallas_triton",
                        functools.partial(api.BACKENDS["pallas_triton"], interpret=True))
    cfg = model.cfg
    prompts = [build_prompt(tok, cfg, "One small step."), build_prompt(tok, cfg, "<|speaker:1|> Hi there.")]
    params, seeds = [SamplingParams(1.0, 0.9, 30)] * 2, [5, 6]
    runs = {}
    for name in ("reference", "pallas_triton"):
        prefill = Prefiller(model, max_len=128, chunk=64, backends=Backends(attention=name))
        n = sum(len(p) for p in prompts)
        runs[name] = prefill.packed(prompts, RequestSampling.make(params, seeds), num_rows=n + 6, num_seqs=2)
    got, want = runs["pallas_triton"], runs["reference"]
    lens = np.array([len(p) for p in prompts])[:, None]
    for a, b in zip(jax.tree.leaves(got.cache), jax.tree.leaves(want.cache)):
        a, b = np.asarray(a), np.asarray(b)
        if a.ndim >= 3 and a.shape[1] == 128:  # KV caches: only rows below each length are written
            keep = (np.arange(128)[None, :] < lens)[(...,) + (None,) * (a.ndim - 2)]
            a, b = a * keep, b * keep
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)  # fp32; the online softmax sums in another order
    np.testing.assert_allclose(np.asarray(got.h), np.asarray(want.h), rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # an off-by-default candidate; its kernel is CI's in tests/kernels/test_append_attention.py
def test_append_attention_kernel_in_the_decode_step(tiny_fp8_dir, tok):
    """Backends.append_attention="pallas_triton" (interpret mode on the CPU): every attention layer of a decode step
    (the backbone's, with fused projections, and the tower's 13) as one append-attention launch gives the separate
    ops' tokens, hidden and caches, over a pool prefix with a free row, for three frames."""
    import dataclasses

    import jax

    from drama3_jax.generate import _prefiller, frame_step_prefix
    model = drama3_jax.load_talker(tiny_fp8_dir, dtype=jnp.float32).fuse_projections()
    cfg = model.cfg
    prompts = [build_prompt(tok, cfg, "One small step."), build_prompt(tok, cfg, "A free slot's stale row."),
               build_prompt(tok, cfg, "Numbers: 3.14 and 12:30."), build_prompt(tok, cfg, "Past the prefix.")]
    lengths = np.array([len(p) for p in prompts], np.int32)
    prefill = _prefiller(model, 256, Backends())
    rows = np.zeros((4, -(-int(lengths.max()) // prefill.chunk) * prefill.chunk, cfg.row_width), np.int32)
    for i, p in enumerate(prompts):
        rows[i, :len(p)] = p
    pool = prefill(rows, lengths, RequestSampling.make([SamplingParams()] * 4, [5, 6, 7, 8]))
    pool = dataclasses.replace(pool, active=jnp.asarray([1, 0, 1, 1], jnp.int32))
    fused = Backends(append_attention="pallas_triton")
    n_att = cfg.text.layer_types.count("full_attention") + cfg.tower.num_layers
    jaxpr = str(jax.make_jaxpr(lambda s: frame_step_prefix(model, s, 3, fused))(pool))
    assert jaxpr.count("name=append_decode_attention") == n_att
    ref_step = jax.jit(lambda s: frame_step_prefix(model, s, 3, Backends()))
    got_step = jax.jit(lambda s: frame_step_prefix(model, s, 3, fused))
    ref, got = pool, pool
    for _ in range(3):
        want, ref = ref_step(ref)
        out, got = got_step(got)
        np.testing.assert_array_equal(np.asarray(out)[[0, 2]], np.asarray(want)[[0, 2]])
    np.testing.assert_allclose(np.asarray(got.h[:3]), np.asarray(ref.h[:3]), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(got.cache), jax.tree.leaves(ref.cache)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
