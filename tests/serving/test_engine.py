"""Engine-level checks in-process: a request's audio is the same alone and among 31 others, equals offline
generation + one-shot codec decode, and long text streams chunk after chunk, pipelined (a step in flight while the host
works, the default) or synchronous."""

from __future__ import annotations

import dataclasses
import functools
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drama3_jax.generate import generate
from drama3_jax.prompt import split_long_text
from drama3_jax.sampling import SamplingParams
from serving.engine import Engine, EngineConfig, Request, _warm_up_result, policy_changes
from serving.launch import tiny_random_parts


@pytest.fixture(scope="module")
def engine():
    talker, tok, codec = tiny_random_parts(jnp.float32)
    # 32 slots, decode steps of 8 and 32: the compiled shapes of the CPU suite's budget (every extra decode size or
    # codec batch is ~30 s of compilation here); the reference encodes are not used, hence lazy
    eng = Engine(talker, tok, codec, EngineConfig(max_streams=32, max_new_tokens=10, max_prompt_rows=512,
                                                  prefill_chunk=128, prefill_batch_sizes=(1, 8),
                                                  prefill_packed_rows=(1024,), prefill_lane_rows=128,
                                                  prefill_busy_streams=1000, codec_first_chunk=4, codec_chunk=8,
                                                  codec_batch_sizes=(8,), compile_threads=2, decode_sizes=(8,),
                                                  encode_warmup="lazy"))
    eng.start()
    yield eng
    eng.shutdown(5)


@pytest.fixture(scope="module")
def sync_engine():
    talker, tok, codec = tiny_random_parts(jnp.float32)
    eng = Engine(talker, tok, codec, EngineConfig(max_streams=4, max_new_tokens=10, max_prompt_rows=512,
                                                  prefill_chunk=128, prefill_batch_sizes=(1,), prefill_packed_rows=(),
                                                  codec_first_chunk=4,
                                                  codec_chunk=8, codec_period=4, pipeline_depth=0,
                                                  codec_low_load_chunk=0,
                                                  encode_warmup="lazy",
                                                  stall_warn_s=1e-9))  # every iteration counts as a stall
    eng.start()
    yield eng
    eng.shutdown(5)


def test_compiled_ahead_of_time_means_no_compile_at_the_first_call():
    """What Engine.warm_up relies on: a jitted step (static size, donated state, as the engine's) compiled with
    `.lower(...).compile()` on worker threads is not compiled again when it is then called (counted by JAX's
    backend-compile events), so the decode sizes can compile side by side and run one after the other."""
    step = jax.jit(lambda w, state, n: jax.tree.map(lambda x: x[:n].sum() + x @ w, state), static_argnums=(2,),
                   donate_argnums=(1,))
    w = jnp.asarray(np.random.default_rng(0).normal(size=(16, 16)), jnp.float32)
    state = {"a": jnp.ones((32, 16), jnp.float32), "b": jnp.full((32, 16), 2.0, jnp.float32)}  # not weakly typed
    compiles = []

    def listener(event, secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(secs)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda n: step.lower(w, state, n).compile(), (8, 32)))
        ahead = len(compiles)
        for n in (8, 32):
            state = step(w, state, n)
        jax.block_until_ready(state)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert ahead == 2 and len(compiles) == 2


@pytest.fixture
def first_frames_engine(engine):
    """The shared engine reconfigured in place so that new streams get 5 frames on their prefill's lanes
    (`admission_frames` = first chunk + 1; its calls compiled by `reconfigure`), restored afterwards."""
    base = engine.cfg
    engine.reconfigure(dataclasses.replace(base, admission_frames=5))
    yield engine
    engine.reconfigure(base)


