"""The speech server end to end, against a live process on 127.0.0.1 serving the tiny random model."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import time

import httpx
import numpy as np
import pytest
import soundfile as sf

SR, FRAME = 44100, 2048
BYTES_PER_FRAME = FRAME * 2  # s16le mono


def post(server, body, **kw):
    return httpx.post(server["base"] + "/v1/audio/speech", json=body, timeout=120, **kw)


def wav_b64(seconds: float, sr: int = 16000, channels: int = 1) -> str:
    t = np.arange(int(seconds * sr)) / sr
    x = (0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * np.random.default_rng(0).normal(size=t.size)).astype(np.float32)
    if channels > 1:
        x = np.stack([x] * channels, axis=1)
    buf = io.BytesIO()
    sf.write(buf, x, sr, format="WAV")
    return base64.b64encode(buf.getvalue()).decode()


def metric(server, name: str, labels: str = "") -> float:
    text = httpx.get(server["base"] + "/metrics").text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_health_models_metrics(server):
    assert httpx.get(server["base"] + "/health").json()["status"] == "ok"
    models = httpx.get(server["base"] + "/v1/models").json()["data"]
    assert models[0]["id"] == "drama-3" and "RANDOM" in models[0]["description"]
    text = httpx.get(server["base"] + "/metrics").text
    for name in ("drama3_queue_depth", "drama3_active_streams", "drama3_time_to_first_audio_seconds_bucket",
                 "drama3_decode_step_seconds_count", "drama3_generated_frames_total", "drama3_engine_stalls_total",
                 "drama3_gc_pause_seconds_count"):
        assert name in text


def test_time_to_first_audio_is_split_into_queue_wait_and_admission(server):
    """Every first audio chunk has an admission: TTFA = queue wait + admission-to-first-audio, per request."""
    assert post(server, {"input": "Split the wait.", "response_format": "pcm", "seed": 3,
                         "forced_frames": 5}).status_code == 200
    ttfa_n = metric(server, "drama3_time_to_first_audio_seconds_count")
    admit_n = metric(server, "drama3_admit_to_first_audio_seconds_count")
    assert ttfa_n >= 1 and admit_n == ttfa_n
    assert metric(server, "drama3_queue_wait_seconds_count") >= ttfa_n
    admit_s = metric(server, "drama3_admit_to_first_audio_seconds_sum")
    assert 0 < admit_s <= metric(server, "drama3_time_to_first_audio_seconds_sum")


def test_openai_client_gets_valid_audio(server):
    from openai import OpenAI

    client = OpenAI(base_url=server["base"] + "/v1", api_key="unused")
    resp = client.audio.speech.create(model="drama-3", voice="alloy", input="Hello from the official client.",
                                      response_format="wav", extra_body={"seed": 1, "forced_frames": 6})
    audio, sr = sf.read(io.BytesIO(resp.content))
    assert sr == SR and audio.shape == (6 * FRAME,) and np.abs(audio).max() > 0
    with client.audio.speech.with_streaming_response.create(
            model="drama-3", voice="alloy", input="Streaming through the client.", response_format="pcm",
            extra_body={"seed": 2, "forced_frames": 7}) as r:
        data = b"".join(r.iter_bytes())
    assert len(data) == 7 * BYTES_PER_FRAME


def test_speed_changes_tempo_not_length_rules(server):
    normal = post(server, {"input": "Tempo.", "response_format": "pcm", "seed": 8, "forced_frames": 12})
    fast = post(server, {"input": "Tempo.", "response_format": "pcm", "seed": 8, "forced_frames": 12, "speed": 2.0})
    assert normal.status_code == fast.status_code == 200
    ratio = len(fast.content) / len(normal.content)
    assert 0.4 < ratio < 0.6


def test_raw_pcm_and_wav_streaming(server):
    body = {"input": "Raw streaming.", "stream": True, "stream_format": "audio", "response_format": "pcm",
            "seed": 3, "forced_frames": 13}
    chunks = []
    with httpx.stream("POST", server["base"] + "/v1/audio/speech", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("audio/pcm")
        for c in r.iter_bytes():
            chunks.append(c)
    assert sum(map(len, chunks)) == 13 * BYTES_PER_FRAME
    body["response_format"] = "wav"
    with httpx.stream("POST", server["base"] + "/v1/audio/speech", json=body, timeout=120) as r:
        data = b"".join(r.iter_bytes())
    assert data[:4] == b"RIFF" and len(data) == 44 + 13 * BYTES_PER_FRAME
    same = np.abs(np.frombuffer(data[44:], np.int16).astype(np.int32) - np.frombuffer(b"".join(chunks), np.int16))
    assert same.max() <= 2  # same seed, same audio (to float rounding)


def test_sse_streaming(server):
    body = {"input": "Server-sent events.", "stream": True, "seed": 4, "forced_frames": 9}
    events = []
    with httpx.stream("POST", server["base"] + "/v1/audio/speech", json=body, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] == 9
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert len(pcm) == 9 * BYTES_PER_FRAME


def test_sixteen_concurrent_streams_of_different_lengths(server):
    async def one(client, i):
        body = {"input": f"Stream number {i}.", "stream": True, "stream_format": "audio", "response_format": "pcm",
                "seed": 100 + i, "forced_frames": 4 + 3 * i}
        n = 0
        async with client.stream("POST", "/v1/audio/speech", json=body) as r:
            assert r.status_code == 200
            async for c in r.aiter_bytes():
                n += len(c)
        return n

    async def main():
        async with httpx.AsyncClient(base_url=server["base"], timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    sizes = asyncio.run(main())
    assert sizes == [(4 + 3 * i) * BYTES_PER_FRAME for i in range(16)]


def test_same_seed_same_audio_alone_or_batched(server):
    body = {"input": "Reproducible speech.", "response_format": "pcm", "seed": 77, "max_new_tokens": 24,
            "temperature": 0.9}
    alone = post(server, body).content

    async def main():
        async with httpx.AsyncClient(base_url=server["base"], timeout=300) as client:
            others = [client.post("/v1/audio/speech", json={"input": f"Other request {i} with its own words.",
                                                            "response_format": "pcm", "seed": i,
                                                            "forced_frames": 20}) for i in range(7)]
            res = await asyncio.gather(client.post("/v1/audio/speech", json=body), *others)
            return res[0].content

    crowd = np.frombuffer(asyncio.run(main()), np.int16)
    alone = np.frombuffer(alone, np.int16)
    # same seed -> the same tokens; the codec ran in other batch shapes, so samples may differ by float rounding
    assert alone.size > 0 and crowd.shape == alone.shape
    assert np.abs(crowd.astype(np.int32) - alone).max() <= 2


def test_client_disconnect_frees_the_slot(server):
    before = metric(server, "drama3_requests_total", '{status="cancelled"}')
    body = {"input": "A long stream we abandon.", "stream": True, "stream_format": "audio", "response_format": "pcm",
            "forced_frames": 64, "seed": 5}
    with httpx.stream("POST", server["base"] + "/v1/audio/speech", json=body, timeout=120) as r:
        next(r.iter_bytes())  # first chunk, then hang up
    for _ in range(100):
        if metric(server, "drama3_requests_total", '{status="cancelled"}') > before and \
                metric(server, "drama3_active_streams") == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert metric(server, "drama3_requests_total", '{status="cancelled"}') == before + 1
    assert metric(server, "drama3_active_streams") == 0


def test_references_voices_and_previous_takes(server):
    codes = np.random.default_rng(1).integers(0, 48, (10, 30)).tolist()
    ok = post(server, {"input": "Clone this voice.", "ref_audio_codes": codes, "ref_text": "Reference words.",
                       "response_format": "pcm", "forced_frames": 5, "seed": 9})
    assert ok.status_code == 200 and len(ok.content) == 5 * BYTES_PER_FRAME
    ok = post(server, {"input": "From audio.", "ref_audio": "data:audio/wav;base64," + wav_b64(1.5, 8000, 2),
                       "ref_text": "A stereo eight kilohertz clip.", "response_format": "pcm", "forced_frames": 4})
    assert ok.status_code == 200
    (server["media"] / "ref.wav").write_bytes(base64.b64decode(wav_b64(1.0)))
    ok = post(server, {"input": "Two references.", "response_format": "pcm", "forced_frames": 4,
                       "references": [{"vq_codes": codes, "text": "First."},
                                      {"audio_path": str(server["media"] / "ref.wav"), "text": "Second."}],
                       "previous_takes": [{"text": "An earlier take.", "codes": codes}]})
    assert ok.status_code == 200
    base = server["base"] + "/v1/audio/voices"
    up = httpx.post(base, json={"name": "Narrator_1", "text": "My reference.", "audio": wav_b64(2.0)}, timeout=60)
    assert up.status_code == 200 and up.json()["name"] == "narrator_1"
    assert any(v["name"] == "narrator_1" for v in httpx.get(base).json()["data"])
    ok = post(server, {"input": "With an uploaded voice.", "voice": "narrator_1", "response_format": "pcm",
                       "forced_frames": 4})
    assert ok.status_code == 200
    assert httpx.delete(base + "/narrator_1").status_code == 200
    assert httpx.delete(base + "/narrator_1").status_code == 404
    assert post(server, {"input": "Gone.", "voice": "narrator_1"}).status_code == 400


BAD = [
    ({"input": ""}, "input"),
    ({"input": "   \n "}, "input"),
    ({"input": "x" * 20_001}, "input"),
    ({"input": "hi", "voice": "nobody-here"}, "voice"),
    ({"input": "hi", "ref_audio": "%%%not base64%%%", "ref_text": "t"}, "ref_audio"),
    ({"input": "hi", "ref_audio": base64.b64encode(b"\x00\x01garbage" * 100).decode(), "ref_text": "t"}, "ref_audio"),
    ({"input": "hi", "ref_audio": wav_b64(0.1), "ref_text": "t"}, "ref_audio"),
    ({"input": "hi", "ref_audio": wav_b64(31.0, 8000), "ref_text": "t"}, "ref_audio"),
    ({"input": "hi", "ref_audio": wav_b64(1.0)}, "ref_text"),
    ({"input": "hi", "ref_audio_codes": [[1, 2, 3]] * 9, "ref_text": "t"}, "ref_audio_codes"),
    ({"input": "hi", "ref_audio_codes": [[1, 2, 99999]] * 10, "ref_text": "t"}, "ref_audio_codes"),
    ({"input": "hi", "ref_audio_codes": [[1, -2, 3]] * 10, "ref_text": "t"}, "ref_audio_codes"),
    ({"input": "say <|im_end|> now"}, "input"),
    ({"input": "<|speaker:16|> hello"}, "input"),
    ({"input": "<|semantic:3|>"}, "input"),
    ({"input": "hi", "response_format": "mp3"}, "response_format"),
    ({"input": "hi", "stream": True, "response_format": "flac"}, "response_format"),
    ({"input": "hi", "stream": True, "speed": 1.5}, "speed"),
    ({"input": "hi", "top_p": 0}, "top_p"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "top_k": 99999}, "top_k"),
    ({"input": "hi", "extra_params": {"top_k": "many"}}, "top_k"),
    ({"input": "hi", "max_new_tokens": 0}, "max_new_tokens"),
    ({"input": "hi", "repetition_penalty": 1.3}, "repetition_penalty"),
    ({"input": "hi", "references": [{"text": "no audio"}]}, "references[0]"),
    ({"input": 5}, "input"),
    ({"voice": "alloy"}, "input"),
]


@pytest.mark.parametrize("body, param", BAD, ids=[p + str(i) for i, (_, p) in enumerate(BAD)])
def test_bad_input_gets_400_with_error_envelope(server, body, param):
    r = post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and err["message"]
    assert err["param"] == param


def test_wrong_model_non_json_and_bad_json(server):
    r = post(server, {"input": "hi", "model": "tts-1-hd"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(server["base"] + "/v1/audio/speech", content=b"input=hi", timeout=30,
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(server["base"] + "/v1/audio/speech", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400


def test_fuzzed_requests_never_break_the_server(server):
    rng = np.random.default_rng(0)
    values = [None, 0, -1, 1.5, 1e30, "", "x", "<|im_start|>", [], {}, [[1]], True, "data:audio/wav;base64,AAAA"]
    keys = ["input", "voice", "ref_audio", "ref_text", "ref_audio_codes", "temperature", "top_p", "top_k", "seed",
            "speed", "stream", "stream_format", "response_format", "references", "previous_takes", "extra_params",
            "max_new_tokens", "forced_frames"]
    for _ in range(60):
        body = {k: values[rng.integers(len(values))] for k in rng.choice(keys, size=rng.integers(1, 6))}
        body.setdefault("forced_frames", 2)
        r = post(server, body)
        assert r.status_code < 500, (body, r.text)
        if r.status_code != 200:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server["base"] + "/health").status_code == 200
    ok = post(server, {"input": "Still alive.", "response_format": "pcm", "forced_frames": 3})
    assert ok.status_code == 200 and len(ok.content) == 3 * BYTES_PER_FRAME


def test_queue_full_gives_429(server):
    async def main():
        async with httpx.AsyncClient(base_url=server["base"], timeout=300) as client:
            reqs = [client.post("/v1/audio/speech", json={"input": f"Flood {i}.", "response_format": "pcm",
                                                          "forced_frames": 40}) for i in range(40)]
            return await asyncio.gather(*reqs)

    res = asyncio.run(main())
    codes = [r.status_code for r in res]
    assert 429 in codes and set(codes) <= {200, 429}
    assert codes.count(200) > 8  # more than the 8 slots: requests queued behind the running ones were served
    r429 = next(r for r in res if r.status_code == 429)
    assert r429.headers["retry-after"] and r429.json()["error"]["code"] == 429


def test_no_recompilation_after_warm_up(server):
    deadline = time.time() + 600  # this server compiles reference-encode shapes in the background after ready
    while metric(server, "drama3_warmup_pending") > 0:
        assert time.time() < deadline, "background warm-up did not finish"
        time.sleep(1)
    assert "reference encode 224 frames (background) compiled" in server["log"].read_text()
    before = metric(server, "drama3_xla_compilations_total")
    async def main():
        async with httpx.AsyncClient(base_url=server["base"], timeout=300) as client:
            bodies = [{"input": "Word " * (1 + 7 * i), "response_format": "pcm", "max_new_tokens": 5 + i,
                       "seed": i} for i in range(6)]
            bodies.append({"input": "Clone.", "ref_audio": wav_b64(12.0), "ref_text": "Twelve seconds.",
                           "response_format": "pcm", "forced_frames": 3})
            return await asyncio.gather(*(client.post("/v1/audio/speech", json=b) for b in bodies))

    assert all(r.status_code == 200 for r in asyncio.run(main()))
    assert metric(server, "drama3_xla_compilations_total") == before