def run(engine, texts, seeds, max_frames=10, forced=None):
    """-> (audio per request, codes [K, n] per request). forced: frames per request (None: stop rules)."""
    outs = {i: [] for i in range(len(texts))}
    reqs = []
    forced = forced or [None] * len(texts)
    for i, (t, s) in enumerate(zip(texts, seeds)):
        reqs.append(engine.submit(Request(chunks=split_long_text(t), references=[], previous_takes=[],
                                          sampling=SamplingParams(), seed=s, max_frames=max_frames,
                                          forced_frames=forced[i], sink=lambda k, p, i=i: outs[i].append((k, p)))))
    deadline = time.time() + 600
    while not all(any(k in ("done", "error") for k, _ in o) for o in outs.values()):
        assert time.time() < deadline
        time.sleep(0.02)
    assert all(o[-1][0] == "done" for o in outs.values()), [o[-1] for o in outs.values()]
    audio = [np.concatenate([p for k, p in o if k == "audio"] or [np.zeros(0, np.float32)]) for o in outs.values()]
    return audio, [np.concatenate([c for _, c in r.takes], axis=1) for r in reqs]


def test_same_audio_alone_and_among_31_others(engine):
    """Also: decode steps sized to the occupied slots (8 / 32 of the pool) give the same tokens as offline
    generation, alone (8-slot steps) and in a crowd whose lower slots free up first."""
    target = "The one request we watch closely."
    (alone,), (alone_codes,) = run(engine, [target], [42])
    steps = lambda n: _sample_value(engine.metrics.step_slots, "_total", slots=str(n))  # noqa: E731
    assert steps(8) > 0 and steps(32) == 0
    texts = [f"Background request number {i}, saying something." for i in range(31)]
    crowd, crowd_codes = run(engine, texts[:20] + [target] + texts[20:], list(range(20)) + [42] + list(range(20, 31)))
    assert engine.active_count() == 0 and steps(32) > 0
    assert int(np.asarray(engine.pool.active).sum()) == 0  # every slot marked free again: routed to no expert
    np.testing.assert_array_equal(crowd_codes[20], alone_codes)  # the same tokens, bit for bit
    np.testing.assert_allclose(crowd[20], alone, atol=1e-4)  # the codec ran in other batch shapes: float rounding
    # and it is exactly what offline generation + a one-shot codec decode give
    codes = generate(_talker(engine), engine.tok, target, seed=42, max_new_frames=10)
    np.testing.assert_array_equal(codes, alone_codes)
    sizes = np.array(engine.codec.cfg.codebook_sizes)[:, None]
    ref = engine.codec.decode(np.minimum(codes, sizes - 1))
    np.testing.assert_allclose(alone, ref, atol=1e-4)
    assert _talker(engine).model.language_model.layers[0].linear_attn.in_proj is not None  # the engine fused them


def test_streams_move_down_so_the_step_shrinks(engine):
    """24 short streams in the low slots end first; the 8 long ones above them move into slots 0-7 (--decode-sizes 8
    with slot compaction), the steps shrink to 8 slots, and the moved streams' tokens and audio are those they
    get alone."""
    long_texts = [f"A long request, number {i}, that outlives the others." for i in range(8)]
    seeds = list(range(100, 108))
    alone = [run(engine, [t], [sd], forced=[10]) for t, sd in zip(long_texts, seeds)]
    moves = lambda: _sample_value(engine.metrics.slot_moves, "_total")  # noqa: E731
    steps = lambda n: _sample_value(engine.metrics.step_slots, "_total", slots=str(n))  # noqa: E731
    moves0, steps8 = moves(), steps(8)
    short = [f"Short request {i}." for i in range(24)]
    audio, codes = run(engine, short + long_texts, list(range(24)) + seeds, forced=[2] * 24 + [10] * 8)
    assert moves() > moves0 and steps(8) > steps8  # (some long ones may already start in freed low slots)
    for i, ((a_alone,), (c_alone,)) in enumerate(alone):
        np.testing.assert_array_equal(codes[24 + i], c_alone)
        np.testing.assert_allclose(audio[24 + i], a_alone, atol=1e-4)
    assert all(c.shape[1] == 2 for c in codes[:24])


@pytest.mark.parametrize("which", ["engine", "first_frames_engine"])
def test_long_text_is_generated_chunk_by_chunk(which, request):
    """The chunks of a long text follow each other in one stream, as offline generation does (the pipelined engine;
    the synchronous one shares the chunking code and is checked on one chunk below); with first frames on the
    prefill lanes, each later chunk is prefilled into the slot it holds and gets its first frames the same way."""
    eng = request.getfixturevalue(which)
    text = " ".join(f"Sentence {i} of a long paragraph that keeps going." for i in range(7))
    assert len(split_long_text(text)) >= 2
    (audio,), (served,) = run(eng, [text], [7], max_frames=8)
    codes = generate(_talker(eng), eng.tok, text, seed=7, max_new_frames=8)
    np.testing.assert_array_equal(served, codes)
    sizes = np.array(eng.codec.cfg.codebook_sizes)[:, None]
    np.testing.assert_allclose(audio, eng.codec.decode(np.minimum(codes, sizes - 1)), atol=1e-4)


def test_first_frames_on_the_prefill_lanes_change_where_frames_are_made_not_the_frames(engine):
    """Six requests admitted in packed prefills of 8 lanes (the empty ones routed to no expert) get their first 5
    frames from the decode call on the prefill's lanes: the tokens and audio are those of the pool alone, for streams
    that stop inside those frames (forced 2), at their end (5), after them (10) and by the stop rules, and each
    request's frames up to its stop are counted as made there; the same under the synchronous tick. `reconfigure`
    compiles those calls (once per frame count), so serving compiles nothing."""
    texts = [f"First frames on the prefill lanes, request {i}." for i in range(6)]
    seeds, forced = list(range(60, 66)), [2, 5, 10, 10, None, None]
    pool_audio, pool_codes = run(engine, texts, seeds, forced=forced)
    base = engine.cfg
    five, sync_five = (dataclasses.replace(base, admission_frames=5, pipeline_depth=d) for d in (1, 0))
    engine.reconfigure(five)
    assert engine.reconfigure(base) == 0.0 and engine.reconfigure(five) == 0.0  # compiled once
    compiles = []

    def listener(event, secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(secs)

    made0 = _sample_value(engine.metrics.admission_frames, "_total")
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        audio, codes = run(engine, texts, seeds, forced=forced)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        engine.reconfigure(base)
    made = _sample_value(engine.metrics.admission_frames, "_total") - made0
    assert not compiles
    engine.reconfigure(sync_five)
    try:
        _, sync_codes = run(engine, texts[:3], seeds[:3], forced=forced[:3])
    finally:
        engine.reconfigure(base)
    for i in range(6):
        np.testing.assert_array_equal(codes[i], pool_codes[i])
        np.testing.assert_allclose(audio[i], pool_audio[i], atol=1e-4)
    assert [c.shape[1] for c in codes[:4]] == [2, 5, 10, 10]
    assert 2 + 5 + 5 + 5 <= made <= 2 + 5 * 5  # each request's frames up to its stop (included), at most 5 each
    for i in range(3):
        np.testing.assert_array_equal(sync_codes[i], pool_codes[i])
    assert engine.active_count() == 0 and int(np.asarray(engine.pool.active).sum()) == 0


def test_synchronous_engine_serves_what_offline_generation_makes(sync_engine):
    """The synchronous engine (no step in flight, prompts padded to [batch, chunk]) gives offline generation's codes
    and their one-shot codec decode."""
    text = "One chunk for the synchronous engine."
    (audio,), (served,) = run(sync_engine, [text], [3], max_frames=8)
    codes = generate(_talker(sync_engine), sync_engine.tok, text, seed=3, max_new_frames=8)
    np.testing.assert_array_equal(served, codes)
    sizes = np.array(sync_engine.codec.cfg.codebook_sizes)[:, None]
    np.testing.assert_allclose(audio, sync_engine.codec.decode(np.minimum(codes, sizes - 1)), atol=1e-4)


def _sample_value(metric, suffix: str, **labels) -> float:
    return sum(s.value for m in metric.collect() for s in m.samples
               if s.name.endswith(suffix) and all(s.labels.get(k) == v for k, v in labels.items()))


def test_codec_runs_per_period_not_per_frame(sync_engine):
    """10 forced frames with codec_period 4: a first chunk, then only the calls every 4 steps, the flush of the end
    included (at most 4 calls, not 10), and every frame decoded exactly once."""
    m = sync_engine.metrics
    calls0, used0 = _sample_value(m.codec_seconds, "_count"), _sample_value(m.codec_frames, "_total", kind="used")
    out = []
    sync_engine.submit(Request(chunks=["Count the codec calls."], references=[], previous_takes=[],
                               sampling=SamplingParams(), seed=5, max_frames=10, forced_frames=10,
                               sink=lambda k, p: out.append((k, p))))
    deadline = time.time() + 300
    while not any(k in ("done", "error") for k, _ in out):
        assert time.time() < deadline
        time.sleep(0.02)
    assert out[-1][0] == "done"
    audio = sum(len(p) for k, p in out if k == "audio")
    assert audio == 10 * sync_engine.codec.frame_length
    assert _sample_value(m.codec_frames, "_total", kind="used") - used0 == 10
    assert 2 <= _sample_value(m.codec_seconds, "_count") - calls0 <= 4
    assert _sample_value(m.stalls, "_total") >= 10  # stall_warn_s ~0: each of the >= 10 iterations was reported


def test_slow_iteration_message_names_the_phases_slowest_first():
    from serving.engine import slow_iteration_message

    phases = {"admit": 0.002, "rows": 0.31, "codec": 0.0004, "audio": 0.05}
    assert slow_iteration_message(phases, 0.2, threshold_s=0.25) is None
    assert slow_iteration_message(phases, 0.4, threshold_s=0) is None  # 0 = never
    assert slow_iteration_message(phases, 0.4, threshold_s=0.25) == (
        "engine: slow iteration 400 ms (rows 310 ms, audio 50 ms, admit 2 ms)")


def _talker(engine):
    from flax import nnx

    return nnx.merge(engine.graphdef, engine.params)


def test_codec_takes_first_chunks_anytime_the_rest_on_periodic_calls():
    """Between periodic calls only first chunks go; a periodic call takes every playing stream and the flush of every
    ended one (also one that ended before its first chunk), each capped."""
    from types import SimpleNamespace as R

    from serving.engine import codec_takes

    def req(pending, chunks, done=False, audio_end=100.0):
        return R(pending=[0] * pending, audio_chunks=chunks, chunk_done=done, t_audio_end=audio_end)

    first = req(4, 0)                  # first chunk ready
    early = req(3, 0)                  # not yet
    playing = req(11, 2)
    ended = req(2, 3, done=True)       # its text ended: a flush
    short = req(2, 0, done=True)       # ended before a first chunk
    idle = req(0, 1)
    slots = [first, None, early, playing, ended, short, idle]
    assert codec_takes(slots, periodic=False, first_chunk=4, cap=8) == [(0, first, 4)]
    assert codec_takes(slots, periodic=True, first_chunk=4, cap=8) == [
        (0, first, 4), (3, playing, 8), (4, ended, 2), (5, short, 2)]


def test_codec_takes_bridges_a_stream_that_would_run_dry_up_to_its_bridge_count():
    """Between periodic calls, a stream that has played at least one and at most `bridges` chunks gets one more when its
    audio ends before the next periodic call could deliver (now + horizon) and it has a first chunk's worth of frames;
    never a stream further along (an overloaded engine must not call the codec every step), never with too few
    frames, never with bridges 0."""
    from types import SimpleNamespace as R

    from serving.engine import codec_takes

    def req(pending, chunks, audio_end, done=False):
        return R(pending=[0] * pending, audio_chunks=chunks, chunk_done=done, t_audio_end=audio_end)

    now = 10.0
    dry = req(5, 1, now + 0.05)          # 50 ms of audio left, next periodic audio in 200 ms
    safe = req(5, 1, now + 0.5)          # enough audio to reach the periodic call
    few = req(3, 1, now + 0.05)          # would run dry, but fewer than a first chunk's frames
    second = req(6, 2, now + 0.05)       # played its first chunk and one bridge
    third = req(4, 3, now + 0.05)        # played two bridges
    ending = req(5, 1, now + 0.05, done=True)  # its text ended: a flush, periodic
    slots = [dry, safe, few, second, third, ending]
    takes = functools.partial(codec_takes, slots, False, 4, 8, now=now)
    assert takes(horizon_s=0.2, bridges=0) == []
    assert takes(horizon_s=0.2, bridges=1) == [(0, dry, 5)]
    assert takes(horizon_s=0.2, bridges=2) == [(0, dry, 5), (3, second, 6)]
    assert takes(horizon_s=0.2, bridges=3) == [(0, dry, 5), (3, second, 6), (4, third, 4)]
    assert takes(horizon_s=0.01, bridges=3) == []
    assert codec_takes(slots, periodic=True, first_chunk=4, cap=8, now=now, horizon_s=0.2, bridges=1) == [
        (i, r, len(r.pending)) for i, r in enumerate(slots)]


def test_codec_takes_defers_deep_streams_at_low_load():
    """With defer_s (low load) a periodic call takes nothing but first chunks while every stream it would serve has
    at least defer_s (and the horizon) of audio buffered, fewer than `cap` frames pending and its text running; one
    thin, full or ended stream makes the call serve them all, each up to `cap`."""
    from types import SimpleNamespace as R

    from serving.engine import codec_takes

    def req(pending, chunks, audio_end, done=False):
        return R(pending=[0] * pending, audio_chunks=chunks, chunk_done=done, t_audio_end=audio_end)

    now = 10.0
    deep, deeper, first = req(8, 2, now + 1.5), req(12, 5, now + 3.0), req(4, 0, now)
    takes = lambda slots, **kw: codec_takes(slots, True, 4, 32, now=now, horizon_s=0.2, **kw)  # noqa: E731
    assert takes([deep, deeper, first], defer_s=1.0) == [(2, first, 4)]
    assert takes([deep, deeper], defer_s=None) == [(0, deep, 8), (1, deeper, 12)]      # off: every periodic call
    assert takes([deep, deeper], defer_s=2.0) == [(0, deep, 8), (1, deeper, 12)]       # deep is not deep enough
    assert codec_takes([deep], True, 4, 32, now=now, horizon_s=1.6, defer_s=1.0) == [(0, deep, 8)]  # the horizon
    full = req(32, 3, now + 5.0)
    assert takes([deep, full], defer_s=1.0) == [(0, deep, 8), (1, full, 32)]
    ended = req(3, 4, now + 5.0, done=True)
    assert takes([deep, ended], defer_s=1.0) == [(0, deep, 8), (1, ended, 3)]
    assert codec_takes([deep, deeper], False, 4, 32, now=now, defer_s=1.0) == []    # not periodic: as before


def test_admission_guard_has_its_own_threshold_for_streams_on_their_first_chunk():
    """Every playing, still-generating stream needs `guard_s` of buffered audio, one that has played only its first
    chunk (or at most `new_chunks`: first chunk and bridges) `guard_new_s`; streams not yet playing and streams whose
    text ended do not count."""
    from types import SimpleNamespace as R

    from serving.engine import guard_allows

    now = 5.0

    def req(chunks, buffered, playing=True, done=False):
        return R(t_first_audio=1.0 if playing else None, chunk_done=done, audio_chunks=chunks,
                 t_audio_end=now + buffered)

    steady = req(3, 0.30)
    new = req(1, 0.15)
    others = [None, req(0, -9, playing=False), req(4, 0.0, done=True)]
    assert guard_allows([steady, *others], now, 0.25, 0.25)
    assert not guard_allows([steady, new, *others], now, 0.25, 0.25)   # one threshold: the new stream blocks
    assert guard_allows([steady, new, *others], now, 0.25, 0.1)        # its own, lower threshold
    assert not guard_allows([req(3, 0.2), new], now, 0.25, 0.1)        # a steady stream below 0.25 s still blocks
    assert guard_allows([], now, 0.25, 0.1)
    bridged = req(3, 0.15)                                             # first chunk and two bridges played
    assert not guard_allows([steady, bridged], now, 0.25, 0.1)
    assert guard_allows([steady, bridged], now, 0.25, 0.1, new_chunks=3)


def test_reconfigure_swaps_policy_fields_only_and_only_when_idle(engine):
    """The pipelined engine turned synchronous in place (what the ablation harness does for its policy rows): the
    same tokens as before; fields that change compiled shapes, bad values and a busy engine are refused."""
    base = engine.cfg
    sync = dataclasses.replace(base, pipeline_depth=0, admit_guard_s=0.1)
    assert policy_changes(sync, base) == {"pipeline_depth", "admit_guard_s"}
    # the codec schedule within the compiled frame counts (4 and 8) may change; a 16-frame period may not
    assert policy_changes(dataclasses.replace(base, codec_period=1), base) == {"codec_period"}
    assert policy_changes(dataclasses.replace(base, codec_period=16), base) is None
    assert policy_changes(dataclasses.replace(base, max_new_tokens=11), base) is None
    assert policy_changes(dataclasses.replace(base, admission_frames=3), base) == {"admission_frames"}  # compiled then
    # the low-load chunk (32 frames) is compiled for the smallest codec batch only: within it it may change, not past
    assert base.codec_shapes == ((8, 4), (8, 8), (8, 32), (32, 4), (32, 8))
    assert policy_changes(dataclasses.replace(base, codec_low_load_chunk=16), base) == {"codec_low_load_chunk"}
    assert policy_changes(dataclasses.replace(base, codec_low_load_chunk=64), base) is None
    assert dataclasses.replace(base, codec_low_load_chunk=0).codec_shapes == ((8, 4), (8, 8), (32, 4), (32, 8))
    assert dataclasses.replace(base, codec_low_load_chunk=4).low_load_frames == 8  # never below the 8-frame cap
    with pytest.raises(ValueError, match="codec_low_load_chunk"):
        engine.reconfigure(dataclasses.replace(base, codec_low_load_chunk=-1))
    with pytest.raises(ValueError, match="codec_period"):
        engine.reconfigure(dataclasses.replace(base, codec_period=16))
    with pytest.raises(ValueError, match="pipeline_depth"):
        engine.reconfigure(dataclasses.replace(base, pipeline_depth=2))
    text = "Reconfigured between two requests."
    _, (before,) = run(engine, [text], [5], forced=[6])
    try:
        engine.reconfigure(sync)
        assert engine.cfg is sync
        _, (after,) = run(engine, [text], [5], forced=[6])
        np.testing.assert_array_equal(after, before)
        busy = engine.submit(Request(chunks=[text], references=[], previous_takes=[], sampling=SamplingParams(),
                                     seed=1, max_frames=10, forced_frames=10, sink=lambda k, p: None))
        with pytest.raises(RuntimeError, match="idle"):
            engine.reconfigure(base)
        while not busy.finished:
            time.sleep(0.02)
        while engine._inflight or engine._codec_inflight:  # the last step's rows and audio still being collected
            time.sleep(0.02)
    finally:
        engine.reconfigure(base)
    assert engine.cfg is base


def _chunks_with(engine, cfg, text, seed, forced):
    """Run one request on `engine` reconfigured to `cfg` (then back): (its PCM chunks, backend compiles counted)."""
    base, chunks, compiles = engine.cfg, [], []

    def listener(event, secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(secs)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        engine.reconfigure(cfg)
        req = engine.submit(Request(chunks=[text], references=[], previous_takes=[], sampling=SamplingParams(),
                                    seed=seed, max_frames=10, forced_frames=forced,
                                    sink=lambda k, p: chunks.append(p) if k == "audio" else None))
        while not req.finished:
            time.sleep(0.02)
        while engine._inflight or engine._codec_inflight:
            time.sleep(0.02)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        engine.reconfigure(base)
    return chunks, compiles


def test_reconfigured_codec_schedule_runs_on_the_compiled_frame_counts(engine):
    """First chunks of 2 frames and a periodic call every 2 steps, on an engine compiled for 4- and 8-frame calls:
    the calls run padded to 4 frames (no compile), the first chunk holds 2 frames, and the audio is the same."""
    text = "A shorter first chunk."
    (before,), _ = run(engine, [text], [7], forced=[9])
    chunks, compiles = _chunks_with(engine, dataclasses.replace(engine.cfg, codec_first_chunk=2, codec_period=2),
                                    text, 7, 9)
    assert not compiles
    frame = engine.codec.frame_length
    sizes = [len(c) // frame for c in chunks]
    # a 2-frame first chunk, then a call every 2 steps with the frames pending (the last one also takes the
    # held-back frame), each run in the 4-frame shape
    assert sizes[0] == 2 and len(sizes) >= 4 and max(sizes) <= 4 and sum(sizes) == 9, sizes
    np.testing.assert_allclose(np.concatenate(chunks), before, atol=1e-4)


def test_bridge_chunks_change_how_the_audio_is_cut_not_the_audio(engine):
    """A 2-frame first chunk and up to 3 bridges with the 8-step period (a period's audio lasts far longer than 2
    frames' 93 ms, so bridges are due): the same PCM as one 4-frame first chunk without bridges, no compile, and
    more chunks than the periodic calls alone would make."""
    text = "Bridged until the period comes."
    (before,), _ = run(engine, [text], [11], forced=[10])
    plain, _ = _chunks_with(engine, engine.cfg, text, 11, 10)
    bridged, compiles = _chunks_with(engine, dataclasses.replace(engine.cfg, codec_first_chunk=2, codec_bridges=3),
                                     text, 11, 10)
    assert not compiles
    frame = engine.codec.frame_length
    sizes = [len(c) // frame for c in bridged]
    assert sizes[0] == 2 and sum(sizes) == 10 and len(sizes) > len(plain), (sizes, [len(c) // frame for c in plain])
    np.testing.assert_allclose(np.concatenate(bridged), before, atol=1e-4)


def test_low_load_codec_deferral_changes_how_the_audio_is_cut_not_the_audio(engine):
    """A lone stream with a codec call due every 2 steps, deferred at low load while any audio is buffered ahead
    (the default 32-frame low-load chunk, no buffered-audio threshold), against every periodic call run: the same
    PCM, no compile."""
    text = "Deferred while the audio runs ahead."
    (before,), _ = run(engine, [text], [13], forced=[10])
    every, _ = _chunks_with(engine, dataclasses.replace(engine.cfg, codec_period=2, codec_low_load_chunk=0), text,
                            13, 10)
    chunks, compiles = _chunks_with(engine, dataclasses.replace(engine.cfg, codec_period=2, codec_defer_s=0.0),
                                    text, 13, 10)
    assert not compiles
    sizes = [len(c) // engine.codec.frame_length for c in chunks]
    assert sizes[0] == 4 and sum(sizes) == 10 and len(sizes) <= len(every), (sizes, len(every))
    np.testing.assert_allclose(np.concatenate(chunks), before, atol=1e-4)


def test_a_warm_up_job_out_of_gpu_memory_names_its_shape_and_the_limits():
    from concurrent.futures import Future

    cfg = EngineConfig(max_streams=128, max_new_tokens=512)
    oom, other = Future(), Future()
    oom.set_exception(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 6.40GiB"))
    other.set_exception(ValueError("bad shape"))
    with pytest.raises(MemoryError, match="warming up codec 128 streams x 8 frames \\(max_streams 128, .*"
                                          "max_new_tokens 512.*raise --gpu-memory-fraction"):
        _warm_up_result("codec 128 streams x 8 frames", oom, cfg)
    with pytest.raises(ValueError, match="bad shape"):
        _warm_up_result("decode step 8 slots", other, cfg)
    done = Future()
    done.set_result(3)
    assert _warm_up_result("x", done, cfg) == 3
